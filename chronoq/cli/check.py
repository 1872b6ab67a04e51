"""`chronoq check DATA_DIR`: verify a data directory; exit 0 clean, 1 damaged, 3 repairable, 2 not a data directory."""

from __future__ import annotations

import argparse

from chronoq.cli.common import add_command
from chronoq.store.check import check_data_dir, format_report


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "check", "verify every file of a data directory (read-only)",
        "Verify every file of a data directory without changing it (safe on a running broker's directory). "
        "Verdicts and exit statuses: OK 0 (clean); DAMAGED 1 (data lost or a person needed); REPAIRABLE 3 (a "
        "torn tail or derived state a restart repairs without losing anything acknowledged); NOT A DATA "
        "DIRECTORY 2 (the path does not exist, is a file, or holds none of chronoq's files).",
        ["chronoq check data", "chronoq check /var/lib/chronoq || echo \"exit status $?\""])
    p.add_argument("data_dir", metavar="DATA_DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = check_data_dir(args.data_dir)
    print(format_report(report, args.data_dir))
    return report.exit_status
