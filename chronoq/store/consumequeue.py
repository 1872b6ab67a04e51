"""Consume queues: per (topic, queue id), a dense index from logical offset to commit-log record.

Theory of operation: a consume queue is derived state. The dispatcher appends one fixed-size
entry per durable record; entry i describes the record with queue offset i. Files hold
`entries_per_file` entries each and are named by their first offset, so offset -> file is
arithmetic (a binary search over first offsets when files written under another setting hold
other counts) and retention drops whole files from the front. Entries carry their own CRC32C so a
torn or flipped entry is found by `load`; the caller (recovery) then re-dispatches from the commit
log. Reads go through `os.pread` on the page cache; nothing is held in memory but file handles,
and not all of those: a broker may have tens of thousands of queues, one file each at least, so
the files are opened on first use and the least recently used is closed once the store's
`OpenFiles` holds `max_open_queue_files` (before, every queue file stayed open: a topic of
65,000 queues ran out of descriptors at its creation); a process out of descriptors when one must
be opened, or created (a queue rolling to its next file), gives up another queue file first. If
none is open to give up, the EMFILE is raised: the dispatcher holds the records back and tries
again later, as for a full disk. A file closed while it holds entries no
fsync has covered is fdatasynced first, on the calling thread, so a checkpoint never covers
entries written through a descriptor it can no longer sync; a checkpoint syncs duplicates of
the dirty files' descriptors (`take_dirty`), so closing the originals meanwhile is safe; while
it runs, consume queues hold up to twice the limit.
A write that runs out of space (a short `pwrite`, ENOSPC at a new file) is undone: the file is
cut back to its last whole entry, a half-made file removed, and the OSError (ENOSPC) raised; the
dispatcher tries again later, and `append_many` skips entries an earlier try already wrote.

The file header (24 bytes) and the entry (20 bytes: position, size, tag hash, CRC32C) are laid
out in `docs/disk-format.md` ("Consume queue"), their one description.
"""

from __future__ import annotations

import bisect
import errno
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import crc32c

from chronoq.errors import CorruptRecord, FsyncFailed
from chronoq.store import files, fsync

CQ_MAGIC = b"CHRONOQQ"
CQ_VERSION = 1
CQ_HEADER = struct.Struct(">8sIQI")
CQ_HEADER_SIZE = CQ_HEADER.size  # 24
LINKED = 1 << 31
"""Set in an entry's size field: the entry is a link (`store/links.py`): its position is its link
record's, the low 31 bits the link's index there. A record's size is below 2**31
(`max_message_size_bytes` is at most 512 MiB); size 0 is a hole."""
ENTRY = struct.Struct(">QII")
ENTRY_BODY_SIZE = ENTRY.size  # 16
ENTRY_SIZE = ENTRY_BODY_SIZE + 4  # 20
_U32 = struct.Struct(">I")


@dataclass
class TakenFlush:
    """A consume queue's pending fsyncs, taken by `ConsumeQueue.take_dirty`: safe to sync on
    another thread while the queue goes on appending (an fsync covers at least what was written
    before it began). `close` releases the duplicated descriptors, whether or not `sync` ran."""

    files: list[tuple[int, Path]]
    directory: Path | None
    queue: ConsumeQueue | None = None
    owners: tuple[CQFile, ...] = ()
    """The files the descriptors duplicate, for `untake`."""
    given_back: bool = False
    """Set by `untake`: nothing is to be synced or recorded for it any more."""

    def untake(self) -> None:
        """Give the queue back what was taken (on the loop, before anything else ran): a
        checkpoint that fails while taking from a later queue must not leave these counted
        clean, or the next one would cover their entries without syncing them."""
        self.given_back = True
        if self.queue is not None:
            for f in self.owners:
                if f.fd >= 0:  # still open (nothing ran in between to close it)
                    f.dirty = True
            if self.directory is not None:
                self.queue._dir_dirty = True
            if self.owners or self.directory is not None:
                self.queue.open_files.note_dirty(self.queue)
        self.close()

    def sync(self) -> None:
        for fd, path in self.files:
            fsync.fdatasync(fd, path)
        if self.directory is not None:
            fsync.fsync_dir(self.directory)

    def close(self) -> None:
        files, self.files = self.files, []
        for fd, _ in files:
            os.close(fd)


def tag_hash(tag: str) -> int:
    return crc32c.crc32c(tag.encode()) if tag else _EMPTY_TAG_HASH


_EMPTY_TAG_HASH = crc32c.crc32c(b"")


