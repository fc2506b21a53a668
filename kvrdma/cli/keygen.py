"""`kvrdma keygen DIR`: make the CURVE keys that secure the side channel."""

from __future__ import annotations

import argparse

from kvrdma.handshake.auth import ENV_CURVE_DIR, generate_keys


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the key files (created, mode 0700)")
    parser.add_argument("--force", action="store_true", help="replace keys already there")


def run(args: argparse.Namespace) -> int:
    for path in generate_keys(args.directory, overwrite=args.force):
        print(path)
    print(
        f"\nPoint every agent and worker at this directory with --curve-dir or ${ENV_CURVE_DIR};"
        "\nin Kubernetes: kubectl create secret generic kvrdma-curve "
        f"--from-file={args.directory}"
    )
    return 0
