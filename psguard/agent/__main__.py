"""``python -m psguard.agent ...`` is ``psguard agent ...``."""

import sys

from psguard.cli import main

sys.exit(main(["agent", *sys.argv[1:]]))
