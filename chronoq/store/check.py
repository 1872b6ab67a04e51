"""`chronoq check DATA_DIR`: verify every file of a data directory, read-only.

Theory of operation: check never writes (it does not even take the broker's lock, so it can
look at a live directory, where a tail still being written may show as not yet dispatched).
It reads each file the way recovery would and sorts what it finds in three:
- *problems*: damage that costs data, or that needs a person: records quarantined because they
  fail their checks with valid (possibly acknowledged) records after them, a damaged record at
  the end that is whole (so it may have been acknowledged), a broken chain of segments, a
  damaged topic table. Exit status 1 (DAMAGED).
- *repairs*: what a restart repairs without losing anything acknowledged: a torn tail (a record
  cut short, with nothing valid after it), a consume queue to rebuild, a missing or damaged
  checkpoint. Exit status 3 (REPAIRABLE), when there are no problems.
- *notes*: facts, not findings (records a restart will dispatch).
And one verdict before any of these: a path that does not exist, is not a directory, or holds
none of chronoq's files is not a data directory at all (`unusable`, exit status 2, as for a
usage error): calling it DAMAGED would send a person looking for lost data that never existed,
and OK would bless a mistyped `--data-dir`.
The checks, one module each, all adding to one `CheckReport` (`check_report.py`, which also
formats it): the commit log, record by record (`check_log.py`); the consume queues, file by file
and then entry by entry against the log (`check_queues.py`); what each damaged range of the log
costs (`check_damage.py`); and, here, the topic table, the checkpoint and the two RocksDB stores.
Check's memory does not grow with the store: the log and the queues are read in bounded pieces
(`SEGMENT_WINDOW_BYTES`, `CHUNK_ENTRIES`, `MAX_HELD_CHUNKS`); findings (not memory) still grow
with the damage: a store whose queues are all lost lists each record missing from its queue.
"""

from __future__ import annotations

import os
from pathlib import Path

from rocksdict import AccessType, Options, Rdict

from chronoq.errors import CorruptRecord
from chronoq.model import is_system_topic
from chronoq.store import check_queues, files
from chronoq.store.check_damage import EngineView, IndexView
from chronoq.store.check_log import check_log
from chronoq.store.check_queues import Queue, QueueEntries, check_queue_ends, load_queues
from chronoq.store.check_report import CheckReport, format_report, plural
from chronoq.store.diskspace import resource_problem
from chronoq.store.meta import CHECKPOINT_VERSION, decode_checkpoint_versioned, decode_topics
from chronoq.timer.index import FORMAT_VERSION as TIMER_INDEX_FORMAT_VERSION
from chronoq.timer.index_codec import CF_META, META_FORMAT_VERSION, U32
from chronoq.timer.wheel import WheelTimerEngine

__all__ = ["DATA_DIR_MARKERS", "CheckReport", "check_data_dir", "format_report"]

DATA_DIR_MARKERS = (files.COMMITLOG_DIR, files.TOPICS, files.CHECKPOINT, files.QUEUES_DIR, files.TIMER_DIR,
                    files.GROUPS_DIR, files.LOCK)
"""A chronoq data directory holds at least one of these (a broker that opened it once made them all)."""


def check_data_dir(data_dir: str | Path) -> CheckReport:
    data_dir = Path(data_dir)
    report = CheckReport()
    if not data_dir.exists():
        report.unusable = f"{data_dir} does not exist"
        return report
    if not data_dir.is_dir():
        report.unusable = f"{data_dir} is a file, not a directory"
        return report
    if not any((data_dir / name).exists() for name in DATA_DIR_MARKERS):
        report.unusable = (f"{data_dir} is not a chronoq data directory: it holds none of "
                           f"{', '.join(DATA_DIR_MARKERS)}")
        return report
    topics = _check_topics(data_dir, report)
    _check_rocksdb(data_dir / files.GROUPS_DIR, "consumer-group store", report, derived=False)
    wheel_dir = data_dir / files.TIMER_WHEEL_DIR
    wheel = _check_wheel(wheel_dir, report) if wheel_dir.exists() else None
    if (data_dir / files.TIMER_DIR).exists() or not wheel_dir.exists():
        _check_rocksdb(data_dir / files.TIMER_DIR, "timer index", report, derived=True,
                       format_version=(CF_META, META_FORMAT_VERSION, TIMER_INDEX_FORMAT_VERSION))
    checkpoint, checkpoint_version = _check_checkpoint(data_dir, report)
    queues = load_queues(data_dir, report, topics)
    entries = QueueEntries(report)
    index: IndexView | EngineView | None = IndexView.open(data_dir / files.TIMER_DIR, TIMER_INDEX_FORMAT_VERSION)
    if wheel is not None:
        if index is None:
            index = EngineView(wheel)
        else:
            wheel.close()
    try:
        report.live_links_from = None if index is None else index.live_links_from
        check_log(data_dir, report, queues, entries, checkpoint,
                  walked_from=checkpoint_version >= CHECKPOINT_VERSION)
        if report.damage.ranges:
            _cost_damage(data_dir, report, queues, entries, index)
    finally:
        if index is not None:
            index.close()
    if report.expired_links:
        report.notes.append(f"{plural(report.expired_links, 'link record')} before {report.live_links_from}, where "
                            "retention's live segments begin, name records retention deleted: messages past "
                            "retention (a reader skips them)")
    check_queue_ends(report, queues, entries)
    return report


