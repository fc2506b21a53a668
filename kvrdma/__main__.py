"""`python -m kvrdma` is the `kvrdma` command."""

import sys

from kvrdma.cli import main

sys.exit(main())
