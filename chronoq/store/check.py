"""`chronoq check DATA_DIR`: verify every file of a data directory, read-only.

Theory of operation: check never writes (it does not even take the broker's lock, so it can
look at a live directory, where a tail still being written may show as not yet dispatched).
It reads each file the way recovery would and reports, per file, what recovery would have to do
(truncate a torn tail, rebuild a consume queue) and what it cannot fix (a damaged segment before
the tail). Magic, version and checksum failures are reported apart, as bbolt's check does.
The consume queues are checked against the log in one pass over the log: every record must have
its entry (position, size, tag hash) at its queue offset, and no queue may hold entries past
the last record of its queue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from chronoq.errors import CorruptRecord
from chronoq.store import files
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE, check_frame, decode_segment_header
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY_SIZE, decode_cq_header, decode_entry, tag_hash
from chronoq.store.meta import decode_checkpoint, decode_topics
from chronoq.store.record import decode_record


@dataclass
class CheckReport:
    problems: list[str] = field(default_factory=list)
    """Damage: the exit code is non-zero when there is any."""
    notes: list[str] = field(default_factory=list)
    """Facts worth knowing that are not damage (e.g. records a restart will dispatch)."""
    records: int = 0
    segments: int = 0
    queues: int = 0
    cq_entries: int = 0
    log_start: int = 0
    log_end: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Queue:
    path: Path
    entries: list[tuple[int, int, int]]
    first_offset: int
    seen_max: int = -1


def check_data_dir(data_dir: str | Path) -> CheckReport:
    data_dir = Path(data_dir)
    report = CheckReport()
    if not data_dir.is_dir():
        report.problems.append(f"{data_dir}: not a directory")
        return report
    _check_topics(data_dir, report)
    checkpoint = _check_checkpoint(data_dir, report)
    queues = _load_queues(data_dir, report)
    _check_log(data_dir, report, queues, checkpoint)
    for (topic, qid), q in sorted(queues.items()):
        # Entries past the queue's last record in the log, ignoring ones retention left behind.
        extra = sum(1 for j, (position, _, _) in enumerate(q.entries)
                    if q.first_offset + j > q.seen_max and position >= report.log_start)
        if extra:
            report.problems.append(f"{q.path}: {extra} entries past the last record of {topic}/{qid} in the log")
    return report


def _check_topics(data_dir: Path, report: CheckReport) -> None:
    path = data_dir / files.TOPICS
    if not path.exists():
        report.notes.append(f"{path}: missing (no topics created yet)")
        return
    try:
        decode_topics(path.read_bytes())
    except CorruptRecord as e:
        report.problems.append(f"{path}: {e.reason}")


def _check_checkpoint(data_dir: Path, report: CheckReport) -> int | None:
    path = data_dir / files.CHECKPOINT
    if not path.exists():
        report.notes.append(f"{path}: missing (a restart replays the whole log)")
        return None
    try:
        return decode_checkpoint(path.read_bytes())
    except CorruptRecord as e:
        report.problems.append(f"{path}: {e.reason} (a restart replays the whole log)")
        return None


def _load_queues(data_dir: Path, report: CheckReport) -> dict[tuple[str, int], _Queue]:
    queues: dict[tuple[str, int], _Queue] = {}
    root = data_dir / files.QUEUES_DIR
    if not root.exists():
        return queues
    for topic in sorted(os.listdir(root)):
        for qid_name in sorted(os.listdir(root / topic)):
            qdir = root / topic / qid_name
            if not qid_name.isdigit() or not qdir.is_dir():
                report.problems.append(f"{qdir}: unexpected entry in the queues directory")
                continue
            report.queues += 1
            q = _load_queue(qdir, report)
            if q is not None:
                queues[(topic, int(qid_name))] = q
    return queues


def _load_queue(qdir: Path, report: CheckReport) -> _Queue | None:
    names = sorted(n for n in os.listdir(qdir) if files.parse_numbered(n, files.CQ_SUFFIX) is not None)
    entries: list[tuple[int, int, int]] = []
    first_offset: int | None = None
    for name in names:
        path = qdir / name
        data = path.read_bytes()
        try:
            first = decode_cq_header(data)
        except CorruptRecord as e:
            report.problems.append(f"{path}: {e.reason} (a restart rebuilds this queue)")
            return None
        if first_offset is None:
            first_offset = first
        elif first != first_offset + len(entries):
            report.problems.append(f"{path}: starts at {first}, expected {first_offset + len(entries)}")
            return None
        body = data[CQ_HEADER_SIZE:]
        if len(body) % ENTRY_SIZE:
            report.problems.append(f"{path}: {len(body) % ENTRY_SIZE} trailing bytes after the last whole entry")
        for j in range(len(body) // ENTRY_SIZE):
            try:
                entries.append(decode_entry(body, j * ENTRY_SIZE))
            except CorruptRecord as e:
                report.problems.append(f"{path}: entry {j}: {e.reason} (a restart rebuilds this queue)")
                return None
    report.cq_entries += len(entries)
    return _Queue(qdir, entries, first_offset or 0)


def _check_log(data_dir: Path, report: CheckReport, queues: dict[tuple[str, int], _Queue],
               checkpoint: int | None) -> None:
    log_dir = data_dir / files.COMMITLOG_DIR
    if not log_dir.exists():
        report.notes.append(f"{log_dir}: missing (empty broker)")
        return
    names = sorted(n for n in os.listdir(log_dir) if files.parse_numbered(n, files.SEGMENT_SUFFIX) is not None)
    expected_base: int | None = None
    for i, name in enumerate(names):
        path = log_dir / name
        is_last = i == len(names) - 1
        data = path.read_bytes()
        report.segments += 1
        try:
            base = decode_segment_header(data)
        except CorruptRecord as e:
            report.problems.append(f"{path}: {e.reason}")
            return
        if expected_base is None:
            report.log_start = base
        elif base != expected_base:
            report.problems.append(f"{path}: base {base}, but the previous segment ends at {expected_base}")
        position = base
        offset = SEGMENT_HEADER_SIZE
        while offset < len(data):
            try:
                size = check_frame(data, offset, position)
                msg = decode_record(data, offset, expected_position=position)
            except CorruptRecord as e:
                what = "torn tail (a restart truncates it)" if is_last else "damaged record"
                report.problems.append(f"{path}: {what} at position {position}: {e.reason}; "
                                       f"{len(data) - offset} bytes from there")
                break
            report.records += 1
            _check_entry(report, queues, msg.topic, msg.queue_id, msg.queue_offset, position, size,
                         tag_hash(msg.tag), checkpoint)
            position += size
            offset += size
        expected_base = position
    report.log_end = expected_base or 0


def _check_entry(report: CheckReport, queues: dict[tuple[str, int], _Queue], topic: str, qid: int, qoff: int,
                 position: int, size: int, th: int, checkpoint: int | None) -> None:
    q = queues.get((topic, qid))
    where = f"{topic}/{qid} offset {qoff}"
    if q is not None:
        q.seen_max = max(q.seen_max, qoff)
    if q is None or not q.first_offset <= qoff < q.first_offset + len(q.entries):
        if q is not None and qoff < q.first_offset:
            return  # the queue's older files were removed by retention
        if checkpoint is not None and position >= checkpoint:
            report.notes.append(f"record at {position} ({where}) is not yet in its consume queue; "
                                "a restart dispatches it")
        else:
            report.problems.append(f"record at {position} ({where}) is missing from its consume queue")
        return
    entry = q.entries[qoff - q.first_offset]
    if entry != (position, size, th):
        report.problems.append(f"consume queue {where} says {entry}, the log has {(position, size, th)}")


def format_report(report: CheckReport, data_dir: str | Path) -> str:
    lines = [f"chronoq check {data_dir}",
             f"  commit log: {report.segments} segments, {report.records} records, "
             f"positions [{report.log_start}, {report.log_end})",
             f"  consume queues: {report.queues} queues, {report.cq_entries} entries"]
    lines += [f"  note: {n}" for n in report.notes[:20]]
    if len(report.notes) > 20:
        lines.append(f"  note: ... and {len(report.notes) - 20} more")
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    lines.append("  OK" if report.ok else f"  DAMAGED: {len(report.problems)} problems")
    return "\n".join(lines)
