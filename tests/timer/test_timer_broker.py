"""Timer messages through the whole in-process broker, in simulated time.

Each test drives a real broker (commit log, consume queues, RocksDB timer index) with a
FakeClock: long delays, same-millisecond ordering, cancel (before, racing and after the fire),
restarts at the awkward moments, a lost or corrupt index, query, limits, precision and the roll
that lets a 30-day timer outlive 72-hour segments.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, HOUR_MS, SECOND_MS
from chronoq.errors import (
    InvalidRecallHandle,
    TimerAlreadyCancelled,
    TimerAlreadyFired,
    TimerDisabled,
    TimerIdAmbiguous,
    TimerNotFound,
)
from chronoq.model import (
    SCHEDULE_TOPIC,
    SYS_FIRED_FROM,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_OUT_MS,
    TIMER_TOPIC,
    MessageType,
    OutgoingMessage,
    TimerState,
)
from chronoq.store.check import check_data_dir
from chronoq.store.messagestore import PreparedMessage
from chronoq.timer.engine import IndexBatch
from chronoq.timer.index import FORMAT_VERSION, RocksTimerIndex
from chronoq.timer.index_codec import CF_META, META_FORMAT_VERSION
from chronoq.timer.recall import decode_recall_handle
from tests.support.brokers import simulated_broker
from tests.support.timers import (
    START_MS,
    assert_not_early,
    drain,
    log_end,
    pending_total,
    restore_index,
    run,
    snapshot_index,
    timer_dir,
)

pytestmark = pytest.mark.usefixtures("each_timer_engine")

# -- long delays -------------------------------------------------------------------------------


@pytest.mark.parametrize("delay_ms", [2 * DAY_MS, 30 * DAY_MS])
def test_long_delay_is_delivered_exactly_at_due_never_a_millisecond_early(tmp_path: Path, delay_ms: int) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage("orders", b"later", delay_ms=delay_ms, keys=("k1",)))
            due = START_MS + delay_ms
            assert r.deliver_at_ms == due and r.recall_handle
            assert await drain(b, "orders") == []
            clock.set(due - 1)
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
            assert pending_total(b) == 1
            clock.set(due)
            assert await b.run_due() == 1
            got = await drain(b, "orders")
            assert [m.body for m in got] == [b"later"]
            m = got[0]
            assert m.message_id == r.message_id and m.topic == "orders" and m.store_ms == due
            assert m.system_properties[SYS_TIMER_OUT_MS] == str(due)
            assert SYS_REAL_TOPIC not in m.system_properties  # timer bookkeeping cleared
            assert m.keys == ("k1",)
            assert pending_total(b) == 0
            [status] = b.query(r.message_id)
            assert status.state is TimerState.DELIVERED and status.fired_ms == due
        finally:
            await b.close()

    run(body())


def test_absolute_deadline_two_days_out(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            due = START_MS + 2 * DAY_MS + 123
            await b.send(OutgoingMessage("orders", b"at", deliver_at_ms=due))
            clock.set(due - 1)
            assert await b.run_due() == 0
            clock.set(due + 5000)  # late wake-up: fires at once, stamped when it fired
            assert await b.run_due() == 1
            [m] = await drain(b, "orders")
            assert m.store_ms == due + 5000 and m.system_properties[SYS_TIMER_OUT_MS] == str(due)
        finally:
            await b.close()

    run(body())


@pytest.mark.slow
def test_ten_thousand_due_in_the_same_millisecond_fire_in_acceptance_order(tmp_path: Path) -> None:
    n = 10_000

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            await b.create_topic("same-ms", queue_count=1)
            due = START_MS + 60_000
            sent: list[str] = []
            for start in range(0, n, 1000):
                results = await b.send_batch([OutgoingMessage("same-ms", str(i).encode(), deliver_at_ms=due)
                                              for i in range(start, start + 1000)])
                sent += [r.message_id for r in results]
                clock.advance(1)  # acceptance spans several ms; the due time is one ms
            assert pending_total(b) == n
            clock.set(due - 1)
            assert await b.run_due() == 0
            clock.set(due)
            assert await b.run_due() == n
            got = await drain(b, "same-ms")
            assert [m.message_id for m in got] == sent
            assert [int(m.body) for m in got] == list(range(n))
            assert {m.store_ms for m in got} == {due}
            assert pending_total(b) == 0
        finally:
            await b.close()

    run(body())


# -- cancel ------------------------------------------------------------------------------------


def test_cancel_before_fire_by_handle_and_by_id(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r1 = await b.send(OutgoingMessage("orders", b"one", delay_ms=10_000))
            r2 = await b.send(OutgoingMessage("orders", b"two", delay_ms=10_000))
            r3 = await b.send(OutgoingMessage("orders", b"three", delay_ms=10_000))
            assert decode_recall_handle(r1.recall_handle) == ("orders", START_MS + 10_000, r1.message_id)
            clock.advance(5_000)
            assert await b.cancel(recall_handle=r1.recall_handle) == r1.message_id
            assert await b.cancel(topic="orders", message_id=r2.message_id) == r2.message_id
            [s1] = b.query(r1.message_id)
            assert s1.state is TimerState.CANCELLED and s1.cancelled_ms == START_MS + 5_000
            assert pending_total(b) == 1
            with pytest.raises(TimerAlreadyCancelled):
                await b.cancel(recall_handle=r1.recall_handle)
            clock.set(START_MS + 10_000)
            assert await b.run_due() == 1
            assert [m.message_id for m in await drain(b, "orders")] == [r3.message_id]
            clock.advance(DAY_MS)
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
        finally:
            await b.close()

    run(body())


def test_cancel_of_a_due_timer_while_its_firing_batch_is_in_flight_is_a_clear_error(tmp_path: Path) -> None:
    """The fire wins: the cancel arrives while the fired copy waits for fsync, and is refused."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            due_now = await b.send(OutgoingMessage("orders", b"firing", delay_ms=1000))
            later = await b.send(OutgoingMessage("orders", b"later", delay_ms=60_000))
            clock.set(START_MS + 1000)
            fire = asyncio.create_task(b.run_due())
            await asyncio.sleep(0)  # the fire batch is appended and waits for durability
            assert not fire.done()
            with pytest.raises(TimerAlreadyFired) as info:
                await b.cancel(recall_handle=due_now.recall_handle)
            assert info.value.code == 42800
            # A cancel of a timer not yet due succeeds even with the batch in flight.
            await b.cancel(recall_handle=later.recall_handle)
            assert await fire == 1
            assert await b.run_due() == 0
            assert [m.body for m in await drain(b, "orders")] == [b"firing"]
            clock.advance(DAY_MS)
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
            assert b.query(later.message_id)[0].state is TimerState.CANCELLED
            assert b.query(due_now.message_id)[0].state is TimerState.DELIVERED
        finally:
            await b.close()

    run(body())


