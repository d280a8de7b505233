"""``python -m olliefs`` and the ``ollie`` command."""

import sys

from olliefs import memory


def main() -> int:
    memory.reexec_early(sys.argv[1:])  # a daemon starts again at once, if it will
    from olliefs.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
