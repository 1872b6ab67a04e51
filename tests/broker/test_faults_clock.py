"""Wall-clock steps: broker time never runs ahead of real time, pauses for a small step back and
is re-based past `clock_max_backward_step_ms`; timers never fire before the wall clock reaches them.

A fault is tested by causing it: each test drives a `SystemClock` with injected wall
(CLOCK_REALTIME) and monotonic (CLOCK_MONOTONIC) sources over a `Machine` whose two clocks the
test moves: `run(ms)` lets time pass (both move), `step(ms)` is an administrator or a bad NTP
server setting the wall clock (only it moves), `slew` is NTP adjusting the rate (both move, by
the same amount: Linux slews CLOCK_MONOTONIC with CLOCK_REALTIME; only CLOCK_MONOTONIC_RAW is
left alone). A clock that was ahead is a `Machine` started a day ahead and then set right, or a
broker restarted on a `Machine` that is right. No test sleeps for real except the ones that
check a real-time wait (a long poll's 200 ms, a paused sleeper's polling, a few ms elsewhere).

What the steps did before (`SystemClock` was `time.time()`): a forward step of an hour fired a
10-minute timer at once and ended a 30-second invisible duration at once; a step back moved
store times back and left a 200 ms long poll waiting for broker time to pass its deadline. And
before broker time had a bound on how far ahead of the wall clock it may be: a wall clock a day
ahead, then set right, left broker time a day ahead, so a timer due by the client's clock in 4 s
fired at once, a 2 s delay was due the next day, and redeliveries and retention waited a day,
across restarts too (in-flight times stored a day ahead).

The last test: a cancel racing the fire of the same timer,
with the fired copy written but its fsync not yet done, must be refused, even when the cancel's
"now" (a clock stepped back) says the timer is not due yet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock, SystemClock
from chronoq.config import Config, ConfigError
from chronoq.errors import TimerAlreadyFired
from chronoq.model import OutgoingMessage, StoredMessage, TimerState
from tests.support.brokers import open_broker, simulated_broker
from tests.support.clocks import HOUR_MS, MINUTE_MS, MS, SECOND_MS, START_MS, Machine

GROUP = "g-clock"


# -- SystemClock alone ------------------------------------------------------------------------------


def test_a_forward_step_leaves_broker_time_behind_the_wall_clock() -> None:
    m = Machine()
    clock = m.clock()
    m.run(500)
    m.step(HOUR_MS)
    assert clock.now_ms() == START_MS + 500  # not START + 1 h: nothing jumps forward
    assert clock.behind_wall_ms() == HOUR_MS
    m.run(10 * SECOND_MS)
    assert clock.now_ms() == START_MS + 500 + 10 * SECOND_MS  # runs on at the real rate
    assert clock.behind_wall_ms() == HOUR_MS
    m.run(30 * 24 * HOUR_MS)  # without catch-up it stays behind (until a restart)
    assert clock.behind_wall_ms() == HOUR_MS


def test_a_step_back_pauses_broker_time_until_the_wall_clock_catches_up() -> None:
    m = Machine()
    clock = m.clock()
    m.run(SECOND_MS)
    paused_at = clock.now_ms()
    assert paused_at == START_MS + SECOND_MS
    m.step(-MINUTE_MS)
    assert clock.now_ms() == paused_at  # never back
    assert clock.behind_wall_ms() == -MINUTE_MS  # negative: the wall clock is behind broker time
    m.run(MINUTE_MS - 1)
    assert clock.now_ms() == paused_at  # a minute of real time, and broker time has not moved
    m.run(1)
    assert clock.now_ms() == paused_at == m.wall_ms
    m.run(5)
    assert clock.now_ms() == m.wall_ms == paused_at + 5  # and follows the wall clock again
    assert clock.behind_wall_ms() == 0


def test_broker_time_is_the_wall_clock_slewed_or_not_and_never_outruns_real_time() -> None:
    m = Machine()
    clock = m.clock()
    assert clock.now_ms() == START_MS and clock.behind_wall_ms() == 0
    for ms in (0.3, 1, 7.7, 250, 3_600_000):
        m.run(ms)
        assert clock.now_ms() == m.wall_ms and clock.behind_wall_ms() == 0
    # NTP slewing changes the rate of both clocks together: broker time is the wall clock exactly.
    for _ in range(1000):
        m.wall += 999_500  # 500 ppm slow
        m.mono += 999_500
        assert clock.now_ms() == m.wall_ms
    # A wall clock slower than the monotonic one (not Linux NTP, but other time daemons step in
    # small steps): broker time is held at the wall clock, never ahead of it.
    for _ in range(1000):
        m.wall += 990_000
        m.mono += MS
        assert clock.now_ms() == m.wall_ms and clock.behind_wall_ms() == 0
    # A wall clock faster than the monotonic one (small forward steps): broker time keeps the real
    # rate, so a delay is never shorter in real time than asked.
    before = clock.now_ms()
    for _ in range(1000):
        m.wall += 1_010_000
        m.mono += MS
        clock.now_ms()
    assert clock.now_ms() == before + 1000
    assert clock.behind_wall_ms() == 10


def test_broker_time_goes_back_only_by_a_rebase_and_never_outruns_real_time_or_the_wall_clock() -> None:
    rng = random.Random(20261124)
    for catchup_ppm, max_back_ms in ((0, MINUTE_MS), (10_000, MINUTE_MS), (0, HOUR_MS)):
        m = Machine()
        clock = m.clock(catchup_ppm, max_back_ms)
        before_ns, mono_before = clock.now_ms() * MS, m.mono
        rebases = 0
        for _ in range(5000):
            roll = rng.random()
            if roll < 0.05:
                m.step(rng.randint(-2 * HOUR_MS, 2 * HOUR_MS))
            elif roll < 0.08:
                m.step(rng.randint(-max_back_ms, 0))  # within the setting: a pause, never a re-base
            else:
                m.run(rng.choice((0, 0.001, 1, 13, 1000, 60_000)))
            now_ns = clock.now_ms() * MS
            if now_ns < before_ns:
                # Back only by a re-base: to the wall clock, found more than the setting behind.
                assert now_ns == m.wall_ms * MS and before_ns - now_ns > max_back_ms * MS
                rebases += 1
                assert clock.rebases == rebases
            elif now_ns > before_ns:
                assert now_ns <= m.wall, "broker time moved past the wall clock"
                real_ns = m.mono - mono_before
                # ms rounding: a reading may show up to 1 ms more than the real time since the last
                assert now_ns - before_ns <= real_ns + real_ns * catchup_ppm // 1_000_000 + MS
            assert now_ns - m.wall <= max_back_ms * MS, "broker time further ahead of the wall clock than the setting"
            assert clock.fire_horizon_ms() * MS <= min(now_ns, m.wall) + MS
            before_ns, mono_before = now_ns, m.mono
        assert rebases == clock.rebases > 0


def test_catch_up_closes_a_forward_step_at_the_configured_rate_then_follows() -> None:
    m = Machine()
    clock = m.clock(catchup_ppm=100_000)  # 10 % faster than real time while behind
    m.step(10 * SECOND_MS)
    assert clock.behind_wall_ms() == 10 * SECOND_MS
    m.run(50 * SECOND_MS)
    assert clock.now_ms() == START_MS + 55 * SECOND_MS  # 50 s of real time, 5 s of catch-up
    assert clock.behind_wall_ms() == 5 * SECOND_MS
    m.run(60 * SECOND_MS)  # could catch up 6 s; only 5 s are missing
    assert clock.now_ms() == m.wall_ms
    m.run(SECOND_MS)
    assert clock.now_ms() == m.wall_ms  # caught up: no faster than the wall clock any more


def test_a_wall_clock_that_gains_on_the_monotonic_clock_is_followed_with_the_default_catch_up() -> None:
    """A wall clock that gains 5 ms a second on CLOCK_MONOTONIC with no step (as virtual
    machines' clocks do): broker time that never outruns the monotonic clock falls behind by 0.5 %
    of its uptime, and every timer fires that much later by the wall clock. The default catch-up
    (2 %) follows such a clock; 0 does not."""
    def run_an_hour(catchup_ppm: int) -> tuple[int, int]:
        m = Machine()
        clock = m.clock(catchup_ppm)
        worst = 0
        for _ in range(3600):
            m.run(1000)
            m.wall += 5 * MS  # the wall clock's gain over that second: a slew, not a step
            now = clock.now_ms()
            assert now <= m.wall_ms, "broker time moved past the wall clock"
            worst = max(worst, m.wall_ms - now)
        return worst, m.wall_ms - clock.now_ms()

    worst, end = run_an_hour(Config().clock_catchup_ppm)
    assert worst == 0 and end == 0, (worst, end)  # each reading catches up the second's 5 ms
    assert run_an_hour(0)[1] == 3600 * 5  # 18 s behind after an hour


def test_catch_up_limits_are_checked_in_config_and_clock() -> None:
    for bad in (-1, 1_000_001):
        with pytest.raises(ConfigError, match="clock_catchup_ppm"):
            Config(clock_catchup_ppm=bad)
        with pytest.raises(ValueError, match=str(bad)):
            SystemClock(catchup_ppm=bad)
    assert Config().clock_catchup_ppm == 20_000
    assert Config(clock_catchup_ppm=1_000_000).clock_catchup_ppm == 1_000_000
    assert Config.load(env={"CHRONOQ_CLOCK_CATCHUP_PPM": "500"}).clock_catchup_ppm == 500


def test_a_step_is_logged_once_not_at_every_reading(caplog: pytest.LogCaptureFixture) -> None:
    m = Machine()
    clock = m.clock()
    with caplog.at_level(logging.INFO, logger="chronoq.clock"):
        m.step(HOUR_MS)
        for _ in range(100):
            m.run(10)
            clock.now_ms()
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert str(HOUR_MS) in caplog.records[0].getMessage()
        m.step(-HOUR_MS + 500)  # a correction back to within 1 s: said once, at INFO
        for _ in range(100):
            m.run(10)
            clock.now_ms()
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
        m.step(-10 * SECOND_MS)  # a new step, back this time: a second warning
        for _ in range(100):
            m.run(10)
            clock.now_ms()
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.WARNING]


def test_the_real_wait_for_a_broker_deadline_never_lets_it_pass_unseen() -> None:
    m = Machine()
    clock = m.clock()
    now = clock.now_ms()
    assert clock.real_wait_ms(now) == 0 and clock.real_wait_ms(now - 5) == 0
    assert clock.real_wait_ms(now + 250) == 250  # in step: broker time runs at the real rate
    m.step(-2)  # paused for 2 ms: the pause ends by itself sooner than the 20 ms poll
    assert clock.real_wait_ms(now + 5) == 7
    m.step(-50 * SECOND_MS)  # paused for 50 s: look every 20 ms (a correction may end it at any time)
    assert clock.real_wait_ms(now + 1) == 20
    assert clock.real_wait_ms(now + 250) == 250  # a longer wait is never too long: B runs no faster
    m2 = Machine()
    fast = m2.clock(catchup_ppm=250_000)
    fast_now = fast.now_ms()
    assert fast.real_wait_ms(fast_now + 1000) == 1000  # in step: no catch-up
    m2.step(HOUR_MS)
    assert fast.real_wait_ms(fast_now + 1000) == 800  # catching up: 25 % faster than real time


def test_a_sleeper_on_a_paused_clock_neither_wakes_early_nor_spins() -> None:
    """One of the few real waits among the clock tests: 150 ms of a paused clock (the wall clock
    stepped back 50 s), during which the sleeper must look at the clock only a few times."""
    m = Machine()
    clock = m.clock()

    async def body() -> None:
        deadline = clock.now_ms() + 1
        m.step(-50 * SECOND_MS)
        reads_before = m.mono_reads
        sleeper = asyncio.create_task(clock.sleep_until(deadline))
        await asyncio.sleep(0.15)
        assert not sleeper.done()  # broker time is paused: the deadline has not come
        reads = m.mono_reads - reads_before
        assert reads <= 30, f"{reads} clock readings in 150 ms: a paused clock must not spin"
        m.step(50 * SECOND_MS)  # the step is undone: broker time runs again
        m.run(1)
        await asyncio.wait_for(sleeper, 2)
        assert clock.now_ms() >= deadline

    asyncio.run(body())


# -- through a broker ---------------------------------------------------------------------------------


async def one_queue_broker(data_dir: Path, clock: Any, **overrides: Any) -> Broker:
    """A simulated broker (tests.support.brokers) with one queue per topic unless told otherwise."""
    return await simulated_broker(data_dir, clock, **{"default_queue_count": 1, **overrides})


async def drain(broker: Broker, topic: str) -> list[StoredMessage]:
    out = []
    while got := await broker.receive(GROUP, topic, batch_size=64):
        for r in got:
            await broker.ack(GROUP, topic, r.receipt_handle)
            out.append(r.message)
    return out


def test_a_forward_step_fires_no_timer_early(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine()
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            r = await b.send(OutgoingMessage("orders", b"ten minutes", delay_ms=10 * MINUTE_MS))
            assert r.deliver_at_ms == START_MS + 10 * MINUTE_MS
            m.step(HOUR_MS)  # the wall clock is now 50 minutes past the due time
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
            m.run(10 * MINUTE_MS - 1)
            assert await b.run_due() == 0
            assert b.query(r.message_id)[0].state is TimerState.PENDING
            m.run(1)  # ten minutes of real time since the send
            assert await b.run_due() == 1
            [got] = await drain(b, "orders")
            assert (got.message_id, got.store_ms) == (r.message_id, r.deliver_at_ms)
            assert b.stats()["clock"]["behind_wall_ms"] == HOUR_MS
        finally:
            await b.close()

    asyncio.run(body())


def test_a_forward_step_ends_no_invisible_duration_early(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine()
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            sent = await b.send(OutgoingMessage("orders", b"work"))
            [first] = await b.receive(GROUP, "orders", invisible_duration_ms=30 * SECOND_MS)
            assert first.delivery_attempt == 1
            m.step(HOUR_MS)
            assert await b.receive(GROUP, "orders", invisible_duration_ms=30 * SECOND_MS) == []
            m.run(30 * SECOND_MS - 1)
            assert await b.receive(GROUP, "orders", invisible_duration_ms=30 * SECOND_MS) == []
            m.run(1)  # 30 s of real time since the receive: the consumer's time is up
            [again] = await b.receive(GROUP, "orders", invisible_duration_ms=30 * SECOND_MS)
            assert (again.message.message_id, again.delivery_attempt) == (sent.message_id, 2)
        finally:
            await b.close()

    asyncio.run(body())


def test_after_a_step_back_nothing_fires_before_the_wall_clock_reaches_it_and_long_polls_end(
        tmp_path: Path) -> None:
    """A step back within the setting (an hour here; a minute by default) pauses broker time."""
    async def body() -> None:
        m = Machine()
        b = await one_queue_broker(tmp_path, m.clock(max_backward_step_ms=2 * HOUR_MS))
        loop = asyncio.get_running_loop()
        try:
            timer = await b.send(OutgoingMessage("orders", b"ten minutes", delay_ms=10 * MINUTE_MS))
            due = timer.deliver_at_ms
            before = await b.send(OutgoingMessage("work", b"before the step"))
            [held] = await b.receive(GROUP, "work", invisible_duration_ms=SECOND_MS)
            m.run(SECOND_MS - 1)
            # A running broker reads its clock all the time; this reading sees the 999 ms pass.
            assert b.clock.now_ms() == START_MS + SECOND_MS - 1  # the invisible duration has 1 ms left
            m.step(-HOUR_MS)
            after = await b.send(OutgoingMessage("other", b"after the step"))
            [first] = await b.read("work", 0, 0, 1)
            [second] = await b.read("other", 0, 0, 1)
            assert (first.message_id, second.message_id) == (before.message_id, after.message_id)
            assert second.store_ms >= first.store_ms  # store times never go back in the log

            # A long poll is a real-time wait: it ends after its 200 ms though broker time is
            # paused; the in-flight message 1 ms from visible is not handed out early; and the
            # poll, woken for that message, does not spin on the paused clock.
            reads_before = m.mono_reads
            started = loop.time()
            got = await asyncio.wait_for(b.receive(GROUP, "work", wait_ms=200), 5)
            waited_s = loop.time() - started
            assert got == []
            assert 0.2 <= waited_s < 3, waited_s
            reads = m.mono_reads - reads_before
            assert reads <= 100, f"{reads} clock readings in a 200 ms long poll on a paused clock"

            m.run(due - 1 - m.wall_ms)  # an hour and nine minutes later the wall clock is 1 ms short of due
            assert await b.run_due() == 0
            [redelivered] = await b.receive(GROUP, "work")  # its 1 ms has passed meanwhile
            assert (redelivered.message.message_id, redelivered.delivery_attempt) == (held.message.message_id, 2)
            m.run(1)
            assert await b.run_due() == 1
            [fired] = await drain(b, "orders")
            assert (fired.message_id, fired.store_ms) == (timer.message_id, due)
        finally:
            await b.close()

    asyncio.run(body())


def test_stats_report_how_far_broker_time_is_behind_the_wall_clock(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine()
        b = await one_queue_broker(tmp_path / "system", m.clock())
        in_step = {"behind_wall_ms": 0, "max_backward_step_ms": MINUTE_MS, "rebases": 0, "rebased_ms": 0,
                   "last_rebase_ms": None, "last_rebase_at_ms": None}
        try:
            assert b.stats()["clock"] == in_step
            m.step(-5 * SECOND_MS)
            assert b.stats()["clock"] == {**in_step, "behind_wall_ms": -5 * SECOND_MS}
            m.step(HOUR_MS + 5 * SECOND_MS)
            assert b.stats()["clock"] == {**in_step, "behind_wall_ms": HOUR_MS}
        finally:
            await b.close()
        fake = await one_queue_broker(tmp_path / "fake", FakeClock(START_MS))
        try:
            # A fake clock has no wall clock apart from itself, and never re-bases.
            assert fake.stats()["clock"] == {**in_step, "max_backward_step_ms": None}
        finally:
            await fake.close()

    asyncio.run(body())


# -- cancel racing the fire -------------------------------------------------------------------------------


def test_a_cancel_is_refused_while_the_fired_copy_awaits_its_fsync(
        make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch) -> None:
    """The fire wrote the copy (page cache) and waits for its fsync: the index still says
    PENDING, and the cancel's "now" is a minute before the due time (a clock stepped back). The
    copy will be delivered, so the cancel must be refused, not acknowledged."""
    gate = threading.Event()
    real_fdatasync = os.fdatasync

    def held_fdatasync(fd: int) -> None:
        if not gate.wait(30):
            raise AssertionError("the test never released the fsync")
        real_fdatasync(fd)

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            r = await b.send(OutgoingMessage("orders", b"fire me", delay_ms=MINUTE_MS))
            due = r.deliver_at_ms
            clock.set(due)
            service = b.timer
            monkeypatch.setattr(os, "fdatasync", held_fdatasync)
            end = b.store.log.end_position
            firing = asyncio.create_task(service.fire_due(due))
            for _ in range(1000):
                if b.store.log.end_position > end:
                    break
                await asyncio.sleep(0)
            assert b.store.log.end_position > end, "the fired copy was not written"
            assert b.store.log.flushed_position == end  # written, not durable
            assert not firing.done()
            assert b.query(r.message_id)[0].state is TimerState.PENDING
            with pytest.raises(TimerAlreadyFired):
                await asyncio.wait_for(service.cancel("orders", r.message_id, due - MINUTE_MS), 5)
            gate.set()
            assert await firing == 1
            monkeypatch.setattr(os, "fdatasync", real_fdatasync)
            got = await drain(b, "orders")
            assert [m.message_id for m in got] == [r.message_id]
            assert b.query(r.message_id)[0].state is TimerState.DELIVERED
            clock.advance(HOUR_MS)
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
        finally:
            gate.set()
            await b.close()

    asyncio.run(body())
