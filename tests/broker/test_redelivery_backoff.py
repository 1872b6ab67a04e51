"""Redelivery timing: an explicit invisible duration is honoured exactly; with none, the broker
backs off along RocketMQ's delay levels, level 3 + attempt; nack too."""

from __future__ import annotations

import asyncio

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.model import OutgoingMessage
from tests.support.brokers import SimulatedBrokers

SECOND = 1000


async def _redelivered_after(broker: Broker, clock: FakeClock, wait_ms: int, **kw: object) -> list[int]:
    clock.advance(wait_ms - 1)
    assert await broker.receive("g", "t", **kw) == []  # type: ignore[arg-type]
    clock.advance(1)
    return [m.delivery_attempt for m in await broker.receive("g", "t", **kw)]  # type: ignore[arg-type]


def test_default_invisible_duration_grows_along_the_delay_levels(brokers: SimulatedBrokers) -> None:
    async def body() -> None:
        broker, clock = await brokers.open(), brokers.clock
        await broker.send(OutgoingMessage("t", b"never acked"))
        first = await broker.receive("g", "t")
        assert [m.delivery_attempt for m in first] == [1]
        # RocketMQ: delay level 3 + reconsumeTimes, reconsumeTimes = attempt - 1.
        assert first[0].invisible_until_ms - clock.now_ms() == 10 * SECOND  # level 3 = 10 s
        assert await _redelivered_after(broker, clock, 10 * SECOND) == [2]  # then level 4 = 30 s
        assert await _redelivered_after(broker, clock, 30 * SECOND) == [3]  # then level 5 = 1 min
        assert await _redelivered_after(broker, clock, 60 * SECOND) == [4]
        await broker.close()

    asyncio.run(body())


def test_an_explicit_invisible_duration_is_honoured_exactly(brokers: SimulatedBrokers) -> None:
    async def body() -> None:
        broker, clock = await brokers.open(), brokers.clock
        await broker.send(OutgoingMessage("t", b"never acked"))
        assert [m.delivery_attempt for m in await broker.receive("g", "t", invisible_duration_ms=5000)] == [1]
        for attempt in (2, 3, 4):
            assert await _redelivered_after(broker, clock, 5000, invisible_duration_ms=5000) == [attempt]
        await broker.close()

    asyncio.run(body())


def test_nack_backs_off_by_level_three_plus_attempts(brokers: SimulatedBrokers) -> None:
    async def body() -> None:
        broker, clock = await brokers.open(), brokers.clock
        await broker.send(OutgoingMessage("t", b"fails"))
        got = await broker.receive("g", "t", invisible_duration_ms=5000)
        await broker.nack("g", "t", got[0].receipt_handle)  # attempt 1 failed: level 3 = 10 s
        assert await _redelivered_after(broker, clock, 10 * SECOND, invisible_duration_ms=5000) == [2]
        await broker.close()

    asyncio.run(body())
