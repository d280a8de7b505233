"""A client with only Python's standard library exercises every file of the tree.

tests/clients/stdlib_client.py runs in its own interpreter with ``-I -S`` (no site
packages, so nothing of olliefs nor any third-party module can leak in) against a real
mount whose replay server plays the client's own script (``--script``), in the order of
its model requests. The client checks everything itself and ends by walking the tree:
a kind of file it did not exercise fails it, so a file added to the tree must be taught
to it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from olliefs.testing import Daemon
from tests.conftest import script

CLIENT = Path(__file__).with_name("stdlib_client.py")


def test_stdlib_client_exercises_every_file(daemon: Daemon, tmp_path: Path) -> None:
    py = [sys.executable, "-I", "-S", str(CLIENT)]
    entries = subprocess.run([*py, "--script"], capture_output=True, text=True, check=True)
    daemon.replay.add(script(*entries.stdout.splitlines()))
    work = tmp_path / "a work dir"  # a cwd with a space, given quoted
    work.mkdir()
    run = subprocess.run(
        [*py, str(daemon.path), str(work)],
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "stdlib client ok" in run.stdout
    # Every scripted answer was asked for, and nothing more: the client's requests are
    # the ones it planned (a refused prompt never reached the model).
    assert len(daemon.replay.requests) == len(entries.stdout.splitlines())
