"""`python -m engine.train ...` (also `loom train ...`): see engine/train/cli.py."""

import sys

from engine.train.cli import main

sys.exit(main())
