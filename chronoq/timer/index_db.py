"""The RocksDB database under the timer index: its options, its handles, and reopening it.

Theory of operation: `IndexDb` is `RocksTimerIndex`'s base class (`timer/index.py`). It holds the
database and one handle per column family (`index_codec.COLUMN_FAMILIES`), and every RocksDB call
of the index runs inside `with self._guard():`, which refuses a closed index, reattaches a
detached one, and names what RocksDB raises: an undecodable value or a "Corruption" is
`TimerIndexCorrupt`, a full disk `DiskFull` (`_translate`).

Memory is bounded by two sizes: one block cache shared by all column families, charged with
their index and filter blocks too (`BLOCK_CACHE_BYTES`), and all memtables together
(`WRITE_BUFFER_BYTES`). Point-in-time WAL recovery: after a power loss RocksDB opens the index
as of its last intact batch, never with a hole in the middle.

A full disk is not damage (`store/diskspace.py`). RocksDB refuses every write after one that
found no space until the database is reopened, even once space is back (measured, rocksdict
0.3.29 on a full tmpfs), so the next write reopens it first (`_writable`), when the disk has
room for that (`DiskSpace.room_for_rocksdb`); reads go on through the old handle meanwhile. If
the reopen itself fails, the index is detached and every call tries to attach it again
(`DiskFull` until it can). A reopen reloads the index's in-memory mirrors (`_reload`, the
index's). Opening on a full disk fails (a new MANIFEST at every open): that too is `DiskFull`,
so the broker does not destroy an index that is only waiting for space.

Why apart from `timer/index.py`: this is what any RocksDB store of this shape needs (options,
lifecycle, error naming, bounded scans), whatever its keys mean; the index itself holds the
timer semantics, and `index_codec.py` the byte layouts.
"""

from __future__ import annotations

import abc
import logging
import struct
from pathlib import Path
from typing import Any

from rocksdict import BlockBasedOptions, Cache, DBRecoveryMode, Options, Rdict, ReadOptions, WriteOptions

from chronoq.errors import ChronoqError, DataDirLocked, StoreUnavailable, TimerIndexClosed, TimerIndexCorrupt
from chronoq.store.diskspace import DiskSpace, is_disk_full, resource_problem
from chronoq.timer.index_codec import CF_ID, CF_POS, CF_TIME, COLUMN_FAMILIES, MalformedValue, prefix_end

log = logging.getLogger("chronoq.timer")


class _Guard:
    """The context manager `IndexDb._guard` hands out: a class rather than a generator,
    because it wraps every index write and a generator-based one cost ~2 % of the instructions
    of a one-timer send. An exception raised inside becomes the named error `_translate` says.

    No reference cycle may survive a failure: the original exception's traceback holds the
    frame that held the RocksDB handle, and a handle kept alive until the cyclic collector runs
    keeps the database's lock, so the reopen after a full disk would find it "in use"
    (`tests/store/test_faults_disk_full.py`). So `__exit__` drops its locals before the named
    error leaves, and the index does not hold its guard (one is made per use)."""

    __slots__ = ("_index",)

    def __init__(self, index: IndexDb) -> None:
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


def open_rdict(path: Path, create: bool, block_cache_bytes: int, write_buffer_bytes: int,
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


def read_bounded(upper: bytes | None) -> ReadOptions:
    ro = ReadOptions()
    if upper is not None:
        ro.set_iterate_upper_bound(upper)
    return ro


# --- the database -------------------------------------------------------------------------------


class IndexDb(abc.ABC):
    """The database and its handles (module docstring). Single-threaded, as the index is."""

    def __init__(self, path: Path, db: Rdict, *, disk: DiskSpace | None = None,
                 block_cache_bytes: int = BLOCK_CACHE_BYTES, write_buffer_bytes: int = WRITE_BUFFER_BYTES) -> None:
        self._path = path
        self._disk = disk or DiskSpace(path)
        self._sizes = (block_cache_bytes, write_buffer_bytes)
        self._db: Rdict | None = None
        self._cf: dict[str, Rdict] = {}
        self._handle: dict[str, Any] = {}
        self._wire(db)
        self._stuck = False
        """A write failed for space: RocksDB refuses writes until reopened (module docstring)."""
        self._write_opt = WriteOptions()  # WAL on, no fsync: see `timer/index.py`
        self._closed = False

    @abc.abstractmethod
    def _reload(self) -> None:
        """Reload what the subclass mirrors in memory from a database opened again (`_attach`)."""

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
        self._wire(open_rdict(self._path, False, *self._sizes, self._disk))
        try:
            self._reload()
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

    # -- every call --------------------------------------------------------------------------

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

    # -- scans -------------------------------------------------------------------------------

    def _scan(self, cf: str, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return self._scan_range(cf, prefix, prefix_end(prefix))

    def _scan_range(self, cf: str, start: bytes, end: bytes | None,
                    limit: int | None = None) -> list[tuple[bytes, bytes]]:
        rows: list[tuple[bytes, bytes]] = []
        for row in self._cf[cf].items(from_key=start, read_opt=read_bounded(end)):
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        return rows
