"""The hand-off (`timer/handoff.py`): with a job as the firer, armed timers fire at their due time,
unarmed ones by the backstop, in simulated time.

The job (the Spark engine) arms a timer when it enters the hand-off horizon; the broker arms on
its own what it accepts already inside the horizon, and, at its first fire step after a start,
everything due within the horizon. Checked here: on time when armed, late by exactly the backstop
when not, never early; ArmTimers' per-timer results; a cancel wins over an arm before or after it
and while its tombstone is being made durable; a restart keeps the armed timers' promise and fires
nothing twice; the loop's deadline follows the armed set.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import MINUTE_MS, Config
from chronoq.model import OutgoingMessage, SendResult, TimerState
from chronoq.timer.handoff import HandOff
from tests.support.brokers import open_broker, simulated_broker
from tests.support.timers import START_MS, drain, run

HORIZON_MS = MINUTE_MS
BACKSTOP_MS = 30_000
SETTINGS = {"timer_firer": "spark", "timer_handoff_horizon_ms": HORIZON_MS, "timer_spark_backstop_ms": BACKSTOP_MS}

pytestmark = pytest.mark.usefixtures("each_timer_engine")


@asynccontextmanager
async def _broker(tmp_path: Path) -> AsyncIterator[tuple[Broker, FakeClock]]:
    """A broker on the simulated clock with the hand-off's settings, its loop's first step taken."""
    clock = FakeClock(START_MS)
    b = await simulated_broker(tmp_path, clock, **SETTINGS)
    try:
        await b.run_due()
        yield b, clock
    finally:
        await b.close()


async def _send(b: Broker, body: bytes, due_ms: int) -> SendResult:
    return await b.send(OutgoingMessage("orders", body, deliver_at_ms=due_ms))


def _arm_of(r: SendResult) -> tuple[int, str, str]:
    return (r.position, "orders", r.message_id)


async def _fired_at(b: Broker, clock: FakeClock, at_ms: int) -> list[bytes]:
    """Move the clock to `at_ms`, fire what is due, and return the bodies delivered."""
    clock.set(at_ms)
    await b.run_due()
    return [m.body for m in await drain(b, "orders")]


def _handoff(b: Broker) -> dict:
    return b.stats()["timer"]["handoff"]


def test_an_armed_timer_fires_at_its_due_time_and_an_unarmed_one_by_the_backstop(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, **SETTINGS)
        try:
            await b.run_due()  # the first step: everything due within the horizon of START_MS is armed
            due = START_MS + 10 * MINUTE_MS
            armed = await _send(b, b"armed", due)
            unarmed = await _send(b, b"unarmed", due + 5)
            assert b.timer.next_deadline_ms() == due + BACKSTOP_MS  # nothing armed: the backstop's time
            clock.set(due - HORIZON_MS)  # the job arms it as it enters the horizon
            assert await b.arm_timers([_arm_of(armed)]) == [("armed", None)]
            assert b.timer.next_deadline_ms() == due
            assert await _fired_at(b, clock, due - 1) == []
            assert await _fired_at(b, clock, due) == [b"armed"]  # to the millisecond
            assert await _fired_at(b, clock, due + 5) == []  # unarmed: not at its due time
            assert await _fired_at(b, clock, due + 5 + BACKSTOP_MS - 1) == []
            assert await _fired_at(b, clock, due + 5 + BACKSTOP_MS) == [b"unarmed"]  # late, never lost
            states = {s.message_id: s for s in (b.query(armed.message_id)[0], b.query(unarmed.message_id)[0])}
            assert states[armed.message_id].fired_ms == due
            assert states[unarmed.message_id].fired_ms == due + 5 + BACKSTOP_MS
            stats = _handoff(b)
            assert (stats["armed"], stats["armed_by_call"], stats["fired_armed"], stats["fired_by_backstop"]) == (
                0, 1, 1, 1)
            assert stats["horizon_ms"] == HORIZON_MS and stats["armed_through_ms"] == START_MS + HORIZON_MS
        finally:
            await b.close()

    run(body())


def test_a_timer_accepted_inside_the_horizon_is_armed_at_acceptance(tmp_path: Path) -> None:
    async def body() -> None:
        async with _broker(tmp_path) as (b, clock):
            now = START_MS + 10 * MINUTE_MS
            clock.set(now)
            near = await _send(b, b"near", now + HORIZON_MS)  # at the horizon's edge: the broker's own
            far = await _send(b, b"far", now + HORIZON_MS + 1)  # beyond it: the job's to arm
            assert _handoff(b)["armed_on_accept"] == 1
            assert await b.arm_timers([_arm_of(near)]) == [("already_armed", None)]
            assert await _fired_at(b, clock, now + HORIZON_MS) == [b"near"]
            assert await _fired_at(b, clock, now + HORIZON_MS + 1) == []
            assert await _fired_at(b, clock, now + HORIZON_MS + 1 + BACKSTOP_MS) == [b"far"]
            assert b.query(far.message_id)[0].state is TimerState.DELIVERED

    run(body())


def test_arm_results_name_what_became_of_each_timer(tmp_path: Path) -> None:
    async def body() -> None:
        async with _broker(tmp_path) as (b, clock):
            due = START_MS + 10 * MINUTE_MS
            fired, cancelled, pending = [await _send(b, name, due) for name in (b"f", b"c", b"p")]
            clock.set(due - HORIZON_MS)
            assert await b.arm_timers([_arm_of(fired)]) == [("armed", None)]
            await b.cancel(topic="orders", message_id=cancelled.message_id)
            assert await _fired_at(b, clock, due) == [b"f"]
            results = await b.arm_timers([
                _arm_of(fired), _arm_of(cancelled), _arm_of(pending), _arm_of(pending),
                (pending.position, "orders", "another-id"), (pending.position, "other-topic", pending.message_id),
                (pending.position + 1, "orders", pending.message_id),
            ])
            assert [r for r, _ in results] == ["fired", "cancelled", "armed", "already_armed", "unknown", "unknown",
                                               "unknown"]
            assert "has fired" in results[0][1] and "was cancelled" in results[1][1]
            assert "not 'another-id' on topic 'orders'" in results[4][1]
            assert f"is recorded at position {pending.position + 1}" in results[6][1]
            assert await _fired_at(b, clock, due + 1) == [b"p"]  # armed after its due time: fires at once

    run(body())


def test_a_cancel_wins_over_an_arm_before_it_after_it_and_racing_it(tmp_path: Path) -> None:
    async def body() -> None:
        async with _broker(tmp_path) as (b, clock):
            due = START_MS + 10 * MINUTE_MS
            before, after, racing, kept = [await _send(b, name, due) for name in (b"b", b"a", b"r", b"k")]
            clock.set(due - HORIZON_MS)
            await b.cancel(topic="orders", message_id=before.message_id)
            assert (await b.arm_timers([_arm_of(before)]))[0][0] == "cancelled"  # an arm cannot revive it
            assert await b.arm_timers([_arm_of(after), _arm_of(racing), _arm_of(kept)]) == [("armed", None)] * 3
            await b.cancel(topic="orders", message_id=after.message_id)  # armed, then cancelled
            clock.set(due - 1)
            cancel = asyncio.create_task(b.cancel(topic="orders", message_id=racing.message_id))
            await asyncio.sleep(0)  # its tombstone waits for durability; the timer is held back
            assert not cancel.done()
            assert await b.arm_timers([_arm_of(racing)]) == [("already_armed", None)]
            clock.set(due)
            fired = await b.run_due()
            await cancel
            fired += await b.run_due()
            assert fired == 1
            assert [m.body for m in await drain(b, "orders")] == [b"k"]
            assert [b.query(r.message_id)[0].state for r in (before, after, racing)] == [TimerState.CANCELLED] * 3
            assert await _fired_at(b, clock, due + BACKSTOP_MS) == []  # nor does the backstop fire them
            assert _handoff(b)["armed"] == 0  # the cancelled ones left the armed set when due

    run(body())


def test_a_restart_keeps_the_armed_timers_on_time_and_fires_nothing_twice(tmp_path: Path) -> None:
    """The armed set is in memory; a restarted broker arms everything due within its horizon at
    its first step, which covers every timer the job armed (the job arms none earlier than the
    horizon). One beyond the horizon at the restart is the job's to arm as before."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock, **SETTINGS)
        due = START_MS + 10 * MINUTE_MS
        try:
            await b.run_due()
            early = await _send(b, b"early", due - 50_000)
            armed = await _send(b, b"armed", due)
            later = await _send(b, b"later", due + 40_000)
            clock.set(due - HORIZON_MS)
            assert [r for r, _ in await b.arm_timers([_arm_of(early), _arm_of(armed)])] == ["armed", "armed"]
            assert await _fired_at(b, clock, due - 50_000) == [b"early"]
        finally:
            await b.close()
        clock.set(due - 30_000)
        b = await simulated_broker(tmp_path, clock, **SETTINGS)
        try:
            await b.run_due()  # nothing due; the horizon from now (due + 30 s) is armed
            assert _handoff(b)["armed_through_ms"] == due + 30_000
            assert await b.arm_timers([_arm_of(armed)]) == [("already_armed", None)]
            clock.set(due + 40_000 - HORIZON_MS)  # "later" enters the horizon: the job arms it
            assert await b.arm_timers([_arm_of(later)]) == [("armed", None)]
            assert await _fired_at(b, clock, due) == [b"armed"]  # on time without a second hand-over
            assert await _fired_at(b, clock, due + 40_000) == [b"later"]
            assert await _fired_at(b, clock, due + 40_000 + 2 * BACKSTOP_MS) == []  # nothing fires twice
            assert [b.query(r.message_id)[0].fired_ms for r in (early, armed, later)] == [
                due - 50_000, due, due + 40_000]
        finally:
            await b.close()

    run(body())