def _cost_damage(data_dir: Path, report: CheckReport, queues: dict[tuple[str, int], Queue], entries: QueueEntries,
                 index: IndexView | EngineView | None) -> None:
    """Add to each damaged range's finding what it costs: one more pass over the consume queues
    (in chunks), finding the entries that name records inside it (`check_damage.py`)."""
    damage = report.damage
    for (topic, qid), q in sorted(queues.items()):
        for number in range(-(-q.count // check_queues.CHUNK_ENTRIES)):
            raw = entries.read(q, number)
            if raw is not None:
                damage.count_entries(topic, qid, q.first_offset + number * check_queues.CHUNK_ENTRIES, raw)
    for problem, cost in zip(damage.problem_index, damage.costs(data_dir, index), strict=True):
        report.problems[problem] += ". " + cost


def _check_wheel(path: Path, report: CheckReport) -> WheelTimerEngine | None:
    """The file wheel (`timer_engine = "wheel"`), opened from a copy as a start would read it,
    writing nothing at `path`: damage is a repair (a start rebuilds it from the log). The opened
    copy, for the costs of damage in the log (link copies, pending timers), or None."""
    engine, reason = WheelTimerEngine.open_copy(path)
    if reason is not None:
        report.repairs.append(f"{path}: the file wheel cannot be used ({reason}); a restart rebuilds it from the log")
    return engine


def _check_rocksdb(path: Path, what: str, report: CheckReport, *, derived: bool,
                   format_version: tuple[str, bytes, int] | None = None) -> None:
    """Open a RocksDB store read-only (it writes nothing, and a running broker's lock does not
    stop it) and read every key: what a restart would find. The consumer-group store is not
    derived: a restart moves a damaged one aside and every group receives the retained log
    again, acknowledged messages too (a problem). The timer index is rebuilt from the log (a
    repair), also when its format version (`format_version`: column family, key, the version
    this chronoq reads) is another one, as a start would."""
    if not path.exists():
        why = "rebuilt from the log at the next start" if derived else "no group has received yet"
        report.notes.append(f"{path}: missing ({why})")
        return
    try:
        cfs = Rdict.list_cf(str(path))
        opts = Options(raw_mode=True)
        db = Rdict(str(path), opts, column_families={name: opts for name in cfs if name != "default"},
                   access_type=AccessType.read_only())
        try:
            for name in cfs:
                handle = db if name == "default" else db.get_column_family(name)
                for _ in handle.keys():  # noqa: SIM118 (keys only: the values are not decoded)
                    pass
            version = None
            if format_version is not None and format_version[0] in cfs:
                raw = db.get_column_family(format_version[0]).get(format_version[1])
                version = U32.unpack(raw)[0] if raw is not None and len(raw) == U32.size else raw
        finally:
            db.close()
        if format_version is not None and version != format_version[2]:
            report.repairs.append(f"{path}: the {what} has format version {version!r}, this chronoq reads "
                                  f"{format_version[2]}; a restart rebuilds it from the log")
    except Exception as e:
        if (problem := resource_problem(e)) is not None:
            report.notes.append(f"{path}: not checked: {problem}")
        elif derived:
            report.repairs.append(f"{path}: the {what} cannot be read ({e}); a restart rebuilds it from the log")
        else:
            report.problems.append(f"{path}: the {what} cannot be read ({e}); a restart moves it aside and every "
                                   "group receives the retained log again, acknowledged messages included")


def _check_topics(data_dir: Path, report: CheckReport) -> dict[str, int]:
    """Check the topic table; return its topics' queue counts (none when it is missing or damaged)."""
    path = data_dir / files.TOPICS
    if not path.exists():
        report.notes.append(f"{path}: missing (no topics created yet)")
        return {}
    try:
        return {t.name: t.queue_count for t in decode_topics(path.read_bytes())}
    except CorruptRecord as e:
        # What `messagestore_recovery._load_topics` will do, so the person knows what a restart costs.
        root = data_dir / files.QUEUES_DIR
        names = sorted(n for n in os.listdir(root) if (root / n).is_dir() and not is_system_topic(n)) \
            if root.is_dir() else []
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        report.problems.append(
            f"{path}: the topic table is damaged ({e.reason}). A restart moves it aside to "
            f"{path.name}.damaged-<ms> and rebuilds it from {root}: {len(names)} topic(s)"
            f"{' (' + shown + ')' if names else ''} come back with their queue counts, but every topic "
            "accepts every message type again and its creation time is lost. Start the broker to repair it; "
            "copy the file first if you want to inspect it")
        return {}


def _check_checkpoint(data_dir: Path, report: CheckReport) -> tuple[int | None, int]:
    """(dispatched position, version), or (None, 0) when there is none to trust."""
    path = data_dir / files.CHECKPOINT
    if not path.exists():
        report.notes.append(f"{path}: missing (a restart replays the whole log)")
        return None, 0
    try:
        return decode_checkpoint_versioned(path.read_bytes())
    except CorruptRecord as e:
        report.repairs.append(f"{path}: {e.reason} (a restart replays the whole log)")
        return None, 0
