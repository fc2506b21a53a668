"""`kvrdma demo`: prefill and decode engines as real processes moving verified KV blocks.

`main` runs it; `rank_process` is one TP rank's process, `ranks` the parent's handle on those
processes, `drive` the request loop, `faults` the injected faults and their verdict, `report`
the summary table, `stages` the `--stages` pipeline variant.
"""

from kvrdma.cli.demo.main import configure_parser, run

__all__ = ["configure_parser", "run"]
