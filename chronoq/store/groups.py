"""Consumer-group progress: per-queue offsets and in-flight (received, unacked) messages.

Theory of operation: RocketMQ 5 simple consumers "pop" messages: a receive hands out messages,
advances the group's offset past them, and remembers each as in flight until it is acked or its
invisible duration ends, when it becomes receivable again with attempt + 1. This module keeps
that state in RocksDB (`DATA_DIR/groups/`), one atomic WriteBatch per receive/ack/change, with
the WAL on. A process crash loses nothing written; a power loss can lose the last writes, which
means a message is delivered again (at least once), never lost, because the offset advance and
the in-flight entry that covers it are in the same batch.

Keys and values (one column family: a group's offset per queue, an in-flight value per message
handed out, a format version) are laid out in `docs/disk-format.md` ("Consumer-group state"),
their one description.

In memory, a mirror of the in-flight entries and offsets, loaded at open (one scan of the `i`
keys: in-flight messages are bounded by what consumers hold), plus one heap per (group, topic)
ordered by visible time. Why not an index by visible time in RocksDB: every ack deletes its key,
and finding the next due entry then means skipping those tombstones on every receive; the heap
costs nothing per ack (stale heap items are dropped when they surface, or by a rebuild).

Damage and restored files. This store is durable state, not derived: nothing rebuilds it. If it
cannot be opened or read (a damaged file, a half-copied directory), `open_or_reset` moves it
aside as `groups.damaged-<ms>` (kept for inspection) and starts empty: every group then receives
the retained log again from its start. At least once, so nothing is lost; the alternative, a
broker that cannot start, serves nobody. And offsets can be ahead of the consume queues (the
store restored from a later copy than the log, a log cut back by recovery): `clamp` brings each
back to its queue's end and drops in-flight entries past it, so the group receives what is
appended there next instead of skipping it. That write, alone, is fsynced: lost to a power loss
after new records filled the queue past the old offset, nothing would bring it back again.

Times here are broker time (`clock.py`). A re-base (the wall clock stepped back by more than
`clock_max_backward_step_ms`) moves every in-flight entry's times back by the step (`rebase`), so
each keeps the real time it had left. Broker time starts at the wall clock, so entries stamped in
an earlier run by a clock that was ahead are brought back at open (`restamp_ahead`), by rules
that never end an invisible duration before it could have ended.

A full disk. A write that finds no space raises `DiskFull` (retriable) and changes nothing (the
mirror follows only a written batch). RocksDB then refuses every later write with the same error,
even once space is back, until the database is reopened (measured with rocksdict 0.3.29 on a full
tmpfs: "IO error: No space left on device: While appending to file: .../000004.log", then
"Writer has previous error" on close); so the next write reopens it first, once the disk has room
for that (`DiskSpace.room_for_rocksdb`). Reads never touch RocksDB after open (the mirror has
everything), so receive-side lookups go on meanwhile. Opening on a full disk fails (RocksDB writes
a new MANIFEST at every open): that is `DiskFull`, never damage, so the store is not moved aside.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import crc32c
from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch, WriteOptions

from chronoq.errors import (
    CorruptRecord,
    DataDirLocked,
    DiskFull,
    InvalidReceiptHandle,
    StoreUnavailable,
    UnsupportedVersion,
)
from chronoq.store import files, fsync
from chronoq.store.diskspace import DiskSpace, is_disk_full, resource_problem

GROUPS_FORMAT_VERSION = 1
LEGACY_SCHEDULE_GROUP = "%SCHEDULE%"
"""Delay-level progress lived here as this group's offsets before the timer index kept it."""
log = logging.getLogger("chronoq.store")
_INFLIGHT = struct.Struct(">BHQIQIQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_QO = struct.Struct(">IQ")
_HANDLE = struct.Struct(">BIQI")  # version, queue id, offset, nonce
HANDLE_VERSION = 1
BLOCK_CACHE_BYTES = 8 * 1024 * 1024
"""Default of `Config.groups_block_cache_bytes` (index and filter blocks included)."""
WRITE_BUFFER_BYTES = 8 * 1024 * 1024
"""Default of `Config.groups_write_buffer_bytes`: the memtables of the store together. The state
here is offsets and in-flight entries, small whatever the backlog; RocksDB's defaults (64 MB
memtables, up to two of them) would cost more than the data."""


@dataclass(frozen=True, slots=True)
class InFlight:
    group: str
    topic: str
    queue_id: int
    offset: int
    attempt: int
    visible_ms: int
    nonce: int
    position: int
    size: int
    first_delivery_ms: int

    @property
    def receipt_handle(self) -> str:
        return encode_handle(self.queue_id, self.offset, self.nonce)


def encode_handle(queue_id: int, offset: int, nonce: int) -> str:
    raw = _HANDLE.pack(HANDLE_VERSION, queue_id, offset, nonce)
    # 21 bytes: exactly 28 base64 characters, no padding to strip.
    return binascii.b2a_base64(raw + _U32.pack(crc32c.crc32c(raw)), newline=False).translate(_URLSAFE).decode()


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def decode_handle(handle: str) -> tuple[int, int, int]:
    """(queue_id, offset, nonce), or InvalidReceiptHandle saying why."""
    if not isinstance(handle, str) or not handle or len(handle) > 64:
        raise InvalidReceiptHandle("not a chronoq receipt handle")
    try:
        raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    except (ValueError, TypeError):
        raise InvalidReceiptHandle("not base64") from None
    if len(raw) != _HANDLE.size + 4:
        raise InvalidReceiptHandle("wrong length")
    if crc32c.crc32c(raw[:-4]) != _U32.unpack(raw[-4:])[0]:
        raise InvalidReceiptHandle("checksum mismatch")
    version, qid, offset, nonce = _HANDLE.unpack(raw[:-4])
    if version != HANDLE_VERSION:
        raise InvalidReceiptHandle(f"unknown handle version {version}")
    # The lenient base64 decoder skips stray characters and padding; one entry, one spelling.
    if encode_handle(qid, offset, nonce) != handle:
        raise InvalidReceiptHandle("not in canonical form (extra or substituted characters)")
    return qid, offset, nonce


_GT_CACHE: dict[tuple[str, str], bytes] = {}


def _gt(group: str, topic: str) -> bytes:
    key = (group, topic)
    packed = _GT_CACHE.get(key)
    if packed is None:
        packed = group.encode() + b"\x00" + topic.encode() + b"\x00"
        if len(_GT_CACHE) < 4096:  # the live (group, topic) pairs; a bound, not an eviction policy
            _GT_CACHE[key] = packed
    return packed


def _db_options(block_cache_bytes: int, write_buffer_bytes: int) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    table = BlockBasedOptions()
    table.set_block_cache(Cache(block_cache_bytes))
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    # Two memtables of half the budget each: one filling while the other flushes.
    opts.set_write_buffer_size(max(1, write_buffer_bytes // 2))
    opts.set_max_write_buffer_number(2)
    opts.set_db_write_buffer_size(write_buffer_bytes)
    return opts


class GroupStore:
    def __init__(self, directory: Path, *, block_cache_bytes: int = BLOCK_CACHE_BYTES,
                 write_buffer_bytes: int = WRITE_BUFFER_BYTES, disk: DiskSpace | None = None) -> None:
        fsync.make_dirs(directory)  # the store is durable state: its name must survive a power loss
        self._opts = _db_options(block_cache_bytes, write_buffer_bytes)
        self.directory = directory
        self.disk = disk or DiskSpace(directory)
        self._db: Rdict | None = self._open_db()
        self._stuck = False
        """A write failed for space: RocksDB refuses writes until reopened (module docstring)."""
        self._wo = WriteOptions()
        self._wo.sync = False
        self._wo_sync = WriteOptions()
        self._wo_sync.sync = True
        """For the one write whose loss costs more than a redelivery (`clamp`)."""
        self._offsets: dict[tuple[str, str, int], int] = {}
        self._inflight: dict[tuple[str, str], dict[tuple[int, int], InFlight]] = {}
        self._heaps: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {}
        try:
            version = self._db.get(b"meta:version")
            if version is None:
                wb = WriteBatch(raw_mode=True)
                wb.put(b"meta:version", _U32.pack(GROUPS_FORMAT_VERSION))
                self._write(wb)
            elif len(version) != 4 or _U32.unpack(version)[0] != GROUPS_FORMAT_VERSION:
                raise UnsupportedVersion("groups store", int.from_bytes(version, "big"), GROUPS_FORMAT_VERSION)
            self._load()
        except BaseException:
            self.close()
            raise

    def _open_db(self) -> Rdict:
        try:
            return Rdict(str(self.directory), self._opts)
        except Exception as exc:
            if (problem := resource_problem(exc)) is not None:
                raise StoreUnavailable("consumer-group store", str(self.directory), problem) from exc
            if "LOCK:" in str(exc) or "lock hold" in str(exc):
                raise DataDirLocked(str(self.directory)) from exc
            if is_disk_full(exc):
                raise self.disk.ran_out("opening the consumer-group store (RocksDB)", self.directory) from exc
            raise

    def _write(self, wb: WriteBatch, *, sync: bool = False) -> None:
        """The one place a batch reaches RocksDB: DiskFull when it found no space. `sync`: fsync
        the write-ahead log before returning."""
        if self._stuck:
            self._reopen()
        assert self._db is not None
        try:
            self._db.write(wb, self._wo_sync if sync else self._wo)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            if not self._stuck:
                log.warning("consumer-group store %s: a write found no space; receives and acks are refused "
                            "(DiskFull) until it can be reopened", self.directory)
            self._stuck = True
            raise self.disk.ran_out("a consumer-group store write (RocksDB)", self.directory) from exc

    def _reopen(self) -> None:
        """Replace a handle RocksDB stopped writing through (after a write found no space), once
        there is room to open it again. Its WAL holds every batch that was written: nothing is
        lost, and the mirror already matches it."""
        if not self.disk.room_for_rocksdb(self.directory):
            raise self.disk.ran_out("reopening the consumer-group store (RocksDB) after a write found no space",
                                    self.directory)
        self._drop_handle()
        self._db = self._open_db()
        self._stuck = False
        log.warning("consumer-group store %s reopened: writes go on", self.directory)

    def _drop_handle(self) -> None:
        """Close RocksDB without losing anything: its flush at close may fail on a full disk, and
        then dropping the handle closes it unflushed, which the WAL makes safe."""
        db, self._db = self._db, None
        if db is None:
            return
        try:
            db.close()
        except Exception as exc:
            log.warning("consumer-group store %s closed without its final flush (%s); its WAL keeps every write",
                        self.directory, str(exc))
        del db

    def _load(self) -> None:
        """Read every offset and in-flight entry now, so damage shows at open (where it can be
        handled) rather than in the middle of a receive."""
        for key, raw in self._db.items(from_key=b"i"):
            if not key.startswith(b"i"):
                break
            group_b, topic_b, rest = key[1:].split(b"\x00", 2)
            qid, offset = _QO.unpack(rest)
            e = _decode_inflight(group_b.decode(), topic_b.decode(), qid, offset, raw)
            self._remember(e)
        for key, raw in self._db.items(from_key=b"o"):
            if not key.startswith(b"o"):
                break
            group_b, topic_b, rest = key[1:].split(b"\x00", 2)
            if len(rest) != 4 or len(raw) != 8:
                raise CorruptRecord(f"offset entry {key!r} -> {raw!r}")
            self._offsets[(group_b.decode(), topic_b.decode(), _U32.unpack(rest)[0])] = _U64.unpack(raw)[0]

    @classmethod
    def open_or_reset(cls, directory: Path, *, block_cache_bytes: int = BLOCK_CACHE_BYTES,
                      write_buffer_bytes: int = WRITE_BUFFER_BYTES,
                      disk: DiskSpace | None = None) -> tuple[GroupStore, str | None]:
        """Open the store; if it is damaged, move it aside and start empty. Returns the store and,
        after a reset, what was wrong and where the damaged copy is."""
        try:
            return cls(directory, block_cache_bytes=block_cache_bytes, write_buffer_bytes=write_buffer_bytes,
                       disk=disk), None
        except (DataDirLocked, UnsupportedVersion, DiskFull, StoreUnavailable):
            raise  # not damage: another broker holds it, a newer chronoq wrote it, or the disk is full
        except Exception as exc:  # RocksDB reports damage as a plain exception; so does a bad value
            if (problem := resource_problem(exc)) is not None:
                # Too many open files, say, while reading it: resetting would redeliver every
                # group's whole retained log for a problem that is not in the files.
                raise StoreUnavailable("consumer-group store", str(directory), problem) from exc
            aside = files.damaged_name(directory)
            os.rename(directory, aside)
            fsync.fsync_dir(directory.parent)
            reason = f"consumer-group store {directory} is damaged ({exc}); moved to {aside}, starting empty: " \
                     "every group receives the retained log again (at least once)"
            log.error("%s", reason)
            store = cls(directory, block_cache_bytes=block_cache_bytes, write_buffer_bytes=write_buffer_bytes,
                        disk=disk)
            return store, reason

    def clamp(self, queue_end: Callable[[str, int], int]) -> int:
        """Bring every offset past its queue's end (`queue_end(topic, queue_id)`) back to it, and
        drop in-flight entries at or past it; returns how many were changed. Also drops the
        delay-level progress that older versions kept here (the timer index keeps it now)."""
        offsets: list[tuple[str, str, int, int]] = []
        remove: list[InFlight] = []
        for (group, topic, qid), offset in list(self._offsets.items()):
            if offset is not None and offset > queue_end(topic, qid):
                offsets.append((group, topic, qid, queue_end(topic, qid)))
        for entries in self._inflight.values():
            remove.extend(e for e in entries.values() if e.offset >= queue_end(e.topic, e.queue_id))
        legacy = [key for key in self._offsets if key[0] == LEGACY_SCHEDULE_GROUP]
        if offsets or remove:
            log.warning("consumer-group offsets ahead of their queues (files restored from different times?): "
                        "%d offsets moved back to their queue's end, %d in-flight entries dropped",
                        len(offsets), len(remove))
            # Durable at once, unlike other writes: lost to a power loss, an offset is ahead of
            # its queue again once new records fill the queue back past it, and then nothing
            # brings it back: the group would skip them (a lost ack or advance only redelivers).
            self.commit(offsets=offsets, remove=remove, sync=True)
        if legacy:
            wb = WriteBatch(raw_mode=True)
            for group, topic, qid in legacy:
                wb.delete(b"o" + _gt(group, topic) + _U32.pack(qid))
            self._write(wb)
            for key in legacy:
                del self._offsets[key]
        return len(offsets) + len(remove)

    def close(self) -> None:
        self._drop_handle()

    @staticmethod
    def destroy(directory: Path) -> None:
        if directory.exists():
            shutil.rmtree(directory)

    # -- offsets ----------------------------------------------------------------------------

    def offset(self, group: str, topic: str, queue_id: int) -> int | None:
        return self._offsets.get((group, topic, queue_id))  # every stored offset is loaded at open

    def groups(self) -> Iterator[tuple[str, str]]:
        """(group, topic) pairs with stored offsets."""
        yield from sorted({(group, topic) for group, topic, _ in self._offsets})

    # -- in flight --------------------------------------------------------------------------

    def get(self, group: str, topic: str, queue_id: int, offset: int) -> InFlight | None:
        entries = self._inflight.get((group, topic))
        return None if entries is None else entries.get((queue_id, offset))

    def due(self, group: str, topic: str, now_ms: int, limit: int, queue_id: int | None = None) -> list[InFlight]:
        """In-flight entries whose invisible duration has ended, earliest first (of one queue
        only, if `queue_id` is given: filtered here, so other queues' overdue entries cannot
        take up the `limit` and keep this queue's from ever coming back)."""
        gt = (group, topic)
        heap = self._heaps.get(gt)
        entries = self._inflight.get(gt, {})
        out: list[InFlight] = []
        keep: list[tuple[int, int, int, int]] = []
        while heap and heap[0][0] <= now_ms and len(out) < limit:
            item = heapq.heappop(heap)
            e = entries.get((item[1], item[2]))
            if e is None or e.nonce != item[3] or e.visible_ms != item[0]:
                continue  # acked or renewed since: a stale heap item
            keep.append(item)
            if queue_id is None or e.queue_id == queue_id:
                out.append(e)
        for item in keep:
            heapq.heappush(heap, item)  # type: ignore[arg-type]
        return out

    def next_visible_ms(self, group: str, topic: str) -> int | None:
        gt = (group, topic)
        heap = self._heaps.get(gt)
        entries = self._inflight.get(gt, {})
        while heap:
            vis, qid, offset, nonce = heap[0]
            e = entries.get((qid, offset))
            if e is not None and e.nonce == nonce and e.visible_ms == vis:
                return vis
            heapq.heappop(heap)
        return None

    def inflight_count(self, group: str, topic: str) -> int:
        return len(self._inflight.get((group, topic), {}))

    def min_inflight_position(self) -> int | None:
        """The lowest commit-log position any group still holds in flight (retention keeps it)."""
        return min((e.position for entries in self._inflight.values() for e in entries.values()), default=None)

    # -- broker time moved (clock.py; docs/design.md, "Time") ----------------------------------

    def rebase(self, step_ms: int, now_ms: int) -> int:
        """Broker time was moved back by `step_ms` to `now_ms` (a re-base): every in-flight
        entry's visible time moves back as far, never before `now_ms`, and its first delivery
        time with it, so each keeps the real time it had left instead of waiting out the step.
        Returns how many entries moved."""
        moved = [replace(e, visible_ms=max(now_ms, e.visible_ms - step_ms),
                         first_delivery_ms=max(0, e.first_delivery_ms - step_ms))
                 for entries in self._inflight.values() for e in entries.values()]
        self._restamp(moved)
        return len(moved)

    def restamp_ahead(self, now_ms: int, longest_invisible_ms: int) -> tuple[int, int]:
        """At open: bring back visible times stamped, in an earlier run, by a clock that was
        ahead of this one (broker time starts at the wall clock, so one stamped a day ahead would
        hide its message for a day). Each entry's visible time V, first delivery F:
        - `min(V, now + (V - F))` (F <= V): V was set at a broker time t >= F (broker time goes
          back only by a re-base, which moves F too, and an open leaves F <= now), at a moment
          before now, for V - t <= V - F; so its invisibility ends by `now + (V - F)`. This moves
          an entry first delivered "in the future" back by as far as that is; F becomes
          `min(F, now)`.
        - at most `now + longest_invisible_ms`, the longest invisible duration the broker sets
          (`max_invisible_duration_ms`, or a redelivery delay level if longer), set before now.
        Neither ends an invisible duration before it could have ended. Returns how many entries
        each rule moved (by the first; by the second only)."""
        by_first, by_longest = 0, 0
        moved: list[InFlight] = []
        ahead_ms = 0
        for entries in self._inflight.values():
            for e in entries.values():
                visible = e.visible_ms
                first_rule = now_ms < e.first_delivery_ms <= visible
                if first_rule:
                    visible -= e.first_delivery_ms - now_ms
                visible = min(visible, now_ms + longest_invisible_ms)
                if visible == e.visible_ms:
                    continue
                by_first += first_rule
                by_longest += not first_rule
                ahead_ms = max(ahead_ms, e.visible_ms - visible)
                moved.append(replace(e, visible_ms=visible, first_delivery_ms=min(e.first_delivery_ms, now_ms)))
        if moved:
            log.warning("%d in-flight messages were invisible until a time stamped by a clock that was ahead of this "
                        "one (up to %d ms too far): %d moved back by as far as their first delivery lies in the "
                        "future, %d to at most %d ms from now (the longest invisible duration this broker sets); "
                        "none ends before it could have", len(moved), ahead_ms, by_first, by_longest,
                        longest_invisible_ms)
            self._restamp(moved)
        return by_first, by_longest

    def _restamp(self, entries: list[InFlight]) -> None:
        """Write `entries` (the same in-flight messages with new times). If the write fails (a
        full disk), the mirror takes them all the same, since it is what decides visibility: the
        stored values stay as they were until each entry is written again, and an open applies
        `restamp_ahead` to them."""
        if not entries:
            return
        try:
            self.commit(put=entries)
        except Exception as exc:
            log.warning("consumer-group store %s: %d in-flight entries given new times in memory only (%s); the "
                        "stored ones keep their old times until written again", self.directory, len(entries), exc)
            for e in entries:
                self._remember(e)

    # -- the one write path -----------------------------------------------------------------

    def commit(self, *, offsets: Iterable[tuple[str, str, int, int]] = (),
               put: Iterable[InFlight] = (), remove: Iterable[InFlight] = (), sync: bool = False) -> None:
        """Atomically: set next offsets, add/replace in-flight entries, remove in-flight entries
        (`sync`: durable before it returns; see `clamp`)."""
        offsets, put, remove = list(offsets), list(put), list(remove)
        wb = WriteBatch(raw_mode=True)
        for group, topic, qid, offset in offsets:
            wb.put(b"o" + _gt(group, topic) + _U32.pack(qid), _U64.pack(offset))
        put_keys = {(e.group, e.topic, e.queue_id, e.offset) for e in put}
        for e in remove:
            if (e.group, e.topic, e.queue_id, e.offset) not in put_keys:
                wb.delete(b"i" + _gt(e.group, e.topic) + _QO.pack(e.queue_id, e.offset))
        for e in put:
            wb.put(b"i" + _gt(e.group, e.topic) + _QO.pack(e.queue_id, e.offset), _encode_inflight(e))
        self._write(wb, sync=sync)
        # The mirror follows only once the batch is written: a failed write changes nothing.
        for group, topic, qid, offset in offsets:
            self._offsets[(group, topic, qid)] = offset
        for e in remove:
            entries = self._inflight.get((e.group, e.topic))
            if entries is not None:
                entries.pop((e.queue_id, e.offset), None)
        for e in put:
            self._remember(e)

    def reset(self, group: str, topic: str, offsets: dict[int, int] | None) -> int:
        """Atomically drop every in-flight entry of (group, topic) and set its queues' offsets to
        `offsets` (queue id -> next offset), or with None forget its offsets too, as if the group
        had never received on the topic. Returns how many in-flight entries were dropped."""
        entries = list(self._inflight.get((group, topic), {}).values())
        wb = WriteBatch(raw_mode=True)
        for e in entries:
            wb.delete(b"i" + _gt(group, topic) + _QO.pack(e.queue_id, e.offset))
        stored = [qid for (g, t, qid) in self._offsets if g == group and t == topic]
        if offsets is None:
            for qid in stored:
                wb.delete(b"o" + _gt(group, topic) + _U32.pack(qid))
        else:
            for qid, offset in offsets.items():
                wb.put(b"o" + _gt(group, topic) + _U32.pack(qid), _U64.pack(offset))
        self._write(wb)
        self._inflight.pop((group, topic), None)
        self._heaps.pop((group, topic), None)
        if offsets is None:
            for qid in stored:
                self._offsets.pop((group, topic, qid), None)
        else:
            for qid, offset in offsets.items():
                self._offsets[(group, topic, qid)] = offset
        return len(entries)

    def _remember(self, e: InFlight) -> None:
        gt = (e.group, e.topic)
        entries = self._inflight.setdefault(gt, {})
        entries[(e.queue_id, e.offset)] = e
        heap = self._heaps.setdefault(gt, [])
        heapq.heappush(heap, (e.visible_ms, e.queue_id, e.offset, e.nonce))
        if len(heap) > 2 * len(entries) + 1024:  # mostly stale items: rebuild from the live entries
            fresh = [(x.visible_ms, x.queue_id, x.offset, x.nonce) for x in entries.values()]
            heapq.heapify(fresh)
            self._heaps[gt] = fresh

    def lookup_handle(self, group: str, topic: str, handle: str) -> InFlight:
        qid, offset, nonce = decode_handle(handle)
        entry = self.get(group, topic, qid, offset)
        if entry is None:
            raise InvalidReceiptHandle("no such in-flight message for this group and topic (acked or expired)")
        if entry.nonce != nonce:
            raise InvalidReceiptHandle("superseded: the message was renewed or redelivered since")
        return entry


_NONCES: list[int] = []
_NONCE_BLOCK = 1024


def new_nonce() -> int:
    """A random u32 that makes each delivery's receipt handle its own (a handle of an earlier
    delivery of the same message stops working). From the OS's random source, a block of
    `_NONCE_BLOCK` per system call rather than one per message."""
    if not _NONCES:
        _NONCES.extend(struct.unpack(f">{_NONCE_BLOCK}I", os.urandom(4 * _NONCE_BLOCK)))
    return _NONCES.pop()


def _encode_inflight(e: InFlight) -> bytes:
    return _INFLIGHT.pack(1, e.attempt, e.visible_ms, e.nonce, e.position, e.size, e.first_delivery_ms)


def _decode_inflight(group: str, topic: str, qid: int, offset: int, raw: bytes) -> InFlight:
    # Checked here, not trusted: a value of another length or version must fail as CorruptRecord
    # (naming the entry), not as struct.error from deep inside a receive.
    if len(raw) != _INFLIGHT.size:
        raise CorruptRecord(f"in-flight value for {group}/{topic}/{qid}@{offset} is {len(raw)} bytes, "
                            f"expected {_INFLIGHT.size}")
    version, attempt, visible_ms, nonce, position, size, first_ms = _INFLIGHT.unpack(raw)
    if version != 1:
        raise CorruptRecord(f"unknown in-flight value version {version} for {group}/{topic}/{qid}@{offset}")
    return InFlight(group, topic, qid, offset, attempt, visible_ms, nonce, position, size, first_ms)
