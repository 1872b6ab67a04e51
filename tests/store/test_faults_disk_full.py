"""A full disk: back-pressure, never a failure, never a loss (docs/design.md, "A full disk").

Every fault here is real: a tmpfs of a few MiB is mounted for the test and a "filler" file on it
takes the free space away (`posix_fallocate`, then byte writes to the last page) and gives it
back (`tests/support/disks.py`, the `mount` fixture). A second, smaller tmpfs mounted on
`DATA_DIR/timer` or `DATA_DIR/groups` fills one RocksDB's disk while the commit log still has
room, so a RocksDB write is what runs out of space. Mounting needs root; without it the tests
skip. The one monkeypatched call is `os.fdatasync` in `test_an_fsync_enospc_is_still_fatal`, the
established way (test_faults_fsync.py) to make an fsync fail, which a full tmpfs never does.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config, ConfigError
from chronoq.errors import ChronoqError, DiskFull, FlushFailed, FsyncFailed, Throttled, TopicNotFound
from chronoq.model import MessageType, OutgoingMessage
from chronoq.store import files
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE
from chronoq.store.diskspace import is_disk_full
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.store.meta import read_checkpoint
from tests.support.brokers import open_broker
from tests.support.disks import PAGE, Disk, MiB
from tests.support.timers import run_without_cycle_collector


@pytest.fixture
def disk(mount: Callable[[Path, int], Disk], tmp_path: Path) -> Disk:
    return mount(tmp_path / "fs", 24 * MiB)


def _config(data: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {
        "segment_size_bytes": 256 * 1024, "max_message_size_bytes": 64 * 1024, "default_queue_count": 1,
        "disk_min_free_bytes": 4 * MiB, "disk_reserve_file_bytes": 1 * MiB, "disk_full_retry_ms": 50,
        **overrides}
    return Config(data_dir=data, **settings)  # type: ignore[arg-type]


async def _ticks(clock: FakeClock, n: int, step_ms: int = 20) -> None:
    """Move `clock` on `n` times by `step_ms`, giving the broker's background ticks (which sleep
    on the clock: checkpoint, retention, a full disk's retry) real time to run after each."""
    for _ in range(n):
        clock.advance(step_ms)
        await asyncio.sleep(0.02)


def _tmp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def _assert_disk_full(err: BaseException) -> None:
    assert isinstance(err, DiskFull), f"expected DiskFull, got {type(err).__name__}: {err}"
    assert err.code == 42900 and err.retriable and isinstance(err, Throttled)


def held_back_samples(broker: Broker) -> dict[tuple[tuple[str, str], ...], float]:
    """`chronoq_held_back`'s samples as the broker's /metrics collector gives them now."""
    from chronoq.http.metrics import make_registry

    return {tuple(sorted(s.labels.items())): s.value for family in make_registry(broker).collect()
            for s in family.samples if s.name == "chronoq_held_back"}


async def _receive_all(broker: Broker, topic: str, *, ack: bool = True) -> list[str]:
    got: list[str] = []
    while batch := await broker.receive("g", topic, batch_size=64):
        for rm in batch:
            got.append(rm.message.message_id)
            if ack:
                await broker.ack("g", topic, rm.receipt_handle)
    return got


# -- settings and the fsync rule ---------------------------------------------------------------


def test_the_disk_settings_are_validated(tmp_path: Path) -> None:
    for name in ("disk_min_free_bytes", "disk_reserve_file_bytes"):
        assert getattr(Config(data_dir=tmp_path, **{name: 0}), name) == 0  # 0 disables it
        with pytest.raises(ConfigError, match=name):
            Config(data_dir=tmp_path, **{name: -1})
    with pytest.raises(ConfigError, match="disk_full_retry_ms"):
        Config(data_dir=tmp_path, disk_full_retry_ms=0)
    assert Config().disk_min_free_bytes == 64 * MiB


