"""Group commit: the commit log's durability (fsync batching, waiting senders, dispatch, failure).

Theory of operation:
- `CommitLog.write()` appends bytes with `os.write` (page cache) and returns at once;
  `wait_durable(end)` resolves when an fsync covering `end` has finished. One flusher task
  (`flush_loop`) does the fsyncs, in a worker thread, each covering everything written so far:
  concurrent producers share one fsync (group commit). With `flush="async"` the flusher runs
  every `flush_interval_ms` instead.
  The thread is the log's own (`SyncThread`): a job goes in through a `queue.SimpleQueue` and
  its outcome comes back with one `call_soon_threadsafe`, ~60 us of CPU less per group commit
  than `run_in_executor`'s concurrent.futures round trip (measured where threads wake slowly).
- `on_durable(end)` lets the broker dispatch what is now durable: visibility follows durability.
  A sender is released only once its records are durable *and* dispatched: when dispatch is held
  back (it ran out of space writing derived state), `on_durable` says how far it got, the
  senders beyond wait, and the flusher calls it again every `dispatch_retry_ms`.
- Any fsync error fails the log for good (`store/fsync.py` says why): every waiting sender gets
  `FlushFailed`, every later write is refused, nothing more is called durable, and `on_failed`
  tells the owner, which stops the broker. Only a restart (recovery from disk) clears it.

`GroupCommit` is `CommitLog`'s base class: the log keeps the segments (which descriptors were
written to, where the log ends), this keeps what is durable, who waits for it and whether the log
has failed. Apart because the two change for different reasons: the file format and recovery on
one side, the batching and threading of fsyncs on the other. Both halves are one object, so a
write marks its descriptor unsynced and a roll or a retention delete fails the log directly.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from chronoq.errors import FlushFailed, FsyncFailed
from chronoq.store import fsync


class GroupCommit(abc.ABC):
    """The durability half of `CommitLog` (see the module docstring); it needs the log's
    `end_position` and `_path_of(fd)`."""

    def __init__(self, *, flush: str, flush_interval_ms: int, dispatch_retry_ms: int) -> None:
        self.flush_mode = flush
        self.flush_interval_ms = flush_interval_ms
        self.dispatch_retry_ms = dispatch_retry_ms
        self._flushed = 0
        self._visible = 0
        """Durable and dispatched up to here: senders at or below it are released."""
        self._unsynced_fds: set[int] = set()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._kick = asyncio.Event()  # binds to a loop on first use, not here
        self._sync_thread = SyncThread("chronoq-fsync")
        self._fsync_idle = asyncio.Event()
        """Clear while a group commit's fsync runs: it outlives a flusher cancelled meanwhile."""
        self._fsync_idle.set()
        self._failed: str | None = None
        self.on_durable: Callable[[int], int | None] | None = None
        """Called with the durable end after each fsync (and again while it returns less):
        returns how far everything is dispatched when that is short of `end`, else None."""
        self.on_failed: Callable[[str], None] | None = None
        """Called once, with the reason, when the log fails for good."""
        self.fsync_count = 0
        self.fsync_seconds = FsyncTimes()
        """Group-commit fsync durations (the hand-off to the sync thread included), for `/metrics`."""

    # -- what the log provides -----------------------------------------------------------------

    @property
    @abc.abstractmethod
    def end_position(self) -> int:
        """Where the log's records end (`CommitLog`)."""

    @abc.abstractmethod
    def _path_of(self, fd: int) -> Path:
        """The file a descriptor in `_unsynced_fds` belongs to, for error messages (`CommitLog`)."""

    # -- durability ----------------------------------------------------------------------------

    @property
    def flushed_position(self) -> int:
        return self._flushed

    @property
    def failure(self) -> str | None:
        """Why the log failed for good, or None while it is healthy."""
        return self._failed

    async def wait_durable(self, end: int) -> None:
        """Return once everything below `end` is durable and dispatched."""
        if self._failed is not None:
            raise FlushFailed(self._failed)
        if end <= self._visible:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((end, fut))
        if self.flush_mode == "sync":
            self._kick.set()
        await fut

    def request_flush(self) -> None:
        self._kick.set()

    async def flush_loop(self) -> None:
        """The flusher task. Owned by the broker's task group; cancelled on close."""
        loop = asyncio.get_running_loop()
        while True:
            timeout_ms: int | None = None if self.flush_mode == "sync" else self.flush_interval_ms
            if self._visible < self._flushed:  # dispatch held back by a full disk: try it again
                timeout_ms = min(timeout_ms or self.dispatch_retry_ms, self.dispatch_retry_ms)
            if timeout_ms is None:
                await self._kick.wait()
            else:
                try:
                    await asyncio.wait_for(self._kick.wait(), timeout_ms / 1000)
                except TimeoutError:
                    pass
            self._kick.clear()
            await self._flush_once(loop)

    async def flush_now(self) -> None:
        await self._flush_once(asyncio.get_running_loop())

    async def _flush_once(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._fsync_idle.is_set():
            # The fsync of a flusher cancelled mid-way (close) is still running; it took the
            # descriptors it covers, so this one must not call anything durable before it ends.
            await self._fsync_idle.wait()
        if self._failed is not None:
            # Nothing written since the failure is ever called durable: an fsync now would
            # return 0 for pages the failed one already lost.
            self.fail(self._failed)
            return
        target = self.end_position
        if target <= self._flushed:
            self._dispatch_and_release()
            return
        fds = list(self._unsynced_fds)
        self._unsynced_fds.clear()
        started = time.perf_counter()  # a duration for /metrics only: no decision reads it
        # Its outcome reaches `_fsync_done` even if this flusher is cancelled meanwhile. Cleared
        # only once the fsync is queued: a thread that cannot start (RuntimeError: a pids limit)
        # kills the flusher, and close's flush must not wait for an fsync that never began.
        synced = self._sync_thread.run(loop, _fsync_all, [(fd, self._path_of(fd)) for fd in fds], self._fsync_done)
        self._fsync_idle.clear()
        try:
            await synced
        except FsyncFailed:
            return  # `_fsync_done` failed the log; anything else is a bug the flusher dies of
        if self._failed is not None:  # failed elsewhere (a roll) while this fsync ran
            self.fail(self._failed)
            return
        self.fsync_count += 1
        self.fsync_seconds.record(time.perf_counter() - started)
        self._flushed = max(self._flushed, target)
        self._dispatch_and_release()

    def _fsync_done(self, error: BaseException | None) -> None:
        """A group commit's fsync ended, whether or not its flusher still waits for it (close
        cancels the flusher): an error fails the log for good, so it is never lost."""
        self._fsync_idle.set()
        if isinstance(error, FsyncFailed):
            self.fail(error.message)
        elif error is not None:
            self.fail(f"the group commit's fsync raised {error!r}")

    def _dispatch_and_release(self) -> None:
        visible = self._flushed
        if self.on_durable is not None:
            dispatched = self.on_durable(self._flushed)
            if dispatched is not None:
                visible = min(visible, dispatched)
        self._visible = max(self._visible, visible)
        self._release(self._visible)

    def fail(self, reason: str) -> None:
        """Fail for good: refuse every later write, fail every sender still waiting for
        durability (a waiter must never hang on an fsync that will not come), call nothing
        durable again, and tell `on_failed` (once). The first reason is kept."""
        first = self._failed is None
        if first:
            self._failed = reason
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(FlushFailed(self._failed or reason))
        self._waiters.clear()
        if first and self.on_failed is not None:
            self.on_failed(reason)

    def _release(self, upto: int) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for end, fut in self._waiters:
            if end <= upto:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((end, fut))
        self._waiters = keep
        if any(end > self._flushed for end, _ in keep):
            self._kick.set()  # written after the last fsync began: another one is needed
        # (Waiters below `_flushed` wait for a dispatch held back by a full disk: the flusher's
        # retry timer, not a kick, brings them on.)

    def sync_blocking(self) -> None:
        """fsync everything now, in this thread (close, tests, recovery). Raises FlushFailed if
        the log has failed (then nothing is synced: see `fail`)."""
        self._check_failed()
        try:
            for fd in list(self._unsynced_fds):
                fsync.fdatasync(fd, self._path_of(fd))
                self._unsynced_fds.discard(fd)
        except FsyncFailed as e:
            self.fail(e.message)
            raise
        self._flushed = self.end_position

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise FlushFailed(self._failed)


FSYNC_BUCKETS_S: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                     0.25, 0.5, 1.0, 2.5)
"""Upper edges of the fsync-duration histogram (Prometheus `le`); one more bucket holds the rest."""


