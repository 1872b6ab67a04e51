"""`chronoq trace export DATA_DIR OUT.parquet`: the delivery trace for `chronoq spark report`.

Theory of operation: reads the trace journal the broker keeps with `trace_enable = true` and
writes it as Parquet through pyarrow, part of the Spark extra: checked first, so a set-up without
it is told `scripts/setup.sh --spark` rather than shown a ModuleNotFoundError. What the rows do
not show (segments rotated away by `trace_retention_bytes`, timers left out for it) is printed
and kept in the Parquet file's metadata, which `chronoq spark report` prints: "no events" and
"events rotated away" never read the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from chronoq.cli.common import CliError, UsageError, add_command, require_modules
from chronoq.store import files


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="export the delivery trace of timer messages (needs trace_enable)",
                       description="The delivery trace: per timer message, when it was accepted, due, fired and "
                                   "first received. The broker keeps it with trace_enable = true "
                                   "(CHRONOQ_TRACE_ENABLE=true).")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="SUBCOMMAND")
    e = add_command(tsub, "export", "write one row per timer message as Parquet (needs pyarrow)",
                    "Write the trace of DATA_DIR as Parquet, the input of `chronoq spark report`. Needs pyarrow "
                    "(`scripts/setup.sh --spark`).",
                    ["chronoq trace export data trace.parquet && chronoq spark report trace.parquet --out report/"])
    e.add_argument("data_dir", metavar="DATA_DIR")
    e.add_argument("out", metavar="OUT.parquet")
    e.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    require_modules("trace export", ["pyarrow"])
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise UsageError(f"{data_dir} is not a directory (give the data directory of a broker run with "
                         "trace_enable = true)")
    from chronoq.spark.trace import write_trace
    from chronoq.trace import TraceFormatError, read_trace

    try:
        trace = read_trace(data_dir)
    except TraceFormatError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot read the trace in {data_dir}: {e}") from None
    rows = trace.rows
    notes = trace.notes()
    if not rows:
        if trace.rotated_segments:
            print(f"no trace events retained in {args.data_dir}: {'; '.join(notes)}")
        else:
            hint = "" if (data_dir / files.TRACE_DIR).exists() else " (start the broker with trace_enable = true)"
            print(f"no trace events in {args.data_dir}{hint}")
        return 1
    write_trace(rows, args.out, notes=notes)
    fired = sum(1 for r in rows if r["fired_ms"] is not None)
    received = sum(1 for r in rows if r["first_received_ms"] is not None)
    print(f"wrote {len(rows)} timer messages ({fired} fired, {received} received) to {args.out}")
    for note in notes:
        print(f"note: {note}")
    return 0
