"""`chronoq demo [--data-dir DIR] [--port PORT]`: the main job's short demonstration."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="start chronoq serve on a data directory and run a short SDK demo")
    p.add_argument("--data-dir", default="data", help="data directory (default: ./data)")
    p.add_argument("--port", type=int, default=None, help="port for chronoq serve (default: a free one)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from chronoq.demo import main

    return main(args.data_dir, args.port)
