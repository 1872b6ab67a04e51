"""Timers under races and restored state: fired once, cancelled for good, resent when asked.

Each test runs a real in-process broker (commit log, consume queues, RocksDB index) on a
FakeClock. Races are made by running two broker operations concurrently on one event loop (the
order in which they reach the log is then fixed by the code, not by luck); power loss and
restores are made by putting back copies of a store's directory taken earlier.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, HOUR_MS
from chronoq.model import OutgoingMessage, StoredMessage, TimerState
from chronoq.store import files
from chronoq.timer.engine import IndexBatch, TimerEntry
from chronoq.timer.index import RocksTimerIndex
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, drain, fired_messages, pending_total, restore_index, run, snapshot_index

pytestmark = pytest.mark.usefixtures("each_timer_engine")


def _fired_copies(broker: Broker, topic: str) -> list[StoredMessage]:
    """Every fired timer on `topic` (what consumers of any group would get)."""
    return fired_messages(broker.store, topic)


def _copy(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


# --- delay-level progress and the index, restored independently -----------------------


@pytest.mark.rocksdb_index("rolls the index on disk back to an older copy")
def test_a_delay_level_message_fires_once_whatever_store_a_power_loss_rolls_back(tmp_path: Path) -> None:
    """A power loss can lose the last writes of each RocksDB store (no fsync per write), each
    by a different amount. Put back a pre-fire copy of the consumer-group store, of the timer
    index, or of both: the delay-level message is fired once in every case."""

    async def body() -> None:
        for restore in (["groups"], ["timer"], ["groups", "timer"]):
            clock = FakeClock(START_MS)
            case = tmp_path / "-".join(restore)
            data = case / "data"
            broker = await simulated_broker(data, clock)
            sent = await broker.send(OutgoingMessage("orders", b"level", message_id="lvl", delay_level=1))
            await broker.close()
            for name in restore:  # the stores as they were before the fire
                _copy(data / name, case / f"before-{name}")
            broker = await simulated_broker(data, clock)
            clock.advance(1_000)
            assert await broker.run_due() == 1
            assert [m.message_id for m in await drain(broker, "orders")] == [sent.message_id]
            await broker.close()
            for name in restore:
                _copy(case / f"before-{name}", data / name)
            broker = await simulated_broker(data, clock)
            try:
                clock.advance(DAY_MS)
                await broker.run_due()
                assert len(_fired_copies(broker, "orders")) == 1, f"fired twice after restoring {restore}"
            finally:
                await broker.close()

    run(body())


# --- a roll racing a fire or a cancel, then an index rebuilt from the log ---------------


async def _rolling_setup(data: Path, clock: FakeClock, n: int, due_ms: int) -> tuple[Broker, list[str]]:
    """`n` timers in the first segments, then enough other traffic that those segments expire."""
    broker = await simulated_broker(data, clock, segment_size_bytes=64 * 1024, max_message_size_bytes=4096,
                         retention_ms=HOUR_MS, timer_roll_batch=100)
    ids = []
    for start in range(0, n, 200):
        batch = [OutgoingMessage("orders", b"t", message_id=f"t{i:05d}", deliver_at_ms=due_ms)
                 for i in range(start, min(n, start + 200))]
        ids += [r.message_id for r in await broker.send_batch(batch)]
    clock.advance(2 * HOUR_MS)  # the timers' segments are now past retention
    for i in range(400):
        await broker.send(OutgoingMessage("filler", b"f" * 600, message_id=f"f{i}"))
    return broker, ids


async def _rebuild_index_and_fire(data: Path, clock: FakeClock) -> Broker:
    """Reopen with the timer index destroyed: rebuilt from the (retained) log alone."""
    shutil.rmtree(data / files.TIMER_DIR)
    broker = await simulated_broker(data, clock, segment_size_bytes=64 * 1024, max_message_size_bytes=4096,
                         retention_ms=HOUR_MS, timer_roll_batch=100)
    clock.advance(DAY_MS)
    await broker.run_due()
    return broker


@pytest.mark.rocksdb_index("removes the index on disk to rebuild it")
@pytest.mark.slow
def test_a_roll_racing_a_fire_then_an_index_rebuild_fires_each_timer_once(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        broker, ids = await _rolling_setup(data, clock, 350, START_MS + HOUR_MS)  # due by now
        # Retention rolls the due timers forward while the timer loop fires them.
        await asyncio.gather(broker.enforce_retention(), broker.run_due())
        await broker.run_due()
        fired = sorted(m.message_id for m in _fired_copies(broker, "orders"))
        assert fired == ids
        # A fired timer's record stays as long as the link record that fired it: past the
        # retention period again, the timers' segments (and the roll copies') go.
        start = broker.store.log.start_position
        for round_ in range(2):  # the link records share their segment with the filler after them
            clock.advance(2 * HOUR_MS)
            for i in range(400):
                await broker.send(OutgoingMessage("filler", b"f" * 600, message_id=f"g{round_}-{i}"))
            await broker.enforce_retention()
        assert broker.store.log.start_position > start, "the timers' segments were not deleted"
        readable_before = sorted(m.message_id for m in _fired_copies(broker, "orders"))
        await broker.close()
        broker = await _rebuild_index_and_fire(data, clock)
        try:
            assert pending_total(broker) == 0
            fired = sorted(m.message_id for m in _fired_copies(broker, "orders"))
            assert fired == readable_before, \
                f"{len(fired) - len(readable_before)} timers fired again after the index was rebuilt"
        finally:
            await broker.close()

    run(body())


@pytest.mark.rocksdb_index("removes the index on disk to rebuild it")
def test_a_roll_racing_a_cancel_then_an_index_rebuild_does_not_bring_the_timer_back(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        # More than one roll chunk, whatever the chunk (here 100; an older build rolled 1,024).
        broker, ids = await _rolling_setup(data, clock, 2_000, START_MS + 10 * DAY_MS)  # not due yet
        victims = [ids[5], ids[1_050], ids[1_500]]
        await asyncio.gather(broker.enforce_retention(), *(broker.cancel(topic="orders", message_id=v)
                                                           for v in victims))
        for v in victims:
            assert broker.query(v, "orders")[0].state is TimerState.CANCELLED
        await broker.close()
        broker = await _rebuild_index_and_fire(data, clock)  # and ten days later
        try:
            clock.advance(10 * DAY_MS)
            await broker.run_due()
            fired = sorted(m.message_id for m in _fired_copies(broker, "orders"))
            assert sorted(set(ids) - set(victims)) == fired, \
                f"came back: {sorted(set(fired) & set(victims))}; twice: {len(fired) - len(set(fired))}"
        finally:
            await broker.close()

    run(body())


# --- cancel, then send the same id again ----------------------------------------------


def test_a_timer_resent_with_its_id_after_a_cancel_is_stored_and_fires(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock)
        try:
            first = await broker.send(OutgoingMessage("orders", b"v1", message_id="order-7", delay_ms=HOUR_MS))
            await broker.cancel(recall_handle=first.recall_handle)
            again = await broker.send(OutgoingMessage("orders", b"v2", message_id="order-7", delay_ms=2 * HOUR_MS))
            assert not again.duplicate and again.deliver_at_ms == START_MS + 2 * HOUR_MS
            assert again.position != first.position
            cancelled, status = broker.query("order-7", "orders")  # every timer of the id, in log order
            assert cancelled.state is TimerState.CANCELLED and cancelled.deliver_at_ms == first.deliver_at_ms
            assert status.state is TimerState.PENDING and status.deliver_at_ms == again.deliver_at_ms
            retry = await broker.send(OutgoingMessage("orders", b"v2", message_id="order-7", delay_ms=2 * HOUR_MS))
            assert retry.duplicate and retry.position == again.position  # a retry of the new send is still one
            clock.advance(2 * HOUR_MS)
            assert await broker.run_due() == 1
            [m] = await drain(broker, "orders")
            assert m.body == b"v2"
        finally:
            await broker.close()

    run(body())


def test_a_cancel_reaches_only_timers_recorded_before_its_tombstone(tmp_path: Path) -> None:
    """In one index batch (as after a replay), a tombstone and a resend of the same id: the
    resend is after the tombstone in the log, so it stays pending."""
    with RocksTimerIndex.open(tmp_path / "index") as index:
        old = TimerEntry(START_MS + 1_000, 100, 80, "same", "orders", START_MS)
        new = TimerEntry(START_MS + 2_000, 300, 80, "same", "orders", START_MS)
        index.apply(IndexBatch(adds=[old, new], cancels=[("orders", "same", START_MS + 5, 200, None)],
                               indexed_position=400))
        assert index.lookup("orders", "same").position == 300
        assert index.lookup("orders", "same").state is TimerState.PENDING
        assert [e.position for e in index.due(START_MS + 10_000, 10)] == [300]


# --- rolling holds one chunk of timers, not all of them --------------------------------


def test_a_roll_reads_and_writes_one_chunk_at_a_time(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        broker, ids = await _rolling_setup(data, clock, 1_000, START_MS + 30 * DAY_MS)
        sizes: list[int] = []
        real_append = broker.timer._append

        async def watch(msgs):  # type: ignore[no-untyped-def]
            sizes.append(len(msgs))
            return await real_append(msgs)

        broker.timer._append = watch  # type: ignore[method-assign]
        limits: list[int | None] = []
        real_pending_in = broker.timer.engine.pending_in

        def pending_in(start: int, end: int, limit: int | None = None) -> list[TimerEntry]:
            limits.append(limit)
            return real_pending_in(start, end, limit)

        broker.timer.engine.pending_in = pending_in  # type: ignore[method-assign]
        try:
            await broker.enforce_retention()
            # Several chunks (the timers sharing a segment with newer traffic stay where they are).
            assert sum(sizes) >= 500 and max(sizes) <= 100, sizes
            assert limits and all(limit is not None and limit <= 100 for limit in limits), limits
            clock.advance(30 * DAY_MS)
            await broker.run_due()
            assert sorted(m.message_id for m in _fired_copies(broker, "orders")) == ids
        finally:
            await broker.close()

    run(body())


def test_a_timer_indexed_at_its_roll_copy_while_its_fire_is_unwritten_is_not_fired_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job fires timers by position (the Spark engine's FireTimers). A roll copy written first
    and made durable first moves a timer to its new position while the fire from its old record
    still waits for its own fsync: for that moment the timer is pending at the new position and
    firing at the old one. A FireTimers naming the new position fired it a second time."""
    hold, held, release = _hold_segment_fdatasync(monkeypatch)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock)
        try:
            sent = await broker.send(OutgoingMessage("orders", b"t", message_id="t1", delay_ms=1_000))
            clock.advance(1_000)
            hold[0] = True
            roll = asyncio.ensure_future(broker.timer.roll_before(broker.store.log.end_position, clock.now_ms()))
            while not held.is_set():  # the roll copy's fsync has begun, and waits
                await asyncio.sleep(0.001)
            fire_old = asyncio.ensure_future(broker.fire_timers([sent.position]))
            await asyncio.sleep(0.01)  # the fired copy is written after the roll copy, not yet fsynced
            release.set()
            assert await roll == 1
            (moved,) = broker.timer.engine.pending_in(sent.position + 1, broker.store.log.end_position, 10)
            assert moved.message_id == "t1"  # pending at the roll copy; its fire is not durable yet
            again = await broker.fire_timers([moved.position])
            assert await fire_old == (1, 0)
            assert again == (0, 1)
            assert [m.message_id for m in _fired_copies(broker, "orders")] == ["t1"]
            assert [m.message_id for m in await drain(broker, "orders")] == ["t1"]
        finally:
            await broker.close()

    run(body())


