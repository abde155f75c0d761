"""`python -m loom_live.engine.train ...` (also `loom train ...`): see engine/train/cli.py."""

import sys

from loom_live.engine.train.cli import main

sys.exit(main())