def test_timer_falling_due_while_its_cancel_is_in_flight_is_not_fired(tmp_path: Path) -> None:
    """The cancel wins: it was accepted before the due time, and the fire loop holds the timer
    back until the tombstone is durable."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage("orders", b"x", delay_ms=1000))
            other = await b.send(OutgoingMessage("orders", b"y", delay_ms=1000))
            clock.set(START_MS + 999)
            cancel = asyncio.create_task(b.cancel(recall_handle=r.recall_handle))
            await asyncio.sleep(0)  # the tombstone is appended and waits for durability
            assert not cancel.done()
            clock.set(START_MS + 1000)
            fired = await b.run_due()
            assert await cancel == r.message_id
            fired += await b.run_due()
            assert fired == 1
            assert [m.message_id for m in await drain(b, "orders")] == [other.message_id]
            assert b.query(r.message_id)[0].state is TimerState.CANCELLED
        finally:
            await b.close()

    run(body())


def test_cancel_unknown_changes_nothing_and_cancel_after_fire_is_an_error(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage("orders", b"x", delay_ms=1000))
            end = log_end(b)
            with pytest.raises(TimerNotFound):
                await b.cancel(topic="orders", message_id="NO-SUCH-ID")
            with pytest.raises(TimerNotFound):
                await b.cancel(topic="other", message_id=r.message_id)
            with pytest.raises(InvalidRecallHandle):
                await b.cancel(recall_handle="not-a-handle")
            with pytest.raises(InvalidRecallHandle):
                await b.cancel(topic="orders")
            assert log_end(b) == end and pending_total(b) == 1
            clock.advance(1000)
            assert await b.run_due() == 1
            end = log_end(b)
            with pytest.raises(TimerAlreadyFired):
                await b.cancel(recall_handle=r.recall_handle)
            with pytest.raises(TimerAlreadyFired):
                await b.cancel(topic="orders", message_id=r.message_id)
            assert log_end(b) == end
            assert [m.message_id for m in await drain(b, "orders")] == [r.message_id]
        finally:
            await b.close()

    run(body())


@pytest.mark.rocksdb_index("puts an older copy of the index on disk back (a crash before its write)")
def test_cancel_survives_restart(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        r = await b.send(OutgoingMessage("orders", b"x", delay_ms=HOUR_MS))
        keep = await b.send(OutgoingMessage("orders", b"keep", delay_ms=HOUR_MS))
        await b.cancel(recall_handle=r.recall_handle)
        await b.close()
        # Also with the index lost: the tombstone in the log must be replayed.
        for wipe in (False, True):
            if wipe:
                import shutil
                shutil.rmtree(timer_dir(tmp_path))
            b = await simulated_broker(tmp_path, clock)
            try:
                assert b.query(r.message_id)[0].state is TimerState.CANCELLED
                assert b.query(keep.message_id)[0].state is TimerState.PENDING
                assert pending_total(b) == 1
            finally:
                await b.close()
        b = await simulated_broker(tmp_path, clock)
        try:
            clock.advance(HOUR_MS)
            assert await b.run_due() == 1
            assert [m.body for m in await drain(b, "orders")] == [b"keep"]
        finally:
            await b.close()

    run(body())


# -- an id reused after the dedupe window ------------------------------------------------------

WINDOW_MS = 60_000


async def _reused_id(b, clock: FakeClock) -> tuple:  # type: ignore[no-untyped-def]
    """Two timers of one id on one topic: the second sent after the dedupe window, due later."""
    t1 = await b.send(OutgoingMessage("orders", b"one", message_id="X", deliver_at_ms=START_MS + 2 * HOUR_MS))
    clock.advance(WINDOW_MS + 1)
    t2 = await b.send(OutgoingMessage("orders", b"two", message_id="X", deliver_at_ms=START_MS + 3 * HOUR_MS))
    assert not t2.duplicate and t2.position > t1.position
    return t1, t2


def _states(b) -> list[tuple[int, TimerState]]:  # type: ignore[no-untyped-def]
    return [(s.deliver_at_ms, s.state) for s in b.query("X")]


@pytest.mark.rocksdb_index("puts an older copy of the index on disk back (a crash before its write)")
@pytest.mark.parametrize("cancelled", ["first", "second"])
def test_each_timer_of_a_reused_id_is_cancelled_by_its_own_handle_and_only_it(tmp_path: Path, cancelled: str) -> None:
    """Two timers with one id. Were cancels keyed by (topic, id), the first timer's own handle would
    be refused ("due time mismatch"), the second's would cancel both, and query showed only the second,
    so the first, acknowledged and never cancelled, would silently never be delivered. A cancel names
    (topic, id, due time), as RocketMQ's delete record does; replay and rebuild apply the same rule."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            t1, t2 = await _reused_id(b, clock)
            assert _states(b) == [(t1.deliver_at_ms, TimerState.PENDING), (t2.deliver_at_ms, TimerState.PENDING)]
            gone, kept = (t1, t2) if cancelled == "first" else (t2, t1)
            assert await b.cancel(recall_handle=gone.recall_handle) == "X"
            assert pending_total(b) == 1
            assert sorted(_states(b)) == sorted([(gone.deliver_at_ms, TimerState.CANCELLED),
                                                  (kept.deliver_at_ms, TimerState.PENDING)])
            with pytest.raises(TimerAlreadyCancelled):
                await b.cancel(recall_handle=gone.recall_handle)
            # The cancel forgot the id in the dedupe window only if the send it remembers was the
            # cancelled one: a retry of the second send (inside its window) is still a duplicate.
            retry = await b.send(OutgoingMessage("orders", b"two", message_id="X", deliver_at_ms=t2.deliver_at_ms))
            assert retry.duplicate == (cancelled == "first") and pending_total(b) == 1 + (cancelled == "second")
            live = b.query("X")
        finally:
            await b.close()
        # Replayed into an index rebuilt from the log, the tombstone cancels the same timer.
        shutil.rmtree(timer_dir(tmp_path))
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            assert b.query("X") == live
            clock.set(START_MS + 4 * HOUR_MS)
            while await b.run_due():
                pass
            fired = await drain(b, "orders")
            assert_not_early(fired)
            assert [m.body for m in fired] == ([b"two"] if cancelled == "first" else [b"one", b"two"])
            assert fired[0].system_properties[SYS_TIMER_OUT_MS] == str(kept.deliver_at_ms)
        finally:
            await b.close()

    run(body())


