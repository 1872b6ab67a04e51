"""`chronoq bench [ARGS...]`: the side-by-side benchmark (`python -m bench`); source checkouts only,
since `bench/` is not part of the installed package."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run the side-by-side benchmark against the peers (see bench/)",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for `python -m bench` (try --help)")
    p.set_defaults(func=run, passthrough=True)


def run(args: argparse.Namespace) -> int:
    try:
        from bench.harness.cli import main
    except ImportError:
        print("chronoq bench runs from a source checkout (the bench/ directory beside chronoq/)")
        return 2
    return int(main(args.args) or 0)