def encode_entry(position: int, size: int, tag_hash_value: int) -> bytes:
    body = ENTRY.pack(position, size, tag_hash_value)
    return body + _U32.pack(crc32c.crc32c(body))


def decode_entry(buf: bytes | memoryview, offset: int = 0) -> tuple[int, int, int]:
    if len(buf) - offset < ENTRY_SIZE:
        raise CorruptRecord(f"{len(buf) - offset} bytes left, an entry needs {ENTRY_SIZE}")
    body = bytes(buf[offset:offset + ENTRY_BODY_SIZE])
    (crc,) = _U32.unpack_from(buf, offset + ENTRY_BODY_SIZE)
    if crc32c.crc32c(body) != crc:
        raise CorruptRecord("consume-queue entry CRC32C mismatch")
    position, size, th = ENTRY.unpack(body)
    return int(position), int(size), int(th)


def encode_cq_header(first_offset: int) -> bytes:
    head = CQ_HEADER.pack(CQ_MAGIC, CQ_VERSION, first_offset, 0)[:20]
    return head + _U32.pack(crc32c.crc32c(head))


def decode_cq_header(buf: bytes) -> int:
    if len(buf) < CQ_HEADER_SIZE:
        raise CorruptRecord(f"consume-queue header is {len(buf)} bytes, needs {CQ_HEADER_SIZE}")
    magic, version, first, crc = CQ_HEADER.unpack_from(buf)
    if magic != CQ_MAGIC:
        raise CorruptRecord(f"bad consume-queue magic {magic!r}")
    if version != CQ_VERSION:
        raise CorruptRecord(f"unknown consume-queue version {version}")
    if crc32c.crc32c(buf[:20]) != crc:
        raise CorruptRecord("consume-queue header CRC32C mismatch")
    return int(first)


@dataclass(eq=False)  # by identity: a key of `OpenFiles`
class CQFile:
    first_offset: int
    path: Path
    fd: int
    """-1 while closed (`OpenFiles` opens it on first use)."""
    count: int
    dirty: bool = False
    """Written since the last `take_dirty` (or eviction): such a file is open, always."""


DEFAULT_MAX_OPEN_FILES = 256


class OpenFiles:
    """The consume-queue files held open, shared by a store's queues: at most `limit`, the least
    recently used closed first. Only the event loop's thread uses it (appends, reads, retention,
    checkpoints' `take_dirty`); the checkpoint thread syncs duplicated descriptors, never these.

    Closing a dirty file fdatasyncs it first, on the calling thread: its entries are then durable
    and its `dirty` flag cleared, so the next checkpoint, which syncs only open dirty files, still
    covers everything below its position. That costs an fsync per eviction only when more than
    `limit` queues are written within one checkpoint interval; raise the limit (and `ulimit -n`)
    for such a broker. An fsync error there calls `on_fsync_failed` (the store fails for good)
    and is raised."""

    def __init__(self, limit: int = DEFAULT_MAX_OPEN_FILES, *,
                 on_fsync_failed: Callable[[str], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"OpenFiles needs a limit of at least 1, not {limit}")
        self.limit = limit
        self._open: OrderedDict[CQFile, None] = OrderedDict()
        self.evictions = 0
        self.evicted_dirty = 0
        self.on_fsync_failed = on_fsync_failed
        self._dirty_queues: dict[ConsumeQueue, None] = {}
        """Queues written (or whose directory changed) since their last `take_dirty`: all a
        checkpoint visits. Visiting every queue cost ~0.9 us each on the loop, every second:
        17.5 ms with 20,000 queues, ~57 ms with 65,000."""

    def note_dirty(self, queue: ConsumeQueue) -> None:
        self._dirty_queues[queue] = None

    def dirty_queues(self) -> list[ConsumeQueue]:
        """The queues a checkpoint must take from (each leaves the set in its `take_dirty`)."""
        return list(self._dirty_queues)

    def note_clean(self, queue: ConsumeQueue) -> None:
        self._dirty_queues.pop(queue, None)

    def __len__(self) -> int:
        return len(self._open)

    def fd(self, f: CQFile) -> int:
        """`f`'s descriptor, opening it (and closing the least recently used) if need be."""
        if f.fd >= 0:
            self._open.move_to_end(f)
            return f.fd
        self._make_room()
        f.fd = self.open_path(f.path, os.O_RDWR)
        self._open[f] = None
        return f.fd

    def open_path(self, path: Path, flags: int, mode: int = 0o644) -> int:
        """`os.open(path, flags, mode)` for a queue file, existing or new. When the process is
        out of descriptors (connections took them, say) while this holds some, it gives one up
        (the least recently used) and tries again, rather than fail the caller: a dispatch that
        cannot write its entries holds back every sender after it. Only when none is left is the
        error (EMFILE, ENFILE) the caller's. The descriptor is not counted here: `fd` and `add`
        count it."""
        while True:
            try:
                return os.open(path, flags, mode)
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE) or not self._open:
                    raise
                self._evict(next(iter(self._open)))

    def add(self, f: CQFile) -> None:
        """Count `f`, just created with its descriptor open."""
        self._open[f] = None
        self._make_room(keep=f)

    def forget(self, f: CQFile) -> None:
        """Close `f` for good (retention removed it, or its queue is closed): no sync here, the
        caller decides (a failed store must not fsync again)."""
        self._open.pop(f, None)
        if f.fd >= 0:
            fd, f.fd = f.fd, -1
            os.close(fd)

    def _make_room(self, keep: CQFile | None = None) -> None:
        while len(self._open) >= self.limit + (keep is not None):
            victim = next(iter(self._open))
            if victim is keep:
                return
            self._evict(victim)

    def _evict(self, victim: CQFile) -> None:
        """Close `victim`, fdatasyncing it first if it is dirty."""
        del self._open[victim]
        self.evictions += 1
        fd, victim.fd = victim.fd, -1
        try:
            if victim.dirty:
                self.evicted_dirty += 1
                fsync.fdatasync(fd, victim.path)
                victim.dirty = False
        except FsyncFailed as e:
            if self.on_fsync_failed is not None:
                self.on_fsync_failed(e.message)
            raise
        finally:
            os.close(fd)