def test_a_cancel_by_id_alone_of_several_pending_timers_is_refused_with_their_due_times(tmp_path: Path) -> None:
    """Without a due time a cancel cannot tell the timers of a reused id apart: it is refused, and
    the error lists each one's due time and recall handle. With one pending, it cancels that one."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            t1, t2 = await _reused_id(b, clock)
            end = log_end(b)
            with pytest.raises(TimerIdAmbiguous) as info:
                await b.cancel(topic="orders", message_id="X")
            assert info.value.details == {"topic": "orders", "message_id": "X",
                                          "deliver_at_ms": [t1.deliver_at_ms, t2.deliver_at_ms],
                                          "recall_handles": [t1.recall_handle, t2.recall_handle]}
            assert t1.recall_handle in info.value.message and info.value.code == 40000
            assert log_end(b) == end and pending_total(b) == 2
            # A handle naming a due time no timer of the id has is refused, with the due times.
            from chronoq.timer.recall import encode_recall_handle
            with pytest.raises(InvalidRecallHandle) as bad:
                await b.cancel(recall_handle=encode_recall_handle("orders", START_MS + HOUR_MS, "X"))
            assert "none of that id there is due then" in bad.value.message
            clock.set(t1.deliver_at_ms)
            assert await b.run_due() == 1
            # One pending left: a cancel by id is that timer's.
            assert await b.cancel(topic="orders", message_id="X") == "X"
            assert _states(b) == [(t1.deliver_at_ms, TimerState.DELIVERED), (t2.deliver_at_ms, TimerState.CANCELLED)]
            with pytest.raises(TimerAlreadyCancelled):
                await b.cancel(topic="orders", message_id="X")
        finally:
            await b.close()

    run(body())


@pytest.mark.rocksdb_index("writes an index of an older format on disk")
def test_an_index_of_format_version_2_is_rebuilt_under_the_due_time_rule(tmp_path: Path) -> None:
    """Version 2 applied a tombstone to every timer of its (topic, id). An index of version 2 that
    applied so a tombstone written under the due-time rule (marked TIMER_DEL_AT_DUE: the second
    timer's own handle) holds the first timer cancelled. Version 3 reads none of it: the broker
    rebuilds the index from the log, where the marked tombstone names the second's due time, so
    the first (acknowledged, never cancelled) is pending. (An unmarked tombstone, written by
    version 2, keeps its rule: the test after this one.)"""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            t1, t2 = await _reused_id(b, clock)
            await b.cancel(recall_handle=t2.recall_handle)
            live = b.query("X")
        finally:
            await b.close()
        # What version 2 made of the same log: the tombstone reached the first timer too.
        with RocksTimerIndex.open(timer_dir(tmp_path)) as index:
            end = index.indexed_position
            index.apply(IndexBatch(cancels=[("orders", "X", START_MS, end - 1, None)], indexed_position=end))
            assert index.lookup_id("X")[0].state is TimerState.CANCELLED
            index._cf[CF_META][META_FORMAT_VERSION] = struct.pack(">I", 2)
        report = check_data_dir(tmp_path)
        assert any(f"format version 2, this chronoq reads {FORMAT_VERSION}" in r for r in report.repairs), \
            report.repairs
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            assert b.query("X") == live
            assert _states(b) == [(t1.deliver_at_ms, TimerState.PENDING), (t2.deliver_at_ms, TimerState.CANCELLED)]
        finally:
            await b.close()
        assert check_data_dir(tmp_path).ok

    run(body())


@pytest.mark.rocksdb_index("replays into, or rebuilds, the index on disk")
@pytest.mark.parametrize("after", ["live", "replay", "rebuild"])
def test_a_tombstone_written_before_the_due_time_rule_keeps_cancelling_every_timer_of_its_id(
        tmp_path: Path, after: str) -> None:
    """Before version 3 a reused id's first timer could not be cancelled by its own handle ("due
    time mismatch"), so a person cancelled by id, was told the id was cancelled, and the tombstone
    (carrying the newest timer's due time) cancelled both timers. Read under the due-time rule,
    that tombstone cancelled only the second: the upgrade's rebuild made the first pending again
    and delivered the very message the person had cancelled. A tombstone keeps the rule it was
    written under: only tombstones marked TIMER_DEL_AT_DUE name one due time."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            t1, t2 = await _reused_id(b, clock)
        finally:
            await b.close()
        snapshot_index(tmp_path, tmp_path / "index-before")
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            # The tombstone version 2 wrote for a cancel by id: the newest timer's due time, no mark.
            await b.timer._append([PreparedMessage(
                topic=TIMER_TOPIC, message_id="X", message_type=MessageType.DELAY, body=b"", born_ms=clock.now_ms(),
                system_properties={SYS_REAL_TOPIC: "orders", SYS_TIMER_DEL_UNIQKEY: "X",
                                   SYS_TIMER_OUT_MS: str(t2.deliver_at_ms)},
                queue_id=0)])
            assert _states(b) == [(t1.deliver_at_ms, TimerState.CANCELLED), (t2.deliver_at_ms, TimerState.CANCELLED)]
            live = b.query("X")
        finally:
            await b.close()
        if after == "rebuild":
            shutil.rmtree(timer_dir(tmp_path))
        elif after == "replay":
            restore_index(tmp_path, tmp_path / "index-before")
        b = await simulated_broker(tmp_path, clock, dedupe_window_ms=WINDOW_MS)
        try:
            assert b.query("X") == live
            clock.advance(4 * HOUR_MS)
            await b.run_due()
            assert await drain(b, "orders") == []
        finally:
            await b.close()

    run(body())


# -- restarts and a lost index -----------------------------------------------------------------


@pytest.mark.rocksdb_index("puts an older copy of the index on disk back (a crash before its write)")
def test_restart_between_accept_and_index(tmp_path: Path) -> None:
    """Timers accepted into the log while the index (rolled back to a copy taken before) never
    heard of them: recovery replays them, nothing fires during recovery, all fire on time."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        b = await simulated_broker(data, clock)
        first = await b.send(OutgoingMessage("orders", b"before", delay_ms=5000))
        await b.close()
        snapshot_index(data, tmp_path / "index-before")
        b = await simulated_broker(data, clock)
        late = [await b.send(OutgoingMessage("orders", f"m{i}".encode(), delay_ms=1000 * (i + 1)))
                for i in range(10)]
        await b.close()
        restore_index(data, tmp_path / "index-before")
        clock.advance(2500)  # two of them are due by the time the broker comes back
        b = await simulated_broker(data, clock)
        try:
            assert b.timer.engine.indexed_position == log_end(b)
            assert pending_total(b) == 11
            assert await drain(b, "orders") == []  # nothing fired during recovery
            assert await b.run_due() == 2
            clock.set(START_MS + 10_000)
            assert await b.run_due() == 9
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted([first.message_id] + [r.message_id for r in late])
            assert_not_early(got)
            assert pending_total(b) == 0
        finally:
            await b.close()

    run(body())


@pytest.mark.rocksdb_index("puts an older copy of the index on disk back (a crash before its write)")
def test_restart_during_a_firing_batch_does_not_fire_twice(tmp_path: Path) -> None:
    """The fired copies reached the log but the index was never told (crash after the append):
    replay sees the copies and marks those timers fired; the restart fires nothing again."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        b = await simulated_broker(data, clock)
        sent = [await b.send(OutgoingMessage("orders", f"m{i}".encode(), delay_ms=1000)) for i in range(20)]
        unfired = await b.send(OutgoingMessage("orders", b"later", delay_ms=5000))
        await b.close()
        snapshot_index(data, tmp_path / "index-before-fire")
        b = await simulated_broker(data, clock)
        clock.set(START_MS + 1000)
        assert await b.run_due() == 20
        await b.close()
        restore_index(data, tmp_path / "index-before-fire")
        b = await simulated_broker(data, clock)
        try:
            assert pending_total(b) == 1
            assert await b.run_due() == 0
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in sent)
            assert b.query(sent[0].message_id)[0].state is TimerState.DELIVERED
            clock.set(START_MS + 5000)
            assert await b.run_due() == 1
            assert [m.message_id for m in await drain(b, "orders")] == [unfired.message_id]
        finally:
            await b.close()

    run(body())


def _corrupt_index(path: Path, how: str) -> None:
    if how == "deleted":
        import shutil
        shutil.rmtree(path)
    elif how == "garbage-current":
        (path / "CURRENT").write_bytes(b"\x00garbage\xff\n")
    elif how == "garbage-manifest":
        for f in path.glob("MANIFEST-*"):
            f.write_bytes(b"\xde\xad\xbe\xef" * 64)
    elif how == "stray-files":
        import shutil
        shutil.rmtree(path)
        path.mkdir()
        (path / "junk").write_bytes(b"not rocksdb")
    else:
        raise AssertionError(how)


@pytest.mark.rocksdb_index("deletes or damages the index on disk")
@pytest.mark.parametrize("how", ["deleted", "garbage-current", "garbage-manifest", "stray-files"])
def test_deleted_or_corrupt_index_is_rebuilt_from_the_log(tmp_path: Path, how: str) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        fired = await b.send(OutgoingMessage("orders", b"fired", delay_ms=1000))
        cancelled = await b.send(OutgoingMessage("orders", b"cancelled", delay_ms=HOUR_MS))
        pending = [await b.send(OutgoingMessage("orders", f"p{i}".encode(), delay_ms=2 * HOUR_MS + i,
                                                keys=(f"key{i}",))) for i in range(5)]
        await b.cancel(recall_handle=cancelled.recall_handle)
        clock.advance(1000)
        assert await b.run_due() == 1
        assert [m.body for m in await drain(b, "orders")] == [b"fired"]
        end = log_end(b)
        await b.close()
        _corrupt_index(timer_dir(tmp_path), how)
        b = await simulated_broker(tmp_path, clock)
        try:
            assert b.timer.engine.indexed_position == end
            assert pending_total(b) == 5
            assert b.query(fired.message_id)[0].state is TimerState.DELIVERED
            assert b.query(cancelled.message_id)[0].state is TimerState.CANCELLED
            assert [s.message_id for s in b.query_key("key3")] == [pending[3].message_id]
            assert await b.run_due() == 0
            clock.set(START_MS + 2 * HOUR_MS + 10)
            assert await b.run_due() == 5
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in pending)
            assert_not_early(got)
        finally:
            await b.close()

    run(body())


