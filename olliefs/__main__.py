import sys

from olliefs.cli import main

sys.exit(main())