async def _past_retention(broker: Broker, clock: FakeClock, days: int) -> None:
    """`days` days of other traffic, retention after each: the first segments go, timers in
    them are rolled forward."""
    for _ in range(days):
        for _ in range(4):
            await broker.send_batch([OutgoingMessage("noise", b"n" * 1000) for _ in range(20)])
        clock.advance(DAY_MS)
        await broker.enforce_retention()


_SMALL = {"segment_size_bytes": 64 * 1024, "max_message_size_bytes": 32 * 1024}


def test_a_roll_is_neither_an_enqueue_lag_sample_nor_a_slot_release(tmp_path: Path) -> None:
    """A roll copy is the same timer moved, not a send: it was counted as an enqueue-lag sample
    (accepted days ago: the lag's P99 read days after every roll), and it released a slot
    reservation it never took (with `timer_congest_num_each_slot`, a second took a timer more)."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock, timer_congest_num_each_slot=2, **_SMALL)
        try:
            due = START_MS + 30 * DAY_MS
            await broker.send(OutgoingMessage("orders", b"x", message_id="rolled", deliver_at_ms=due))
            lag = broker.timer.engine.latencies.enqueue_lag_ms
            assert lag.count == 1
            await _past_retention(broker, clock, 3)
            # A send for the same second is in flight (reserved, not yet indexed) when the roll lands.
            from chronoq.model import MessageType
            from chronoq.store.messagestore import PreparedMessage
            broker.timer.route(PreparedMessage("orders", "in-flight", MessageType.DELAY, b"y", clock.now_ms()),
                               due, None, clock.now_ms())
            start = broker.store.log.start_position
            await _past_retention(broker, clock, 4)
            assert broker.store.log.start_position > start
            assert broker.query("rolled", "orders")[0].position > start  # it was rolled
            assert lag.count == 1 and lag.to_dict()["max"] == 0  # no sample of days
            assert dict(broker.timer._reserved) == {due // 1000: 1}  # the in-flight send's, kept
        finally:
            await broker.close()

    run(body())


@pytest.mark.rocksdb_index("puts an older copy of the index on disk back")
def test_an_index_older_than_the_retained_log_is_rebuilt_not_replayed(tmp_path: Path) -> None:
    """An index restored from a copy older than the retained log: the fired copies and
    tombstones that settled some of its timers are deleted, and a replay from the log's start
    left those timers pending for good (stuck at the head, starving later timers of fire
    steps). It is rebuilt from the retained log instead."""
    async def body() -> None:
        data, snap = tmp_path / "data", tmp_path / "snap"
        clock = FakeClock(START_MS)
        broker = await simulated_broker(data, clock, **_SMALL)
        fired = await broker.send(OutgoingMessage("orders", b"one-hour", message_id="fired", delay_ms=HOUR_MS))
        cancelled = await broker.send(OutgoingMessage("orders", b"c", message_id="cancelled", delay_ms=2 * DAY_MS))
        await broker.close()
        snapshot_index(data, snap)
        broker = await simulated_broker(data, clock, **_SMALL)
        await broker.cancel(recall_handle=cancelled.recall_handle)
        clock.advance(HOUR_MS)
        assert await broker.run_due() == 1
        await _past_retention(broker, clock, 5)
        assert broker.store.log.start_position > cancelled.position
        await broker.close()
        restore_index(data, snap)
        broker = await simulated_broker(data, clock, **_SMALL)
        try:
            assert broker.timer.engine.indexed_position >= broker.store.log.start_position
            assert pending_total(broker) == 0
            for r in (fired, cancelled):
                assert all(s.state is not TimerState.PENDING for s in broker.query(r.message_id, "orders"))
        finally:
            await broker.close()

    run(body())


def test_a_broker_started_with_fewer_delay_levels_than_its_unfired_messages_need_refuses_to_start(
        tmp_path: Path) -> None:
    """Messages sent at level 18, then a restart with `delay_levels` of 3: nothing fired them,
    `stats` did not count them, and retention would have deleted them, silently. The start is
    refused, naming the levels; with the table back they fire."""
    from chronoq.config import ConfigError

    async def body() -> None:
        data = tmp_path / "data"
        clock = FakeClock(START_MS)
        broker = await simulated_broker(data, clock)
        await broker.send(OutgoingMessage("orders", b"late", message_id="l18", delay_level=18))
        await broker.close()
        with pytest.raises(ConfigError, match="level 18: 1"):
            await simulated_broker(data, clock, delay_levels="1s 5s 10s")
        broker = await simulated_broker(data, clock)  # the default table again
        try:
            clock.advance(2 * HOUR_MS)
            assert await broker.run_due() == 1
            assert [m.message_id for m in await drain(broker, "orders")] == ["l18"]
        finally:
            await broker.close()

    run(body())


def test_a_fire_timers_call_cancelled_while_its_fire_is_made_durable_is_not_fired_again_by_its_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark engine's FireTimers call goes away (its deadline cancels the handler) while the
    fired copy waits for its group commit, and the engine retries. The copy becomes durable all
    the same, but the cancellation had already let the timer go from the firing set, and the
    index still called it pending until the copy's dispatch: the retry fired it a second time."""
    hold, held, release = _hold_segment_fdatasync(monkeypatch)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock)
        try:
            sent = await broker.send(OutgoingMessage("orders", b"t", message_id="t1", delay_ms=1_000))
            clock.advance(1_000)
            hold[0] = True
            first = asyncio.ensure_future(broker.fire_timers([sent.position]))
            while not held.is_set():  # the fired copy is written; its group commit waits
                await asyncio.sleep(0.001)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            retry = asyncio.ensure_future(broker.fire_timers([sent.position]))
            await asyncio.sleep(0.01)
            release.set()
            assert await retry == (0, 1)
            for _ in range(500):  # the first call's copy is made durable and dispatched
                if broker.store.dispatched_position == broker.store.log.end_position:
                    break
                await asyncio.sleep(0.01)
            assert broker.query("t1", "orders")[0].state is TimerState.DELIVERED
            assert [m.message_id for m in _fired_copies(broker, "orders")] == ["t1"]
            assert [m.message_id for m in await drain(broker, "orders")] == ["t1"]
        finally:
            await broker.close()

    run(body())


