"""RocketMQ 5's own timer-store tests (TimerMessageStoreTest), restated in chronoq's terms.

Each test names the RocketMQ scenario it follows: put to many topics with relative and absolute
deadlines (`testPutTimerMessage`), a deadline already past (`testTimerExpiredMessage`), delete
by tombstone (`testDeleteTimerMessage`), the same unique key on another topic
(`testDeleteTimerMessage_ukCollision`), per-slot flow control (`testTimerFlowControl`), a deadline
beyond the max (`testPutTimerMessageBeyondMax`-style admission) and recovery of pending timers
(`testStateAndRecover`). Simulated time throughout.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import DAY_MS
from chronoq.errors import DeliveryTimeTooFar, TimerSlotCongested
from chronoq.model import OutgoingMessage, TimerState
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, assert_not_early, drain, log_end, pending_total, run

pytestmark = pytest.mark.usefixtures("each_timer_engine")


def test_put_to_ten_topics_relative_and_absolute_all_delivered_pending_back_to_zero(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            rng = random.Random(5)
            topics = [f"TimerTest{i}" for i in range(10)]
            asked: dict[str, int] = {}
            by_topic: dict[str, set[str]] = {t: set() for t in topics}
            for i in range(500):
                topic = topics[i % 10]
                delay = rng.randrange(1, 60_000)
                if i % 2:
                    msg = OutgoingMessage(topic, f"{i}".encode(), delay_ms=delay)
                else:
                    msg = OutgoingMessage(topic, f"{i}".encode(), deliver_at_ms=clock.now_ms() + delay)
                r = await b.send(msg)
                asked[r.message_id] = clock.now_ms() + delay
                by_topic[topic].add(r.message_id)
                if i % 7 == 0:
                    clock.advance(3)
            stats = b.stats()["timer"]
            assert stats["pending_total"] == 500
            assert stats["pending_by_topic"] == {t: 50 for t in topics}
            got: dict[str, list] = {t: [] for t in topics}
            while clock.now_ms() < START_MS + 61_000:
                clock.advance(rng.randrange(1, 700))
                await b.run_due()
                for t in topics:
                    got[t] += await drain(b, t)
            for t in topics:
                assert {m.message_id for m in got[t]} == by_topic[t]
                assert_not_early(got[t], asked)
            stats = b.stats()["timer"]
            assert stats["pending_total"] == 0 and sum(stats["pending_by_topic"].values()) == 0
            assert stats["pending_by_due"] == {k: 0 for k in stats["pending_by_due"]}
        finally:
            await b.close()

    run(body())


def test_past_deadline_is_delivered_at_once(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage("expired", b"late", deliver_at_ms=START_MS - 5 * DAY_MS))
            zero = await b.send(OutgoingMessage("expired", b"zero", delay_ms=0))
            assert await b.run_due() == 2  # no clock movement needed
            got = await drain(b, "expired")
            assert [m.message_id for m in got] == [r.message_id, zero.message_id]
            assert {m.store_ms for m in got} == {START_MS}
            assert pending_total(b) == 0
        finally:
            await b.close()

    run(body())


def test_tombstone_for_one_of_five_leaves_four(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            sent = [await b.send(OutgoingMessage("del", f"{i}".encode(), delay_ms=3000)) for i in range(5)]
            await b.cancel(topic="del", message_id=sent[2].message_id)
            assert pending_total(b) == 4
            clock.advance(3000)
            assert await b.run_due() == 4
            got = await drain(b, "del")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for i, r in enumerate(sent) if i != 2)
            assert pending_total(b) == 0
        finally:
            await b.close()

    run(body())


def test_same_message_id_on_another_topic_is_not_cancelled(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            a = await b.send(OutgoingMessage("topicA", b"a", message_id="UK-1", delay_ms=2000))
            c = await b.send(OutgoingMessage("topicB", b"b", message_id="UK-1", delay_ms=2000))
            assert a.message_id == c.message_id == "UK-1"
            await b.cancel(recall_handle=a.recall_handle)
            states = {s.topic: s.state for s in b.query("UK-1")}
            assert states == {"topicA": TimerState.CANCELLED, "topicB": TimerState.PENDING}
            clock.advance(2000)
            assert await b.run_due() == 1
            assert await drain(b, "topicA") == []
            assert [m.body for m in await drain(b, "topicB")] == [b"b"]
        finally:
            await b.close()

    run(body())


def test_per_slot_flow_control(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_congest_num_each_slot=5)
        try:
            slot_start = START_MS + 10_000
            for i in range(5):
                await b.send(OutgoingMessage("flow", f"{i}".encode(), deliver_at_ms=slot_start + i * 100))
            end = log_end(b)
            with pytest.raises(TimerSlotCongested) as info:
                await b.send(OutgoingMessage("flow", b"x", deliver_at_ms=slot_start + 999))
            assert info.value.retriable and info.value.details["limit"] == 5
            # A batch is refused as a whole by default, with nothing stored.
            with pytest.raises(TimerSlotCongested):
                await b.send_batch([OutgoingMessage("flow", b"ok", deliver_at_ms=slot_start + 1000),
                                    OutgoingMessage("flow", b"no", deliver_at_ms=slot_start + 500)])
            assert log_end(b) == end
            # The next second is its own slot; partial batches refuse only the excess.
            out = await b.send_batch([OutgoingMessage("flow", f"n{i}".encode(), deliver_at_ms=slot_start + 1000)
                                      for i in range(7)], partial=True)
            assert [isinstance(o, TimerSlotCongested) for o in out] == [False] * 5 + [True] * 2
            # Normal messages and already-due timers are not flow-controlled.
            await b.send(OutgoingMessage("flow", b"normal"))
            await b.send(OutgoingMessage("flow", b"due", deliver_at_ms=START_MS))
            # Once the slot has fired it has room again... but it is in the past by then, so
            # check a cancelled timer frees its place instead.
            later = START_MS + 50_000
            rs = [await b.send(OutgoingMessage("flow", b"l", deliver_at_ms=later)) for _ in range(5)]
            with pytest.raises(TimerSlotCongested):
                await b.send(OutgoingMessage("flow", b"l", deliver_at_ms=later))
            await b.cancel(recall_handle=rs[0].recall_handle)
            await b.send(OutgoingMessage("flow", b"l", deliver_at_ms=later))
            clock.set(later)
            assert await b.run_due() == 5 + 5 + 1 + 5
        finally:
            await b.close()

    run(body())


def test_deadline_beyond_the_max_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_max_delay_ms=DAY_MS)
        try:
            end = log_end(b)
            with pytest.raises(DeliveryTimeTooFar) as info:
                await b.send(OutgoingMessage("max", b"x", delay_ms=DAY_MS + 1))
            assert info.value.details["max_delay_ms"] == DAY_MS
            with pytest.raises(DeliveryTimeTooFar):
                await b.send(OutgoingMessage("max", b"x", deliver_at_ms=START_MS + DAY_MS + 1))
            with pytest.raises(DeliveryTimeTooFar):
                await b.send(OutgoingMessage("max", b"x", properties={"TIMER_DELAY_SEC": str(86_401)}))
            assert log_end(b) == end and pending_total(b) == 0
            r = await b.send(OutgoingMessage("max", b"edge", delay_ms=DAY_MS))  # exactly the max is fine
            clock.set(r.deliver_at_ms)
            assert await b.run_due() == 1
        finally:
            await b.close()

    run(body())


def test_250_pending_messages_survive_a_restart(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        rng = random.Random(250)
        asked = {}
        for i in range(250):
            delay = rng.randrange(1000, 120_000)
            r = await b.send(OutgoingMessage(f"rec{i % 3}", f"{i}".encode(), delay_ms=delay))
            asked[r.message_id] = START_MS + delay
        await b.close()
        b = await simulated_broker(tmp_path, clock)
        try:
            assert pending_total(b) == 250
            assert await b.run_due() == 0
            clock.set(START_MS + 120_000)
            assert await b.run_due() == 250
            got = [m for t in ("rec0", "rec1", "rec2") for m in await drain(b, t)]
            assert sorted(m.message_id for m in got) == sorted(asked)
            assert_not_early(got, asked)
            assert pending_total(b) == 0
        finally:
            await b.close()

    run(body())
