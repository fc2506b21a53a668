"""The `kvrdma` command and its sub-commands: everything a user runs, outside the runtime.

`main` is the console script's entry point (`kvrdma = "kvrdma.cli:main"`); each sub-command
lives in its own module (`agent`, `demo`, `inspect`, `bench`, `keygen`).
"""

from kvrdma.cli.main import main

__all__ = ["main"]