def test_an_arm_wakes_the_sleeping_loop_which_then_fires_at_the_due_time(tmp_path: Path) -> None:
    """The real background loop: asleep until the unarmed timer's backstop time, an arm must wake it
    (`TimerLoop.wake_for`) so that it sleeps until the due time instead."""

    async def until_asleep(b: Broker) -> None:
        for _ in range(30_000):
            await asyncio.sleep(0.001)
            if b.timer_loop.sleeping:
                return
        raise AssertionError("the timer loop did not go back to sleep within 30 s")

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(Config(data_dir=tmp_path, **SETTINGS), clock=clock, background=True)
        try:
            due = START_MS + 10 * MINUTE_MS
            r = await _send(b, b"x", due)
            await until_asleep(b)
            clock.set(due - HORIZON_MS)
            await until_asleep(b)
            assert await b.arm_timers([_arm_of(r)]) == [("armed", None)]
            await until_asleep(b)
            clock.set(due)
            for _ in range(30_000):
                if b.query(r.message_id)[0].state is TimerState.DELIVERED:
                    break
                await asyncio.sleep(0.001)
            assert b.query(r.message_id)[0].fired_ms == due
        finally:
            await b.close()

    run(body())


def test_with_the_broker_as_the_firer_every_pending_timer_is_already_armed(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path, clock)
        try:
            r = await _send(b, b"x", START_MS + 10 * MINUTE_MS)
            assert await b.arm_timers([_arm_of(r)]) == [("already_armed", None)]
            assert "handoff" not in b.stats()["timer"]
        finally:
            await b.close()

    run(body())


def test_the_armed_set_holds_only_timers_beyond_the_start_horizon() -> None:
    h = HandOff(60_000)
    assert h.arm(1, 100_000) and not h.arm(1, 100_000)
    assert h.arm(2, 50_000)
    h.start(0)  # everything due by 60 s counts as armed: position 2 leaves the set
    assert h.stats()["armed"] == 1 and h.is_armed(2, 50_000) and h.is_armed(99, 60_000)
    assert not h.is_armed(99, 60_001)
    assert h.due(99_999, 10) == [] and h.due(100_000, 10) == [1]
    assert h.deadline_ms(70_000, 30_000) == 100_000  # the armed head before the unarmed one's backstop
    assert h.deadline_ms(50_000, 30_000) == 50_000  # due within the start horizon: armed
    assert h.scan_horizon_ms(200_000, 30_000) == 170_000 and h.scan_horizon_ms(40_000, 30_000) == 40_000
    h.moved(1, 7, 100_000)
    assert h.due(100_000, 10) == [7]
    h.fired([7])
    assert h.next_armed_ms() is None and h.stats()["armed"] == 0
