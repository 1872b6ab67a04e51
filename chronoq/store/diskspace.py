"""Free space on the data directory's file system: what "disk full" means, and what is set aside.

Theory of operation (docs/design.md, "A full disk"): a full disk is back-pressure, not a
failure. Two lines of defence, then graceful degradation:
- The send reserve: `check_send` refuses a producer send (`DiskFull`, retriable) while the file
  system has less than `disk_min_free_bytes` free (one `statvfs`, ~3 us, per send call). The
  broker's own writes never check it, so they have that much room to go on: fired timers,
  rolled timers (which retention needs before it can free whole segments), DLQ copies, cancel
  tombstones, consumer state, checkpoints.
- The reserve file `DATA_DIR/reserve` (`disk_reserve_file_bytes`): space taken while the disk
  has room, and given up only when the broker *starts* with less than that free. Opening RocksDB
  writes (a new MANIFEST and OPTIONS file at every open, and an SST for what its WAL held), so
  on a disk with 0 bytes free neither the consumer-group store nor the timer index opens (both
  measured on a full tmpfs). The file is kept for that step: while running, every other write
  that finds no space is a retriable refusal that resumes by itself. It is made again once the
  disk has `disk_min_free_bytes` plus its size free. It holds no data (never fsynced: a crash
  that loses it only means the next start makes it again).
- A write that runs out of space anyway (another process filled the disk) raises `DiskFull`
  after undoing itself; `is_disk_full` recognises that case wherever it surfaces (an OSError
  ENOSPC/EDQUOT from a write, or RocksDB's "No space left on device" status text). Callers retry
  after `disk_full_retry_ms`; `note_full` / `note_ok` log one warning per episode, not one per
  retry.

An fsync error is never back-pressure, whatever its errno: ENOSPC from fsync means the kernel
could not write pages it had accepted, the fsyncgate case (`store/fsync.py`). `FsyncFailed`
therefore never counts as disk full here, even though its text may say "No space left".
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from chronoq.errors import ChronoqError, DiskFull
from chronoq.store import files

log = logging.getLogger("chronoq.store")

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
ROCKSDB_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")
"""How rocksdict reports ENOSPC/EDQUOT: a plain Exception carrying RocksDB's status text, e.g.
"IO error: No space left on device: While appending to file: .../000004.log"."""
ROCKSDB_OPEN_SLACK_BYTES = 1024 * 1024
"""Room a RocksDB open needs beyond its WAL (which it turns into an SST): a new MANIFEST,
OPTIONS, CURRENT and info LOG. Measured on tmpfs after a clean close: the consumer-group store
opened with 48 KiB free, the timer index (seven column families) needed 192 KiB."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` says a write found no space (back-pressure), as opposed to any other failure."""
    if isinstance(exc, ChronoqError):
        return isinstance(exc, DiskFull)  # FsyncFailed (even with ENOSPC) is fatal, never this
    if isinstance(exc, OSError):
        return exc.errno in DISK_FULL_ERRNOS
    text = str(exc)
    return any(t in text for t in ROCKSDB_DISK_FULL_TEXTS)


RESOURCE_LIMIT_TEXTS = ("Too many open files", "Permission denied", "Cannot allocate memory")
"""What RocksDB (and the OS) say when an open lacked a resource other than space."""


def resource_problem(exc: BaseException) -> str | None:
    """Why opening a store failed for lack of a resource other than space (file descriptors,
    permission, memory), or None. Not damage: a store must not be moved aside or rebuilt for it,
    nor the failure reported as another broker holding it (RocksDB's "While lock file: .../LOCK:
    Too many open files" names the lock)."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM,
                                                  errno.ENOMEM):
        return str(exc)
    text = str(exc)
    return text if any(t in text for t in RESOURCE_LIMIT_TEXTS) else None


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still allocate on `path`'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def rocksdb_wal_bytes(path: Path) -> int:
    """Bytes in the WAL files of the RocksDB at `path`: what its next open writes into an SST."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.name.endswith(".log"))
    except OSError:
        return 0


