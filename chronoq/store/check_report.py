"""What `chronoq check` found (`CheckReport`), its exit status, and the text a person reads.

Theory of operation: every finding is a sentence in one of three lists, sorted by what it costs:
- *problems*: damage that costs data, or that needs a person (exit status 1, DAMAGED);
- *repairs*: what a restart repairs without losing anything acknowledged (exit status 3,
  REPAIRABLE, when there are no problems);
- *notes*: facts, not findings (records a restart will dispatch, a file retention removed while
  it was being checked).
And one verdict before any of these, `unusable` (exit status 2, as for a usage error): the path
is not a data directory at all. A finding is written for a person when it is found (the file,
what is wrong, what a restart does about it), so `format_report` only lists them, after the
counts of what was read, and ends with the verdict.

Apart from the checks (`store/check.py`, `check_log.py`, `check_queues.py`), which all add to
one report, and the CLI (`chronoq/cli/check.py`), which prints it and exits with its status.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from chronoq.store.check_damage import DamageCosts


@dataclass
class CheckReport:
    unusable: str | None = None
    """Why there was nothing to check (no such path, not a directory, not a data directory): exit status 2."""
    problems: list[str] = field(default_factory=list)
    """Damage that costs data or needs a person (exit status 1)."""
    repairs: list[str] = field(default_factory=list)
    """What a restart repairs without losing anything acknowledged (exit status 3)."""
    notes: list[str] = field(default_factory=list)
    """Facts worth knowing that are not damage (e.g. records a restart will dispatch)."""
    records: int = 0
    segments: int = 0
    queues: int = 0
    cq_entries: int = 0
    log_start: int = 0
    log_end: int = 0
    damage: DamageCosts = field(default_factory=DamageCosts, repr=False)
    """The damaged ranges of the log, and what names records inside them (`check_damage.py`)."""
    live_links_from: int | None = None
    """Where retention's live link records begin, as the timer index says (None: unknown)."""
    expired_links: int = 0
    """Link records before `live_links_from` that name records retention deleted."""

    @property
    def ok(self) -> bool:
        """A data directory with nothing to repair and nothing damaged."""
        return self.unusable is None and not self.problems and not self.repairs

    @property
    def damaged(self) -> bool:
        return bool(self.problems)

    @property
    def exit_status(self) -> int:
        if self.unusable is not None:
            return 2
        return 1 if self.problems else 3 if self.repairs else 0


def open_or_note(path: Path, report: CheckReport) -> int | None:
    """A file descriptor to read `path`; None (and a note) when a running broker's retention
    removed it after the directory was listed: not damage."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        report.notes.append(f"{path}: removed by retention while being checked")
        return None


def format_report(report: CheckReport, data_dir: str | Path) -> str:
    if report.unusable is not None:
        return "\n".join([f"chronoq check {data_dir}", f"  NOT A DATA DIRECTORY: {report.unusable}",
                          "  (nothing was checked; give the directory `chronoq serve --data-dir` uses)"])
    lines = [f"chronoq check {data_dir}",
             f"  commit log: {plural(report.segments, 'segment')}, {plural(report.records, 'record')}, "
             f"positions [{report.log_start}, {report.log_end})",
             f"  consume queues: {plural(report.queues, 'queue')}, {plural(report.cq_entries, 'entry', 'entries')}"]
    lines += [f"  note: {n}" for n in report.notes[:20]]
    if len(report.notes) > 20:
        lines.append(f"  note: ... and {len(report.notes) - 20} more")
    lines += [f"  REPAIR: {r}" for r in report.repairs]
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    if report.problems:
        lines.append(f"  DAMAGED: {plural(len(report.problems), 'problem')}" +
                     (f", {plural(len(report.repairs), 'repair')}" if report.repairs else ""))
    elif report.repairs:
        lines.append(f"  REPAIRABLE: {plural(len(report.repairs), 'finding')} a restart repairs without losing "
                     "anything acknowledged")
    else:
        lines.append("  OK")
    return "\n".join(lines)


def plural(n: int, one: str, many: str | None = None) -> str:
    """"1 segment", "2 segments": the report is read by a person."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"
