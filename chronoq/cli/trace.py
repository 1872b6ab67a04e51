"""`chronoq trace export DATA_DIR OUT.parquet`: the delivery trace for `chronoq spark report`."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="export the delivery trace of timer messages (needs trace_enable)")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    e = tsub.add_parser("export", help="write one row per timer message as Parquet")
    e.add_argument("data_dir", metavar="DATA_DIR")
    e.add_argument("out", metavar="OUT.parquet")
    e.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from chronoq.spark.trace import write_trace
    from chronoq.trace import export_rows

    rows = export_rows(Path(args.data_dir))
    if not rows:
        print(f"no trace events in {args.data_dir} (start the broker with trace_enable = true)")
        return 1
    write_trace(rows, args.out)
    fired = sum(1 for r in rows if r["fired_ms"] is not None)
    received = sum(1 for r in rows if r["first_received_ms"] is not None)
    print(f"wrote {len(rows)} timer messages ({fired} fired, {received} received) to {args.out}")
    return 0
