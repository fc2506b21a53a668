"""`python -m kvrdma` is the `kvrdma` command."""

import sys

from kvrdma.cli.main import main

sys.exit(main())
