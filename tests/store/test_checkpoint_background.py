"""The checkpoint tick off the event loop: `MessageStore.checkpoint_in_background`.

Its fsyncs (every dirty consume-queue file, the directory, the checkpoint file) run on a worker
thread, so the loop goes on serving while they take their milliseconds. What must stay true, each
tried here with the fsync held or failed at the system-call boundary (`os.fdatasync` looked up
at call time, as `store/fsync.py` promises):
- the loop serves sends while a checkpoint's fsync is stuck, and the checkpoint it then writes
  covers exactly what was dispatched when it began, every queue file fsynced before;
- an fsync error on the thread fails the store for good, as on the loop: the checkpoint file is
  not replaced, sends are refused, and a restart has everything acknowledged;
- a close while a background checkpoint is stuck waits for it, then writes its own.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronoq.config import Config
from chronoq.errors import BrokerClosed, FlushFailed
from chronoq.model import OutgoingMessage
from chronoq.store import files
from chronoq.store.meta import read_checkpoint
from tests.support.brokers import SimulatedBrokers


def _config(tmp_path: Path) -> Config:
    return Config(data_dir=tmp_path / "data", default_queue_count=2)


class QueueSyncs:
    """`os.fdatasync` wrapped: calls on consume-queue files are recorded with the thread that
    made them, and can be held (until released) or failed with EIO."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        self.hold = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self.fail = False
        real = os.fdatasync

        def fdatasync(fd: int) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(files.CQ_SUFFIX):
                self.calls.append((path, threading.current_thread().name))
                if self.hold.is_set():
                    self.held.set()
                    assert self.release.wait(10), "the test never released the held fsync"
                if self.fail:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)


@pytest.fixture
def queue_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[QueueSyncs]:
    yield QueueSyncs(monkeypatch)


async def _wait_for(event: threading.Event) -> None:
    for _ in range(500):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the checkpoint thread never reached its fsync")


def _run(body: Callable[[], object]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


def test_the_loop_serves_while_a_checkpoint_fsyncs(brokers: SimulatedBrokers, tmp_path: Path,
                                                   queue_syncs: QueueSyncs) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        try:
            await broker.create_topic("t", 2)
            for i in range(4):
                await broker.send(OutgoingMessage("t", b"before", message_id=f"a{i}"))
            covered = broker.store.dispatched_position
            queue_syncs.calls.clear()  # from here on, only the background checkpoint syncs queues
            queue_syncs.hold.set()
            tick = asyncio.create_task(broker.store.checkpoint_in_background())
            await _wait_for(queue_syncs.held)
            # The checkpoint is stuck in its fsync; the loop still accepts (and makes durable) sends.
            sent = await asyncio.wait_for(broker.send(OutgoingMessage("t", b"during", message_id="d")), 5)
            assert not tick.done()
            queue_syncs.release.set()
            assert await asyncio.wait_for(tick, 10) == covered
            assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == covered
            assert sent.position >= covered, "the checkpoint covers only what was dispatched when it began"
            threads = {name for _, name in queue_syncs.calls}
            assert threads and all(name.startswith("chronoq-checkpoint") for name in threads), threads
            synced = {(Path(p).parent.parent.name, Path(p).parent.name) for p, _ in queue_syncs.calls}
            assert {("t", "0"), ("t", "1")} <= synced, synced
        finally:
            queue_syncs.release.set()
            await broker.close()

    _run(body)


def test_an_fsync_error_on_the_thread_fails_the_store_for_good(brokers: SimulatedBrokers, tmp_path: Path,
                                                               queue_syncs: QueueSyncs) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        await broker.create_topic("t", 2)
        await broker.send(OutgoingMessage("t", b"one", message_id="one"))
        before = broker.store.checkpoint()
        await broker.send(OutgoingMessage("t", b"two", message_id="two"))
        queue_syncs.fail = True
        with pytest.raises(FlushFailed):
            await broker.store.checkpoint_in_background()
        assert queue_syncs.calls, "no queue fsync was attempted"
        assert broker.store.log.failure is not None, "a failed checkpoint fsync must fail the log for good"
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == before
        queue_syncs.fail = False  # the disk "recovers": nothing may be acknowledged on top of it
        with pytest.raises((FlushFailed, BrokerClosed)):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"three")), 5)
        await broker.close()
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == before
        broker = await brokers.open(_config(tmp_path))
        try:
            got = {m.message.message_id for m in await broker.receive("g", "t", batch_size=8)}
            got |= {m.message.message_id for m in await broker.receive("g", "t", batch_size=8)}
            assert got == {"one", "two"}
        finally:
            await broker.close()

    _run(body)


def test_a_close_waits_for_a_stuck_background_checkpoint(brokers: SimulatedBrokers, tmp_path: Path,
                                                         queue_syncs: QueueSyncs) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        await broker.create_topic("t", 2)
        await broker.send(OutgoingMessage("t", b"one", message_id="one"))
        queue_syncs.hold.set()
        tick = asyncio.create_task(broker.store.checkpoint_in_background())
        await _wait_for(queue_syncs.held)
        tick.cancel()  # as the broker's close cancels its checkpoint task
        with pytest.raises(asyncio.CancelledError):
            await tick
        await broker.send(OutgoingMessage("t", b"two", message_id="two"))
        end = broker.store.dispatched_position
        queue_syncs.hold.clear()
        threading.Timer(0.2, queue_syncs.release.set).start()
        await broker.close()  # waits for the stuck thread, then checkpoints everything
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == end
        assert not (tmp_path / "data" / (files.CHECKPOINT + ".tmp")).exists()

    _run(body)
