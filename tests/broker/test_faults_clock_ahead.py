"""A wall clock that was ahead, then set right: timers wait for the wall clock, nothing else waits
out the step for longer than `clock_max_backward_step_ms`, in one run or across a restart.

A fault is tested by causing it, on a `Machine` (tests/support/clocks.py) whose wall clock starts
ahead, a day or 30 s, and is then set right (`step`), or on which the broker restarts with the
wall clock right. What each test pins, and what it found before the fire horizon and the re-base:
- a timer a client sends with an absolute due time 4 s ahead by its own (right) clock is not
  delivered before the wall clock gets there (before: at once, with broker time still ahead), nor
  fired by Spark's FireTimers, and a cancel of it is accepted (before: "already fired");
- after a re-base, a timer sent with a 2 s delay is due 2 s ahead by the wall clock (before: a day
  and 2 s), and one sent before it, with a delay stamped under the clock that was ahead, fires
  late by the step, never early; the re-base is an ERROR line, a stats line and a metric;
- an in-flight message keeps the real time its invisible duration had left (before: a day more),
  in memory and in the consumer-group store;
- after a restart with the clock right, in-flight messages stamped a day ahead come back when
  their duration could have ended, or at most the longest invisible duration later (before: a day);
- retention deletes a segment `retention_ms` after its records were stored (before: a day later);
- the dedupe window forgets an id `dedupe_window_ms` after its send (before: a day later, and the
  id sent again meanwhile was answered with the first send's result and stored nowhere);
- the timer loop's fire gap, measured before a step back, does not hold the next fire;
- auto-renew deadlines follow a re-base (before: renewals stopped for a day and the message came
  back to another consumer).
No test sleeps for real but the timer-loop and sleeper tests (a few ms; at most 2 s on failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chronoq.broker import Broker
from chronoq.cli.stats import render
from chronoq.clock import MAX_BACKWARD_STEP_MS, SystemClock
from chronoq.config import Config, ConfigError
from chronoq.http.metrics import make_registry
from chronoq.model import OutgoingMessage, StoredMessage, TimerState
from chronoq.server.renewals import Renewals
from chronoq.store import files
from chronoq.store.groups import GroupStore
from tests.support.brokers import open_broker, simulated_broker
from tests.support.clocks import DAY_MS, HOUR_MS, MINUTE_MS, SECOND_MS, START_MS, Machine

GROUP = "g-ahead"
SMALL_SEGMENTS = {"segment_size_bytes": 4096, "max_message_size_bytes": 2048}


async def one_queue_broker(data_dir: Path, clock: Any, **overrides: Any) -> Broker:
    return await simulated_broker(data_dir, clock, **{"default_queue_count": 1, **overrides})


async def drain(broker: Broker, topic: str) -> list[StoredMessage]:
    out = []
    while got := await broker.receive(GROUP, topic, batch_size=64):
        for r in got:
            await broker.ack(GROUP, topic, r.receipt_handle)
            out.append(r.message)
    return out


async def redelivered(broker: Broker, topic: str) -> list[tuple[str, int]]:
    """(message id, attempt) of what a receive hands out now; each stays in flight an hour."""
    got = await broker.receive(GROUP, topic, batch_size=64, invisible_duration_ms=HOUR_MS)
    return [(r.message.message_id, r.delivery_attempt) for r in got]


# -- the clock alone -----------------------------------------------------------------------------


def test_a_step_back_past_the_setting_rebases_broker_time_once_with_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    m = Machine()
    clock = m.clock(max_backward_step_ms=MINUTE_MS)
    calls: list[tuple[int, int]] = []
    stop = clock.add_rebase_listener(lambda step_ms, now_ms: calls.append((step_ms, now_ms)))
    with caplog.at_level(logging.INFO, logger="chronoq.clock"):
        m.run(SECOND_MS)
        paused_at = clock.now_ms()
        m.step(-MINUTE_MS)  # exactly the setting: a pause, as before
        assert clock.now_ms() == paused_at and clock.rebases == 0 and calls == []
        m.step(-1)  # one ms more: re-based to the wall clock, once
        assert clock.now_ms() == m.wall_ms == paused_at - MINUTE_MS - 1
        assert calls == [(MINUTE_MS + 1, m.wall_ms)]
        for _ in range(100):
            m.run(10)
            assert clock.now_ms() == m.wall_ms  # and follows it from there
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "60001 ms" in errors[0].getMessage()
        assert "clock_max_backward_step_ms=60000" in errors[0].getMessage()
    assert (clock.rebases, clock.rebased_ms, clock.last_rebase_ms) == (1, MINUTE_MS + 1, MINUTE_MS + 1)
    rebased_at = clock.last_rebase_at_ms
    m.step(-DAY_MS)
    clock.now_ms()
    assert calls[1] == (DAY_MS, m.wall_ms) and clock.rebased_ms == DAY_MS + MINUTE_MS + 1
    assert clock.stats() == {"behind_wall_ms": 0, "max_backward_step_ms": MINUTE_MS, "rebases": 2,
                             "rebased_ms": DAY_MS + MINUTE_MS + 1, "last_rebase_ms": DAY_MS,
                             "last_rebase_at_ms": m.wall_ms}
    assert rebased_at is not None and rebased_at > m.wall_ms
    stop()
    m.step(-DAY_MS)
    clock.now_ms()
    assert len(calls) == 2 and clock.rebases == 3  # a listener stopped is not called


def test_the_fire_horizon_is_the_wall_clock_while_broker_time_is_paused() -> None:
    m = Machine()
    clock = m.clock()
    m.run(SECOND_MS)
    paused_at = clock.now_ms()
    assert clock.fire_horizon_ms() == paused_at  # in step: the horizon is broker time
    m.step(-30 * SECOND_MS)
    assert clock.now_ms() == paused_at
    assert clock.fire_horizon_ms() == m.wall_ms == paused_at - 30 * SECOND_MS
    assert clock.horizon_wait_ms(m.wall_ms) == 0
    # Within broker time's reach, a correction could bring the horizon there at any moment: look
    # every 20 ms. Past it, the horizon moves no faster than broker time could run.
    assert clock.horizon_wait_ms(m.wall_ms + 4 * SECOND_MS) == 20
    assert clock.horizon_wait_ms(paused_at + 10 * SECOND_MS) == 10 * SECOND_MS
    m.run(4 * SECOND_MS)
    assert clock.fire_horizon_ms() == m.wall_ms and clock.now_ms() == paused_at
    m.step(HOUR_MS)  # a forward step: broker time runs on behind the wall clock, and is the horizon
    assert clock.fire_horizon_ms() == clock.now_ms() < m.wall_ms


def test_a_broker_time_sleeper_follows_a_rebase_and_a_horizon_sleeper_a_step_back() -> None:
    """Real waits of a few ms: `sleep_until` (the auto-renew loop's) waits for a broker-time
    deadline, which a re-base moves back; `sleep_until_horizon` (the timer loop's) returns to
    its caller once the wall clock went back, so it can look again at what is due."""
    m = Machine()
    clock = m.clock()

    async def body() -> None:
        deadline = clock.now_ms() + 5
        sleeper = asyncio.create_task(clock.sleep_until(deadline))
        await asyncio.sleep(0)
        m.step(-DAY_MS)
        m.run(5)
        await asyncio.wait_for(sleeper, 2)  # before: broker time had a day to go
        assert clock.rebases == 1 and clock.now_ms() == deadline - DAY_MS

        m.step(-30 * SECOND_MS)  # paused: the horizon is the wall clock
        horizon = asyncio.create_task(clock.sleep_until_horizon(clock.now_ms(), clock.fire_horizon_ms()))
        await asyncio.sleep(0.03)
        assert not horizon.done()
        m.step(-10 * SECOND_MS)  # back again, within the setting: still paused, the horizon went back
        await asyncio.wait_for(horizon, 2)
        assert clock.fire_horizon_ms() == m.wall_ms < clock.now_ms()
        # A step back between the caller's look and the sleep: its first look returns.
        chosen_at = clock.fire_horizon_ms()
        m.step(-SECOND_MS)
        await asyncio.wait_for(clock.sleep_until_horizon(chosen_at + HOUR_MS, chosen_at), 0.1)

    asyncio.run(body())


def test_the_step_back_bound_is_a_named_limit(tmp_path: Path) -> None:
    for bad in (0, 999, DAY_MS + 1):
        with pytest.raises(ConfigError, match="clock_max_backward_step_ms"):
            Config(clock_max_backward_step_ms=bad)
    assert Config().clock_max_backward_step_ms == MAX_BACKWARD_STEP_MS == MINUTE_MS
    assert Config.load(env={"CHRONOQ_CLOCK_MAX_BACKWARD_STEP_MS": "5000"}).clock_max_backward_step_ms == 5000
    with pytest.raises(ValueError, match="max_backward_step_ms"):
        SystemClock(max_backward_step_ms=0)

    async def body() -> None:
        b = await open_broker(Config(data_dir=tmp_path, clock_max_backward_step_ms=5000), background=False)
        try:
            assert b.stats()["clock"]["max_backward_step_ms"] == 5000  # the broker's own clock gets it
        finally:
            await b.close()

    asyncio.run(body())


# -- through a broker, in one run -----------------------------------------------------------------


@pytest.mark.parametrize("ahead_ms", [30 * SECOND_MS, DAY_MS], ids=["paused", "rebased"])
def test_a_timer_at_an_absolute_time_waits_for_the_wall_clock_after_a_clock_ahead_is_set_right(
        tmp_path: Path, ahead_ms: int) -> None:
    """The official clients send every timer as an absolute due time from their own clock."""
    async def body() -> None:
        m = Machine(wall_ms=START_MS + ahead_ms)
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            m.run(SECOND_MS)
            m.step(-ahead_ms)  # set right
            due = m.wall_ms + 4 * SECOND_MS  # the client's clock, which is right: 4 s from now
            r = await b.send(OutgoingMessage("orders", b"in 4 s", deliver_at_ms=due))
            other = await b.send(OutgoingMessage("orders", b"cancelled", deliver_at_ms=due))
            assert other.recall_handle is not None
            assert await b.cancel(recall_handle=other.recall_handle) == other.message_id  # not fired: cancellable
            assert await b.fire_timers([r.position]) == (0, 1)  # Spark's FireTimers: not due either
            m.run(4 * SECOND_MS - 1)
            assert await b.run_due() == 0
            assert await drain(b, "orders") == []
            assert b.query(r.message_id)[0].state is TimerState.PENDING
            m.run(1)  # the wall clock reaches the due time
            assert await b.run_due() == 1
            assert [x.message_id for x in await drain(b, "orders")] == [r.message_id]
        finally:
            await b.close()

    asyncio.run(body())


def test_after_a_rebase_a_delay_is_due_by_the_wall_clock_and_one_stamped_before_fires_late_not_early(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            before = await b.send(OutgoingMessage("orders", b"ten minutes, a day ahead", delay_ms=10 * MINUTE_MS))
            assert before.deliver_at_ms == START_MS + DAY_MS + 10 * MINUTE_MS
            m.run(SECOND_MS)
            m.step(-DAY_MS)
            with caplog.at_level(logging.ERROR, logger="chronoq.clock"):
                after = await b.send(OutgoingMessage("orders", b"two seconds", delay_ms=2 * SECOND_MS))
            assert after.deliver_at_ms == m.wall_ms + 2 * SECOND_MS  # before: a day and 2 s ahead
            [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert f"moved back {DAY_MS} ms" in error.getMessage()
            m.run(2 * SECOND_MS - 1)
            assert await b.run_due() == 0
            m.run(1)
            assert await b.run_due() == 1
            assert [x.message_id for x in await drain(b, "orders")] == [after.message_id]
            # The one stamped under the clock that was ahead: its due time is a fact in the log, so
            # it fires when the wall clock reaches it: a day late in real time, never early.
            m.run(10 * MINUTE_MS)
            assert await b.run_due() == 0
            m.run(before.deliver_at_ms - 1 - m.wall_ms)
            assert await b.run_due() == 0
            m.run(1)
            assert await b.run_due() == 1
            clock = b.stats()["clock"]
            assert (clock["rebases"], clock["last_rebase_ms"], clock["behind_wall_ms"]) == (1, DAY_MS, 0)
        finally:
            await b.close()

    asyncio.run(body())


def test_a_rebase_is_a_stats_line_and_metrics(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            metrics = _samples(b)
            assert (metrics["chronoq_clock_rebases_total"], metrics["chronoq_clock_last_rebase_ms"]) == (0, 0)
            assert not [line for line in render(b.stats()) if "RE-BASED" in line]
            m.step(-DAY_MS)
            m.run(5 * MINUTE_MS)
            metrics = _samples(b)
            assert metrics["chronoq_clock_rebases_total"] == 1
            assert metrics["chronoq_clock_last_rebase_ms"] == DAY_MS
            assert metrics["chronoq_clock_behind_wall_ms"] == 0
            m.run(5 * MINUTE_MS)
            [line] = [line for line in render(b.stats()) if "RE-BASED" in line]
            assert line.strip() == "RE-BASED 1x after steps back over 1m00s: last by 1 day, 5m00s ago"
            assert len(line) <= 80
        finally:
            await b.close()

    asyncio.run(body())


def _samples(b: Broker) -> dict[str, float]:
    text = generate_latest(make_registry(b)).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("chronoq_clock_")}


def test_after_a_rebase_an_in_flight_message_keeps_the_real_time_it_had_left(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            sent = await b.send(OutgoingMessage("work", b"work"))
            [held] = await b.receive(GROUP, "work", invisible_duration_ms=30 * SECOND_MS)
            m.run(10 * SECOND_MS)
            m.step(-DAY_MS)
            assert await redelivered(b, "work") == []  # the re-base happens at this reading
            m.run(20 * SECOND_MS - 1)
            assert await redelivered(b, "work") == []  # never early: 30 s of real time not yet over
            # In the store too: a restart now would find the time the message has left, not a day more.
            stored = _stored_visible_ms(b, held.receipt_handle)
            assert stored == m.wall_ms + 1
            m.run(1)
            assert await redelivered(b, "work") == [(sent.message_id, 2)]  # before: a day later
        finally:
            await b.close()

    asyncio.run(body())


def _stored_visible_ms(b: Broker, handle: str) -> int:
    """The visible time the consumer-group store holds for `handle`'s message, read from RocksDB."""
    entry = b.groups.lookup_handle(GROUP, "work", handle)
    raw = b.groups._db.get(b"i" + GROUP.encode() + b"\x00" + b"work" + b"\x00"
                           + entry.queue_id.to_bytes(4, "big") + entry.offset.to_bytes(8, "big"))
    assert raw is not None
    return int.from_bytes(raw[3:11], "big")  # >BHQ...: version, attempt, visible_ms


def test_after_a_rebase_the_dedupe_window_lasts_its_real_length(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, m.clock())
        try:
            first = await b.send(OutgoingMessage("orders", b"first", message_id="order-1"))
            m.run(SECOND_MS)
            m.step(-DAY_MS)
            retry = await b.send(OutgoingMessage("orders", b"first", message_id="order-1"))
            assert retry.duplicate and retry.position == first.position  # a retry within the window
            m.run(b.config.dedupe_window_ms)
            reused = await b.send(OutgoingMessage("orders", b"second", message_id="order-1"))
            assert not reused.duplicate  # the id reused after the window is stored (before: a day later)
            assert [x.body for x in await drain(b, "orders")] == [b"first", b"second"]
        finally:
            await b.close()

    asyncio.run(body())


def test_retention_deletes_on_time_after_a_rebase(tmp_path: Path) -> None:
    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, m.clock(), retention_ms=HOUR_MS, **SMALL_SEGMENTS)
        try:
            for i in range(40):
                await b.send(OutgoingMessage("orders", b"x" * 200, message_id=f"m-{i:02d}"))
            assert len(b.store.log.segments()) >= 3
            m.run(SECOND_MS)
            m.step(-DAY_MS)  # set right: the records were stored 1 s ago, in real time
            m.run(HOUR_MS - 2 * SECOND_MS)
            await b.enforce_retention()
            assert b.store.log.start_position == 0  # an hour has not passed: nothing goes early
            m.run(2 * SECOND_MS)
            await b.enforce_retention()
            assert b.stats()["clock"]["rebases"] == 1
            assert b.store.log.start_position > 0  # before: kept a day longer
        finally:
            await b.close()

    asyncio.run(body())


def test_a_step_back_does_not_hold_the_next_fire_for_the_fire_gap(tmp_path: Path) -> None:
    """The real timer loop (a few ms of real time). A fire step opens a 1 s gap measured on the
    fire horizon; the wall clock then goes back 30 s. A timer already due by the wall clock fires
    at once: the gap's end lies 30 s of wall clock away and must not hold it."""
    async def body() -> None:
        m = Machine()
        b = await open_broker(Config(data_dir=tmp_path, default_queue_count=1, timer_fire_gap_ms=1000), m.clock())
        try:
            first = await b.send(OutgoingMessage("orders", b"due now", deliver_at_ms=m.wall_ms))
            await _until_delivered(b, first.message_id)
            m.step(-30 * SECOND_MS)
            second = await b.send(OutgoingMessage("orders", b"due by the wall clock", deliver_at_ms=m.wall_ms))
            await _until_delivered(b, second.message_id)
        finally:
            await b.close()

    asyncio.run(body())


async def _until_delivered(b: Broker, message_id: str) -> None:
    give_up = time.monotonic() + 2
    while b.query(message_id)[0].state is not TimerState.DELIVERED:
        assert time.monotonic() < give_up, f"{message_id} did not fire within 2 s"
        await asyncio.sleep(0.005)


def test_auto_renew_deadlines_follow_a_rebase() -> None:
    class Renewing:
        def __init__(self) -> None:
            self.renewed: list[str] = []

        async def change_invisible_duration(self, group: str, topic: str, handle: str, duration_ms: int) -> str:
            self.renewed.append(handle)
            return handle + "+"

    async def body() -> None:
        m = Machine(wall_ms=START_MS + DAY_MS)
        clock = m.clock()
        broker = Renewing()
        renewals = Renewals(broker, clock, duration_ms=30 * SECOND_MS, max_hold_ms=2 * MINUTE_MS, max_clients=10)
        renewals.hold("h", group=GROUP, topic="work", client_id="c", invisible_until_ms=clock.now_ms() + 30 * SECOND_MS)
        m.step(-DAY_MS)
        clock.now_ms()  # re-based
        m.run(20 * SECOND_MS - 1)
        await renewals.renew_due()
        assert broker.renewed == []  # more than a third of 30 s left
        m.run(1)
        await renewals.renew_due()
        assert broker.renewed == ["h"]  # before: nothing renewed for a day, the message came back
        for _ in range(9):  # the client keeps calling; it is let go 2 min after its receive
            m.run(10 * SECOND_MS)
            renewals.touch("c")
            await renewals.renew_due()
        assert len(renewals) == 1
        m.run(10 * SECOND_MS)
        renewals.touch("c")
        await renewals.renew_due()
        assert len(renewals) == 0  # before: held a day longer

    asyncio.run(body())


# -- across a restart ------------------------------------------------------------------------------


def test_a_restart_with_the_clock_set_right_holds_in_flight_messages_no_longer_than_their_duration(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        ahead = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, ahead.clock())
        try:
            plain = await b.send(OutgoingMessage("work", b"plain"))
            renewed = await b.send(OutgoingMessage("work", b"renewed"))
            [r1, r2] = await b.receive(GROUP, "work", batch_size=2, invisible_duration_ms=30 * SECOND_MS)
            assert (r1.message.message_id, r2.message.message_id) == (plain.message_id, renewed.message_id)
            ahead.run(10 * SECOND_MS)
            await b.change_invisible_duration(GROUP, "work", r2.receipt_handle, MINUTE_MS)
            ahead.run(SECOND_MS)
        finally:
            await b.close()
        # Set right while the broker was down; 11 s of real time since the receive.
        m = Machine(wall_ms=START_MS + 11 * SECOND_MS)
        with caplog.at_level(logging.WARNING, logger="chronoq.store"):
            b = await one_queue_broker(tmp_path, m.clock())
        try:
            [warning] = [r for r in caplog.records if "in-flight" in r.getMessage()]
            assert "2 in-flight messages" in warning.getMessage()
            now = m.wall_ms
            # plain: its 30 s end 19 s from now in real time; it is back 30 s from now (the 11 s
            # since the receive count again: late by them, never early). Before: a day.
            m.run(30 * SECOND_MS - 1)
            assert await redelivered(b, "work") == []
            m.run(1)
            assert await redelivered(b, "work") == [(plain.message_id, 2)]
            # renewed: its minute ends 59 s from now; back 70 s from now (its visible time less
            # its first delivery).
            m.run(now + 70 * SECOND_MS - 1 - m.wall_ms)
            assert await redelivered(b, "work") == []
            m.run(1)
            assert await redelivered(b, "work") == [(renewed.message_id, 2)]
        finally:
            await b.close()

    asyncio.run(body())


def test_a_restart_brings_in_flight_times_a_clock_ahead_stamped_to_within_the_longest_duration(
        tmp_path: Path) -> None:
    """First delivered under a right clock, delivered again under one a day ahead (its first
    delivery tells nothing then), and the broker restarted with the clock right: it waits at
    most the longest invisible duration the broker sets (max_invisible_duration_ms, 1 h here;
    the longest delay level, 10 s, is shorter)."""
    settings = {"max_invisible_duration_ms": HOUR_MS, "delay_levels": "1s 5s 10s"}

    async def body() -> None:
        m = Machine()
        b = await one_queue_broker(tmp_path, m.clock(), **settings)
        try:
            sent = await b.send(OutgoingMessage("work", b"work"))
            assert await redelivered(b, "work") == [(sent.message_id, 1)]
        finally:
            await b.close()
        ahead = Machine(wall_ms=START_MS + DAY_MS)
        b = await one_queue_broker(tmp_path, ahead.clock(), **settings)
        try:
            assert await b.receive(GROUP, "work", invisible_duration_ms=30 * SECOND_MS) != []
        finally:
            await b.close()
        m = Machine(wall_ms=START_MS + 2 * SECOND_MS)
        await (await one_queue_broker(tmp_path, m.clock(), **settings)).close()
        # What the open moved is stored: another open finds nothing ahead.
        groups = GroupStore(tmp_path / files.GROUPS_DIR)
        try:
            assert groups.restamp_ahead(m.wall_ms, HOUR_MS) == (0, 0)
        finally:
            groups.close()
        b = await one_queue_broker(tmp_path, m.clock(), **settings)
        try:
            m.run(HOUR_MS - 1)
            assert await redelivered(b, "work") == []
            m.run(1)
            assert await redelivered(b, "work") == [(sent.message_id, 3)]  # before: a day
        finally:
            await b.close()

    asyncio.run(body())
