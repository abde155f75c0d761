"""`python -m loom_live.engine serve ...`: the engine process's own entry point (the launcher uses this form)."""

import sys

from loom_live.engine.graphs.compile_cache import enable_bytecode_cache

enable_bytecode_cache()  # before torch is imported: its imports are most of a restart's first seconds

from loom_live.engine.server.main import main  # noqa: E402

sys.exit(main())