class FsyncTimes:
    """Counts of fsync durations per bucket of `FSYNC_BUCKETS_S`, their sum: one bisect per
    group commit (a few hundred ns beside a ~250 us fsync)."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(FSYNC_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def record(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(FSYNC_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds


class SyncThread:
    """One worker thread for blocking calls the event loop must not make (the group commit's
    fsyncs). `run` queues a call and returns a future of the loop's that the thread settles with
    the call's outcome; calls run one at a time, in order. A future cancelled meanwhile (the
    flusher stopped) is left alone: the call still runs to its end, as a system call must, and
    its outcome still reaches the `done` callback given with it (an fsync error is never lost).

    Started on first use; `stop` lets the calls queued so far finish, then joins the thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[_SyncJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, loop: asyncio.AbstractEventLoop, fn: Callable[[_T], None], arg: _T,
            done: Callable[[BaseException | None], None]) -> asyncio.Future[None]:
        """Queue `fn(arg)`; `done` gets its outcome on the loop (None, or what it raised) before
        the returned future does, and gets it even if the future was cancelled meanwhile."""
        if self._thread is None:
            thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            thread.start()  # RuntimeError when no thread can be made; `stop` then has none to join
            self._thread = thread
        fut: asyncio.Future[None] = loop.create_future()
        self._jobs.put((loop, fn, arg, fut, done))
        return fut

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, fn, arg, fut, done = job
            error: BaseException | None = None
            try:
                fn(arg)
            except BaseException as e:  # handed to the waiter, whatever it is
                error = e
            try:
                loop.call_soon_threadsafe(_settle, fut, error, done)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this outcome any more


_T = TypeVar("_T")
_SyncJob = tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any, "asyncio.Future[None]",
                 Callable[[BaseException | None], None]]


def _settle(fut: asyncio.Future[None], error: BaseException | None,
            done: Callable[[BaseException | None], None]) -> None:
    done(error)
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _fsync_all(fds: list[tuple[int, Path]]) -> None:
    """The group commit, in the flusher's worker thread."""
    for fd, path in fds:
        fsync.fdatasync(fd, path)
