"""Timer admission at the broker: each bad request gets its specific error and stores nothing.

"Stores nothing" is checked where it matters: the commit log's end position, the topic table
and the pending count are unchanged after the refusal. Also here: how each way of asking for a
timer (fields and RocketMQ properties) resolves, and the delay-level rule: the RocketMQ 4
`DELAY` property clamps a level above the maximum, as RocketMQ does; chronoq's own explicit
`delay_level` field refuses a level outside 1..max (0 or 19) with a specific error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, HOUR_MS
from chronoq.errors import (
    ChronoqError,
    ConflictingDelivery,
    DeliveryTimeTooFar,
    InvalidDelayLevel,
    InvalidDeliveryTime,
    InvalidProperty,
    NegativeDelay,
    ReservedProperty,
    TimerDisabled,
    TimerSlotCongested,
)
from chronoq.model import RESERVED_PROPERTIES, SYS_TIMER_OUT_MS, OutgoingMessage
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, drain, log_end, pending_total, run

# A bad timer that hangs the broker must fail the test, not stall it.
pytestmark = [pytest.mark.usefixtures("each_timer_engine"), pytest.mark.timeout(120)]
M = "adm"
BAD: list[tuple[str, OutgoingMessage, type[ChronoqError]]] = [
    ("delay too far", OutgoingMessage(M, b"x", delay_ms=30 * DAY_MS + 1), DeliveryTimeTooFar),
    ("deliver-at too far", OutgoingMessage(M, b"x", deliver_at_ms=START_MS + 31 * DAY_MS), DeliveryTimeTooFar),
    ("TIMER_DELAY_MS too far", OutgoingMessage(M, b"x", properties={"TIMER_DELAY_MS": str(31 * DAY_MS)}),
     DeliveryTimeTooFar),
    ("TIMER_DELIVER_MS too far",
     OutgoingMessage(M, b"x", properties={"TIMER_DELIVER_MS": str(START_MS + 31 * DAY_MS)}), DeliveryTimeTooFar),
    ("TIMER_DELAY_SEC too far", OutgoingMessage(M, b"x", properties={"TIMER_DELAY_SEC": str(31 * 86_400)}),
     DeliveryTimeTooFar),
    ("negative delay", OutgoingMessage(M, b"x", delay_ms=-1), NegativeDelay),
    ("negative TIMER_DELAY_MS", OutgoingMessage(M, b"x", properties={"TIMER_DELAY_MS": "-5"}), NegativeDelay),
    ("negative TIMER_DELAY_SEC", OutgoingMessage(M, b"x", properties={"TIMER_DELAY_SEC": "-1"}), NegativeDelay),
    ("deliver-at before the epoch", OutgoingMessage(M, b"x", deliver_at_ms=-1), InvalidDeliveryTime),
    # Not whole milliseconds: once accepted, these used to break indexing and hang the broker.
    ("deliver-at a float", OutgoingMessage(M, b"x", deliver_at_ms=START_MS + 1000.5), InvalidDeliveryTime),
    ("deliver-at a string", OutgoingMessage(M, b"x", deliver_at_ms=str(START_MS)), InvalidDeliveryTime),
    ("delay a float", OutgoingMessage(M, b"x", delay_ms=10.5), InvalidDeliveryTime),
    ("delay a bool", OutgoingMessage(M, b"x", delay_ms=True), InvalidDeliveryTime),
    ("delay NaN", OutgoingMessage(M, b"x", delay_ms=float("nan")), InvalidDeliveryTime),
    ("level a string", OutgoingMessage(M, b"x", delay_level="3"), InvalidDelayLevel),
    ("level 0", OutgoingMessage(M, b"x", delay_level=0), InvalidDelayLevel),
    ("level -3", OutgoingMessage(M, b"x", delay_level=-3), InvalidDelayLevel),
    ("level 19", OutgoingMessage(M, b"x", delay_level=19), InvalidDelayLevel),
    ("level True", OutgoingMessage(M, b"x", delay_level=True), InvalidDelayLevel),  # type: ignore[arg-type]
    ("DELAY=0", OutgoingMessage(M, b"x", properties={"DELAY": "0"}), InvalidDelayLevel),
    ("DELAY=-1", OutgoingMessage(M, b"x", properties={"DELAY": "-1"}), InvalidDelayLevel),
    ("DELAY not a number", OutgoingMessage(M, b"x", properties={"DELAY": "three"}), InvalidProperty),
    ("TIMER_DELAY_MS not a number", OutgoingMessage(M, b"x", properties={"TIMER_DELAY_MS": "1.5"}),
     InvalidProperty),
    ("two ways at once", OutgoingMessage(M, b"x", delay_ms=5, delay_level=2), ConflictingDelivery),
    ("field and property", OutgoingMessage(M, b"x", delay_ms=5, properties={"TIMER_DELAY_SEC": "1"}),
     ConflictingDelivery),
    ("reserved __CHRONOQ prefix", OutgoingMessage(M, b"x", properties={"__CHRONOQ_X": "1"}), ReservedProperty),
    *[(f"reserved {p}", OutgoingMessage(M, b"x", delay_ms=1000, properties={p: "1"}), ReservedProperty)
      for p in sorted(RESERVED_PROPERTIES)],
]


@pytest.mark.parametrize(("case", "msg", "error"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_timer_request_gets_its_specific_error_and_stores_nothing(
        tmp_path: Path, case: str, msg: OutgoingMessage, error: type[ChronoqError]) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            end, topics = log_end(b), b.list_topics()
            with pytest.raises(error) as info:
                await b.send(msg)
            assert type(info.value) is error, (case, info.value)
            assert info.value.code // 100 in (400, 403), info.value.code  # a client error, not retriable
            assert not info.value.retriable
            assert log_end(b) == end and b.list_topics() == topics and pending_total(b) == 0
            # The same message in a batch with a good one: the whole batch is refused.
            with pytest.raises(error):
                await b.send_batch([OutgoingMessage(M, b"good", delay_ms=1000), msg])
            assert log_end(b) == end and b.list_topics() == topics and pending_total(b) == 0
            clock.advance(31 * DAY_MS)
            assert await b.run_due() == 0
        finally:
            await b.close()

    run(body())


def test_error_names_the_value_and_the_limit(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            with pytest.raises(InvalidDelayLevel) as info:
                await b.send(OutgoingMessage(M, b"x", delay_level=19))
            assert info.value.details == {"level": 19, "max_level": 18, "top_delay_ms": 7_200_000}
            assert "19" in str(info.value) and "18" in str(info.value)
            with pytest.raises(DeliveryTimeTooFar) as far:
                await b.send(OutgoingMessage(M, b"x", delay_ms=30 * DAY_MS + 1))
            assert "timer_max_delay_ms" in str(far.value)
            with pytest.raises(NegativeDelay) as neg:
                await b.send(OutgoingMessage(M, b"x", delay_ms=-7))
            assert neg.value.details == {"delay_ms": -7}
            with pytest.raises(ReservedProperty) as res:
                await b.send(OutgoingMessage(M, b"x", properties={"REAL_TOPIC": "other"}))
            assert res.value.details == {"key": "REAL_TOPIC"}
        finally:
            await b.close()

    run(body())


def test_partial_batch_refuses_only_the_bad_timer_messages(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            out = await b.send_batch([OutgoingMessage(M, b"a", delay_ms=1000),
                                      OutgoingMessage(M, b"b", delay_ms=-1),
                                      OutgoingMessage(M, b"c", delay_level=19),
                                      OutgoingMessage(M, b"d", delay_ms=2000)], partial=True)
            assert [type(o).__name__ for o in out] == ["SendResult", "NegativeDelay", "InvalidDelayLevel",
                                                       "SendResult"]
            assert pending_total(b) == 2
            clock.advance(2000)
            assert await b.run_due() == 2
            assert sorted(m.body for m in await drain(b, M)) == [b"a", b"d"]
        finally:
            await b.close()

    run(body())


def test_delay_property_above_the_top_is_clamped_like_rocketmq(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r19 = await b.send(OutgoingMessage(M, b"19", properties={"DELAY": "19"}))
            r99 = await b.send(OutgoingMessage(M, b"99", properties={"DELAY": "99"}))
            r18 = await b.send(OutgoingMessage(M, b"18", delay_level=18))  # the explicit top is fine
            assert r19.deliver_at_ms == r99.deliver_at_ms == r18.deliver_at_ms == START_MS + 2 * HOUR_MS
            assert b.stats()["timer"]["pending_by_delay_level"] == {"18": 3}
            clock.set(START_MS + 2 * HOUR_MS - 1)
            assert await b.run_due() == 0
            clock.set(START_MS + 2 * HOUR_MS)
            assert await b.run_due() == 3
            got = await drain(b, M)
            assert [m.body for m in got] == [b"19", b"99", b"18"]
            assert all("DELAY" not in m.properties for m in got)
        finally:
            await b.close()

    run(body())


@pytest.mark.parametrize(("props", "fields", "expect_delay_ms"), [
    ({"TIMER_DELIVER_MS": str(START_MS + 1234)}, {}, 1234),
    ({"TIMER_DELAY_MS": "1500"}, {}, 1500),
    ({"TIMER_DELAY_SEC": "3"}, {}, 3000),
    ({"DELAY": "4"}, {}, 30_000),
    ({}, {"deliver_at_ms": START_MS + 777}, 777),
    ({}, {"delay_ms": 888}, 888),
    ({}, {"delay_level": 1}, 1000),
])
def test_each_way_of_asking_resolves_to_one_due_time(tmp_path: Path, props: dict, fields: dict,
                                                     expect_delay_ms: int) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await b.send(OutgoingMessage(M, b"x", properties={"user": "u", **props}, **fields))
            assert r.deliver_at_ms == START_MS + expect_delay_ms
            # Timers in the time index are recallable; delay-level messages (RocketMQ 4 path) are not.
            is_level = "DELAY" in props or "delay_level" in fields
            assert (r.recall_handle is None) == is_level
            clock.set(START_MS + expect_delay_ms - 1)
            assert await b.run_due() == 0
            clock.set(START_MS + expect_delay_ms)
            assert await b.run_due() == 1
            [m] = await drain(b, M)
            assert dict(m.properties) == {"user": "u"}  # timer properties do not leak to consumers
            assert m.system_properties[SYS_TIMER_OUT_MS] == str(START_MS + expect_delay_ms)
        finally:
            await b.close()

    run(body())


def test_timer_disabled_is_refused_at_admission_leaving_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_wheel_enable=False)
        try:
            end, topics = log_end(b), b.list_topics()
            with pytest.raises(TimerDisabled):
                await b.send(OutgoingMessage("fresh-topic", b"x", delay_ms=1000))
            assert log_end(b) == end and b.list_topics() == topics
        finally:
            await b.close()

    run(body())


def test_slot_congestion_stores_nothing_in_the_log(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_congest_num_each_slot=1)
        try:
            await b.send(OutgoingMessage(M, b"x", deliver_at_ms=START_MS + 5000))
            end = log_end(b)
            with pytest.raises(TimerSlotCongested):
                await b.send(OutgoingMessage(M, b"y", deliver_at_ms=START_MS + 5500))
            assert log_end(b) == end and pending_total(b) == 1
        finally:
            await b.close()

    run(body())


def test_refused_requests_leave_no_auto_created_topic(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, timer_congest_num_each_slot=1)
        try:
            await b.send(OutgoingMessage(M, b"x", deliver_at_ms=START_MS + 5000))
            topics = b.list_topics()
            with pytest.raises(TimerSlotCongested):
                await b.send(OutgoingMessage("fresh-topic", b"y", deliver_at_ms=START_MS + 5500))
            with pytest.raises(NegativeDelay):
                await b.send_batch([OutgoingMessage("fresh-2", b"ok"), OutgoingMessage("fresh-2", b"x", delay_ms=-1)])
            assert b.list_topics() == topics
        finally:
            await b.close()

    run(body())
