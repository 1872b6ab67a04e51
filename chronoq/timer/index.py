"""The default timer engine: a durable time index in RocksDB (rocksdict).

Theory of operation
-------------------
The index is derived state of the commit log (see `timer/engine.py`): every change arrives as
an `IndexBatch` the broker built from log records, and is written as ONE RocksDB WriteBatch
together with the new `indexed_position` and every counter it moves. After any crash the index
is exactly as of some applied batch, and the broker replays the log from `indexed_position`.
Applying a record twice changes nothing (an add of a known position is a no-op, a fired mark
for a position no longer pending is ignored), so replay may overlap what was applied.

Pending timers live in the `time` column family, ordered by (due time, log position): the head
is the next timer to fire, and timers due in the same millisecond come out in acceptance order.
A timer's facts live in `id` under (message id, topic, position), so a query or cancel by id is
a prefix scan; its state (pending, rolled, delivered or cancelled, and when) lives in `pos` under
its position, the only thing a fired mark names. Firing a timer thus rewrites one `pos` row and
touches no `id` row, and a delivered or cancelled timer is known until `prune_history` forgets
it. The message id comes first in `id` keys (not the topic) so that `lookup_id` finds an id on
every topic with one prefix scan; the position last lets one id recur on a topic (a reused id,
or a retry) without two timers sharing a key. A cancel names its timer's due time too (a reused
id names several timers): it scans the id's rows on its topic and finishes the pending ones
whose `pos` row (read anyway) holds that due time. Every timer ever applied keeps its `pos` row
until pruned, so "was this record applied before?" (replay) is one read.

Counters (pending per second, grouped one key per minute; pending per hour; pending per topic)
are kept in `counters` and mirrored in memory, so `slot_count`, per-topic counts and the
pending-by-due buckets never scan the pending entries. Grouping the seconds of a minute in one
value makes a batch of timers spread over hours rewrite one counter per minute it touches rather
than one per second, and the whole mirror stays small: a 30-day horizon is at most 43,200
minutes of 240 bytes, loaded at open.

Durability: writes use the WAL without fsync (WriteOptions sync=False, WAL on). A process crash
(SIGKILL) loses nothing, because each batch is in the OS page cache once `write` returns. A
power loss may lose the last batches; RocksDB's point-in-time WAL recovery then opens the index
as of an earlier batch, with the matching earlier `indexed_position`, and the broker replays the
log from there. That costs replay time, never a timer. (The broker must still check that
`indexed_position` is not past the end of its own log after a power loss, and rebuild if so.)

A missing column family, a missing or foreign format version, or an undecodable value raises
`TimerIndexCorrupt`; the broker then calls `RocksTimerIndex.destroy(path)` and rebuilds the index
by replaying the log from position 0.

A full disk is not damage: a write that finds no space raises `DiskFull` and changes nothing
(one atomic batch; the mirrors follow only a written one), and the database is reopened once
there is room (`index_db.py` says how).

The index is one class built in three layers, each a module: `index_db.py` (`IndexDb`: the
RocksDB database, its options and handles, naming its errors, reopening it after a full disk),
`index_retention.py` (`IndexRetention`: link floors and copies, history pruning: what the index
forgets), and this module (`RocksTimerIndex`: format version, loading the counter mirrors,
`apply`, and the queries). Beside them, `index_validate.py` refuses a batch the layout cannot
hold before anything is written, `index_txn.py` turns one batch into one WriteBatch, and
`index_codec.py` holds the encoders for the layouts. Only the broker's timer task calls in
(single-threaded; nothing here takes a lock or reads the clock).

Byte layouts: `docs/disk-format.md` ("Timer index") is the one description of every column
family, key and value (`FORMAT_VERSION`); `index_codec.py` encodes them and
`tests/timer/test_timer_index.py` checks stored bytes against what the document says.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from array import array
from pathlib import Path

from rocksdict import Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from chronoq.errors import TimerIndexClosed, TimerIndexCorrupt
from chronoq.model import TimerStatus
from chronoq.store import fsync
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.timer.engine import DueRow, DueTimers, IndexBatch, TimerEntry
from chronoq.timer.index_codec import (
    CF_COUNTERS,
    CF_ID,
    CF_KEY,
    CF_LINKS,
    CF_META,
    CF_POS,
    CF_TIME,
    COLUMN_FAMILIES,
    I64,
    META_FORMAT_VERSION,
    META_HEAD_FLOOR,
    META_INDEXED_POSITION,
    META_LEVEL_PREFIX,
    META_LIVE_LINKS_FROM,
    POS_PENDING,
    TIME_KEY,
    U16,
    U32,
    U64,
    MalformedValue,
    decode_entry,
    decode_handed,
    decode_minute_slots,
    decode_pos_pending,
    decode_status,
    encode_link_copy,
    id_prefix,
    pack_str,
    prefix_end,
    time_key,
)
from chronoq.timer.index_db import BLOCK_CACHE_BYTES, WRITE_BUFFER_BYTES, open_rdict, read_bounded
from chronoq.timer.index_retention import IndexRetention
from chronoq.timer.index_txn import IndexTxn
from chronoq.timer.index_validate import check_batch
from chronoq.timer.metrics import TimerLatencies, TimerMetricsSnapshot, pending_by_due

__all__ = ["BLOCK_CACHE_BYTES", "FORMAT_VERSION", "WRITE_BUFFER_BYTES", "RocksTimerIndex"]

FORMAT_VERSION = 6
log = logging.getLogger("chronoq.timer")

_HANDED_LIMIT = 1_000_000
"""`due()` remembers at most this many handed-out timers (see `_handed`)."""


# --- the index ----------------------------------------------------------------------------------


class RocksTimerIndex(IndexRetention):
    """`TimerEngine` on RocksDB. Single-threaded: the broker's timer task owns it."""

    def __init__(self, path: Path, db: Rdict, *, disk: DiskSpace | None = None,
                 block_cache_bytes: int = BLOCK_CACHE_BYTES, write_buffer_bytes: int = WRITE_BUFFER_BYTES) -> None:
        # Use `open`; this only wires handles.
        super().__init__(path, db, disk=disk, block_cache_bytes=block_cache_bytes,
                         write_buffer_bytes=write_buffer_bytes)
        self._indexed_position = 0
        self._topic_counts: dict[str, int] = {}
        self._minute_slots: dict[int, array[int]] = {}
        """minute -> pending per second of it (60 counts); only minutes with a pending timer."""
        self._hour_counts: dict[int, int] = {}
        self._link_floors: dict[int, int] = {}  # (these two: `IndexRetention`)
        self._live_links_from: int | None = None
        self._head: bytes | None = None
        self._levels: dict[int, int] = {}
        """Delay level -> next offset to fire (mirror of the `level:` meta keys)."""
        self._latencies = TimerLatencies()
        self._handed: dict[int, tuple[bytes, bytes, str, int, int]] = {}
        """position -> (`time` key, `id` key, topic, due time, the time its delivery error counts
        from) of what `due()` has handed out and not yet seen fired, cancelled or rolled. The
        fire-lag histogram counts each timer once however often the broker asks, and a fired
        mark for one of these settles it without reading `pos` or decoding anything."""

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, create_if_missing: bool = True, block_cache_bytes: int = BLOCK_CACHE_BYTES,
             write_buffer_bytes: int = WRITE_BUFFER_BYTES, disk: DiskSpace | None = None) -> RocksTimerIndex:
        """Open the index at `path`, creating an empty one (indexed_position 0) if there is
        none and `create_if_missing`. The two sizes bound RocksDB's memory (block cache with
        index and filter blocks; all memtables). Raises `TimerIndexCorrupt` for a missing (when not
        creating), damaged or foreign-version index, `DataDirLocked` if another holder has it,
        `DiskFull` if the disk has no room for RocksDB to open it."""
        path = Path(path)
        disk = disk or DiskSpace(path.parent)
        fresh = not (path / "CURRENT").exists()
        if fresh:
            if not create_if_missing:
                raise TimerIndexCorrupt(path, "no index there (missing CURRENT file)")
            if path.exists() and any(path.iterdir()):
                raise TimerIndexCorrupt(path, "directory holds files but no RocksDB CURRENT file")
            try:
                fsync.make_dirs(path)
            except OSError as exc:
                if is_disk_full(exc):
                    raise disk.ran_out("making the timer index's directory", path) from exc
                raise
        else:
            try:
                families = set(Rdict.list_cf(str(path), Options(raw_mode=True)))
            except Exception as exc:
                raise TimerIndexCorrupt(path, f"cannot list column families: {exc}") from exc
            expected = {*COLUMN_FAMILIES, "default"}
            if families != expected:
                raise TimerIndexCorrupt(path, f"column families {sorted(families)}, expected {sorted(expected)}")
        db = open_rdict(path, fresh, block_cache_bytes, write_buffer_bytes, disk)
        index = cls(path, db, disk=disk, block_cache_bytes=block_cache_bytes, write_buffer_bytes=write_buffer_bytes)
        try:
            if fresh:
                with index._guard():
                    index._initialise()
            index._load()
        except BaseException:
            index.close()
            raise
        return index

    @staticmethod
    def destroy(path: str | Path) -> None:
        """Remove the index at `path` (whatever state it is in) so it can be rebuilt."""
        path = Path(path)
        if path.exists():
            shutil.rmtree(path)

    def _initialise(self) -> None:
        wb = WriteBatch(raw_mode=True)
        wb.put(META_FORMAT_VERSION, U32.pack(FORMAT_VERSION), self._handle[CF_META])
        wb.put(META_INDEXED_POSITION, U64.pack(0), self._handle[CF_META])
        wb.put(META_HEAD_FLOOR, b"", self._handle[CF_META])
        sync = WriteOptions()
        sync.sync = True
        self._live().write(wb, sync)

    def _load(self) -> None:
        meta = self._cf[CF_META]
        raw_version = meta.get(META_FORMAT_VERSION)
        if raw_version is None or len(raw_version) != 4:
            raise TimerIndexCorrupt(self._path, "no format version (creation interrupted?)")
        (version,) = U32.unpack(raw_version)
        if version != FORMAT_VERSION:
            raise TimerIndexCorrupt(self._path, f"format version {version}; this chronoq reads {FORMAT_VERSION}")
        raw_position = meta.get(META_INDEXED_POSITION)
        if raw_position is None or len(raw_position) != 8:
            raise TimerIndexCorrupt(self._path, "no indexed position")
        (self._indexed_position,) = U64.unpack(raw_position)
        counters = self._cf[CF_COUNTERS]
        with self._guard():
            for key, value in counters.items(from_key=b"h", read_opt=read_bounded(b"n")):
                if len(key) != 9 or key[:1] not in (b"h", b"m"):
                    raise MalformedValue(f"counter key {key!r}")
                if key[:1] == b"h":
                    self._hour_counts[U64.unpack_from(key, 1)[0]] = self._counter_value(value)
                else:
                    self._minute_slots[U64.unpack_from(key, 1)[0]] = decode_minute_slots(value)
            for key, value in counters.items(from_key=b"t", read_opt=read_bounded(b"u")):
                self._topic_counts[key[1:].decode()] = self._counter_value(value)
            for key, value in counters.items(from_key=b"f", read_opt=read_bounded(b"g")):
                if len(key) != 9 or len(value) != 8:
                    raise MalformedValue(f"link floor {key!r} -> {value!r}")
                self._link_floors[U64.unpack_from(key, 1)[0]] = U64.unpack(value)[0]
            for key, value in meta.items(from_key=META_LEVEL_PREFIX,
                                         read_opt=read_bounded(prefix_end(META_LEVEL_PREFIX))):
                if len(key) != len(META_LEVEL_PREFIX) + 2 or len(value) != 8:
                    raise MalformedValue(f"level progress {key!r} -> {value!r}")
                self._levels[U16.unpack_from(key, len(META_LEVEL_PREFIX))[0]] = U64.unpack(value)[0]
            live = meta.get(META_LIVE_LINKS_FROM)
            if live is not None and len(live) != 8:
                raise MalformedValue(f"live links from {live!r}")
            self._live_links_from = None if live is None else U64.unpack(live)[0]
            floor = meta.get(META_HEAD_FLOOR)
            if floor is None or len(floor) not in (0, TIME_KEY.size):
                raise MalformedValue(f"head floor {floor!r}")
            self._head = self._first_time_key(floor) if floor else None
            if self._head is not None:
                decode_entry(self._head, self._cf[CF_TIME][self._head])
        pending = self.pending_total
        by_minutes = sum(sum(slots) for slots in self._minute_slots.values())
        if sum(self._hour_counts.values()) != pending or by_minutes != pending:
            raise TimerIndexCorrupt(self._path, "pending counters per topic, minute and hour disagree")
        if (self._head is None) != (pending == 0):
            raise TimerIndexCorrupt(self._path, "pending counters disagree with the time order")

    @staticmethod
    def _counter_value(value: bytes) -> int:
        if len(value) != 8:
            raise MalformedValue(f"counter value of {len(value)} bytes")
        (count,) = I64.unpack(value)
        if count <= 0:
            raise MalformedValue(f"counter value {count}")
        return count

    def _reload(self) -> None:
        """The mirrors again, from a database `IndexDb._attach` opened again."""
        self._topic_counts, self._minute_slots, self._hour_counts, self._levels = {}, {}, {}, {}
        self._head = None
        self._load()

    def __enter__(self) -> RocksTimerIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine interface ----------------------------------------------------------------

    @property
    def indexed_position(self) -> int:
        return self._indexed_position

    @property
    def pending_total(self) -> int:
        return sum(self._topic_counts.values())

    def pending_by_topic(self) -> dict[str, int]:
        return dict(self._topic_counts)

    def apply(self, batch: IndexBatch) -> None:
        if self._closed:
            raise TimerIndexClosed(self._path)
        check_batch(batch, self._indexed_position)
        with self._guard():
            db = self._writable()  # before the batch is built: it names this handle's column families
            txn = IndexTxn(self)
            txn.add_all(batch.adds)
            for old_position, entry in batch.rolled:
                txn.roll(old_position, entry)
            txn.fire_all(batch.fired)
            for topic, message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
                txn.cancel(topic, message_id, cancelled_ms, tombstone_position, due_ms)
            for position, damaged_ms in batch.damaged:
                txn.damage(position, damaged_ms)
            levels = {level: offset for level, offset in batch.level_progress.items()
                      if offset > self._levels.get(level, -1)}
            for level, offset in levels.items():
                txn.wb.put(META_LEVEL_PREFIX + U16.pack(level), U64.pack(offset), self._handle[CF_META])
            floors: dict[int, int] = {}
            for base, floor in batch.link_floors:
                known = floors.get(base, self._link_floors.get(base))
                if known is None or floor < known:
                    floors[base] = floor
            for base, floor in floors.items():
                txn.wb.put(b"f" + U64.pack(base), U64.pack(floor), self._handle[CF_COUNTERS])
            for position, linked_ms, body in batch.link_copies:
                txn.wb.put(U64.pack(position), encode_link_copy(linked_ms, body), self._handle[CF_LINKS])
            txn.finish(batch.indexed_position)
            db.write(txn.wb, self._write_opt)
            self._commit(txn, batch)
            self._levels.update(levels)
            self._link_floors.update(floors)

    def _commit(self, txn: IndexTxn, batch: IndexBatch) -> None:
        """Bring the in-memory mirrors in line with what was just written."""
        self._indexed_position = batch.indexed_position
        for minute, slots in txn.new_minutes.items():
            if any(slots):
                self._minute_slots[minute] = slots
            else:
                self._minute_slots.pop(minute, None)
        for hour, count in txn.new_hours.items():
            if count:
                self._hour_counts[hour] = count
            else:
                self._hour_counts.pop(hour, None)
        for topic, count in txn.new_topics.items():
            if count:
                self._topic_counts[topic] = count
            else:
                self._topic_counts.pop(topic, None)
        removed = txn.removed
        added = txn.added_time_keys
        lowest_added = (min(added, default=None) if not removed  # (a batch of sends: nothing removed)
                        else min((tk for tk in added if tk not in removed), default=None))
        old_head = self._head
        # No live key lies below the old head, so if it went, the new head is the first key
        # from there on, or one of this batch's adds that is lower still.
        head = self._first_time_key(old_head) if old_head is not None and old_head in txn.removed else old_head
        if lowest_added is not None and (head is None or lowest_added < head):
            head = lowest_added
        self._head = head
        handed = self._handed
        if handed:
            for position in txn.finished_positions:
                handed.pop(position, None)
            if len(handed) > _HANDED_LIMIT:
                handed.clear()  # a broker that asks and never fires: forget, rather than grow
        if txn.delivery_errors_ms:
            self._latencies.delivery_error_ms.record_many(txn.delivery_errors_ms)
        if batch.applied_ms is not None and txn.added_entries:
            applied_ms = batch.applied_ms
            self._latencies.enqueue_lag_ms.record_many([applied_ms - e.accepted_ms for e in txn.added_entries])

    def _first_time_key(self, from_key: bytes | None) -> bytes | None:
        it = self._cf[CF_TIME].iter(ReadOptions())
        if from_key is None:
            it.seek_to_first()
        else:
            it.seek(from_key)
        return it.key() if it.valid() else None

    def due(self, now_ms: int, limit: int) -> list[TimerEntry]:
        return [TimerEntry(*row) for row in self._due_rows(now_ms, limit)]

    def due_timers(self, now_ms: int, limit: int) -> DueTimers:
        return DueTimers(self._due_rows(now_ms, limit))

    def _due_rows(self, now_ms: int, limit: int) -> list[DueRow]:
        if self._closed:
            raise TimerIndexClosed(self._path)
        if limit <= 0 or self._head is None or TIME_KEY.unpack(self._head)[0] > now_ms:
            return []
        out: list[DueRow] = []
        handed = self._handed
        lags: list[int] = []
        with self._guard():
            upper = time_key(now_ms + 1, 0)
            rows = self._cf[CF_TIME].items(from_key=self._head, read_opt=read_bounded(upper))
            for tk, value in itertools.islice(rows, limit):
                row, ik = decode_handed(tk, value)  # row: TimerEntry's fields, in order (`DueRow`)
                out.append(row)
                position = row[1]
                if position not in handed:
                    deliver_at_ms, accepted_ms = row[0], row[5]
                    # As delivery_error_ms: from the due time, or from acceptance if that came later.
                    counted_from_ms = deliver_at_ms if deliver_at_ms >= accepted_ms else accepted_ms
                    handed[position] = (tk, ik, row[4], deliver_at_ms, counted_from_ms)
                    lags.append(now_ms - counted_from_ms)
        self._latencies.fire_lag_ms.record_many(lags)
        return out

    def next_deadline_ms(self) -> int | None:
        return None if self._head is None else TIME_KEY.unpack(self._head)[0]

    def lookup(self, topic: str, message_id: str) -> TimerStatus | None:
        with self._guard():
            rows = self._scan(CF_ID, id_prefix(message_id, topic))
            # Keys end in the position: the last row is the newest timer.
            return self._statuses(rows[-1:])[0] if rows else None

    def lookup_id(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        with self._guard():
            statuses = self._statuses(self._scan(CF_ID, id_prefix(message_id, topic)))
            # Keys order topics by their length prefix first, not by name.
            return sorted(statuses, key=lambda s: (s.topic, s.position))

    def lookup_key(self, key: str) -> list[TimerStatus]:
        with self._guard():
            id_keys = [ik for _, ik in self._scan(CF_KEY, pack_str(key))]  # in position order
            facts = self._cf[CF_ID].get(id_keys) if id_keys else []
            return self._statuses([(ik, value) for ik, value in zip(id_keys, facts, strict=True) if value is not None])

    def _statuses(self, rows: list[tuple[bytes, bytes]]) -> list[TimerStatus]:
        """Statuses of `id` rows: the facts there, the state from `pos` (one multi-get)."""
        if not rows:
            return []
        states = self._cf[CF_POS].get([ik[-8:] for ik, _ in rows])
        return [decode_status(ik, facts, state) for (ik, facts), state in zip(rows, states, strict=True)]

    def slot_count(self, slot_s: int) -> int:
        if self._closed:
            raise TimerIndexClosed(self._path)
        slots = self._minute_slots.get(slot_s // 60)
        return 0 if slots is None else slots[slot_s % 60]

    def level_progress(self, level: int) -> int | None:
        return self._levels.get(level)

    def pending_in(self, start_position: int, end_position: int, limit: int | None = None) -> list[TimerEntry]:
        if end_position <= start_position or (limit is not None and limit <= 0):
            return []
        with self._guard():
            time_keys = []
            read_opt = read_bounded(U64.pack(min(end_position, (1 << 64) - 1)))
            for pk, pv in self._cf[CF_POS].items(from_key=U64.pack(max(start_position, 0)), read_opt=read_opt):
                if pv[0] == POS_PENDING:
                    deliver_at_ms, _ = decode_pos_pending(pv)
                    time_keys.append(time_key(deliver_at_ms, U64.unpack(pk)[0]))
                    if limit is not None and len(time_keys) >= limit:
                        break
            values = self._cf[CF_TIME].get(time_keys) if time_keys else []
            out = []
            for tk, value in zip(time_keys, values, strict=True):
                if value is None:
                    raise MalformedValue(f"pending position {TIME_KEY.unpack(tk)[1]} missing from the time order")
                out.append(decode_entry(tk, value))
            return out

    def pending_due_before_s(self, slot_s: int) -> int:
        if self._closed:
            raise TimerIndexClosed(self._path)
        return self._count_before_s(slot_s)  # the in-memory mirror of the counters

    def pending_between(self, from_ms: int, to_ms: int, topic: str | None, limit: int,
                        max_scanned: int) -> tuple[list[TimerEntry], bool]:
        if to_ms <= from_ms or limit <= 0:
            return [], False
        out: list[TimerEntry] = []
        scanned = 0
        with self._guard():
            upper = time_key(min(to_ms, (1 << 64) - 1), 0)
            for tk, value in self._cf[CF_TIME].items(from_key=time_key(max(from_ms, 0), 0),
                                                     read_opt=read_bounded(upper)):
                if len(out) >= limit or scanned >= max_scanned:
                    return out, True
                scanned += 1
                entry = decode_entry(tk, value)
                if topic is None or entry.topic == topic:
                    out.append(entry)
        return out, False

    def metrics(self, now_ms: int) -> TimerMetricsSnapshot:
        with self._guard():
            total = self.pending_total
            buckets = pending_by_due(now_ms, total, self._count_before_s)
        deadline = self.next_deadline_ms()
        return TimerMetricsSnapshot(
            now_ms=now_ms, pending_total=total, pending_by_topic=dict(self._topic_counts),
            pending_by_due=buckets, next_deadline_ms=deadline,
            oldest_overdue_ms=max(0, now_ms - deadline) if deadline is not None else 0,
            indexed_position=self._indexed_position, latencies=self._latencies.summaries(),
        )

    @property
    def latencies(self) -> TimerLatencies:
        return self._latencies

    def _count_before_s(self, slot_s: int) -> int:
        """Pending due in seconds < slot_s: whole hours, then whole minutes, then seconds, so
        at most (live hours) + 59 minutes + 59 seconds are added whatever the number pending."""
        if slot_s <= 0:
            return 0
        hour, minute = slot_s // 3600, slot_s // 60
        minutes = self._minute_slots
        total = sum(count for h, count in self._hour_counts.items() if h < hour)
        total += sum(sum(minutes[m]) for m in range(hour * 60, minute) if m in minutes)
        if minute in minutes:
            total += sum(minutes[minute][:slot_s % 60])
        return total
