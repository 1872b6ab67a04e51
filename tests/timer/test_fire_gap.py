"""`timer_fire_gap_ms`: timers falling due just after a fire step wait for the gap and fire together.

Each fire step ends in a group commit (an fsync) and a hand-off to the store's writer thread:
~370 µs of CPU however few timers it fires. At a steady stream of timers one step per due
millisecond pays that per timer; a gap of a few ms lets the timers of those milliseconds share
one step. These tests pin what the gap may and may not do, in simulated time with the real
background loop: a timer due after a quiet spell fires at once, timers due inside the gap fire
together at its end, nothing fires early, and a gap of 0 gives every due time its own step.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config, ConfigError
from chronoq.model import OutgoingMessage
from tests.support.brokers import open_broker
from tests.support.timers import START_MS, drain

pytestmark = pytest.mark.usefixtures("each_timer_engine")

DUE_OFFSETS = {"a": 1000, "b": 1001, "c": 1002, "d": 1004, "e": 1030}


async def until_loop_waits(broker: Broker, clock: FakeClock) -> None:
    """Wait (real time: fire steps fsync; a generous bound for a busy machine) until the timer
    loop sleeps again (the checkpoint and retention ticks sleep on the clock too: the loop says
    itself)."""
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        await asyncio.sleep(0.001)
        if broker.timer_loop.sleeping:
            return
    raise AssertionError("the timer loop did not go back to sleep within 30 s")


async def fire_times(tmp_path: Path, gap_ms: int) -> dict[str, int]:
    """Send the timers of DUE_OFFSETS, walk the clock a millisecond at a time past them, and
    return, per message, the offset from START_MS at which it fired (its fired copy's store time)."""
    clock = FakeClock(START_MS)
    broker = await open_broker(Config(data_dir=tmp_path / "data", timer_fire_gap_ms=gap_ms), clock=clock,
                               background=True)
    try:
        await broker.create_topic("orders", 2)
        for mid, offset in DUE_OFFSETS.items():
            await broker.send(OutgoingMessage("orders", b"x", message_id=mid, deliver_at_ms=START_MS + offset))
        await until_loop_waits(broker, clock)
        for t in range(999, 1040):
            clock.set(START_MS + t)
            await until_loop_waits(broker, clock)
        got = await drain(broker, "orders")
        return {m.message_id: int(m.store_ms) - START_MS for m in got}
    finally:
        await broker.close()


def test_timers_due_within_the_gap_fire_together_at_its_end(tmp_path: Path, arun: Any) -> None:
    fired = arun(fire_times(tmp_path, gap_ms=5))
    # a: the first after a quiet spell, at once. b, c, d fall due inside the gap a's step opened
    # (1000..1005) and fire in one step at its end. e: due after the gap closed, at once.
    assert fired == {"a": 1000, "b": 1005, "c": 1005, "d": 1005, "e": 1030}
    assert all(fired[m] >= DUE_OFFSETS[m] for m in fired), f"fired early: {fired}"


def test_a_gap_of_zero_fires_each_due_time_in_its_own_step(tmp_path: Path, arun: Any) -> None:
    assert arun(fire_times(tmp_path, gap_ms=0)) == DUE_OFFSETS


def test_the_gap_is_a_named_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="timer_fire_gap_ms"):
        Config(data_dir=tmp_path, timer_fire_gap_ms=-1)
    with pytest.raises(ConfigError, match="timer_fire_gap_ms"):
        Config(data_dir=tmp_path, timer_fire_gap_ms=1001)
