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

A full disk is not damage (`store/diskspace.py`). A write that finds no space raises `DiskFull`
and changes nothing (one atomic batch; the mirrors follow only a written one). RocksDB then
refuses every later write until the database is reopened, even once space is back (measured,
rocksdict 0.3.29 on a full tmpfs), so the next write reopens it first, when the disk has room for
that (`DiskSpace.room_for_rocksdb`); reads go on through the old handle meanwhile. If the reopen
itself fails, the index is detached and every call tries to attach it again (`DiskFull` until it
can). Opening on a full disk fails (a new MANIFEST at every open): that too is `DiskFull`, so the
broker does not destroy an index that is only waiting for space.

This module owns the database, its lifecycle and the queries; `index_txn.py` turns one batch
into one WriteBatch; `index_codec.py` holds the encoders for the layouts. Only the
broker's timer task calls in (single-threaded; nothing here takes a lock or reads the clock).

Byte layouts: `docs/disk-format.md` ("Timer index") is the one description of every column
family, key and value (`FORMAT_VERSION`); `index_codec.py` encodes them and
`tests/timer/test_timer_index.py` checks stored bytes against what the document says.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import struct
from array import array
from pathlib import Path
from typing import Any

from rocksdict import (
    BlockBasedOptions,
    Cache,
    DBRecoveryMode,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from chronoq.errors import (
    ChronoqError,
    DataDirLocked,
    IndexPositionWentBack,
    StoreUnavailable,
    TimerIndexClosed,
    TimerIndexCorrupt,
)
from chronoq.model import TimerStatus
from chronoq.store import fsync
from chronoq.store.diskspace import DiskSpace, is_disk_full, resource_problem
from chronoq.timer.engine import DueRow, DueTimers, IndexBatch, TimerEntry, check_route
from chronoq.timer.index_codec import (
    CF_COUNTERS,
    CF_HISTORY,
    CF_ID,
    CF_KEY,
    CF_LINKS,
    CF_META,
    CF_POS,
    CF_TIME,
    COLUMN_FAMILIES,
    HIST_FIRED,
    HIST_REDIRECT,
    HIST_STATUS,
    HISTORY_KEY,
    I64,
    MAX_STR_BYTES,
    META_FORMAT_VERSION,
    META_HEAD_FLOOR,
    META_INDEXED_POSITION,
    META_LEVEL_PREFIX,
    META_LIVE_LINKS_FROM,
    POS_DONE,
    POS_PENDING,
    POS_ROLLED,
    TIME_KEY,
    U16,
    U32,
    U64,
    MalformedValue,
    decode_entry,
    decode_fired_history,
    decode_handed,
    decode_link_copy,
    decode_minute_slots,
    decode_pos_pending,
    decode_status,
    encode_link_copy,
    facts_keys,
    history_timers,
    id_prefix,
    key_cf_key,
    pack_str,
    prefix_end,
    time_key,
)
from chronoq.timer.index_txn import IndexTxn
from chronoq.timer.metrics import TimerLatencies, TimerMetricsSnapshot, pending_by_due

FORMAT_VERSION = 6
log = logging.getLogger("chronoq.timer")


_PRUNE_CHUNK = 10_000
_HANDED_LIMIT = 1_000_000
"""`due()` remembers at most this many handed-out timers (see `_handed`)."""


_LIMIT_63 = 1 << 63
_LIMIT_32 = 1 << 32
_SHORT_STR = MAX_STR_BYTES // 4


def _check_u63(what: str, value: int) -> None:
    if type(value) is not int or not 0 <= value < _LIMIT_63:
        raise ValueError(f"{what} must be an int in [0, 2**63), not {value!r}")


def _check_entry(entry: TimerEntry, batch_end: int) -> None:
    """Refuse an entry the layout cannot hold, before anything of its batch is written.
    (`type(x) is int` keeps bools and floats out; it is also the cheapest test, and this runs
    for every timer.)"""
    check_route(entry)
    d, p, s, a = entry.deliver_at_ms, entry.position, entry.size, entry.accepted_ms
    if (type(d) is int and type(p) is int and type(s) is int and type(a) is int
            and 0 <= d < _LIMIT_63 and 0 <= p < batch_end and 0 <= s < _LIMIT_32 and -_LIMIT_63 <= a < _LIMIT_63):
        # A str of <= 16383 characters is <= 65535 UTF-8 bytes, so the usual case costs a len().
        if len(entry.message_id) > _SHORT_STR or len(entry.topic) > _SHORT_STR or entry.keys:
            for text in (entry.message_id, entry.topic, *entry.keys):
                if len(text) > _SHORT_STR and len(text.encode()) > MAX_STR_BYTES:
                    raise ValueError(f"a TimerEntry string of {len(text.encode())} UTF-8 bytes does not fit "
                                     f"the index (limit {MAX_STR_BYTES})")
            if len(entry.keys) > MAX_STR_BYTES:
                raise ValueError(f"{len(entry.keys)} keys do not fit the index (limit {MAX_STR_BYTES})")
        return
    if type(p) is int and p >= batch_end:
        raise ValueError(f"TimerEntry.position {p} is not inside the batch's log range (it ends at {batch_end})")
    raise ValueError(f"TimerEntry fields out of range or not int: deliver_at_ms={d!r} position={p!r} "
                     f"size={s!r} accepted_ms={a!r}")


class _Guard:
    """The context manager `RocksTimerIndex._guard` hands out: a class rather than a generator,
    because it wraps every index write and a generator-based one cost ~2 % of the instructions
    of a one-timer send. An exception raised inside becomes the named error `_translate` says.

    No reference cycle may survive a failure: the original exception's traceback holds the
    frame that held the RocksDB handle, and a handle kept alive until the cyclic collector runs
    keeps the database's lock, so the reopen after a full disk would find it "in use"
    (`tests/store/test_faults_disk_full.py`). So `__exit__` drops its locals before the named
    error leaves, and the index does not hold its guard (one is made per use)."""

    __slots__ = ("_index",)

    def __init__(self, index: RocksTimerIndex) -> None:
        self._index = index

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if exc is None:
            return False
        named = self._index._translate(exc)
        if named is None:
            return False
        try:
            raise named from exc
        finally:
            # The frame of this call is in `named`'s traceback: it must not hold `named` itself
            # (a cycle), nor the original exception and its traceback.
            del named, exc, tb


# --- RocksDB options ----------------------------------------------------------------------------


BLOCK_CACHE_BYTES = 32 * 1024 * 1024
"""Default of `Config.timer_index_block_cache_bytes`: one block cache shared by all column
families of an index (RocksDB would otherwise give each its own). Index and filter blocks are
charged to it too (see `_cf_options`), so it bounds read-side memory however many timers are
pending."""
WRITE_BUFFER_BYTES = 64 * 1024 * 1024
"""Default of `Config.timer_index_write_buffer_bytes`: all memtables of an index together."""


def _db_options(create: bool, write_buffer_bytes: int) -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(create)
    opts.create_missing_column_families(create)
    # Point-in-time: after a power loss, recover to the last intact batch and stop there; an
    # older consistent index plus a replay beats a hole in the middle.
    opts.set_wal_recovery_mode(DBRecoveryMode.point_in_time())
    opts.set_paranoid_checks(True)
    opts.set_max_background_jobs(2)
    opts.set_db_write_buffer_size(write_buffer_bytes)
    opts.set_max_total_wal_size(128 * 1024 * 1024)
    opts.set_keep_log_file_num(3)
    return opts


def _cf_options(name: str, cache: Cache) -> Options:
    opts = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_block_cache(cache)
    # Without this every open table file keeps its index and bloom filter blocks on the heap,
    # outside the cache: about 1.3 bytes per key per filtered family plus the indexes, memory
    # that grows with the backlog (tens of MB at 10 M pending). In the cache they are bounded
    # and evictable; L0 ones stay pinned because fresh files are the ones read most.
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    if name != CF_TIME:
        # Point lookups (is this position known? this counter?) dominate; a bloom filter makes
        # the usual miss cost no disk read.
        table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    if name == CF_TIME:
        # The time order is a queue: fired timers leave tombstones at its head. Compact files
        # that are mostly tombstones so seeking the head stays cheap.
        opts.add_compact_on_deletion_collector_factory(4096, 2048, 0.5)
    if name in (CF_TIME, CF_ID, CF_POS):
        opts.set_write_buffer_size(8 * 1024 * 1024)
    else:
        opts.set_write_buffer_size(4 * 1024 * 1024)
    return opts


def _open_rdict(path: Path, create: bool, block_cache_bytes: int, write_buffer_bytes: int,
                disk: DiskSpace) -> Rdict:
    try:
        cache = Cache(block_cache_bytes)
        return Rdict(str(path), _db_options(create, write_buffer_bytes),
                     column_families={name: _cf_options(name, cache) for name in COLUMN_FAMILIES})
    except Exception as exc:
        if (problem := resource_problem(exc)) is not None:  # not damage: a rebuild would meet it too
            raise StoreUnavailable("timer index", str(path), problem) from exc
        # RocksDB says "lock hold by current process" or "While lock file: .../LOCK: ...";
        # match those exactly ("block checksum mismatch" must stay a corruption).
        if "LOCK:" in str(exc) or "lock hold" in str(exc):
            raise DataDirLocked(str(path)) from exc
        if is_disk_full(exc):
            raise disk.ran_out("opening the timer index (RocksDB)", path) from exc
        raise TimerIndexCorrupt(path, f"RocksDB refused to open it: {exc}") from exc


def _read_bounded(upper: bytes | None) -> ReadOptions:
    ro = ReadOptions()
    if upper is not None:
        ro.set_iterate_upper_bound(upper)
    return ro


# --- the index ----------------------------------------------------------------------------------


class RocksTimerIndex:
    """`TimerEngine` on RocksDB. Single-threaded: the broker's timer task owns it."""

    def __init__(self, path: Path, db: Rdict, *, disk: DiskSpace | None = None,
                 block_cache_bytes: int = BLOCK_CACHE_BYTES, write_buffer_bytes: int = WRITE_BUFFER_BYTES) -> None:
        # Use `open`; this only wires handles.
        self._path = path
        self._disk = disk or DiskSpace(path)
        self._sizes = (block_cache_bytes, write_buffer_bytes)
        self._db: Rdict | None = None
        self._cf: dict[str, Rdict] = {}
        self._handle: dict[str, Any] = {}
        self._wire(db)
        self._stuck = False
        """A write failed for space: RocksDB refuses writes until reopened (module docstring)."""
        self._write_opt = WriteOptions()  # WAL on, no fsync: see the module docstring
        self._closed = False
        self._indexed_position = 0
        self._topic_counts: dict[str, int] = {}
        self._minute_slots: dict[int, array[int]] = {}
        """minute -> pending per second of it (60 counts); only minutes with a pending timer."""
        self._hour_counts: dict[int, int] = {}
        self._link_floors: dict[int, int] = {}
        """Segment base -> the lowest timer record position a link record in that segment names
        (mirror of the `f` counters)."""
        self._live_links_from: int | None = None
        """Mirror of the `live_links_from` meta key."""
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
        db = _open_rdict(path, fresh, block_cache_bytes, write_buffer_bytes, disk)
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
            for key, value in counters.items(from_key=b"h", read_opt=_read_bounded(b"n")):
                if len(key) != 9 or key[:1] not in (b"h", b"m"):
                    raise MalformedValue(f"counter key {key!r}")
                if key[:1] == b"h":
                    self._hour_counts[U64.unpack_from(key, 1)[0]] = self._counter_value(value)
                else:
                    self._minute_slots[U64.unpack_from(key, 1)[0]] = decode_minute_slots(value)
            for key, value in counters.items(from_key=b"t", read_opt=_read_bounded(b"u")):
                self._topic_counts[key[1:].decode()] = self._counter_value(value)
            for key, value in counters.items(from_key=b"f", read_opt=_read_bounded(b"g")):
                if len(key) != 9 or len(value) != 8:
                    raise MalformedValue(f"link floor {key!r} -> {value!r}")
                self._link_floors[U64.unpack_from(key, 1)[0]] = U64.unpack(value)[0]
            for key, value in meta.items(from_key=META_LEVEL_PREFIX,
                                         read_opt=_read_bounded(prefix_end(META_LEVEL_PREFIX))):
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

    def close(self) -> None:
        """Close, flushing memtables if the disk lets it; if not, close unflushed (the WAL keeps
        every batch), never raise: a full disk must not stop a broker from shutting down."""
        if self._closed:
            return
        self._closed = True
        self._detach()

    # -- handles, and reopening after a full disk --------------------------------------------

    def _wire(self, db: Rdict) -> None:
        self._db = db
        self._cf = {name: db.get_column_family(name) for name in COLUMN_FAMILIES}
        self._handle = {name: db.get_column_family_handle(name) for name in COLUMN_FAMILIES}

    def _live(self) -> Rdict:
        if self._db is None:
            self._attach()
        assert self._db is not None
        return self._db

    def _detach(self) -> None:
        """Drop every handle (column-family objects and handles keep RocksDB open: all of them go
        before the DB). Each close flushes; on a full disk that fails and the drop closes unflushed."""
        handles: list[Rdict] = [*self._cf.values(), *([self._db] if self._db is not None else [])]
        self._cf, self._handle, self._db = {}, {}, None
        failures = []
        while handles:
            try:
                handles.pop(0).close()
            except Exception as exc:
                failures.append(str(exc))
        if failures:
            log.warning("timer index %s closed without its final flush (%s); its WAL keeps every batch",
                        self._path, failures[0])

    def _attach(self) -> None:
        """Open the database again (after `_detach`) and reload the mirrors from it."""
        if self._closed:
            raise TimerIndexClosed(self._path)
        self._check_room_to_reopen()
        self._wire(_open_rdict(self._path, False, *self._sizes, self._disk))
        self._topic_counts, self._minute_slots, self._hour_counts, self._levels = {}, {}, {}, {}
        self._head = None
        try:
            self._load()
        except BaseException:
            self._detach()
            raise
        self._stuck = False
        log.warning("timer index %s reopened: writes go on", self._path)

    def _writable(self) -> Rdict:
        """The handle to write through: reopened first if a write found no space before."""
        if self._stuck and self._db is not None:
            self._check_room_to_reopen()  # else keep the old handle: reads still work through it
            self._detach()
        return self._live()

    def _check_room_to_reopen(self) -> None:
        if not self._disk.room_for_rocksdb(self._path):
            raise self._disk.ran_out("reopening the timer index (RocksDB) after a write found no space", self._path)

    def __enter__(self) -> RocksTimerIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guard(self) -> _Guard:
        """`with self._guard():` around every RocksDB call: refuses a closed index, reattaches a
        detached one, and names what RocksDB raises (`_Guard`)."""
        if self._closed:
            raise TimerIndexClosed(self._path)
        if self._db is None:
            self._attach()  # detached by a reopen that found no space: DiskFull until it can
        return _Guard(self)

    def _translate(self, exc: BaseException) -> BaseException | None:
        """What a RocksDB call's exception becomes (None: it stays as it is)."""
        if isinstance(exc, (MalformedValue, struct.error, UnicodeDecodeError)):
            return TimerIndexCorrupt(self._path, f"undecodable value: {exc}")
        if isinstance(exc, ChronoqError) or not isinstance(exc, Exception):
            return None  # already named (corrupt, closed, locked, disk full), or not an error
        # RocksDB reports a bad block or file as an exception whose text starts "Corruption".
        if "Corruption" in str(exc) or "corruption" in str(exc):
            return TimerIndexCorrupt(self._path, str(exc))
        if is_disk_full(exc):
            if not self._stuck:
                log.warning("timer index %s: a write found no space; it is reopened once there is room",
                            self._path)
            self._stuck = True
            return self._disk.ran_out("a timer-index write (RocksDB)", self._path)
        return None

    @property
    def path(self) -> Path:
        return self._path

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
        _check_u63("indexed_position", batch.indexed_position)
        if batch.indexed_position < self._indexed_position:
            raise IndexPositionWentBack(self._indexed_position, batch.indexed_position)
        end = batch.indexed_position
        for entry in batch.adds:
            _check_entry(entry, end)
        for old_position, entry in batch.rolled:
            _check_entry(entry, end)
            _check_u63("rolled old position", old_position)
        for position, fired_ms in batch.fired:
            if type(position) is not int or type(fired_ms) is not int or not (
                    0 <= position < _LIMIT_63 and 0 <= fired_ms < _LIMIT_63):
                raise ValueError(f"fired mark ({position!r}, {fired_ms!r}) must be two ints in [0, 2**63)")
        for topic, message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
            _check_u63("cancelled_ms", cancelled_ms)
            _check_u63("tombstone position", tombstone_position)
            if due_ms is not None:
                _check_u63("cancelled timer's deliver_at_ms", due_ms)
            id_prefix(message_id, topic)  # refuses ids and topics the layout cannot hold
        for position, damaged_ms in batch.damaged:
            _check_u63("damaged position", position)
            _check_u63("damaged_ms", damaged_ms)
        for level, offset in batch.level_progress.items():
            if type(level) is not int or not 0 < level < 1 << 16:
                raise ValueError(f"delay level {level!r} must be an int in [1, 65535]")
            _check_u63("level offset", offset)
        for base, floor in batch.link_floors:
            if type(base) is not int or type(floor) is not int or not (0 <= base < _LIMIT_63 and 0 <= floor < end):
                raise ValueError(f"link floor ({base!r}, {floor!r}) must be two ints in [0, 2**63), the floor "
                                 f"inside the batch's log range (it ends at {end})")
        for position, linked_ms, body in batch.link_copies:
            if type(position) is not int or not 0 <= position < end or not isinstance(body, bytes):
                raise ValueError(f"link copy at {position!r} must be an int inside the batch's log range (it ends "
                                 f"at {end}) with a bytes body")
            _check_u63("link record store time", linked_ms)
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
            rows = self._cf[CF_TIME].items(from_key=self._head, read_opt=_read_bounded(upper))
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
            read_opt = _read_bounded(U64.pack(min(end_position, (1 << 64) - 1)))
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
                                                     read_opt=_read_bounded(upper)):
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

    def linked_floor(self, segment_base: int) -> int | None:
        return min((f for b, f in self._link_floors.items() if b >= segment_base), default=None)

    def forget_links_below(self, position: int, live_from: int | None = None) -> None:
        if self._closed:
            raise TimerIndexClosed(self._path)
        gone = [b for b in self._link_floors if b < position]
        with self._guard():
            db = self._writable()
            wb = WriteBatch(raw_mode=True)
            for base in gone:
                wb.delete(b"f" + U64.pack(base), self._handle[CF_COUNTERS])
            wb.delete_range(U64.pack(0), U64.pack(position), self._handle[CF_LINKS])
            if live_from is not None:
                wb.put(META_LIVE_LINKS_FROM, U64.pack(live_from), self._handle[CF_META])
            db.write(wb, self._write_opt)
        for base in gone:
            del self._link_floors[base]
        if live_from is not None:
            self._live_links_from = live_from

    def link_copy(self, position: int) -> tuple[bytes, int] | None:
        with self._guard():
            value = self._cf[CF_LINKS].get(U64.pack(position))
            return None if value is None else decode_link_copy(value)

    def link_copies_in(self, start: int, end: int) -> list[int]:
        with self._guard():
            return [U64.unpack(key)[0] for key, _ in
                    self._scan_range(CF_LINKS, U64.pack(start), U64.pack(end))]

    def live_links_from(self) -> int | None:
        return self._live_links_from

    def prune_history(self, before_ms: int) -> int:
        if self._closed:
            raise TimerIndexClosed(self._path)
        if before_ms <= 0:
            return 0
        pruned = 0
        with self._guard():
            start, upper = b"", HISTORY_KEY.pack(min(before_ms, (1 << 64) - 1), 0)
            while True:
                rows = self._scan_range(CF_HISTORY, start, upper, limit=_PRUNE_CHUNK)
                if not rows:
                    return pruned
                # About `_PRUNE_CHUNK` timers a write, not rows: a fired row speaks for up to
                # HISTORY_FIRED_MAX (the last row taken may run past the chunk by less than that).
                timers = 0
                for i, (_, hv) in enumerate(rows):
                    timers += history_timers(hv)
                    if timers >= _PRUNE_CHUNK:
                        rows = rows[:i + 1]
                        break
                pruned += self._prune_rows(rows)
                start = rows[-1][0] + b"\x00"  # past what was just deleted: no tombstone walk

    def _prune_rows(self, rows: list[tuple[bytes, bytes]]) -> int:
        """Delete one chunk of history and what it points at; returns the statuses forgotten."""
        db = self._writable()  # before the batch is built: it names this handle's column families
        wb = WriteBatch(raw_mode=True)
        h = self._handle
        finished = [(HISTORY_KEY.unpack(hk)[1], hv[1:]) for hk, hv in rows if hv[0] == HIST_STATUS]
        redirects = [HISTORY_KEY.unpack(hk)[1] for hk, hv in rows if hv[0] == HIST_REDIRECT]
        fired_rows = [hv for _, hv in rows if hv[0] == HIST_FIRED]
        if len(finished) + len(redirects) + len(fired_rows) != len(rows):
            raise MalformedValue("history row of unknown kind")
        for hv in fired_rows:
            finished.extend((U64.unpack_from(ik, len(ik) - 8)[0], ik) for ik in decode_fired_history(hv))
        forgotten = 0
        if finished:
            facts = self._cf[CF_ID].get([ik for _, ik in finished])
            states = self._cf[CF_POS].get([U64.pack(position) for position, _ in finished])
            for (position, ik), value, state in zip(finished, facts, states, strict=True):
                if value is None or state is None or state[0] != POS_DONE:
                    continue  # already gone
                for key in facts_keys(value):
                    wb.delete(key_cf_key(key, position), h[CF_KEY])
                wb.delete(ik, h[CF_ID])
                wb.delete(U64.pack(position), h[CF_POS])
                forgotten += 1
        position_keys = [U64.pack(position) for position in redirects]
        for pk, pv in zip(position_keys, self._cf[CF_POS].get(position_keys) if redirects else [], strict=True):
            if pv is not None and pv[0] == POS_ROLLED:
                wb.delete(pk, h[CF_POS])
        for hk, _ in rows:
            wb.delete(hk, h[CF_HISTORY])
        db.write(wb, self._write_opt)
        return forgotten

    # -- scans -------------------------------------------------------------------------------

    def _scan(self, cf: str, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return self._scan_range(cf, prefix, prefix_end(prefix))

    def _scan_range(self, cf: str, start: bytes, end: bytes | None,
                    limit: int | None = None) -> list[tuple[bytes, bytes]]:
        rows: list[tuple[bytes, bytes]] = []
        for row in self._cf[cf].items(from_key=start, read_opt=_read_bounded(end)):
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        return rows