def _hold_segment_fdatasync(monkeypatch: pytest.MonkeyPatch) -> tuple[list[bool], threading.Event, threading.Event]:
    """(arm, held, release): once `arm[0]` is set, the next group commit of a segment waits for
    `release` (the fsync thread blocks; the event loop goes on)."""
    held, release = threading.Event(), threading.Event()
    arm = [False]
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if arm[0] and os.readlink(f"/proc/self/fd/{fd}").endswith(files.SEGMENT_SUFFIX):
            arm[0] = False
            held.set()
            assert release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return arm, held, release


def test_a_cancel_whose_caller_goes_away_while_its_tombstone_is_made_durable_still_cancels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel's caller goes away (a client's deadline) while the tombstone waits for its group
    commit; the tombstone becomes durable all the same, and the timer is cancelled. Two things
    used to go with the caller: the hold on the timer (it fell due meanwhile, the loop fired it,
    and its copy was delivered after the tombstone), and forgetting the id in the dedupe window
    (a resend of the id, the cancel-and-resend pattern, was answered as a duplicate of the
    cancelled timer and stored nowhere: acknowledged, never delivered)."""
    arm, held, release = _hold_segment_fdatasync(monkeypatch)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock)
        try:
            first = await broker.send(OutgoingMessage("orders", b"v1", message_id="order-7", delay_ms=1_000))
            clock.advance(999)
            arm[0] = True
            cancel = asyncio.ensure_future(broker.cancel(recall_handle=first.recall_handle))
            while not held.is_set():  # the tombstone is written; its group commit waits
                await asyncio.sleep(0.001)
            cancel.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancel
            clock.advance(1)  # due now
            fire = asyncio.ensure_future(broker.run_due())
            await asyncio.sleep(0.01)
            release.set()
            fired = await fire
            for _ in range(500):  # the tombstone is durable and dispatched
                if broker.store.dispatched_position == broker.store.log.end_position:
                    break
                await asyncio.sleep(0.01)
            assert fired == 0, "fired while its cancel was being made durable"
            assert broker.query("order-7", "orders")[0].state is TimerState.CANCELLED
            again = await broker.send(OutgoingMessage("orders", b"v2", message_id="order-7", delay_ms=HOUR_MS))
            assert not again.duplicate, "a resend after the cancel was answered with the cancelled timer"
            clock.advance(HOUR_MS)
            await broker.run_due()
            assert [m.body for m in await drain(broker, "orders")] == [b"v2"]
        finally:
            await broker.close()

    run(body())
