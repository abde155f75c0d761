"""`python -m engine ...` is the same as the `loom` command (the launcher uses this form)."""

import sys

from engine.cli import main

sys.exit(main())
