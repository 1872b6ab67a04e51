"""Property: whatever the schedule, cancels and restarts, no timer fires early, and every timer
not successfully cancelled is delivered exactly once (hypothesis, simulated time).

Hypothesis draws a program of steps: send timers (relative, absolute, past, same-ms bursts,
delay levels), cancel a sent one, move the clock (firing or not), restart the broker (close +
reopen on the same directory, the FakeClock continuing), lose the timer index outright
(deleted before the reopen, rebuilt from the log), or put back the index as it was at the
previous restart (a crash between log appends and index writes: replay must neither lose a
timer nor fire one twice). After every step the test drains the real
topics and checks each delivered copy was stored no earlier than the time asked for. At the end
the clock jumps past every deadline and the delivered set must equal sent minus cancelled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq import envvars
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.errors import TimerAlreadyFired, TimerNotFound
from chronoq.model import OutgoingMessage, StoredMessage
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, drain, restore_index, run, snapshot_index, timer_dir

pytestmark = pytest.mark.usefixtures("each_timer_engine")

TOPICS = ("pa", "pb")
LEVELS_MS = (1000, 5000, 10_000)

send_step = st.tuples(st.just("send"), st.sampled_from(TOPICS), st.sampled_from(["delay", "at", "level"]),
                      st.integers(-2000, 20_000), st.integers(1, 4))
cancel_step = st.tuples(st.just("cancel"), st.integers(0, 10_000), st.booleans())
advance_step = st.tuples(st.just("advance"), st.integers(0, 6000), st.booleans())
restart_step = st.tuples(st.just("restart"), st.sampled_from(["clean", "lose-index", "stale-index"]))
steps = st.lists(st.one_of(send_step, send_step, cancel_step, advance_step, advance_step, restart_step),
                 min_size=1, max_size=30)


class Model:
    def __init__(self) -> None:
        self.asked: dict[tuple[str, str], int] = {}  # (topic, id) -> earliest allowed delivery ms
        self.handles: list[tuple[str, str, str | None, bool]] = []  # (topic, id, recall handle, is level)
        self.cancelled: set[tuple[str, str]] = set()
        self.delivered: list[tuple[str, str]] = []

    def check(self, got: list[StoredMessage]) -> None:
        for m in got:
            key = (m.topic, m.message_id)
            assert key in self.asked, key
            assert m.store_ms >= self.asked[key], ("fired early", key, m.store_ms, self.asked[key])
            assert key not in self.cancelled, ("a cancelled timer fired", key)
            self.delivered.append(key)


class Runner:
    """Applies one drawn step at a time to a live broker and the model."""

    def __init__(self, data: Path, precision_ms: int) -> None:
        self.data = data
        self.stale = data.parent / (data.name + "-stale-index")
        self.clock = FakeClock(START_MS)
        self.cfg = {"timer_precision_ms": precision_ms, "delay_levels": "1s 5s 10s"}
        self.model = Model()
        self.b: Broker | None = None

    async def open(self) -> None:
        self.b = await simulated_broker(self.data, self.clock, **self.cfg)

    async def drain_all(self) -> None:
        assert self.b is not None
        for t in TOPICS:
            if t in self.b.store.topics:  # a topic nothing was sent to does not exist (receive refuses it)
                self.model.check(await drain(self.b, t))

    async def send(self, topic: str, how: str, amount: int, burst: int) -> None:
        assert self.b is not None
        now = self.clock.now_ms()
        for _ in range(burst):
            if how == "delay":
                msg, asked = OutgoingMessage(topic, b"d", delay_ms=max(amount, 0)), now + max(amount, 0)
            elif how == "at":
                msg, asked = OutgoingMessage(topic, b"a", deliver_at_ms=now + amount), now + amount
            else:
                level = amount % 3 + 1
                msg, asked = OutgoingMessage(topic, b"l", delay_level=level), now + LEVELS_MS[level - 1]
            r = await self.b.send(msg)
            assert r.deliver_at_ms is not None and r.deliver_at_ms >= asked
            assert (r.recall_handle is None) == (how == "level")
            self.model.asked[(topic, r.message_id)] = asked
            self.model.handles.append((topic, r.message_id, r.recall_handle, how == "level"))

    async def cancel(self, pick: int, by_handle: bool) -> None:
        assert self.b is not None
        if not self.model.handles:
            return
        topic, mid, handle, is_level = self.model.handles[pick % len(self.model.handles)]
        if (topic, mid) in self.model.cancelled:
            return
        try:
            if by_handle and handle is not None:
                await self.b.cancel(recall_handle=handle)
            else:
                await self.b.cancel(topic=topic, message_id=mid)
        except TimerAlreadyFired:
            assert self.model.asked[(topic, mid)] <= self.clock.now_ms()  # refused only once due
        except TimerNotFound:
            assert is_level  # delay-level messages (RocketMQ 4 path) are not recallable
        else:
            assert not is_level
            assert (topic, mid) not in self.model.delivered
            self.model.cancelled.add((topic, mid))

    async def advance(self, delta_ms: int, fire: bool) -> None:
        assert self.b is not None
        self.clock.advance(delta_ms)
        if fire:
            await self.b.run_due()

    async def restart(self, how: str) -> None:
        assert self.b is not None
        await self.b.close()
        # An index kept only in memory is lost at every restart: "lose-index" is what "clean"
        # does to it, and there is no file to put an older copy of back.
        if how == "lose-index" and timer_dir(self.data).exists():
            shutil.rmtree(timer_dir(self.data))
        elif how == "stale-index" and self.stale.exists():
            # As if the process died after appending records the index never heard of
            # (timers, tombstones, fired copies) since the previous restart.
            restore_index(self.data, self.stale)
        if timer_dir(self.data).exists():
            snapshot_index(self.data, self.stale)
        await self.open()

    async def finish(self) -> None:
        assert self.b is not None
        self.clock.advance(40_000)
        await self.b.run_due()
        await self.drain_all()
        expected = sorted(set(self.model.asked) - self.model.cancelled)
        assert sorted(self.model.delivered) == expected, "every uncancelled timer delivered exactly once"
        assert self.b.stats()["timer"]["pending_total"] == 0


async def _program(data: Path, program: list[tuple], precision_ms: int) -> None:
    runner = Runner(data, precision_ms)
    await runner.open()
    try:
        for kind, *args in program:
            await getattr(runner, kind)(*args)
            await runner.drain_all()
        await runner.finish()
    finally:
        if runner.b is not None:
            await runner.b.close()


# slow: a long property run (seconds); plain pytest stays under 2 minutes, scripts/test.sh runs it
@pytest.mark.slow
@settings(max_examples=int(os.environ.get(envvars.PROP_EXAMPLES, "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(program=steps, precision_ms=st.sampled_from([1, 1, 250, 1000]))
def test_no_timer_fires_early_and_each_fires_once(program: list[tuple], precision_ms: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="chronoq-prop-"))
    try:
        run(_program(root / "data", program, precision_ms))
    finally:
        shutil.rmtree(root, ignore_errors=True)
