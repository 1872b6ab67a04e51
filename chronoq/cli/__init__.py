"""The `chronoq` command: one module per group of subcommands.

Theory of operation: each module in `COMMAND_MODULES` has `register(subparsers)`, which adds its
subcommands and sets `func(args) -> int` (the exit code) on each. `main` parses and dispatches;
nothing here knows what a subcommand does.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "chronoq.cli.check",
    "chronoq.cli.demo",
    "chronoq.cli.serve",
    "chronoq.cli.trace",
    "chronoq.cli.messages",
    "chronoq.cli.topics",
    "chronoq.cli.stats",
    "chronoq.cli.bench",
    "chronoq.cli.spark",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chronoq", description="chronoq: scheduled and delayed messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*extra, *args.args]  # a pass-through command hands its arguments on whole
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
