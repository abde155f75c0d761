"""`python -m loom_live.engine serve ...`: the engine process's own entry point (the launcher uses this form)."""

import sys

from loom_live.engine.server.main import main

sys.exit(main())
