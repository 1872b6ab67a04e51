"""`chronoq check`'s consume queues: each file validated, then every record's entry compared.

Theory of operation: the consume queues are checked against the log in one pass over the log
(`check_log.py` calls `check_entry` for each record, and for each link of a link record): every
record must have its entry (position, size, tag hash) at its queue offset, and no queue may hold
entries past the last record of its queue (`check_queue_ends`). A hole entry (size 0) marks a
record lost to damage. A queue a restart rebuilds from the log (a damaged file, a gap, no file at
all, or no directory for a queue the topic table names: `messagestore_recovery.recover`) is a repair,
and its records are not also reported missing. A record the log still holds below its queue's
first offset is a problem: retention removes a queue's files only once all their entries lie
below the log's start, so a file at the queue's start is missing, and a restart, which cannot
tell that from files retention removed, does not rebuild the queue.

Memory does not grow with the store. A consume queue is read twice, never held: loading
validates each file (header, the chain of first offsets, every entry's CRC32C) in reads of
`CHUNK_ENTRIES` entries and keeps only the file list (`Queue`); the pass over the log then reads
the entries it compares in chunks of `CHUNK_ENTRIES`, holding at most `MAX_HELD_CHUNKS` of them
(least recently used out first: one chunk per queue the log interleaves, usually:
`QueueEntries`), and the entries past a queue's last record are counted chunk by chunk. Before,
every entry was a Python tuple in a list (about 160 bytes each: 1.5 GB for a store of 10 M
messages, where the broker itself runs in less than 300 MB). A queue file a running broker's
retention removes between the two reads is noted as removed while being checked, and its
entries compared with nothing.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from chronoq.errors import CorruptRecord
from chronoq.store import files
from chronoq.store.check_report import CheckReport, open_or_note, plural
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY, ENTRY_SIZE, decode_cq_header, decode_entry

CHUNK_ENTRIES = 256
"""Consume-queue entries read at a time (5 KiB of file), and held as one chunk."""
MAX_HELD_CHUNKS = 512
"""The most chunks of consume-queue entries check holds at once (least recently used out first)."""
MAX_HELD_ENTRIES = CHUNK_ENTRIES * MAX_HELD_CHUNKS
"""Check's bound on consume-queue entries in memory, whatever the store holds: 131,072 (2.5 MiB
of raw entries), where it used to hold every entry of every queue as a tuple."""


_ENTRY_WHOLE = struct.Struct(">QIII")  # an entry with its CRC32C


@dataclass
class Queue:
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


class QueueEntries:
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

    def get(self, q: Queue, index: int) -> tuple[int, int, int] | None:
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

    def read(self, q: Queue, number: int) -> bytes | None:
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


def check_queue_ends(report: CheckReport, queues: dict[tuple[str, int], Queue], entries: QueueEntries) -> None:
    """After the pass over the log: report each queue's records below its first offset, and the
    entries past its last record in the log (ignoring ones retention left behind)."""
    for (topic, qid), q in sorted(queues.items()):
        if q.below_first:
            low, high = q.below_first_offsets
            report.problems.append(
                f"{q.path}: {plural(q.below_first, 'record')} of {topic}/{qid} the log still holds (offsets "
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


def load_queues(data_dir: Path, report: CheckReport, topics: dict[str, int]) -> dict[tuple[str, int], Queue]:
    """Every queue's files, validated; a queue a restart rebuilds (damaged, or without a file or a
    directory though the topic table names it) is a repair and marked `rebuilt`."""
    queues: dict[tuple[str, int], Queue] = {}
    root = data_dir / files.QUEUES_DIR
    for topic in sorted(os.listdir(root)) if root.exists() else []:
        for qid_name in sorted(os.listdir(root / topic)):
            qdir = root / topic / qid_name
            if not qid_name.isdigit() or not qdir.is_dir():
                report.problems.append(f"{qdir}: unexpected entry in the queues directory")
                continue
            report.queues += 1
            q = _load_queue(qdir, report)
            queues[(topic, int(qid_name))] = Queue(qdir, [], 0, 0, rebuilt=True) if q is None else q
    for topic, count in sorted(topics.items()):
        for qid in range(count):
            q = queues.get((topic, qid))
            if q is None or (not q.files and not q.rebuilt):
                qdir = root / topic / str(qid)
                report.repairs.append(f"{qdir}: {'missing' if q is None else 'no queue file'} (a restart "
                                      "rebuilds this queue from the log)")
                queues[(topic, qid)] = Queue(qdir, [], 0, 0, rebuilt=True)
    return queues


def _load_queue(qdir: Path, report: CheckReport) -> Queue | None:
    """Validate a queue's files (header, first offsets, every entry) in reads of `CHUNK_ENTRIES`
    entries; None (and a repair) if a restart rebuilds it."""
    names = sorted(n for n in os.listdir(qdir) if files.parse_numbered(n, files.CQ_SUFFIX) is not None)
    cq_files: list[tuple[int, int, Path]] = []
    count = 0
    first_offset: int | None = None
    for name in names:
        path = qdir / name
        if (fd := open_or_note(path, report)) is None:
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
    return Queue(qdir, cq_files, first_offset or 0, count)


def check_entry(report: CheckReport, queues: dict[tuple[str, int], Queue], entries: QueueEntries, topic: str,
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
