"""`python -m loom_live.plugin.cli ...` is the `loom` command."""

import sys

from loom_live.plugin.cli.main import main

sys.exit(main())
