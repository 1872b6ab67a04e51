"""When the timer loop wakes: only for a timer due before its own wake-up.

Each pass of the loop asks the index what is due (a RocksDB seek, the level heads, the next
deadline). A sleeping loop used to be woken by every dispatch that carried a timer record, so a
producer sending one timer per request paid a whole pass per group commit (501 passes for 2,000
one-message sends in process) for timers due in an hour. Now a timer due at or after the loop's
own wake-up does not wake it; an earlier one does, and still fires on time. Simulated time (a
`FakeClock`) with the real background loop; the wake-up decision is made in the dispatch, before
the send is acknowledged, so it is read right after the send.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage
from tests.support.brokers import open_broker
from tests.support.timers import START_MS, drain

pytestmark = pytest.mark.usefixtures("each_timer_engine")


async def settle(broker: Broker, passes: int | None = None) -> None:
    """Let the loop run what it was woken for (no I/O when nothing is due: a few yields)."""
    for _ in range(200):
        await asyncio.sleep(0)
        if passes is not None and broker.timer_loop.passes >= passes:
            return


def test_later_timers_leave_the_sleeping_loop_alone_and_an_earlier_one_wakes_it(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await open_broker(Config(data_dir=tmp_path / "data"), clock=clock, background=True)
        try:
            await broker.create_topic("orders", 2)
            await settle(broker, 1)
            await broker.send(OutgoingMessage("orders", b"x", message_id="at-10s", deliver_at_ms=START_MS + 10_000))
            await settle(broker)
            loop = broker.timer_loop
            passes = loop.passes
            for i, later_ms in enumerate((10_000, 20_000, 3_600_000)):
                await broker.send(OutgoingMessage("orders", b"x", message_id=f"later-{i}",
                                                  deliver_at_ms=START_MS + later_ms))
                assert not loop._wakeup.is_set(), f"a timer due at +{later_ms} ms woke a loop asleep until +10 s"
                await settle(broker)
            assert loop.passes == passes

            await broker.send(OutgoingMessage("orders", b"x", message_id="at-5s", deliver_at_ms=START_MS + 5_000))
            assert loop._wakeup.is_set(), "a timer due before the loop's wake-up must wake it"
            await settle(broker, passes + 1)
            assert loop.passes == passes + 1

            clock.advance(5_000)
            await settle(broker, passes + 2)
            for _ in range(100):  # the fired copy's group commit is a real fsync
                if got := await drain(broker, "orders"):
                    break
                await asyncio.sleep(0.01)
            assert [m.message_id for m in got] == ["at-5s"]
            assert all(int(m.store_ms) >= START_MS + 5_000 for m in got)
        finally:
            await broker.close()

    arun(body())


def test_a_cancel_of_the_head_wakes_the_loop(tmp_path: Path, arun: Any) -> None:
    """A tombstone always wakes the loop (its head may be gone), and the next head still fires."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await open_broker(Config(data_dir=tmp_path / "data"), clock=clock, background=True)
        try:
            await broker.create_topic("orders", 2)
            head = await broker.send(OutgoingMessage("orders", b"x", message_id="head",
                                                     deliver_at_ms=START_MS + 1_000))
            await broker.send(OutgoingMessage("orders", b"x", message_id="next", deliver_at_ms=START_MS + 2_000))
            await settle(broker)
            passes = broker.timer_loop.passes
            await broker.cancel(recall_handle=head.recall_handle, topic="orders")
            await settle(broker, passes + 1)
            assert broker.timer_loop.passes > passes
            clock.advance(2_000)
            for _ in range(100):
                if got := await drain(broker, "orders"):
                    break
                await asyncio.sleep(0.01)
            assert [m.message_id for m in got] == ["next"]
        finally:
            await broker.close()

    arun(body())
