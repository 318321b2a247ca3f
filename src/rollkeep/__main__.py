"""`python -m rollkeep ...` is the `rollkeep` command."""

import sys

from rollkeep.cli import main

sys.exit(main())
