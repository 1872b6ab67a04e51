"""`chronoq demo [--data-dir DIR] [--port PORT]`: the main job's short demonstration."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="start chronoq serve on a data directory and run a short SDK demo",
                       description="Start `chronoq serve` on a data directory, send normal and timer messages with "
                                   "the SDK and print each as it arrives with how late it was; exit status 1 if "
                                   "any arrived early, went missing or arrived after it was recalled, or if the "
                                   "server did not start (its message is printed). What "
                                   "scripts/demo.sh runs. The server runs with its web console and /metrics on; "
                                   "the demo prints their URL (--stay keeps them running afterwards).")
    p.add_argument("--data-dir", default="data", help="data directory (default: ./data)")
    p.add_argument("--port", type=int, default=None, help="port for chronoq serve (default: a free one)")
    p.add_argument("--http-port", type=int, default=None,
                   help="port for the web console and /metrics (default: a free one; the URL is printed)")
    p.add_argument("--stay", action="store_true",
                   help="keep the server and its console running after the demo, until Ctrl-C")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from chronoq.client.testing import ServerFailedToStart
    from chronoq.demo import main

    try:
        return main(args.data_dir, args.port, http_port=args.http_port, stay=args.stay)
    except ServerFailedToStart as exc:
        # The server's own words (a bad setting, an unknown CHRONOQ_* variable, a port in use),
        # not a traceback of the demo that waited for it.
        print(f"chronoq demo: {str(exc).strip()}", file=sys.stderr)
        return 1
