"""kvrdma benchmarks: `python benchmarks/run.py` or `kvrdma bench` (see benchmarks/README.md)."""
