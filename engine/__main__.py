"""`python -m engine serve ...`: the engine process's own entry point (the launcher uses this form)."""

import sys

from engine.server.main import main

sys.exit(main())
