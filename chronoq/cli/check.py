"""`chronoq check DATA_DIR`: verify a data directory; exit 1 on damage."""

from __future__ import annotations

import argparse

from chronoq.store.check import check_data_dir, format_report


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="verify every file of a data directory (read-only)")
    p.add_argument("data_dir", metavar="DATA_DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = check_data_dir(args.data_dir)
    print(format_report(report, args.data_dir))
    return 0 if report.ok else 1