class DiskSpace:
    """The data directory's free space, its reserve file, and the disk-full episodes under way."""

    def __init__(self, data_dir: Path, *, min_free_bytes: int = 0, reserve_file_bytes: int = 0) -> None:
        self.data_dir = Path(data_dir)
        self.min_free_bytes = min_free_bytes
        self.reserve_file_bytes = reserve_file_bytes
        self.reserve_path = self.data_dir / files.RESERVE
        self._reserve_ok = False
        """The reserve file is known to be there, whole (saves a stat per tick)."""
        self._reserve_unsupported = False
        """Making the reserve file failed for another reason than space: not tried again."""
        self._episodes: dict[str, str] = {}
        """What is being held back by a full disk (name -> first error), for one log line each."""

    def free_bytes(self) -> int:
        return free_bytes(self.data_dir)

    # -- errors -----------------------------------------------------------------------------

    def check_send(self) -> None:
        """Refuse a producer send while less than `min_free_bytes` is free (DiskFull)."""
        if self.min_free_bytes:
            free = self.free_bytes()
            if free < self.min_free_bytes:
                raise DiskFull(str(self.data_dir), free, self.min_free_bytes)

    def ran_out(self, during: str, path: str | Path | None = None) -> DiskFull:
        """The error for a write (`during`) to `path` that found no space (the free space is that
        of `path`'s file system: a store may live on a disk of its own)."""
        where = Path(path) if path is not None else self.data_dir
        free = 0
        for candidate in (where, where.parent, self.data_dir):  # a file that was never made: its directory
            try:
                free = free_bytes(candidate)
                break
            except OSError:
                continue
        return DiskFull(str(where), free, self.min_free_bytes, during)

    def room_for_rocksdb(self, path: Path) -> bool:
        """Whether reopening the RocksDB at `path` can be expected to succeed (its WAL becomes an
        SST, plus the files every open writes)."""
        return free_bytes(path) >= rocksdb_wal_bytes(path) + ROCKSDB_OPEN_SLACK_BYTES

    def note_full(self, what: str, err: BaseException) -> None:
        """`what` is held back by a full disk: a warning the first time, silence while it lasts."""
        if what not in self._episodes:
            # Text only, here and in the log record: an exception object kept by a log handler
            # keeps its traceback's frames alive, and with them a RocksDB handle that must close
            # before it can be reopened.
            self._episodes[what] = str(err)
            log.warning("%s held back by a full disk, retrying until space is freed: %s", what, self._episodes[what])

    def note_ok(self, what: str) -> None:
        if self._episodes.pop(what, None) is not None:
            log.warning("%s resumed: the disk has room again", what)

    @property
    def held_back(self) -> dict[str, str]:
        """What a full disk is holding back now (name -> the error that started it)."""
        return dict(self._episodes)

    # -- the reserve file -------------------------------------------------------------------

    def open_reserve(self) -> None:
        """At start, before anything else writes: give the reserve up if the disk has less than
        its size free (so recovery and RocksDB can open), else make sure it is there."""
        if not self.reserve_path.exists():
            self.tend()
            return
        free = self.free_bytes()
        if self.reserve_file_bytes == 0 or free < self.reserve_file_bytes:
            self.reserve_path.unlink()
            self._reserve_ok = False
            if self.reserve_file_bytes:
                log.warning("disk nearly full (%d bytes free in %s): released the %d-byte reserve file so the "
                            "broker can open; sends are refused until space is freed", free, self.data_dir,
                            self.reserve_file_bytes)
            return
        self.tend()

    def tend(self) -> None:
        """Make the reserve file if it is missing (or short) and the disk has room for it and for
        `min_free_bytes` besides. Called at start and on every checkpoint tick."""
        if self._reserve_ok or self._reserve_unsupported or not self.reserve_file_bytes:
            return
        try:
            if self.reserve_path.exists() and self.reserve_path.stat().st_size >= self.reserve_file_bytes:
                self._reserve_ok = True
                return
            if self.free_bytes() < self.min_free_bytes + self.reserve_file_bytes:
                return
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, self.reserve_file_bytes)
            finally:
                os.close(fd)
            self._reserve_ok = True
        except OSError as e:
            # Raced with another writer for the last bytes, or a file system without fallocate:
            # no reserve this time; the next tick tries again.
            self.reserve_path.unlink(missing_ok=True)
            if not is_disk_full(e):
                self._reserve_unsupported = True
                log.warning("cannot make the reserve file %s (%s); running without one", self.reserve_path, e)
