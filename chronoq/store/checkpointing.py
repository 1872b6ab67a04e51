"""Writing a checkpoint: the queue fsyncs it depends on, then the file, here or on a worker thread.

Theory of operation: a checkpoint records how far the consume queues cover the log (the
dispatched position), so recovery replays the log from there. What it covers is decided by the
store on the event loop (`MessageStore._take_checkpoint`: the position and the queue writes
dirty below it, each taken as a `TakenFlush`); this module does the disk work: make those queue
writes durable, then replace the checkpoint file atomically (`write_atomic`), releasing the
duplicated descriptors either way. `write_now` does it on the caller's thread (open, close,
before retention deletes); `write_in_background` on the writer's own single worker thread (the
broker's periodic tick), so the loop goes on serving through the fsyncs.

A background write outlives a caller that stops waiting (the broker closing): the thread
finishes regardless, and the next checkpoint first waits for it and takes its outcome
(`wait_for_running`, `settle`). An outcome is taken as the caller would have raised it
(`failed`, the store's: an fsync error fails the log for good; a full disk is `DiskFull`, and
the old checkpoint file stays valid). A job whose worker could not start when it was queued (a
pids limit) is given back: its queues count as dirty again, and the job, should its worker
start later, does nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from chronoq.errors import DiskFull
from chronoq.store.consumequeue import TakenFlush
from chronoq.store.meta import write_atomic


class CheckpointWriter:
    def __init__(self, path: Path, failed: Callable[[BaseException], None]) -> None:
        self.path = path
        self._failed = failed
        """What a failed write means (the store's `_checkpoint_failed`): it raises `DiskFull`
        for a full disk, fails the log for an fsync error; the caller re-raises the rest."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chronoq-checkpoint")
        """Runs background checkpoints' disk work, one at a time."""
        self._running: Future[None] | None = None
        """The background checkpoint submitted last, until its outcome is taken."""

    def write_now(self, taken: list[TakenFlush], checkpoint: bytes) -> None:
        """Sync `taken` and write `checkpoint`, on this thread."""
        try:
            _sync_and_record(taken, self.path, checkpoint)
        except BaseException as e:
            self._failed(e)
            raise

    async def wait_for_running(self) -> None:
        """Wait for a background checkpoint still running (one whose caller went away) and take
        its outcome as `settle` does."""
        if self._running is not None:
            await _finished(self._running)
            self.settle()

    async def write_in_background(self, taken: list[TakenFlush], checkpoint: bytes) -> None:
        """`write_now` on the worker thread; raises its outcome here. Cancelled while waiting,
        the thread runs on (its queues are counted clean already), and whoever checkpoints next
        takes its outcome."""
        try:
            job = self._pool.submit(_sync_and_record, taken, self.path, checkpoint)
        except BaseException:
            # No worker thread (RuntimeError: a pids limit; it starts on first use): give back
            # what was taken, or the next checkpoint would cover those queues' entries unsynced
            # (and the duplicates leak). The job stays queued in the pool; a worker that starts
            # later finds it given back and skips it (`_sync_and_record`).
            for t in taken:
                t.untake()
            raise
        self._running = job
        await _finished(job)
        if self._running is job:
            self._running = None
        # Taken here even if a checkpoint on the loop settled it meanwhile: this caller (the
        # broker's tick) must hear of a full disk, or it would end the episode as recovered.
        self._outcome(job, quiet_disk_full=False)

    def settle(self) -> None:
        """Wait for a background checkpoint still running (a close, or a checkpoint after a
        cancelled one) and take its outcome: an fsync error fails the log for good and is
        raised; a full disk only means that checkpoint was not written (the one before stays
        valid), and one is about to be tried again."""
        job, self._running = self._running, None
        if job is not None:
            self._outcome(job, quiet_disk_full=True)

    def shutdown(self) -> None:
        """Stop the worker thread once any job queued has run."""
        self._pool.shutdown(wait=True)

    def _outcome(self, job: Future[None], *, quiet_disk_full: bool) -> None:
        """`job`'s result (waiting for it), as a checkpoint on this thread would have raised it."""
        try:
            job.result()
        except BaseException as e:
            try:
                self._failed(e)
            except DiskFull:
                if quiet_disk_full:
                    return
                raise
            raise


async def _finished(job: Future[None]) -> None:
    """Wait until a worker thread's `job` is done, without taking its outcome (the caller takes
    it from `job`) and without cancelling it if the wait is cancelled (`asyncio.wait` does not)."""
    done = asyncio.wrap_future(job)
    done.add_done_callback(_retrieve)
    await asyncio.wait((done,))


def _retrieve(done: asyncio.Future[None]) -> None:
    """Mark the loop's copy of a thread's outcome as seen (it is taken from the thread's future)."""
    if not done.cancelled():
        done.exception()


def _sync_and_record(taken: list[TakenFlush], path: Path, checkpoint: bytes) -> None:
    """A checkpoint's disk work (on a worker thread, or the caller's): make the taken queue
    writes durable, then replace the checkpoint file. The descriptors are released either way.
    A job whose checkpoint was given back (its worker could not start when it was queued) does
    nothing: its queues count as dirty again, and a later checkpoint syncs and records them."""
    if any(t.given_back for t in taken):
        return
    try:
        for t in taken:
            t.sync()
    finally:
        for t in taken:
            t.close()
    write_atomic(path, checkpoint)
