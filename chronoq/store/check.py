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
A torn tail and damage are told apart as recovery does (`store/damage.py`): by whether a valid
record follows the bad one. Magic, version and checksum failures are named apart, as bbolt's
check does. The consume queues are checked against the log in one pass over the log: every
record must have its entry (position, size, tag hash) at its queue offset, and no queue may hold
entries past the last record of its queue. A hole entry (size 0) marks a record lost to damage.
A queue a restart rebuilds from the log (a damaged file, a gap, no file at all, or no directory
for a queue the topic table names: `MessageStore._recover`) is a repair, and its records are not
also reported missing. A record the log still holds below its queue's first offset is a problem:
retention removes a queue's files only once all their entries lie below the log's start, so a
file at the queue's start is missing, and a restart, which cannot tell that from files retention
removed, does not rebuild the queue.
Check's memory does not grow with the store. The log is read through a window of
`SEGMENT_WINDOW_BYTES` (a larger record is read whole; a size that runs past the segment's end is
judged from the header, as `check_frame` would, not read). A consume queue is read twice, never
held: loading validates each file (header, the chain of first offsets, every entry's CRC32C) in
reads of `CHUNK_ENTRIES` entries and keeps only the file list; the pass over the log then reads
the entries it compares in chunks of `CHUNK_ENTRIES`, holding at most `MAX_HELD_CHUNKS` of them
(least recently used out first: one chunk per queue the log interleaves, usually), and the
entries past a queue's last record are counted chunk by chunk. Before, every entry was a Python
tuple in a list (about 160 bytes each: 1.5 GB for a store of 10 M messages, where the broker
itself runs in less than 300 MB) and each segment was read whole. A queue file a running
broker's retention removes between the two reads is noted as removed while being checked, as a
log segment is, and its entries compared with nothing. Findings (not memory) still grow with the
damage: a store whose queues are all lost lists each record missing from its queue.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from rocksdict import AccessType, Options, Rdict

from chronoq.errors import CorruptRecord
from chronoq.model import LINKS_TOPIC, is_system_topic
from chronoq.store import files
from chronoq.store.check_damage import DamageCosts, IndexView
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE, check_frame, decode_segment_header
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY, ENTRY_SIZE, decode_cq_header, decode_entry, tag_hash
from chronoq.store.damage import DAMAGED, Pread, classify
from chronoq.store.diskspace import resource_problem
from chronoq.store.links import decode_links, link_entries
from chronoq.store.meta import CHECKPOINT_VERSION, decode_checkpoint_versioned, decode_topics
from chronoq.store.record import HEADER, HEADER_SIZE, RECORD_MAGIC, RECORD_VERSION, decode_record
from chronoq.timer.index import FORMAT_VERSION as TIMER_INDEX_FORMAT_VERSION
from chronoq.timer.index_codec import CF_META, META_FORMAT_VERSION, U32

DATA_DIR_MARKERS = (files.COMMITLOG_DIR, files.TOPICS, files.CHECKPOINT, files.QUEUES_DIR, files.TIMER_DIR,
                    files.GROUPS_DIR, files.LOCK)
"""A chronoq data directory holds at least one of these (a broker that opened it once made them all)."""

CHUNK_ENTRIES = 256
"""Consume-queue entries read at a time (5 KiB of file), and held as one chunk."""
MAX_HELD_CHUNKS = 512
"""The most chunks of consume-queue entries check holds at once (least recently used out first)."""
MAX_HELD_ENTRIES = CHUNK_ENTRIES * MAX_HELD_CHUNKS
"""Check's bound on consume-queue entries in memory, whatever the store holds: 131,072 (2.5 MiB
of raw entries), where it used to hold every entry of every queue as a tuple."""

SEGMENT_WINDOW_BYTES = 4 * 1024 * 1024
"""Commit-log bytes check reads (and holds) at a time; a larger record is read whole. Before, it
read each segment whole (256 MiB by default), and the next one before letting the last go."""

_ENTRY_WHOLE = struct.Struct(">QIII")  # an entry with its CRC32C


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


@dataclass
class _Queue:
    path: Path
    files: list[tuple[int, int, Path]]
    """(index of its first entry in the queue, whole entries, path) of each file, as loaded: the
    entries themselves are read again when the log is checked against them."""
    first_offset: int
    count: int
    """Whole entries in the files, from `first_offset`."""
    seen_max: int = -1
    rebuilt: bool = False
    """A restart rebuilds this queue from the log (a repair already reported): its records are
    not compared with the files."""
    below_first: int = 0
    """Records the log holds below `first_offset` (a missing first file), the lowest and highest
    of their queue offsets in `below_first_offsets`."""
    below_first_offsets: tuple[int, int] = (0, 0)


class _Entries:
    """Consume-queue entries read back from their files in chunks of `CHUNK_ENTRIES`, at most
    `MAX_HELD_CHUNKS` of them held (least recently used out first). `held_peak` is the most
    entries held at once."""

    def __init__(self, report: CheckReport) -> None:
        self.report = report
        self.chunks: OrderedDict[tuple[Path, int], bytes | None] = OrderedDict()
        self.held = 0
        self.held_peak = 0
        self.gone: set[Path] = set()
        self.last_key: tuple[Path, int] | None = None
        self.last_raw: bytes | None = None

    def get(self, q: _Queue, index: int) -> tuple[int, int, int] | None:
        """Entry `index` (from the queue's first offset); None when its file is gone."""
        number, k = divmod(index, CHUNK_ENTRIES)
        key = (q.path, number)
        if key == self.last_key:  # the usual case: the entry after the last one
            raw = self.last_raw
        elif key in self.chunks:
            self.chunks.move_to_end(key)
            raw = self.chunks[key]
        else:
            raw = self.read(q, number)
            if len(self.chunks) >= MAX_HELD_CHUNKS:
                _, dropped = self.chunks.popitem(last=False)
                self.held -= 0 if dropped is None else len(dropped) // ENTRY_SIZE
            self.chunks[key] = raw
            self.held += 0 if raw is None else len(raw) // ENTRY_SIZE
            self.held_peak = max(self.held_peak, self.held)
        self.last_key, self.last_raw = key, raw
        if raw is None:
            return None
        return ENTRY.unpack_from(raw, k * ENTRY_SIZE)  # type: ignore[return-value]

    def read(self, q: _Queue, number: int) -> bytes | None:
        """Chunk `number` of the queue's entries (raw, CHUNK_ENTRIES of them or the last ones); None
        if a file it lies in was removed since it was loaded (or no longer holds them)."""
        start = number * CHUNK_ENTRIES
        stop = min(start + CHUNK_ENTRIES, q.count)
        parts: list[bytes] = []
        i = bisect.bisect_right(q.files, start, key=lambda f: f[0]) - 1
        while start < stop:
            first, count, path = q.files[i]
            n = min(stop, first + count) - start
            if path in self.gone:
                return None
            try:
                with open(path, "rb") as f:
                    part = os.pread(f.fileno(), n * ENTRY_SIZE, CQ_HEADER_SIZE + (start - first) * ENTRY_SIZE)
            except FileNotFoundError:
                part = b""
            if len(part) != n * ENTRY_SIZE:
                self.gone.add(path)
                self.report.notes.append(f"{path}: removed by retention while being checked")
                return None
            parts.append(part)
            start += n
            i += 1
        return b"".join(parts)


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
    _check_rocksdb(data_dir / files.TIMER_DIR, "timer index", report, derived=True,
                   format_version=(CF_META, META_FORMAT_VERSION, TIMER_INDEX_FORMAT_VERSION))
    checkpoint, checkpoint_version = _check_checkpoint(data_dir, report)
    queues = _load_queues(data_dir, report, topics)
    entries = _Entries(report)
    index = IndexView.open(data_dir / files.TIMER_DIR, TIMER_INDEX_FORMAT_VERSION)
    try:
        report.live_links_from = None if index is None else index.live_links_from
        _check_log(data_dir, report, queues, entries, checkpoint,
                   walked_from=checkpoint_version >= CHECKPOINT_VERSION)
        if report.damage.ranges:
            _cost_damage(data_dir, report, queues, entries, index)
    finally:
        if index is not None:
            index.close()
    if report.expired_links:
        report.notes.append(f"{_count(report.expired_links, 'link record')} before {report.live_links_from}, where "
                            "retention's live segments begin, name records retention deleted: messages past "
                            "retention (a reader skips them)")
    for (topic, qid), q in sorted(queues.items()):
        if q.below_first:
            low, high = q.below_first_offsets
            report.problems.append(
                f"{q.path}: {_count(q.below_first, 'record')} of {topic}/{qid} the log still holds (offsets "
                f"{low} to {high}) lie below the queue's first offset {q.first_offset}: "
                "a file at its start is missing, and a restart does not rebuild it. Remove the directory "
                f"{q.path} and restart the broker to rebuild the queue from the log")
        # Entries past the queue's last record in the log, ignoring ones retention left behind.
        extra = past_end = 0
        start = max(0, q.seen_max + 1 - q.first_offset)
        for number in range(start // CHUNK_ENTRIES, -(-q.count // CHUNK_ENTRIES)):
            raw = entries.read(q, number)
            if raw is None:
                continue
            for j, (position, _, _, _) in enumerate(_ENTRY_WHOLE.iter_unpack(raw), number * CHUNK_ENTRIES):
                # (An entry naming a damaged record is counted in that damage's cost.)
                if j >= start and position >= report.log_start and not report.damage.holds(position):
                    extra += 1
                    past_end += position >= report.log_end
        if past_end:
            report.repairs.append(f"{q.path}: {past_end} entries point past the log's end {report.log_end} "
                                  f"(a restart drops them)")
        if extra > past_end:
            report.problems.append(f"{q.path}: {extra - past_end} entries past the last record of "
                                   f"{topic}/{qid} in the log")
    return report


def _cost_damage(data_dir: Path, report: CheckReport, queues: dict[tuple[str, int], _Queue], entries: _Entries,
                 index: IndexView | None) -> None:
    """Add to each damaged range's finding what it costs: one more pass over the consume queues
    (in chunks), finding the entries that name records inside it (`check_damage.py`)."""
    damage = report.damage
    for (topic, qid), q in sorted(queues.items()):
        for number in range(-(-q.count // CHUNK_ENTRIES)):
            raw = entries.read(q, number)
            if raw is not None:
                damage.count_entries(topic, qid, q.first_offset + number * CHUNK_ENTRIES, raw)
    for problem, cost in zip(damage.problem_index, damage.costs(data_dir, index), strict=True):
        report.problems[problem] += ". " + cost


def _open(path: Path, report: CheckReport) -> int | None:
    """A file descriptor to read `path`; None (and a note) when a running broker's retention
    removed it after the directory was listed: not damage."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        report.notes.append(f"{path}: removed by retention while being checked")
        return None


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
        # What `MessageStore._load_topics` will do, so the person knows what a restart costs.
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


def _load_queues(data_dir: Path, report: CheckReport, topics: dict[str, int]) -> dict[tuple[str, int], _Queue]:
    """Every queue's files, validated; a queue a restart rebuilds (damaged, or without a file or a
    directory though the topic table names it) is a repair and marked `rebuilt`."""
    queues: dict[tuple[str, int], _Queue] = {}
    root = data_dir / files.QUEUES_DIR
    for topic in sorted(os.listdir(root)) if root.exists() else []:
        for qid_name in sorted(os.listdir(root / topic)):
            qdir = root / topic / qid_name
            if not qid_name.isdigit() or not qdir.is_dir():
                report.problems.append(f"{qdir}: unexpected entry in the queues directory")
                continue
            report.queues += 1
            q = _load_queue(qdir, report)
            queues[(topic, int(qid_name))] = _Queue(qdir, [], 0, 0, rebuilt=True) if q is None else q
    for topic, count in sorted(topics.items()):
        for qid in range(count):
            q = queues.get((topic, qid))
            if q is None or (not q.files and not q.rebuilt):
                qdir = root / topic / str(qid)
                report.repairs.append(f"{qdir}: {'missing' if q is None else 'no queue file'} (a restart "
                                      "rebuilds this queue from the log)")
                queues[(topic, qid)] = _Queue(qdir, [], 0, 0, rebuilt=True)
    return queues


def _load_queue(qdir: Path, report: CheckReport) -> _Queue | None:
    """Validate a queue's files (header, first offsets, every entry) in reads of `CHUNK_ENTRIES`
    entries; None (and a repair) if a restart rebuilds it."""
    names = sorted(n for n in os.listdir(qdir) if files.parse_numbered(n, files.CQ_SUFFIX) is not None)
    cq_files: list[tuple[int, int, Path]] = []
    count = 0
    first_offset: int | None = None
    for name in names:
        path = qdir / name
        if (fd := _open(path, report)) is None:
            continue
        try:
            size = os.fstat(fd).st_size
            try:
                first = decode_cq_header(os.pread(fd, CQ_HEADER_SIZE, 0))
            except CorruptRecord as e:
                report.repairs.append(f"{path}: {e.reason} (a restart rebuilds this queue)")
                return None
            if first_offset is None:
                first_offset = first
            elif first != first_offset + count:
                report.repairs.append(f"{path}: starts at {first}, expected {first_offset + count} "
                                      "(a restart rebuilds this queue)")
                return None
            body_size = size - CQ_HEADER_SIZE
            if body_size % ENTRY_SIZE:
                report.repairs.append(f"{path}: {body_size % ENTRY_SIZE} trailing bytes after the last whole entry "
                                      "(a restart rebuilds this queue)")
            whole = body_size // ENTRY_SIZE
            for chunk_start in range(0, whole, CHUNK_ENTRIES):
                n = min(CHUNK_ENTRIES, whole - chunk_start)
                body = os.pread(fd, n * ENTRY_SIZE, CQ_HEADER_SIZE + chunk_start * ENTRY_SIZE)
                for k in range(n):
                    try:
                        decode_entry(body, k * ENTRY_SIZE)
                    except CorruptRecord as e:
                        report.repairs.append(f"{path}: entry {chunk_start + k}: {e.reason} "
                                              "(a restart rebuilds this queue)")
                        return None
        finally:
            os.close(fd)
        cq_files.append((count, whole, path))
        count += whole
    report.cq_entries += count
    return _Queue(qdir, cq_files, first_offset or 0, count)


def _check_log(data_dir: Path, report: CheckReport, queues: dict[tuple[str, int], _Queue], entries: _Entries,
               checkpoint: int | None, *, walked_from: bool = False) -> None:
    """`walked_from`: the checkpoint is of version 2, where recovery starts its walk of the last
    segment (bytes below it that the segment still spans are not looked at: readers meet them)."""
    log_dir = data_dir / files.COMMITLOG_DIR
    if not log_dir.exists():
        report.notes.append(f"{log_dir}: missing (empty broker)")
        return
    names = sorted(n for n in os.listdir(log_dir) if files.parse_numbered(n, files.SEGMENT_SUFFIX) is not None)
    expected_base: int | None = None
    for i, name in enumerate(names):
        path = log_dir / name
        is_last = i == len(names) - 1
        if (fd := _open(path, report)) is None:
            continue
        try:
            expected_base = _check_segment(report, queues, entries, path, fd, name, expected_base, is_last,
                                           checkpoint, walked_from)
        finally:
            os.close(fd)
    report.log_end = expected_base or 0
    if checkpoint is not None and report.log_end < checkpoint:
        # A torn tail (or a file cut short) below the checkpoint: a problem, not a repair.
        report.problems.append(
            f"{log_dir}: the log's valid records end at {report.log_end}, below the checkpoint {checkpoint}: "
            f"{checkpoint - report.log_end} bytes of records the consume queues were given (so acknowledged) are "
            f"gone. {_LOST_BELOW_CHECKPOINT}")


def _check_segment(report: CheckReport, queues: dict[tuple[str, int], _Queue], entries: _Entries, path: Path,
                   fd: int, name: str, expected_base: int | None, is_last: bool, checkpoint: int | None,
                   walked_from: bool = False) -> int:
    """Check one segment's records (read through a `_Window`); return where it ends.
    `walked_from`: as `_bad_record`'s."""
    report.segments += 1
    base = files.parse_numbered(name, files.SEGMENT_SUFFIX) or 0
    try:
        if decode_segment_header(os.pread(fd, SEGMENT_HEADER_SIZE, 0)) != base:
            raise CorruptRecord("the base in the header differs from the file name")
    except CorruptRecord as e:
        report.problems.append(f"{path}: damaged segment header: {e.reason} (the records are read by the "
                               "base the file name gives)")
    if expected_base is None:
        report.log_start = base
    elif base != expected_base:
        report.problems.append(f"{path}: base {base}, but the previous segment ends at {expected_base}: "
                               "a segment is missing or misnamed; the broker refuses to start")
    end = base + max(0, os.fstat(fd).st_size - SEGMENT_HEADER_SIZE)
    window = _Window(fd, base, end)
    position = base
    while position < end:
        try:
            buf, offset = window.at(position, HEADER_SIZE)
            if len(buf) - offset >= HEADER_SIZE:
                total = U32.unpack_from(buf, offset)[0]  # a record's first field is its size
                if total > end - position > SEGMENT_WINDOW_BYTES:
                    raise _past_the_end(buf[offset:offset + HEADER_SIZE], position, total, end - position)
                if offset + total > len(buf):
                    buf, offset = window.at(position, total)
            size = check_frame(buf, offset, position)
            msg = decode_record(buf, offset, expected_position=position)
        except CorruptRecord as e:
            resume = _bad_record(report, path, window.pread, position, end, e.reason, is_last, checkpoint,
                                 walked_from)
            if resume is None:  # a torn tail: the log a restart keeps ends here
                end = position
                break
            position = resume
            continue
        report.records += 1
        try:
            # A record's own entry, and each link of a link record (`store/links.py`).
            _check_entry(report, queues, entries, msg.topic, msg.queue_id, msg.queue_offset, position, size,
                         tag_hash(msg.tag), checkpoint)
            if msg.topic == LINKS_TOPIC:
                links = decode_links(msg.body, position)
                for topic, qid, qoff, at, entry_size, th in link_entries(position, links):
                    _check_entry(report, queues, entries, topic, qid, qoff, at, entry_size, th, checkpoint)
                if report.damage.ranges:  # (links point back: damage they reach was met before)
                    for i, target in enumerate(links.positions):
                        report.damage.count_link(target, links.topics[links.topic_indexes[i]], links.queue_ids[i],
                                                 links.queue_offsets[i])
                low = min(links.positions, default=None)
                if low is not None and low < report.log_start and report.live_links_from is not None \
                        and position < report.live_links_from:
                    report.expired_links += 1  # past retention itself: what it names may go (retention.py)
                elif low is not None and low < report.log_start:
                    report.problems.append(
                        f"{path}: link record at position {position} names a record at {low}, below the log's "
                        f"start {report.log_start}: the message it fired is gone (retention must keep it)")
        except CorruptRecord as e:
            report.problems.append(f"{path}: link record at position {position} cannot be read: {e.reason}; "
                                   "the messages it fired are missing from their consume queues")
        position += size
    return end


class _Window:
    """A segment's records from position `base` to `end` (its size when opened), read
    `SEGMENT_WINDOW_BYTES` at a time, or one record whole when it is larger."""

    def __init__(self, fd: int, base: int, end: int) -> None:
        self.fd, self.base, self.end = fd, base, end
        self.start = base
        self.buf = b""

    def pread(self, at: int, size: int) -> bytes:
        """Up to `size` bytes from position `at`, none past `end`."""
        return os.pread(self.fd, max(0, min(size, self.end - at)), at - self.base + SEGMENT_HEADER_SIZE)

    def at(self, position: int, need: int) -> tuple[bytes, int]:
        """A buffer that holds the `need` bytes from `position` (up to `end`) and reaches `end` or
        beyond them, and the offset of `position` in it."""
        if not self.start <= position or position + min(need, self.end - position) > self.start + len(self.buf):
            self.buf = b""  # let it go before reading the next
            self.start = position
            self.buf = self.pread(position, max(need, SEGMENT_WINDOW_BYTES))
        return self.buf, position - self.start


def _past_the_end(head: bytes, position: int, total: int, avail: int) -> CorruptRecord:
    """What `check_frame` finds in a record whose size runs past the segment's end, from its
    header alone (not reading the bytes the size claims): its magic and version, then the size."""
    magic, version = HEADER.unpack_from(head)[2:4]
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        check_frame(head, 0, position)  # raises, in its own words
    return CorruptRecord(f"record size {total} does not fit the {avail} bytes available", position)


_LOST_BELOW_CHECKPOINT = ('With flush = "async" and a checkpoint of version 1 a power loss took them before '
                          "their fsync, the price of that option; otherwise the disk lost fsynced records. A "
                          "restart cuts the tail, says how much was lost, and brings the consume queues and the "
                          "timer index back to the log's end")


def _bad_record(report: CheckReport, path: Path, pread: Pread, position: int, end: int, reason: str,
                is_last: bool, checkpoint: int | None, walked_from: bool = False) -> int | None:
    """Report the record at `position` that failed its checks; return where to read on (None:
    a torn tail, where the log ends once a restart has truncated it). A torn tail below the
    checkpoint is a problem, not a repair: the records there had been dispatched, so
    acknowledged, in either flush mode (recovery: `commitlog_recovery._lost_below_checkpoint`). Below a
    version-2 checkpoint the segment still spans (`walked_from`), recovery's walk never meets
    it: a restart keeps those bytes, and readers quarantine them, as any damage."""
    verdict, resume = classify(pread, check_frame, position, end)
    if verdict == DAMAGED:
        after = "valid records follow and are kept" if resume < end else "it is whole, so it may have been acknowledged"
        report.problems.append(f"{path}: damaged bytes at positions [{position}, {resume}) "
                               f"({resume - position} bytes): {reason}; {after}. A restart quarantines them "
                               "(skips and reports them), it does not cut anything after them")
        report.damage.add(position, resume, len(report.problems) - 1)
        return resume
    if is_last and checkpoint is not None and position < checkpoint:
        if walked_from and checkpoint <= end:
            report.problems.append(f"{path}: damaged bytes at positions [{position}, {checkpoint}) "
                                   f"({checkpoint - position} bytes), below the checkpoint: {reason}; records the "
                                   "consume queues were given (so acknowledged) are lost. A restart keeps them; "
                                   "readers quarantine them (skip and report them)")
            report.damage.add(position, checkpoint, len(report.problems) - 1)
            return checkpoint  # where recovery's walk starts
        return None  # the log's end is below the checkpoint: `_check_log` reports it, once
    if is_last:
        report.repairs.append(f"{path}: torn tail at position {position} ({end - position} bytes): {reason}; no valid "
                              "record follows, so nothing fsynced is in it (with flush = \"sync\", nothing "
                              "acknowledged). A restart truncates it")
        return None
    else:
        report.problems.append(f"{path}: damaged bytes at positions [{position}, {end}) to the segment's end: {reason}")
        report.damage.add(position, end, len(report.problems) - 1)
    return end


def _check_entry(report: CheckReport, queues: dict[tuple[str, int], _Queue], entries: _Entries, topic: str,
                 qid: int, qoff: int, position: int, size: int, th: int, checkpoint: int | None) -> None:
    q = queues.get((topic, qid))
    where = f"{topic}/{qid} offset {qoff}"
    if q is not None:
        if q.rebuilt:
            return  # a restart rebuilds the queue from the log, this record's entry with it
        q.seen_max = max(q.seen_max, qoff)
    if q is None or not q.first_offset <= qoff < q.first_offset + q.count:
        if q is not None and qoff < q.first_offset:
            # Retention removes a queue's files only once every entry in them lies below the
            # log's start: a record the log holds below the first offset lost its file.
            low, high = q.below_first_offsets if q.below_first else (qoff, qoff)
            q.below_first_offsets = (min(low, qoff), max(high, qoff))
            q.below_first += 1
            return
        if checkpoint is not None and position >= checkpoint:
            report.notes.append(f"record at {position} ({where}) is not yet in its consume queue; "
                                "a restart dispatches it")
        else:
            report.problems.append(f"record at {position} ({where}) is missing from its consume queue")
        return
    entry = entries.get(q, qoff - q.first_offset)
    if entry is None:
        return  # its file was removed by retention since it was loaded (noted)
    if entry != (position, size, th):
        report.problems.append(f"consume queue {where} says {entry}, the log has {(position, size, th)}")


def format_report(report: CheckReport, data_dir: str | Path) -> str:
    if report.unusable is not None:
        return "\n".join([f"chronoq check {data_dir}", f"  NOT A DATA DIRECTORY: {report.unusable}",
                          "  (nothing was checked; give the directory `chronoq serve --data-dir` uses)"])
    lines = [f"chronoq check {data_dir}",
             f"  commit log: {_count(report.segments, 'segment')}, {_count(report.records, 'record')}, "
             f"positions [{report.log_start}, {report.log_end})",
             f"  consume queues: {_count(report.queues, 'queue')}, {_count(report.cq_entries, 'entry', 'entries')}"]
    lines += [f"  note: {n}" for n in report.notes[:20]]
    if len(report.notes) > 20:
        lines.append(f"  note: ... and {len(report.notes) - 20} more")
    lines += [f"  REPAIR: {r}" for r in report.repairs]
    lines += [f"  PROBLEM: {p}" for p in report.problems]
    if report.problems:
        lines.append(f"  DAMAGED: {_count(len(report.problems), 'problem')}" +
                     (f", {_count(len(report.repairs), 'repair')}" if report.repairs else ""))
    elif report.repairs:
        lines.append(f"  REPAIRABLE: {_count(len(report.repairs), 'finding')} a restart repairs without losing "
                     "anything acknowledged")
    else:
        lines.append("  OK")
    return "\n".join(lines)


def _count(n: int, one: str, many: str | None = None) -> str:
    """"1 segment", "2 segments": the report is read by a person."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"
