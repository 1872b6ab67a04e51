"""The message store's upkeep: checkpoints (how far a restart must replay) and retention.

Theory of operation: a checkpoint (the dispatched position, once every consume-queue write below
it is fsynced, and never past the log's fsynced end, which `flush = "async"` dispatch runs ahead
of) runs on the caller's thread at open, close and before retention deletes, and on the store's
own worker thread for the broker's periodic tick (`checkpoint_in_background`), so the loop does
not wait out its fsyncs: what it covers is decided on the loop first (`_take_checkpoint`), the
disk work is `store/checkpointing.py`'s, and the next checkpoint, or the close, takes its
outcome. A checkpoint that finds no space raises `DiskFull` and leaves the old one valid.

Retention (`expired_before`) deletes whole segments, oldest first, once the youngest store time
inside one is older than `retention_ms`: store times, never file times (a directory restored from
a backup has old mtimes). Records already in the log at open were stored before it, so a store
time later than the broker time at open (a clock that was wrong) counts as the open time
(`_stored_ms`), and such a segment cannot hold retention back past `retention_ms` after the open.
A re-base of broker time (`clock.py`) moves the store times kept for this (`clock_rebased`) back
with it, so no segment waits out the step.

Why apart from `store/messagestore.py`: both bound the store over time, at the log's two ends
(what a restart replays, what the disk keeps), and run at the broker's ticks, not on the path of
a message. `StoreUpkeep` is a base class of `MessageStore`, not an object it holds, so callers
ask the store as before; its state (the attributes annotated on the class) is set by
`MessageStore.__init__` and recovery.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from chronoq.config import Config
from chronoq.errors import FlushFailed, FsyncFailed
from chronoq.store import files
from chronoq.store.checkpointing import CheckpointWriter
from chronoq.store.commitlog import CommitLog, Segment
from chronoq.store.consumequeue import ConsumeQueue, OpenFiles, TakenFlush
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.store.meta import encode_checkpoint


class StoreUpkeep:
    """`MessageStore`'s checkpoints and retention (the module docstring). Its state, set by
    `MessageStore.__init__` (and `log` by recovery), is annotated here."""

    config: Config
    dir: Path
    log: CommitLog
    disk: DiskSpace
    queue_files: OpenFiles
    dispatched_position: int
    first_seen_ms: int | None
    _cqs: dict[tuple[str, int], ConsumeQueue]
    _checkpoints: CheckpointWriter
    _topics_unsaved: bool
    _save_topics: Callable[[], None]
    """The store's: write the topic table (a checkpoint saves one recovery could not)."""

    def checkpoint(self) -> int:
        """Make consume queues durable and record how far they cover, all on the calling thread
        (open, close, retention before it deletes; tests). After any fsync error (here or in the
        log) it raises FlushFailed and writes nothing: the checkpoint on disk stays at the last
        point known durable, and a restart replays the log from there."""
        self._checkpoints.settle()
        position, taken = self._take_checkpoint()
        self._checkpoints.write_now(taken, encode_checkpoint(position, 0))
        return position

    async def checkpoint_in_background(self) -> int:
        """`checkpoint`, with its fsyncs and the checkpoint file's write on a worker thread: the
        event loop goes on serving meanwhile (a checkpoint every second made of several fsyncs
        on the loop held every message behind it for milliseconds). What it covers is decided
        on the loop, before the thread starts: the position dispatched so far and the queue
        files dirty up to it. Cancelled while waiting (the broker closing), the thread finishes
        regardless, and the next checkpoint waits for it and takes its outcome."""
        await self._checkpoints.wait_for_running()
        position, taken = self._take_checkpoint()
        await self._checkpoints.write_in_background(taken, encode_checkpoint(position, 0))
        return position

    def _take_checkpoint(self) -> tuple[int, list[TakenFlush]]:
        """On the loop: the position a checkpoint records and the fsyncs that must precede it."""
        if self.log.failure is not None:
            raise FlushFailed(self.log.failure)
        # Never past the log's fsynced end: with flush = "async" records are dispatched once
        # written, and a checkpoint past the fsynced end would point into what a power loss can
        # zero, where recovery's walk from the checkpoint could not see the loss. (With "sync",
        # dispatch follows the fsync and this is the dispatched position.)
        position = min(self.dispatched_position, self.log.flushed_position)
        try:
            if self._topics_unsaved:
                self._save_topics()
                self._topics_unsaved = False
        except BaseException as e:
            self._checkpoint_failed(e)
            raise
        # Only the queues written since their last take (all the store's queues share
        # `queue_files`): with tens of thousands of idle queues, visiting each held the loop.
        taken: list[TakenFlush] = []
        try:
            for cq in self.queue_files.dirty_queues():
                taken.append(cq.take_dirty())
        except BaseException:
            # (An EMFILE on a duplicate, say.) What was taken is given back, or the next
            # checkpoint would cover those queues' entries without syncing them.
            for t in taken:
                t.untake()
            raise
        return position, taken

    def _checkpoint_failed(self, e: BaseException) -> None:
        """What a failed checkpoint means: an fsync error fails the log for good (re-raised by
        the caller); a full disk raises DiskFull (the old checkpoint file is still whole)."""
        if isinstance(e, FsyncFailed):
            self.log.fail(e.message)
        elif isinstance(e, OSError) and is_disk_full(e):
            # write_atomic removed its temp file; the old checkpoint is still whole and valid.
            raise self.disk.ran_out("writing the checkpoint", self.dir / files.CHECKPOINT) from e

    async def expired_before(self, now_ms: int) -> int:
        """The position below which whole segments are older than the retention period, judged
        by the store times inside them (`_stored_ms`), never by file times."""
        if self.first_seen_ms is None:
            self.first_seen_ms = now_ms
        cutoff_ms = now_ms - self.config.retention_ms
        limit = self.log.start_position
        for seg in self.log.segments()[:-1]:
            if await self._stored_ms(seg) >= cutoff_ms:
                break
            limit = seg.end
        return min(limit, self.dispatched_position)

    async def active_segment_expired(self, now_ms: int) -> bool:
        """Whether every record of the segment being written is older than the retention period
        (nothing was written for that long). It is never deleted, but what its records pin is
        past retention too (`retention.py`: the link records in it)."""
        if self.first_seen_ms is None:
            self.first_seen_ms = now_ms
        return await self._stored_ms(self.log.segments()[-1]) < now_ms - self.config.retention_ms

    async def _stored_ms(self, seg: Segment) -> int:
        """When retention counts `seg` as stored: the store time of its youngest record. A
        record from an earlier run was stored before this run began, so a store time after
        `first_seen_ms` (in the future when the broker opened) was written by a wrong clock: it
        counts as `first_seen_ms`, so that segment expires `retention_ms` after the broker first
        saw it instead of blocking retention (which deletes a prefix) until its false date. A
        segment none of whose earlier-run records pass their checks counts as first seen too."""
        stored = seg.last_store_ms
        if seg.opened_size:
            assert self.first_seen_ms is not None
            opened = await self.log.opened_youngest_store_ms(seg)
            stored = max(stored, self.first_seen_ms if opened is None else min(opened, self.first_seen_ms))
        return stored

    def clock_rebased(self, step_ms: int) -> None:
        """Broker time was moved back by `step_ms` (a re-base, `clock.py`): the store times this
        run keeps for retention (each segment's youngest written, the open time) move back as
        far, so a segment keeps its real age instead of waiting out the step. The records keep
        the store times they were written with; one found at the next open later than that open
        counts as the open time (`_stored_ms`)."""
        for seg in self.log.segments():
            if seg.last_store_ms:
                seg.last_store_ms = max(1, seg.last_store_ms - step_ms)
        if self.first_seen_ms is not None:
            self.first_seen_ms -= step_ms

    def delete_before(self, position: int) -> int:
        removed = self.log.delete_segments_before(position)
        if removed:
            for cq in self._cqs.values():
                cq.delete_files_before(self.log.start_position)
        return len(removed)
