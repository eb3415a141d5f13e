"""`python -m plait ...` == the `plait` command."""

import sys

from plait.cli import main

sys.exit(main())