@dataclass
class LoadReport:
    truncated_entries: int = 0
    damaged: str | None = None
    """Set when the queue cannot be trusted (bad header, bad entry before the tail, a gap):
    the caller rebuilds it from the commit log."""


class ConsumeQueue:
    def __init__(self, directory: Path, entries_per_file: int, open_files: OpenFiles | None = None) -> None:
        self.directory = directory
        self.entries_per_file = entries_per_file
        self.open_files = open_files if open_files is not None else OpenFiles()
        """Shared by the store's queues: what bounds their open descriptors."""
        self._files: list[CQFile] = []
        self._dir_dirty = False
        """A file was created in or removed from `directory` since the last `flush`."""
        self._empty_next_offset = 0

    @classmethod
    def open(cls, directory: Path, entries_per_file: int, *, log_start: int, log_end: int,
             open_files: OpenFiles | None = None) -> tuple[ConsumeQueue, LoadReport]:
        cq = cls(directory, entries_per_file, open_files)
        report = cq._load(log_start, log_end)
        return cq, report

    def _load(self, log_start: int, log_end: int) -> LoadReport:
        report = LoadReport()
        if not self.directory.exists():
            return report
        names = sorted(
            (first, name) for name in os.listdir(self.directory)
            if (first := files.parse_numbered(name, files.CQ_SUFFIX)) is not None
        )
        for i, (first_from_name, name) in enumerate(names):
            path = self.directory / name
            with open(path, "rb") as f:
                data = f.read()
            try:
                first = decode_cq_header(data)
                if first != first_from_name:
                    raise CorruptRecord("header offset differs from the file name")
            except CorruptRecord as e:
                report.damaged = f"{name}: {e.reason}"
                return report
            if self._files and self._files[-1].first_offset + self._files[-1].count != first:
                report.damaged = f"{name}: gap after offset {self._files[-1].first_offset + self._files[-1].count}"
                return report
            is_last = i == len(names) - 1
            body = data[CQ_HEADER_SIZE:]
            count = 0
            for j in range(len(body) // ENTRY_SIZE):
                try:
                    position, size, _ = decode_entry(body, j * ENTRY_SIZE)
                except CorruptRecord as e:
                    # Even in the last file: the entries after it (or it) may lie below the
                    # checkpoint, where replay would not restore them. A rebuild always does.
                    report.damaged = f"{name} entry {j}: {e.reason}"
                    return report
                if position + (1 if size & LINKED else size) > log_end:
                    # Points past the (truncated) log: its record is gone with the tail. (A link
                    # names its link record's start; a record is cut whole, so a start below the
                    # end is a record the log still holds.)
                    break
                count += 1
            whole = len(body) // ENTRY_SIZE
            if len(body) % ENTRY_SIZE:
                report.damaged = f"{name}: {len(body) % ENTRY_SIZE} bytes of a partial entry at the end"
                return report
            if count < whole:
                if not is_last:
                    report.damaged = f"{name}: entry {count} is beyond the log's end"
                    return report
                report.truncated_entries += whole - count
            if len(body) != count * ENTRY_SIZE:
                _cut_durably(path, CQ_HEADER_SIZE + count * ENTRY_SIZE)
            self._files.append(CQFile(first, path, -1, count))  # opened on first use
        del log_start  # entries below the log's start are expired, not damaged
        return report

    # -- offsets ----------------------------------------------------------------------------

    @property
    def min_offset(self) -> int:
        return self._files[0].first_offset if self._files else self._empty_next_offset

    @property
    def next_offset(self) -> int:
        if not self._files:
            return self._empty_next_offset
        last = self._files[-1]
        return last.first_offset + last.count

    @property
    def is_empty(self) -> bool:
        return not self._files

    def ensure_file(self) -> None:
        """Give an empty queue its first (header-only) file. Every queue of a topic has a file
        from the topic's creation on, so recovery can tell a deleted queue from an unused one."""
        if not self._files:
            self._new_file(self.next_offset)

    def set_start(self, offset: int) -> None:
        """For an empty queue rebuilt from a log whose first records for it were expired."""
        if self._files:
            raise ValueError("set_start only applies to an empty consume queue")
        self._empty_next_offset = offset

    # -- writing ----------------------------------------------------------------------------

    def append(self, position: int, size: int, tag_hash_value: int) -> int:
        offset = self.next_offset
        f = self._files[-1] if self._files else None
        if f is None or f.count >= self.entries_per_file:
            f = self._new_file(offset)
        self._write_entries(f, encode_entry(position, size, tag_hash_value))
        f.count += 1
        return offset

    def append_many(self, entries: list[tuple[int, int, int]], first_offset: int | None = None) -> None:
        """Append (position, size, tag hash) entries in order: one pwrite per file they fill,
        where `append` would make one per entry. With `first_offset` (the queue offset of
        `entries[0]`), entries the queue already holds are skipped: a dispatch retried after
        running out of space halfway appends only the rest."""
        i = 0 if first_offset is None else max(0, self.next_offset - first_offset)
        while i < len(entries):
            f = self._files[-1] if self._files else None
            if f is None or f.count >= self.entries_per_file:
                f = self._new_file(self.next_offset)
            take = min(len(entries) - i, self.entries_per_file - f.count)
            blob = b"".join([encode_entry(p, s, t) for p, s, t in entries[i:i + take]])
            self._write_entries(f, blob)
            f.count += take
            i += take

    def _write_entries(self, f: CQFile, blob: bytes) -> None:
        """Write whole entries after the last one of `f`, or none (cut back, ENOSPC raised)."""
        end = CQ_HEADER_SIZE + f.count * ENTRY_SIZE
        fd = self.open_files.fd(f)
        f.dirty = True  # before the write: a part-written file must be synced before it is closed
        self.open_files.note_dirty(self)
        try:
            n = os.pwrite(fd, blob, end)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            n = -1
        if n != len(blob):  # short: the disk is full; a part-entry must not stay at the end
            os.ftruncate(fd, end)
            raise OSError(errno.ENOSPC, f"consume-queue append of {len(blob)} bytes to {f.path} ran out of space")

    def _new_file(self, first_offset: int) -> CQFile:
        # A new queue's directories are made durable at once (rare: once per queue); the new
        # file's own entry in it at the next `flush` (the checkpoint), the only thing that
        # relies on it: until then recovery replays the log into it anyway.
        fsync.make_dirs(self.directory)
        path = self.directory / files.cq_file_name(first_offset)
        # Renamed into place with its header: a kill never leaves a header-less queue file.
        tmp = path.with_name(path.name + ".tmp")
        fd = -1
        try:
            fd = self.open_files.open_path(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC)  # gives up another if need be
            header = encode_cq_header(first_offset)
            if os.write(fd, header) != len(header):
                raise OSError(errno.ENOSPC, f"short write of a consume-queue header ({tmp})")
            os.rename(tmp, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-made queue file behind
            raise
        self._dir_dirty = True
        f = CQFile(first_offset, path, fd, 0, dirty=True)
        self._files.append(f)
        self.open_files.note_dirty(self)
        self.open_files.add(f)
        return f

    def flush(self) -> None:
        """Make every entry appended so far, and every file created, durable (FsyncFailed)."""
        taken = self.take_dirty()
        try:
            taken.sync()
        finally:
            taken.close()

    def take_dirty(self) -> TakenFlush:
        """What `flush` would make durable, to be synced by its taker (the store's checkpoint, on
        a worker thread): a duplicate descriptor of each dirty file, valid even if retention
        closes the file meanwhile, and the directory if it changed; all counted clean from now.
        A taker whose sync fails must fail the store for good, as a failed `flush` does (the
        next checkpoint would otherwise cover entries no fsync made durable)."""
        taken = TakenFlush([], self.directory if self._dir_dirty else None)
        dirty = [f for f in self._files if f.dirty]  # open, all of them (`OpenFiles` syncs before it closes)
        try:
            for f in dirty:
                taken.files.append((os.dup(f.fd), f.path))
        except BaseException:
            taken.close()
            raise
        for f in dirty:
            f.dirty = False
        self._dir_dirty = False
        self.open_files.note_clean(self)
        taken.queue, taken.owners = self, tuple(dirty)
        return taken

    # -- reading ----------------------------------------------------------------------------

    def _file_for(self, offset: int) -> CQFile | None:
        files = self._files
        if not files or offset < files[0].first_offset:
            return None
        # Arithmetic finds the file when every file holds `entries_per_file` entries; files
        # written under another `consume_queue_entries_per_file` (the setting changed between
        # runs) do not, and are found by their first offsets instead.
        i = (offset - files[0].first_offset) // self.entries_per_file
        f = files[i] if i < len(files) else None
        if f is None or not f.first_offset <= offset < f.first_offset + f.count:
            f = files[bisect.bisect_right(files, offset, key=_first_offset) - 1]
        return f if offset < f.first_offset + f.count else None

    def get(self, offset: int) -> tuple[int, int, int] | None:
        f = self._file_for(offset)
        if f is None:
            return None
        buf = os.pread(self.open_files.fd(f), ENTRY_SIZE, CQ_HEADER_SIZE + (offset - f.first_offset) * ENTRY_SIZE)
        return decode_entry(buf)

    def read_range(self, offset: int, max_entries: int) -> list[tuple[int, int, int, int]]:
        """Up to `max_entries` (offset, position, size, tag_hash) from `offset`, within one file."""
        offset = max(offset, self.min_offset)
        f = self._file_for(offset)
        if f is None:
            return []
        n = min(max_entries, f.first_offset + f.count - offset)
        buf = os.pread(self.open_files.fd(f), n * ENTRY_SIZE, CQ_HEADER_SIZE + (offset - f.first_offset) * ENTRY_SIZE)
        out = []
        for j in range(len(buf) // ENTRY_SIZE):
            position, size, th = decode_entry(buf, j * ENTRY_SIZE)
            out.append((offset + j, position, size, th))
        return out

    # -- retention --------------------------------------------------------------------------

    def delete_files_before(self, log_start: int) -> int:
        """Drop whole files (never the last) whose every entry points below `log_start`."""
        removed = 0
        while len(self._files) > 1:
            last_entry = self.get(self._files[0].first_offset + self._files[0].count - 1)
            if last_entry is None or last_entry[0] >= log_start:
                break
            f = self._files.pop(0)
            self.open_files.forget(f)  # entries wholly below the log's start: nothing to sync
            f.path.unlink()
            self._dir_dirty = True
            self.open_files.note_dirty(self)
            removed += 1
        return removed

    def destroy(self) -> None:
        self.close(sync=False)
        if self.directory.exists():
            for name in os.listdir(self.directory):
                (self.directory / name).unlink()
        self._files = []

    def close(self, *, sync: bool = True) -> None:
        """Close every file, fsyncing what is dirty first unless `sync` is False (the store has
        failed: an fsync now could report success for pages a failed one lost)."""
        try:
            if sync:
                self.flush()
        finally:
            for f in self._files:
                self.open_files.forget(f)
                f.dirty = False
            self._files = []
            self.open_files.note_clean(self)


def _cut_durably(path: Path, size: int) -> None:
    """Cut a queue file back to `size` bytes (entries past the log's end dropped at recovery),
    fdatasynced before anything is appended: the log goes on at its end, so other records take
    the positions those entries named. A cut no fsync covered could come back with a power loss
    after them (the queue need not be written again, so no checkpoint would sync it), its old
    entries pointing at those records: consumers of this queue would receive them."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        fsync.fdatasync(fd, path)
    finally:
        os.close(fd)


def _first_offset(f: CQFile) -> int:
    return f.first_offset
