"""`chronoq demo [--data-dir DIR]`: the main job's short demonstration."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run a broker on a data directory and a short send/receive demo")
    p.add_argument("--data-dir", default="data", help="data directory (default: ./data)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from chronoq.demo import main

    return main(args.data_dir)
