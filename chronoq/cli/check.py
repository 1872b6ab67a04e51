"""`chronoq check DATA_DIR`: verify a data directory; exit 0 clean, 1 damaged, 3 repairable."""

from __future__ import annotations

import argparse

from chronoq.store.check import check_data_dir, format_report


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="verify every file of a data directory (read-only)",
                       description="Verify every file of a data directory without changing it. Exit status: 0 "
                                   "clean; 1 damaged (data lost or a person needed); 3 repairable (a torn tail or "
                                   "derived state a restart repairs without losing anything acknowledged).")
    p.add_argument("data_dir", metavar="DATA_DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = check_data_dir(args.data_dir)
    print(format_report(report, args.data_dir))
    return report.exit_status