def test_an_fsync_enospc_is_still_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC reported by an fsync is fsyncgate, not back-pressure: the store fails for good."""
    assert not is_disk_full(FsyncFailed("x", errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert is_disk_full(OSError(errno.ENOSPC, "no space")) and is_disk_full(OSError(errno.EDQUOT, "quota"))
    assert is_disk_full(Exception("IO error: No space left on device: While appending to file: x/000004.log"))

    async def body() -> None:
        broker = await open_broker(_config(tmp_path / "data", disk_min_free_bytes=0), clock=FakeClock(),
                                   background=False)
        await broker.send(OutgoingMessage("t", b"before"))

        def fdatasync(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        with pytest.raises(FlushFailed) as info:
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"after")), 5)
        assert not isinstance(info.value, DiskFull)
        assert broker.fatal is not None
        monkeypatch.undo()
        await broker.close()

    asyncio.run(body())


# -- (a) below the send reserve ----------------------------------------------------------------


def test_below_the_send_reserve_sends_are_refused_and_reads_acks_and_timers_go_on(disk: Disk) -> None:
    data = disk.root / "data"

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(_config(data), clock=clock, background=False)
        acked = [(await broker.send(OutgoingMessage("t", b"x" * 100, message_id=f"m{i}"))).message_id
                 for i in range(5)]
        due = clock.now_ms() + 1000
        timer = await broker.send(OutgoingMessage("t", b"timer", message_id="timer", deliver_at_ms=due))
        disk.fill(leave_bytes=2 * MiB)  # under the 4 MiB reserve, but not empty
        end = broker.store.log.end_position
        queue_end = broker.queue_offsets("t", 0)
        for attempt in (broker.send(OutgoingMessage("t", b"refused", message_id="r1")),
                        broker.send_batch([OutgoingMessage("t", b"r", message_id=f"r{i}") for i in range(3)])):
            with pytest.raises(DiskFull) as info:
                await attempt
            _assert_disk_full(info.value)
            assert info.value.details["free_bytes"] < info.value.details["min_free_bytes"] == 4 * MiB
        assert broker.store.log.end_position == end, "a refused send wrote to the log"
        assert broker.queue_offsets("t", 0) == queue_end
        assert await _receive_all(broker, "t") == acked  # receive and ack use the reserve
        clock.set(due - 1)
        assert await broker.run_due() == 0  # never early
        clock.set(due)
        assert await broker.run_due() == 1  # on time, written into the reserve
        fired = await broker.receive("g", "t", batch_size=8)
        assert [m.message.message_id for m in fired] == [timer.message_id]
        assert fired[0].message.store_ms == due
        assert broker.fatal is None
        await broker.close()

    asyncio.run(body())


# -- (b) no space left at all ------------------------------------------------------------------


@pytest.mark.slow
def test_no_space_left_refuses_sends_and_background_work_survives_and_close_completes(
        disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    data = disk.root / "data"

    async def body() -> None:
        # The real background tasks, ticking fast: checkpoint and retention every 20 ms of the clock.
        clock = FakeClock(1_000_000)
        broker = await open_broker(_config(data, checkpoint_interval_ms=20, retention_check_interval_ms=20),
                                   clock=clock)
        for i in range(10):
            await broker.send(OutgoingMessage("t", b"x" * 1000, message_id=f"m{i}"))
        await _ticks(clock, 5)
        checkpoint_before = read_checkpoint(data / files.CHECKPOINT)
        assert checkpoint_before == broker.store.dispatched_position
        disk.fill()
        assert disk.free() == 0
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(DiskFull) as info:
                await broker.send(OutgoingMessage("t", b"y" * 8000, message_id="refused"))
            _assert_disk_full(info.value)
            await _ticks(clock, 15)  # the checkpoint loop finds no space about 15 times
            assert broker.fatal is None, f"a full disk killed the broker: {broker.fatal!r}"
            held = [r for r in caplog.records if "checkpoint held back by a full disk" in r.getMessage()]
            assert len(held) == 1, f"one warning per episode, got {len(held)}"
            assert not _tmp_files(data)
            assert read_checkpoint(data / files.CHECKPOINT) == checkpoint_before  # the old one stays valid
            await broker.close()  # must not raise
        assert not _tmp_files(data), "close left temporary files behind"
        assert (data / files.RESERVE).exists(), "a running broker keeps its reserve file for the next start"

    asyncio.run(body())


# -- (c) restart with no space left -------------------------------------------------------------


@pytest.mark.slow
def test_a_restart_with_no_space_left_opens_and_delivers_every_acknowledged_message(
        disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    data = disk.root / "data"

    async def body() -> None:
        broker = await open_broker(_config(data), clock=FakeClock(1_000_000), background=False)
        acked = [(await broker.send(OutgoingMessage("t", b"x" * 500, message_id=f"m{i}"))).message_id
                 for i in range(20)]
        first = await broker.receive("g", "t", batch_size=5)
        for rm in first:
            await broker.ack("g", "t", rm.receipt_handle)
        assert (data / files.RESERVE).stat().st_size == 1 * MiB
        disk.fill()
        await broker.close()  # RocksDB cannot flush at close: closed unflushed (its WAL has it all)
        assert not _tmp_files(data)
        disk.fill()  # whatever the close freed, taken too: 0 bytes free at the restart
        assert disk.free() == 0
        with caplog.at_level(logging.WARNING):
            broker = await open_broker(_config(data), clock=FakeClock(1_000_000), background=False)
        assert any("released the 1048576-byte reserve file" in r.getMessage() for r in caplog.records)
        assert not (data / files.RESERVE).exists()
        assert not list(data.parent.glob("data/*.damaged-*")), "a full disk was taken for damage"
        rest = await _receive_all(broker, "t")
        assert sorted(rest) == sorted(acked[len(first):]), "acknowledged messages missing after the restart"
        with pytest.raises(DiskFull):
            await broker.send(OutgoingMessage("t", b"refused"))
        assert broker.fatal is None
        await broker.close()

    asyncio.run(body())


def test_a_restart_without_room_for_rocksdb_is_disk_full_and_damages_nothing(disk: Disk) -> None:
    """Without a reserve file RocksDB cannot open on a full disk (it writes a new MANIFEST at every
    open): the start fails with DiskFull, and nothing is taken for damage (the consumer-group
    store is not moved aside, the timer index not destroyed). With space back, all is there."""
    data = disk.root / "data"
    config = _config(data, disk_reserve_file_bytes=0)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        acked = [(await broker.send(OutgoingMessage("t", b"x" * 500, message_id=f"m{i}"))).message_id
                 for i in range(10)]
        for rm in await broker.receive("g", "t", batch_size=4):
            await broker.ack("g", "t", rm.receipt_handle)
        await broker.close()
        disk.fill()
        with pytest.raises(DiskFull) as info:
            await open_broker(config, clock=FakeClock(1_000_000), background=False)
        assert "RocksDB" in str(info.value)
        assert (data / files.GROUPS_DIR / "CURRENT").exists() and (data / files.TIMER_DIR / "CURRENT").exists()
        assert not list(data.glob("*.damaged-*"))
        disk.unfill()
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        assert broker.open_report.groups_reset is None
        assert await _receive_all(broker, "t") == acked[4:], "the group's acks were lost"
        await broker.close()

    asyncio.run(body())


# -- (d) resume ---------------------------------------------------------------------------------


def test_sends_resume_without_a_restart_when_space_returns(disk: Disk) -> None:
    data = disk.root / "data"

    async def body() -> None:
        broker = await open_broker(_config(data), clock=FakeClock(1_000_000), background=False)
        await broker.send(OutgoingMessage("t", b"before", message_id="before"))
        disk.fill()
        with pytest.raises(DiskFull):
            await broker.send(OutgoingMessage("t", b"during", message_id="during"))
        with pytest.raises(DiskFull):  # a new topic needs its queue files and topic table
            await broker.create_topic("new")
        with pytest.raises(TopicNotFound):  # a receive creates no topic, full disk or not
            await broker.receive("g", "other")
        assert "new" not in broker.store.topics and "other" not in broker.store.topics
        assert not _tmp_files(data)
        disk.unfill()
        result = await broker.send(OutgoingMessage("t", b"during", message_id="during"))
        assert result.message_id == "during" and not result.duplicate
        assert await _receive_all(broker, "t") == ["before", "during"]
        await broker.create_topic("new")
        assert await broker.receive("g", "new") == []
        assert broker.fatal is None
        await broker.close()

    asyncio.run(body())


def test_the_reserve_file_is_made_again_when_space_returns(disk: Disk) -> None:
    data = disk.root / "data"

    async def body() -> None:
        broker = await open_broker(_config(data), clock=FakeClock(1_000_000), background=False)
        await broker.close()
        disk.fill()
        broker = await open_broker(_config(data), clock=FakeClock(1_000_000), background=False)
        assert not (data / files.RESERVE).exists()
        await broker._checkpoint(0)  # a tick with no room: nothing made
        assert not (data / files.RESERVE).exists()
        disk.unfill()
        await broker._checkpoint(0)
        assert (data / files.RESERVE).stat().st_blocks * 512 >= 1 * MiB
        await broker.close()

    asyncio.run(body())


# -- writes that run out of space anyway ----------------------------------------------------------


def test_a_commit_log_write_or_roll_that_runs_out_of_space_is_undone(disk: Disk) -> None:
    """With the send reserve off, the write itself runs out: a short write is cut back, a roll's
    half-made segment removed; DiskFull, not FlushFailed; the log goes on afterwards."""
    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, segment_size_bytes=128 * 1024, max_message_size_bytes=64 * 1024)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        for i in range(3):
            await broker.send(OutgoingMessage("t", b"a" * 30_000, message_id=f"a{i}"))
        log = broker.store.log
        disk.fill()
        segment = log.segments()[-1]
        size = segment.path.stat().st_size
        with pytest.raises(DiskFull) as info:  # fits the segment, not the disk: a short write
            await broker.send(OutgoingMessage("t", b"b" * 20_000, message_id="short"))
        _assert_disk_full(info.value)
        assert "commit-log write" in str(info.value)
        assert segment.path.stat().st_size == size, "the short write was not cut back"
        with pytest.raises(DiskFull) as info:  # does not fit the segment: a roll, out of space
            await broker.send(OutgoingMessage("t", b"c" * 60_000, message_id="roll"))
        assert "new commit-log segment" in str(info.value)
        assert len(log.segments()) == 1 and not _tmp_files(data)
        assert log.failure is None and broker.fatal is None
        disk.unfill()
        await broker.send(OutgoingMessage("t", b"c" * 60_000, message_id="roll"))
        assert len(log.segments()) == 2
        assert await _receive_all(broker, "t") == ["a0", "a1", "a2", "roll"]
        await broker.close()

    asyncio.run(body())


def test_a_batch_whose_roll_runs_out_of_space_after_its_first_records_leaves_nothing(disk: Disk) -> None:
    """A batch that spans two segments: its first records fit the active segment and are
    written, then the roll to the next segment finds no space. The sender is refused, so none of
    the batch may stay: it used to be stored and delivered all the same (and a retry stored it
    again). The disk has room for exactly the first records' pages."""
    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, segment_size_bytes=128 * 1024, max_message_size_bytes=64 * 1024)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        sent = [await broker.send(OutgoingMessage("t", b"a" * 10_000, message_id=f"a{i}")) for i in range(10)]
        record = sent[1].position - sent[0].position
        log = broker.store.log
        segment = log.segments()[-1]
        room = 128 * 1024 - 24 - segment.data_size
        first = room // record  # records of the batch that fit the active segment
        assert 1 <= first < 4
        size = segment.path.stat().st_size
        disk.fill()
        disk.give_back(-(-(size + first * record) // PAGE) * PAGE - -(-size // PAGE) * PAGE)
        batch = [OutgoingMessage("t", b"b" * 10_000, message_id=f"b{i}") for i in range(4)]
        with pytest.raises(DiskFull) as info:
            await broker.send_batch(batch)
        assert "new commit-log segment" in str(info.value)
        assert segment.path.stat().st_size == size, "the batch's first records were not taken back"
        assert len(log.segments()) == 1 and not _tmp_files(data)
        assert log.failure is None and broker.fatal is None
        await broker.store.log.flush_now()
        assert await _receive_all(broker, "t") == [m.message_id for m in sent]
        disk.unfill()
        retried = await broker.send_batch(batch)
        assert not any(r.duplicate for r in retried)
        assert await _receive_all(broker, "t") == [m.message_id for m in batch]
        await broker.close()

    asyncio.run(body())


def test_a_batch_whose_write_into_a_new_segment_runs_out_of_space_removes_it_durably_first(
        disk: Disk, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roll succeeds (the new segment's header fits) and the write into it finds no space:
    the batch is taken back, the new segment removed and the old one cut back. The removal is
    made durable (the directory fsynced) *before* the cut: a power loss between the two must not
    bring the removed segment back after a cut one, a broken chain the log refuses to open.
    The real calls are recorded in order (they still run)."""
    from chronoq.store import commitlog, fsync

    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, segment_size_bytes=128 * 1024, max_message_size_bytes=64 * 1024)
    calls: list[str] = []
    real_fsync_dir, real_ftruncate = fsync.fsync_dir, commitlog.os.ftruncate

    def fsync_dir(path: Path) -> None:
        calls.append("fsync_dir")
        real_fsync_dir(path)

    def ftruncate(fd: int, length: int) -> None:
        calls.append("ftruncate")
        real_ftruncate(fd, length)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        sent = [await broker.send(OutgoingMessage("t", b"a" * 10_000, message_id=f"a{i}")) for i in range(10)]
        record = sent[1].position - sent[0].position
        log = broker.store.log
        segment = log.segments()[-1]
        first = (128 * 1024 - 24 - segment.data_size) // record
        assert 1 <= first < 4
        size = segment.path.stat().st_size
        disk.fill()
        # Room for the first records' pages and a page for the new segment's header, not for the
        # records the batch writes after it.
        disk.give_back(-(-(size + first * record) // PAGE) * PAGE - -(-size // PAGE) * PAGE + PAGE)
        monkeypatch.setattr(fsync, "fsync_dir", fsync_dir)
        monkeypatch.setattr(commitlog.os, "ftruncate", ftruncate)
        batch = [OutgoingMessage("t", b"b" * 10_000, message_id=f"b{i}") for i in range(4)]
        with pytest.raises(DiskFull):
            await broker.send_batch(batch)
        monkeypatch.undo()
        assert segment.path.stat().st_size == size, "the batch's first records were not taken back"
        assert len(log.segments()) == 1 and len(list((data / files.COMMITLOG_DIR).glob("*.log"))) == 1
        # Before them: the roll's directory fsync and the failed write cutting back its own
        # partial bytes. The undo's two steps come last, the directory's fsync first.
        assert calls[-2:] == ["fsync_dir", "ftruncate"], \
            f"the new segment's removal was not made durable before the cut: {calls}"
        assert log.failure is None and broker.fatal is None
        disk.unfill()
        retried = await broker.send_batch(batch)
        assert not any(r.duplicate for r in retried)
        assert await _receive_all(broker, "t") == [m.message_id for m in sent + batch]
        await broker.close()

    asyncio.run(body())


def test_a_fire_step_whose_roll_runs_out_of_space_fires_once_when_space_returns(disk: Disk) -> None:
    """The same for the timer side: a fire step's write does not fit the active segment and the
    roll finds no space. Fired copies written before it used to stay in the log while their
    timers stayed pending, so the next step fired them again and consumers got them twice; a
    link record is one record, but the step must still leave nothing behind and fire each timer
    once. The disk has room for the rest of the active segment only."""
    data = disk.root / "data"
    segment_size = 64 * 1024
    config = _config(data, disk_min_free_bytes=0, segment_size_bytes=segment_size, max_message_size_bytes=4096)

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(config, clock=clock, background=False)
        ids = [f"m{i:02d}" for i in range(12)]
        for mid in ids:
            await broker.send(OutgoingMessage("t", b"x" * 600, message_id=mid, delay_ms=1_000))
        log = broker.store.log
        while (room := segment_size - 24 - log.segments()[-1].data_size) > 300:  # less than the link record
            await broker.send(OutgoingMessage("filler", b"f" * max(1, min(1_000, room - 400))))
        size = log.segments()[-1].path.stat().st_size
        disk.fill()
        disk.give_back(-(-segment_size // PAGE) * PAGE - -(-size // PAGE) * PAGE)
        clock.advance(1_000)
        with pytest.raises(DiskFull):
            await broker.run_due()
        assert log.segments()[-1].path.stat().st_size == size and len(log.segments()) == 1
        assert broker.fatal is None and log.failure is None
        assert await _receive_all(broker, "t") == []  # nothing fired, nothing delivered
        disk.unfill()
        assert await broker.run_due() == len(ids)
        assert sorted(await _receive_all(broker, "t")) == ids  # each once
        await broker.close()

    asyncio.run(body())


def test_a_timer_refused_because_its_topic_could_not_be_made_frees_its_slot(disk: Disk) -> None:
    """With `timer_congest_num_each_slot` on, a timer holds a place in its second while it is
    written. A send whose new topic could not be made (no space for its queue files) kept that
    place, so its second stayed full for good: the retry, once space was back, was refused as
    congested."""
    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, timer_congest_num_each_slot=1)

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(config, clock=clock, background=False)
        due = clock.now_ms() + 60_000
        disk.fill()
        with pytest.raises(DiskFull):
            await broker.send(OutgoingMessage("new-topic", b"t", message_id="t1", deliver_at_ms=due))
        disk.unfill()
        sent = await broker.send(OutgoingMessage("new-topic", b"t", message_id="t1", deliver_at_ms=due))
        assert sent.deliver_at_ms == due
        await broker.close()

    asyncio.run(body())


async def _block_dispatch(broker: Broker, disk: Disk) -> asyncio.Future:
    """Two messages fill the queue's file (two entries per file); the disk is filled; a third is
    sent: its record fits the log's last page (one is given back if not) and is made durable, but
    its consume-queue entry needs a new queue file and there is no page for it. Returns the send."""
    await broker.send(OutgoingMessage("t", b"one", message_id="one"))
    await broker.send(OutgoingMessage("t", b"two", message_id="two"))
    disk.fill()
    segment = broker.store.log.segments()[-1].path
    if (-segment.stat().st_size) % PAGE < 512:
        disk.give_back(PAGE)  # a page for the log's write; none left for the new queue file
    sender = asyncio.ensure_future(broker.send(OutgoingMessage("t", b"three", message_id="three")))
    await asyncio.sleep(0.3)
    assert not sender.done(), f"acknowledged before its queue entry was written: {sender!r}"
    assert broker.store.log.flushed_position == broker.store.log.end_position  # durable, not dispatched
    assert broker.queue_offsets("t", 0) == (0, 2)
    return sender


def test_a_dispatch_that_runs_out_of_space_holds_its_sender_until_it_is_done(disk: Disk) -> None:
    """The record is durable, but its consume-queue entry has no room: the sender is not
    acknowledged (not visible, not indexed), sends are refused meanwhile, /metrics says dispatch
    is held back by a full disk, nothing dies; with space back the flusher's retry finishes the
    dispatch and the sender returns."""
    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, consume_queue_entries_per_file=2)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        sender = await _block_dispatch(broker, disk)
        assert broker.fatal is None
        with pytest.raises(DiskFull) as info:
            await broker.send(OutgoingMessage("t", b"four", message_id="four"))
        assert "dispatching" in str(info.value)
        assert held_back_samples(broker) == {(("reason", "disk_full"), ("what", "dispatch")): 1}  # /metrics
        assert [m.message.message_id for m in await broker.receive("g", "t", batch_size=8)] == ["one", "two"]
        disk.unfill()
        result = await asyncio.wait_for(sender, 5)
        assert result.message_id == "three"
        assert held_back_samples(broker) == {}
        assert [m.message.message_id for m in await broker.receive("g2", "t", batch_size=8)] == ["one", "two", "three"]
        await broker.send(OutgoingMessage("t", b"four", message_id="four"))
        assert not _tmp_files(data)
        await broker.close()

    asyncio.run(body())


@pytest.mark.slow
def test_a_record_whose_dispatch_was_held_back_at_close_is_delivered_after_a_restart(disk: Disk) -> None:
    """Closed while dispatch waits for space: the sender is told the broker closed (not
    acknowledged), but the record is durable in the log, so a restart, on the still full disk,
    dispatches and delivers it (at least once: a client that retries may store a second copy).
    Recovery writes that queue entry into the space the released reserve file gave back."""
    data = disk.root / "data"
    config = _config(data, disk_min_free_bytes=0, consume_queue_entries_per_file=2)

    async def body() -> None:
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        sender = await _block_dispatch(broker, disk)
        await broker.close()
        with pytest.raises(ChronoqError):
            await sender
        disk.fill()
        broker = await open_broker(config, clock=FakeClock(1_000_000), background=False)
        assert await _receive_all(broker, "t") == ["one", "two", "three"]
        await broker.close()

    asyncio.run(body())


def test_retention_uses_the_reserve_and_waits_out_a_full_disk(disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    """Retention frees space, but first rolls pending timers and writes a checkpoint: below the
    send reserve it runs (the reserve is for such writes); at 0 bytes free it waits, with no
    harm done, and finishes once space returns. The rolled timer still fires when due."""
    data = disk.root / "data"
    config = _config(data, segment_size_bytes=64 * 1024, max_message_size_bytes=32 * 1024, retention_ms=10_000,
                     retention_check_interval_ms=20, checkpoint_interval_ms=20, disk_full_retry_ms=20)

    async def expire_segments(broker: Broker, clock: FakeClock, tag: str) -> int:
        for i in range(8):
            await broker.send(OutgoingMessage("bulk", b"b" * 20_000, message_id=f"{tag}{i}"))
        clock.advance(60_000)
        return broker.store.log.start_position

    clock = FakeClock(1_000_000)

    async def wait_for(predicate: object, timeout_s: float = 5) -> None:
        for _ in range(int(timeout_s / 0.02)):
            if predicate():  # type: ignore[operator]
                return
            await _ticks(clock, 1)
        raise AssertionError("timed out")

    async def body() -> None:
        broker = await open_broker(config, clock=clock)
        due = clock.now_ms() + 3_600_000
        await broker.send(OutgoingMessage("t", b"timer", message_id="timer", deliver_at_ms=due))
        start = await expire_segments(broker, clock, "a")
        disk.fill(leave_bytes=2 * MiB)  # below the send reserve
        with pytest.raises(DiskFull):
            await broker.send(OutgoingMessage("t", b"refused"))
        await wait_for(lambda: broker.store.log.start_position > start)  # rolled, checkpointed, deleted
        assert broker.query("timer", "t")[0].position >= broker.store.log.start_position
        disk.unfill()
        start = await expire_segments(broker, clock, "b")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            disk.fill()
            await _ticks(clock, 15)
            assert broker.store.log.start_position == start, "deleted segments without a checkpoint"
            assert broker.fatal is None
            held = [r.getMessage() for r in caplog.records if "held back by a full disk" in r.getMessage()]
            assert held and len(held) == len(set(held)), f"one warning per episode: {held}"
            disk.unfill()
            await wait_for(lambda: broker.store.log.start_position > start)
        clock.set(due)
        await wait_for(lambda: broker.query("timer", "t")[0].state.name != "PENDING")
        got = await broker.receive("g", "t")
        assert [m.message.message_id for m in got] == ["timer"]
        await broker.close()

    asyncio.run(body())


@pytest.mark.parametrize("engine", ["rocksdb", "wheel"])
def test_a_timer_index_out_of_space_holds_timer_senders_and_is_reopened(mount, tmp_path: Path, engine: str) -> None:
    """The timer index alone is out of space (its own small tmpfs): its RocksDB write fails and
    RocksDB refuses every write after that until reopened (the file wheel's write is cut back).
    Timer senders wait (not indexed, not acknowledged), other sends are refused, reads go on;
    with space back the index is reopened, the senders return, and the timers fire."""
    main = mount(tmp_path / "fs", 24 * MiB)
    data = main.root / "data"
    index_disk = mount(data / (files.TIMER_DIR if engine == "rocksdb" else files.TIMER_WHEEL_DIR),
                       4 * MiB if engine == "rocksdb" else 24 * MiB)

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(_config(data, timer_engine=engine), clock=clock, background=False)
        await broker.send(OutgoingMessage("t", b"plain", message_id="plain"))
        due = clock.now_ms() + 60_000
        index_disk.fill()
        waiting: list[asyncio.Future] = []
        accepted: list[str] = []
        for i in range(200):  # until a batch needs a page the index's WAL does not have
            send = asyncio.ensure_future(broker.send(OutgoingMessage(
                "t", b"timer" * 50, message_id=f"timer{i}", deliver_at_ms=due, keys=(f"k{i}" * 40,))))
            await asyncio.wait([send], timeout=0.2)
            if not send.done():
                waiting.append(send)
                break
            accepted.append(send.result().message_id)
        assert waiting, "the index never ran out of space"
        assert broker.fatal is None
        with pytest.raises(DiskFull):
            await broker.send(OutgoingMessage("t", b"refused"))
        plain = await broker.receive("g", "t")  # reads and acks go on
        assert [m.message.message_id for m in plain] == ["plain"]
        await broker.ack("g", "t", plain[0].receipt_handle)
        index_disk.unfill()
        blocked = await asyncio.wait_for(waiting[0], 5)
        assert broker.query(blocked.message_id, "t")[0].deliver_at_ms == due
        await broker.send(OutgoingMessage("t", b"after", message_id="after"))
        clock.set(due)
        assert await broker.run_due() == len(accepted) + 1
        got = await _receive_all(broker, "t")
        assert sorted(got) == sorted(["after", *accepted, blocked.message_id])
        await broker.close()

    # The cyclic collector off: the reopen must not wait for it. A reference cycle that kept the
    # failed RocksDB handle (and its lock) alive would pass whenever a collection happened to run
    # first, and fail only when it did not.
    run_without_cycle_collector(body())


def test_a_consumer_group_store_out_of_space_refuses_acks_then_is_reopened(mount, tmp_path: Path) -> None:
    main = mount(tmp_path / "fs", 24 * MiB)
    data = main.root / "data"
    groups_disk = mount(data / files.GROUPS_DIR, 4 * MiB)
    config = _config(data, max_receive_batch=64)

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(config, clock=clock, background=False)
        await broker.send_batch([OutgoingMessage("t", b"m", message_id=f"m{i:03d}") for i in range(256)])
        held = []
        for _ in range(4):
            held += await broker.receive("g", "t", batch_size=64, invisible_duration_ms=3_600_000)
        assert len(held) == 256
        groups_disk.fill()
        acked, refused = [], None
        for rm in held:
            try:
                await broker.ack("g", "t", rm.receipt_handle)
                acked.append(rm)
            except DiskFull as e:
                refused = e
                break
        assert refused is not None, "the group store never ran out of space"
        _assert_disk_full(refused)
        with pytest.raises(DiskFull):  # RocksDB refuses every write now: the store must reopen it
            await broker.ack("g", "t", held[len(acked)].receipt_handle)
        assert broker.fatal is None
        groups_disk.unfill()
        for rm in held[len(acked):]:
            await broker.ack("g", "t", rm.receipt_handle)
        await broker.close()
        broker = await open_broker(config, clock=clock, background=False)
        clock.advance(2 * 3_600_000)
        assert await broker.receive("g", "t") == [], "acknowledged messages came back"
        await broker.close()

    asyncio.run(body())


# -- (e) a real server and the SDK ------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_server_answers_disk_full_and_recovers(mount, tmp_path: Path) -> None:
    """`chronoq serve` on a tmpfs (the data directory is the mount, so the server's own log
    stays on the real disk), the SDK as client."""
    from chronoq.client import Producer, outgoing
    from chronoq.client.testing import ServerProcess

    disk = mount(tmp_path / "data", 24 * MiB)
    settings = {"disk_min_free_bytes": 4 * MiB, "disk_reserve_file_bytes": 1 * MiB, "disk_full_retry_ms": 100,
                "checkpoint_interval_ms": 50}
    server = ServerProcess(disk.root, settings=settings).start()
    try:
        with Producer(server.address, send_attempts=1) as producer:
            producer.send("orders", b"before", message_id="before")
            disk.fill()
            with pytest.raises(ChronoqError) as info:  # RocketMQ's SendMessage: only the code crosses
                producer.send("orders", b"refused", message_id="refused1")
            assert type(info.value) is Throttled and info.value.code == 42900 and info.value.retriable
            assert "disk full" in str(info.value)
            with pytest.raises(DiskFull) as full:  # the admin SendBatch names the class
                producer.send_batch([outgoing("orders", b"refused", message_id="refused2")])
            assert full.value.retriable and full.value.code == 42900
            time.sleep(0.5)  # checkpoints find no space meanwhile; the server must stay up
            assert server.pid is not None and server._proc is not None and server._proc.poll() is None, \
                f"the server exited on a full disk:\n{server.log()}"
            disk.unfill()
            assert producer.send("orders", b"after", message_id="after").message_id == "after"
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_a_full_trace_disk_stops_the_trace_never_a_send(mount, tmp_path: Path) -> None:
    """The trace's own disk is full (a tmpfs on `DATA_DIR/trace`): the journal hits ENOSPC while
    writing events and making its next segment; it stops for the run with one warning, and every
    send, fire and receive goes on. What it wrote stays readable, and the next run traces again."""
    data = tmp_path / "data"
    trace_disk = mount(data / files.TRACE_DIR, 64 * 1024)
    config = _config(data, trace_enable=True, trace_segment_size_bytes=4096, trace_retention_bytes=1 * MiB)

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(config, clock=clock, background=False)
        assert broker.trace is not None and broker.trace.stopped is None
        trace_disk.fill()
        for n in range(10):  # ~3 x 36 bytes per timer: past the 4 KiB buffer-free space at once
            results = await broker.send_batch([OutgoingMessage("t", b"x", message_id=f"M{n}-{i}",
                                                               deliver_at_ms=clock.now_ms() + 1000)
                                               for i in range(50)])
            assert len(results) == 50
            clock.advance(1000)
            assert await broker.run_due() == 50
            assert len(await _receive_all(broker, "t")) == 50
            broker.trace.flush()  # as the checkpoint tick does
        assert broker.trace.stopped is not None and "No space left on device" in broker.trace.stopped
        assert broker.fatal is None
        await broker.close()
        trace_disk.unfill()
        from chronoq.trace import read_trace
        assert read_trace(data).rows is not None  # readable, whatever it kept
        broker = await open_broker(config, clock=clock, background=False)
        assert broker.trace is not None and broker.trace.stopped is None
        await broker.send(OutgoingMessage("t", b"x", message_id="again", deliver_at_ms=clock.now_ms() + 1000))
        await broker.close()
        assert "again" in {r["message_id"] for r in read_trace(data).rows}

    run_without_cycle_collector(body())


def test_a_stopped_trace_is_shown_in_stats_and_on_metrics_not_only_logged(mount, tmp_path: Path) -> None:
    """The trace's disk (a real tmpfs on `DATA_DIR/trace`) fills and the journal stops: the broker's
    stats (`chronoq stats`' "trace" line) and a real /metrics scrape say so, and why. Before,
    only a log warning did; stats and /metrics looked the same as a trace still recording."""
    from prometheus_client.parser import text_string_to_metric_families

    from chronoq.cli.stats import render
    from chronoq.http.server import HttpServer
    from chronoq.server.admin_service import AdminService

    data = tmp_path / "data"
    trace_disk = mount(data / files.TRACE_DIR, 64 * 1024)
    config = _config(data, trace_enable=True, trace_segment_size_bytes=4096, trace_retention_bytes=1 * MiB,
                     http_port=0)

    async def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        import aiohttp
        async with aiohttp.ClientSession() as session, session.get(base + "/metrics") as reply:
            assert reply.status == 200
            text = await reply.text()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    async def body() -> None:
        clock = FakeClock(1_000_000)
        broker = await open_broker(config, clock=clock, background=False)
        server = HttpServer(broker, config, AdminService(broker, config))
        try:
            base = f"http://127.0.0.1:{await server.start()}"
            assert broker.stats()["trace"] == {"enabled": True, "active": True, "stopped_reason": None,
                                               "stopped": None}
            m = await scrape(base)
            assert m[("chronoq_trace_enabled", ())] == 1 and m[("chronoq_trace_active", ())] == 1
            assert not [k for k in m if k[0] == "chronoq_trace_stopped"]
            assert any(line.startswith("trace") and "recording" in line for line in render(broker.stats()))
            trace_disk.fill()
            for n in range(10):  # ~27 bytes an event: past the segment's last free page at once
                await broker.send_batch([OutgoingMessage("t", b"x", message_id=f"M{n}-{i}",
                                                         deliver_at_ms=clock.now_ms() + 1000) for i in range(50)])
                broker.trace.flush()  # as the checkpoint tick does
            trace = broker.stats()["trace"]
            assert trace["enabled"] and not trace["active"] and trace["stopped_reason"] == "disk_full"
            assert "No space left on device" in trace["stopped"]
            m = await scrape(base)
            assert m[("chronoq_trace_enabled", ())] == 1 and m[("chronoq_trace_active", ())] == 0
            assert m[("chronoq_trace_stopped", (("reason", "disk_full"),))] == 1
            [line] = [line for line in render(broker.stats()) if line.startswith("trace")]
            assert "STOPPED" in line and "disk_full" in line and len(line) <= 80
            assert broker.fatal is None and m[("chronoq_ready", ())] == 1
        finally:
            await server.stop()
            await broker.close()

    run_without_cycle_collector(body())


def test_a_checkpoint_past_the_log_end_that_recovery_cannot_replace_is_not_trusted_again(
        disk: Disk, tmp_path: Path) -> None:
    """Recovery found the log ending below the checkpoint (a disk that lost fsynced records: the
    segment cut short) and could not write the new checkpoint: the disk is full (no reserve
    file: a second start on a full disk has none left). The old one, past the log's end, must
    not be trusted once new records run past it: it names no record boundary of theirs. Before,
    it stayed; after new, acknowledged records and a crash, recovery walked the last segment from
    it, mid-record, took the record it landed in for a torn tail and cut it: acknowledged, lost,
    without a word."""
    data = disk.root / "data"
    config = _config(data, disk_reserve_file_bytes=0, disk_min_free_bytes=0)

    def msg(mid: str, size: int) -> PreparedMessage:
        return PreparedMessage("t", mid, MessageType.NORMAL, b"x" * size, 0, queue_id=0)

    async def body() -> None:
        store, _ = MessageStore.open(config)
        try:
            store.create_topic("t", 1, frozenset(MessageType), 0)
            stored = store.append([msg(f"m{i}", 100) for i in range(6)], 1)
            await store.log.flush_now()  # the group commit (no flusher task here)
        finally:
            store.close()
        end = stored[-1].position + stored[-1].size
        cut = stored[3].position
        assert read_checkpoint(data / files.CHECKPOINT) == end
        segment = next((data / files.COMMITLOG_DIR).glob("*.log"))
        os.truncate(segment, SEGMENT_HEADER_SIZE + cut)  # the disk lost the last three
        disk.fill()
        store, report = MessageStore.open(config)
        try:
            assert report.log.lost_below_checkpoint == end - cut
            assert store.log.end_position == cut
            disk.unfill()
            [late] = store.append([msg("late", 1000)], 2)
            await store.log.flush_now()
            await store.wait_durable(late.position + late.size)  # acknowledged
            assert late.position == cut < end < late.position + late.size
            # A crash: the directory as the page cache holds it (everything fsynced anyway).
            shutil.copytree(data, tmp_path / "after", ignore=shutil.ignore_patterns(files.LOCK))
        finally:
            store.close()
        store, _ = MessageStore.open(_config(tmp_path / "after"))
        try:
            got = [m.message_id for _, p, s, _ in store.queue("t", 0).read_range(0, 10)
                   if (m := store.readable(p, s)) is not None]
            assert got == ["m0", "m1", "m2", "late"], f"an acknowledged record was cut: {got}"
        finally:
            store.close()

    asyncio.run(body())
