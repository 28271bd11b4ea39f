"""`python -m kvpage.cli`: the same as the `kvpage` script."""

import sys

from kvpage.cli import main

sys.exit(main())