# -- query -------------------------------------------------------------------------------------


def test_query_by_id_and_key_pending_delivered_cancelled(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            a = await b.send(OutgoingMessage("orders", b"a", delay_ms=1000, keys=("order-1",)))
            c = await b.send(OutgoingMessage("orders", b"c", delay_ms=DAY_MS, keys=("order-1", "x")))
            p = await b.send(OutgoingMessage("orders", b"p", delay_ms=DAY_MS, keys=("order-2",)))
            [sa] = b.query(a.message_id)
            assert (sa.state, sa.deliver_at_ms, sa.accepted_ms, sa.topic) == (
                TimerState.PENDING, START_MS + 1000, START_MS, "orders")
            assert b.query(a.message_id, topic="orders") == [sa]
            assert b.query(a.message_id, topic="elsewhere") == []
            assert b.query("unknown-id") == []
            clock.advance(1000)
            await b.run_due()
            clock.advance(500)
            await b.cancel(recall_handle=c.recall_handle)
            [sa] = b.query(a.message_id)
            assert sa.state is TimerState.DELIVERED and sa.fired_ms == START_MS + 1000
            [sc] = b.query(c.message_id)
            assert sc.state is TimerState.CANCELLED and sc.cancelled_ms == START_MS + 1500
            by_key = b.query_key("order-1")
            assert [(s.message_id, s.state) for s in by_key] == [
                (a.message_id, TimerState.DELIVERED), (c.message_id, TimerState.CANCELLED)]
            [sp] = b.query_key("order-2")
            assert sp.message_id == p.message_id and sp.state is TimerState.PENDING
            assert sp.deliver_at_ms == START_MS + DAY_MS
        finally:
            await b.close()

    run(body())


# -- limits, precision, retention ----------------------------------------------------------------


def test_timer_wheel_disabled_refuses_timer_messages_but_not_normal_ones(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_wheel_enable=False)
        try:
            await b.send(OutgoingMessage("orders", b"normal"))
            end = log_end(b)
            for msg in (OutgoingMessage("orders", b"t", delay_ms=1000),
                        OutgoingMessage("orders", b"t", deliver_at_ms=START_MS + 1000),
                        OutgoingMessage("orders", b"t", delay_level=2),
                        OutgoingMessage("orders", b"t", properties={"TIMER_DELAY_SEC": "3"})):
                with pytest.raises(TimerDisabled):
                    await b.send(msg)
            assert log_end(b) == end
            assert [m.body for m in await drain(b, "orders")] == [b"normal"]
        finally:
            await b.close()

    run(body())


def test_precision_coarsens_the_due_time_upwards_never_early(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS + 7)  # not on a precision boundary
        b = await simulated_broker(tmp_path, clock, timer_precision_ms=1000)
        try:
            asked = {}
            for delay in (1, 999, 1000, 1001, 2500):
                r = await b.send(OutgoingMessage("orders", str(delay).encode(), delay_ms=delay))
                asked[r.message_id] = START_MS + 7 + delay
                assert r.deliver_at_ms % 1000 == 0 and r.deliver_at_ms >= asked[r.message_id]
                assert r.deliver_at_ms - asked[r.message_id] < 1000
            got = []
            while len(got) < 5:
                clock.advance(1)
                await b.run_due()
                got += await drain(b, "orders")
            assert clock.now_ms() <= START_MS + 7 + 2500 + 1000
            assert_not_early(got, asked)
            assert {m.store_ms % 1000 for m in got} == {0}
        finally:
            await b.close()

    run(body())


@pytest.mark.rocksdb_index("one case deletes the index on disk")
@pytest.mark.parametrize("restart_midway", ["none", "clean", "index-lost"])
def test_thirty_day_timer_outlives_72h_segments_by_rolling(tmp_path: Path, restart_midway: str) -> None:
    small = {"segment_size_bytes": 64 * 1024, "max_message_size_bytes": 32 * 1024}

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, **small)
        try:
            r = await b.send(OutgoingMessage("orders", b"thirty days", delay_ms=30 * DAY_MS, keys=("k30",)))
            cancelled = await b.send(OutgoingMessage("orders", b"cancelled", delay_ms=20 * DAY_MS))
            await b.cancel(recall_handle=cancelled.recall_handle)
            first_position = b.query(r.message_id)[0].position
            rolls = 0
            for day in range(1, 31):
                # Ordinary traffic fills segments; each day the old ones expire.
                for _ in range(4):
                    await b.send_batch([OutgoingMessage("noise", b"n" * 1000) for _ in range(20)])
                clock.set(START_MS + day * DAY_MS - 1)
                before = b.store.log.start_position
                await b.enforce_retention()
                rolls += b.store.log.start_position > before
                assert b.store.log.start_position > first_position or day < 4
                assert b.query(r.message_id)[0].state is TimerState.PENDING
                if day < 30:
                    assert await b.run_due() == 0
                if day == 20 and restart_midway != "none":
                    # The original record and early rolled copies are gone from the log by now:
                    # a rebuilt index must find the timer from the latest rolled copy alone.
                    await b.close()
                    if restart_midway == "index-lost":
                        import shutil
                        shutil.rmtree(timer_dir(tmp_path))
                    b = await simulated_broker(tmp_path, clock, **small)
                    assert b.query(r.message_id)[0].state is TimerState.PENDING
                    assert b.query(cancelled.message_id) == [] or \
                        b.query(cancelled.message_id)[0].state is TimerState.CANCELLED
                    assert pending_total(b) == 1
            assert rolls > 0 and b.store.log.start_position > first_position
            assert b.query(r.message_id)[0].position >= b.store.log.start_position
            clock.set(START_MS + 30 * DAY_MS)
            assert await b.run_due() == 1
            [m] = await drain(b, "orders")
            assert (m.message_id, m.body, m.store_ms, m.keys) == (r.message_id, b"thirty days",
                                                                  START_MS + 30 * DAY_MS, ("k30",))
            assert b.query(r.message_id)[0].state is TimerState.DELIVERED
        finally:
            await b.close()

    run(body())


