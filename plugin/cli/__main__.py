"""`python -m plugin.cli ...` is the `loom` command."""

import sys

from plugin.cli.main import main

sys.exit(main())