# -- delay levels (RocketMQ 4 path) --------------------------------------------------------------


def test_delay_levels_use_the_schedule_topic_one_queue_per_level(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            table = b.timer.levels.levels_ms
            assert len(table) == 18 and table[0] == SECOND_MS and table[-1] == 2 * HOUR_MS
            sent = {}
            for level in (1, 3, 5, 18):
                r = await b.send(OutgoingMessage("orders", f"L{level}".encode(), delay_level=level))
                assert r.deliver_at_ms == START_MS + table[level - 1]
                sent[level] = r
            r = await b.send(OutgoingMessage("orders", b"prop", properties={"DELAY": "2"}))
            assert r.deliver_at_ms == START_MS + 5 * SECOND_MS
            for level in (1, 2, 3, 5, 18):
                assert b.queue_offsets(SCHEDULE_TOPIC, level - 1) == (0, 1)
            assert b.stats()["timer"]["pending_by_delay_level"] == {"1": 1, "2": 1, "3": 1, "5": 1, "18": 1}
            order = []
            for level_ms in sorted({table[0], table[1], table[2], table[4], table[17]}):
                clock.set(START_MS + level_ms - 1)
                assert await b.run_due() == 0
                clock.set(START_MS + level_ms)
                assert await b.run_due() == 1
                got = await drain(b, "orders")
                assert len(got) == 1 and got[0].store_ms == START_MS + level_ms
                order.append(got[0].body)
            assert order == [b"L1", b"prop", b"L3", b"L5", b"L18"]
            assert b.stats()["timer"]["pending_by_delay_level"] == {}
        finally:
            await b.close()

    run(body())


def test_delay_level_progress_is_persisted_across_restart(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        for i in range(3):
            await b.send(OutgoingMessage("orders", f"a{i}".encode(), delay_level=2))  # 5 s
        clock.advance(1000)
        for i in range(3):
            await b.send(OutgoingMessage("orders", f"b{i}".encode(), delay_level=2))  # due 1 s later
        clock.set(START_MS + 5000)
        assert await b.run_due() == 3
        assert [m.body for m in await drain(b, "orders")] == [b"a0", b"a1", b"a2"]
        await b.close()
        b = await simulated_broker(tmp_path, clock)
        try:
            assert b.stats()["timer"]["pending_by_delay_level"] == {"2": 3}
            assert await b.run_due() == 0  # the first three are not fired again
            clock.set(START_MS + 6000)
            assert await b.run_due() == 3
            assert [m.body for m in await drain(b, "orders")] == [b"b0", b"b1", b"b2"]
        finally:
            await b.close()

    run(body())


def test_delay_level_path_off_routes_levels_through_the_timer_index(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, schedule_topic_levels_enable=False)
        try:
            r = await b.send(OutgoingMessage("orders", b"x", delay_level=3))
            assert b.queue_offsets(SCHEDULE_TOPIC, 2) == (0, 0)
            assert b.queue_offsets(TIMER_TOPIC, 0)[1] == 1
            assert b.query(r.message_id)[0].deliver_at_ms == START_MS + 10_000
            clock.set(START_MS + 10_000)
            assert await b.run_due() == 1
            [m] = await drain(b, "orders")
            assert m.store_ms == START_MS + 10_000
        finally:
            await b.close()

    run(body())


def test_nack_redelivery_uses_level_three_plus_attempts(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            table = b.timer.levels.levels_ms
            await b.send(OutgoingMessage("orders", b"retry me"))
            [got] = await b.receive("g", "orders")
            for attempt in range(1, 6):
                assert got.delivery_attempt == attempt
                await b.nack("g", "orders", got.receipt_handle)
                wait_ms = table[min(3 + attempt - 1, len(table)) - 1]  # level 3, 4, 5, ...
                clock.advance(wait_ms - 1)
                assert await b.receive("g", "orders") == []
                clock.advance(1)
                [got] = await b.receive("g", "orders")
        finally:
            await b.close()

    run(body())


def test_fired_copy_records_where_it_came_from(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage("orders", b"x", delay_ms=10, properties={"user": "v"}, tag="t"))
            clock.advance(10)
            await b.run_due()
            [m] = await drain(b, "orders")
            assert int(m.system_properties[SYS_FIRED_FROM]) == b.query(r.message_id)[0].position
            assert dict(m.properties) == {"user": "v"} and m.tag == "t"
        finally:
            await b.close()

    run(body())


def test_crash_between_level_progress_and_index_write_does_not_fire_twice(tmp_path: Path) -> None:
    """A crash image taken at the moment the delay-level progress is about to be written to the
    timer index (the fired copy durable in the log). Reopened, the broker must not fire that level
    message again: the progress is derived from the log and replayed with the index."""

    async def body() -> None:
        import shutil

        clock = FakeClock(START_MS)
        data, image = tmp_path / "data", tmp_path / "crash-image"
        b = await simulated_broker(data, clock)
        r = await b.send(OutgoingMessage("orders", b"lvl", delay_level=1))
        real_apply = b.timer.engine.apply

        def apply_after_crash_image(batch):  # type: ignore[no-untyped-def]
            if batch.level_progress and not image.exists():
                shutil.copytree(data, image)  # what a SIGKILL right here would leave on disk
            return real_apply(batch)

        b.timer.engine.apply = apply_after_crash_image  # type: ignore[method-assign]
        clock.advance(1000)
        assert await b.run_due() == 1
        await b.close()
        assert image.exists()
        b = await simulated_broker(image, clock)
        try:
            assert await b.run_due() == 0
            clock.advance(DAY_MS)
            assert await b.run_due() == 0
            got = await drain(b, "orders")
            assert [m.message_id for m in got] == [r.message_id]  # the fired copy in the image, once
            assert sum(b.queue_offsets("orders", q)[1] for q in range(4)) == 1
        finally:
            await b.close()

    run(body())


def test_delayed_messages_of_a_message_group_fire_into_the_group_queue_in_order(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            await b.create_topic("fifo", queue_count=4)
            home = {}
            for g in ("ga", "gb", "gc"):
                r = await b.send(OutgoingMessage("fifo", f"{g}-now".encode(), message_group=g))
                home[g] = r.queue_id
            sent = {g: [] for g in home}
            for i in range(10):
                for g in home:
                    r = await b.send(OutgoingMessage("fifo", f"{g}-{i}".encode(), message_group=g, delay_ms=1000))
                    sent[g].append(r.message_id)
            clock.advance(1000)
            assert await b.run_due() == 30
            for g, qid in home.items():
                msgs = await b.read("fifo", qid, 0, 100)
                fired = [m.message_id for m in msgs if m.body.startswith(f"{g}-".encode()) and b"now" not in m.body]
                assert fired == sent[g]
        finally:
            await b.close()

    run(body())



@pytest.mark.rocksdb_index("puts a newer copy of the index on disk back")
def test_index_ahead_of_the_log_is_rebuilt(tmp_path: Path) -> None:
    """Power loss can keep index writes the log lost: an index covering more than the log holds
    is not trusted, it is rebuilt from the log (no firing of records that are not there)."""

    async def body() -> None:
        import shutil

        clock = FakeClock(START_MS)
        data, older = tmp_path / "data", tmp_path / "older"
        b = await simulated_broker(data, clock)
        kept = [await b.send(OutgoingMessage("orders", f"k{i}".encode(), delay_ms=1000)) for i in range(5)]
        await b.close()
        shutil.copytree(data, older)
        b = await simulated_broker(data, clock)
        for i in range(5):
            await b.send(OutgoingMessage("orders", f"lost{i}".encode(), delay_ms=1000))
        await b.close()
        restore_index(older, timer_dir(data).parent / "timer")  # the newer index onto the older log
        b = await simulated_broker(older, clock)
        try:
            assert b.timer.engine.indexed_position == log_end(b)
            assert pending_total(b) == 5
            clock.advance(1000)
            assert await b.run_due() == 5
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in kept)
        finally:
            await b.close()

    run(body())


@pytest.mark.rocksdb_index("writes an index of another format on disk")
def test_an_index_of_another_format_is_rebuilt_with_one_line_that_says_so(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """An upgrade's first start logged "... cannot be used: format version 2; this chronoq reads
    3; rebuild it from the commit log: rebuilding it from the commit log"."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        await b.send(OutgoingMessage("orders", b"x", delay_ms=1000))
        await b.close()
        with RocksTimerIndex.open(timer_dir(tmp_path)) as index:
            index._cf[CF_META][META_FORMAT_VERSION] = struct.pack(">I", 2)
        with caplog.at_level("WARNING", logger="chronoq.timer"):
            b = await simulated_broker(tmp_path, clock)
        try:
            assert pending_total(b) == 1
        finally:
            await b.close()

    run(body())
    [line] = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    assert line == (f"timer index at {timer_dir(tmp_path)} cannot be used: format version 2; "
                    f"this chronoq reads {FORMAT_VERSION}; rebuilding it from the commit log (derived state: "
                    "nothing acknowledged is lost)")


@pytest.mark.parametrize("firer", ["broker", "spark"])
def test_concurrent_fires_do_not_deliver_a_timer_twice(tmp_path: Path, firer: str) -> None:
    """Two fire calls overlapping in time (the timer loop and `run_due`, or a Spark `FireTimers`
    and its retry) must not both pick the timers whose fired copies are still being made durable."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        # With a job as the firer, the timers are due beyond the hand-off horizon and not handed
        # over: only FireTimers fires them here (the loop's `run_due` fires the delay levels).
        handoff = {"timer_handoff_horizon_ms": 1000} if firer == "spark" else {}
        b = await simulated_broker(tmp_path, clock, timer_firer=firer, **handoff)
        try:
            await b.run_due()
            timers = [await b.send(OutgoingMessage("orders", b"t", delay_ms=2000)) for _ in range(10)]
            levels = [await b.send(OutgoingMessage("orders", b"l", delay_level=1)) for _ in range(5)]
            clock.advance(2000)
            if firer == "broker":
                fired = await asyncio.gather(b.run_due(), b.run_due())
                assert sum(fired) == 15
            else:
                positions = [b.query(r.message_id)[0].position for r in timers]
                results = await asyncio.gather(b.fire_timers(positions), b.fire_timers(positions),
                                               b.run_due(), b.run_due())
                assert results[0][0] + results[1][0] == 10 and results[2] + results[3] == 5
                assert await b.fire_timers(positions) == (0, 10)  # a later retry fires nothing
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in timers + levels)
            assert sum(b.queue_offsets("orders", q)[1] for q in range(4)) == 15
        finally:
            await b.close()

    run(body())


def test_timer_engine_names_the_index_the_broker_runs_on(tmp_path: Path, each_timer_engine: str) -> None:
    """`timer_engine` picks the index (`timer/engines.py`): RocksDB files in `data/timer`, or an
    in-memory index that leaves nothing on disk and is rebuilt from the whole log at each start,
    so timers pending, fired and cancelled before a restart are so after it."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            assert type(b.timer.engine).__name__ == {"rocksdb": "RocksTimerIndex", "wheel": "WheelTimerEngine",
                                                      "memory": "MemoryTimerEngine"}[each_timer_engine]
            fired = await b.send(OutgoingMessage("orders", b"f", delay_ms=1000))
            cancelled = await b.send(OutgoingMessage("orders", b"c", delay_ms=5000))
            pending = await b.send(OutgoingMessage("orders", b"p", delay_ms=9000))
            await b.cancel(topic="orders", message_id=cancelled.message_id)
            clock.advance(1000)
            assert await b.run_due() == 1
        finally:
            await b.close()
        assert timer_dir(tmp_path).exists() == (each_timer_engine == "rocksdb")
        assert (timer_dir(tmp_path).parent / "timerwheel" / "timercheck").exists() == (each_timer_engine == "wheel")
        b = await simulated_broker(tmp_path, clock)
        try:
            states = {r.message_id: b.query(r.message_id)[0].state for r in (fired, cancelled, pending)}
            assert states == {fired.message_id: TimerState.DELIVERED, cancelled.message_id: TimerState.CANCELLED,
                              pending.message_id: TimerState.PENDING}
            clock.advance(8000)
            assert await b.run_due() == 1
            assert [m.body for m in await drain(b, "orders")] == [b"f", b"p"]
        finally:
            await b.close()

    run(body())
