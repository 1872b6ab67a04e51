"""Clocks: the only place chronoq reads the time.

Theory of operation: every component below the server takes `now_ms` as an argument or holds a
`Clock`; nothing else reads the time for a broker decision. `SystemClock` is the broker's real
clock, `FakeClock` lets a test jump a two-day delay in one call, `WallClock` is the plain wall
clock for stamps that are only reported (the SDK's born and received times).

Broker time B (`SystemClock`) is built from two kernel clocks: the wall clock W
(CLOCK_REALTIME, `time.time_ns`), which says what time it is but can be *stepped* (set back or
forward by an administrator, a bad NTP server, a VM restored from a snapshot), and the monotonic
clock (CLOCK_MONOTONIC, `time.monotonic_ns`), which is never stepped: NTP slews it together with
W, so while nobody steps W the two run at the same rate. B obeys these rules:
- it never runs faster than real time, i.e. the monotonic clock, except by `catchup_ppm` while
  behind W (a step forward of S leaves B behind W by S: everything runs late, never early,
  until a restart or until the catch-up closes the gap, which shortens running delays by that
  fraction; it also keeps B with a wall clock that gains on the monotonic clock without steps,
  as virtual machines' clocks do (0.5 % was seen on one). `Config.clock_catchup_ppm` is 2 % by default; 0 never
  catches up);
- it never gets ahead of W by more than `max_backward_step_ms` (B is W whenever the two agree,
  so due times and store times are wall-clock times a person can read);
- it goes back only by a *re-base*: a step back of S *pauses* B until W catches up (what B
  stamps, relative delays and invisible durations, comes up to S late, never early), unless S
  is more than `max_backward_step_ms` (`Config.clock_max_backward_step_ms`, 1 min by default):
  then B is set to W at once, an ERROR is logged and counted (`stats()`), and the listeners
  (`add_rebase_listener`) move what they stamped in the old broker time back by the step, so
  each keeps the real time it had left. A pause therefore lasts at most that setting.
Each reading: `elapsed = mono - last_mono`, `candidate = B + elapsed (+ elapsed * catchup_ppm /
1e6 while W is ahead)`, `B = max(B, min(W, candidate))`; then, if `B - W` is more than the
setting, `B = W`, and the step the listeners are given is `candidate - W` (the real time since
the last reading counts: a stamp keeps the time it had left however rarely the clock is read).
At construction B = W: a restart has no monotonic reference to the previous run, so a step made
while the broker was down is adopted. A gap between B and W of more than `STEP_WARNING_MS` is
logged once per step, not per reading.

Timers fire by the *fire horizon* `min(B, W)` (`fire_horizon_ms`), not by B: a due time a client
stamps with its own wall clock (an absolute delivery time, as the official clients send every
timer) must not fire before W reaches it, and while B is paused ahead of W it would. B <= W
except during a pause, so in normal running the horizon is B. Due times are never moved by a
re-base (an absolute one is a wall-clock fact): a timer due by a relative delay stamped under a
clock that was ahead fires late by that much, never early.

`FakeClock.advance()` moves time forward and wakes every sleeper whose deadline has come, in
deadline order, so background loops driven by it stay deterministic. It never re-bases. Every
wait of a broker's background task is one of the clock's (`sleep_until`, `sleep_until_horizon`,
`sleep_ms`: the timer loop, the checkpoint and retention ticks, a full disk's retry), so a test
on a `FakeClock` runs them exactly when it moves the clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("chronoq.clock")

NS_PER_MS = 1_000_000
PPM = 1_000_000
STEP_WARNING_MS = 1000
"""Broker time and the wall clock further apart than this: the wall clock was stepped; logged."""
PAUSED_POLL_MS = 20
"""While broker time is paused (the wall clock stepped back), a sleeper looks again this often:
the pause ends when the wall clock catches up, or at once if it is stepped forward again, and
the second cannot be foreseen. Short enough to be on time after such a correction, long enough
not to spin (50 readings a second)."""
MAX_BACKWARD_STEP_MS = 60_000
"""Default of `Config.clock_max_backward_step_ms` (and of `SystemClock`'s `max_backward_step_ms`)."""

RebaseListener = Callable[[int, int], None]
"""`(step_ms, now_ms)`: broker time was just moved back by `step_ms` to `now_ms`. Called on the
reading that found the step, before that reading returns; it must not read the clock."""


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...

    def fire_horizon_ms(self) -> int:
        """The latest due time a timer may fire at now: `min(now_ms(), the wall clock)`."""
        ...

    async def sleep_until(self, deadline_ms: int) -> None:
        """Return once `now_ms() >= deadline_ms` (may return later, never earlier). A deadline
        in broker time moves back with a re-base, as the stamps it was computed from do."""
        ...

    async def sleep_until_horizon(self, deadline_ms: int, from_ms: int) -> None:
        """Return once `fire_horizon_ms() >= deadline_ms`, or at a look that finds the horizon
        below `from_ms`, the horizon the caller chose the deadline at (the wall clock went back
        since: the caller looks again at what is due); never earlier."""
        ...

    async def sleep_ms(self, interval_ms: int) -> None:
        """Return once `interval_ms` has passed on this clock, as a periodic task waits between
        its runs. `SystemClock`: real (event-loop) time, which a step of the wall clock or a
        pause of broker time neither shortens nor lengthens; `FakeClock`: until the test has
        moved it on that far."""
        ...

    def real_wait_ms(self, deadline_ms: int) -> float:
        """Real (event-loop) milliseconds to wait before looking again whether `now_ms()` has
        reached `deadline_ms`: 0 if it has; otherwise never so long that the deadline passes
        unseen (except by `PAUSED_POLL_MS` after a paused clock is stepped forward again)."""
        ...

    def add_rebase_listener(self, listener: RebaseListener) -> Callable[[], None]:
        """Call `listener` at every re-base; returns the call that stops it."""
        ...

    def stats(self) -> dict[str, Any]:
        """`behind_wall_ms` (W - B), the re-base setting, and the re-bases so far."""
        ...


class SystemClock:
    """Broker time: see the module's theory of operation. `wall_ns`, `mono_ns` are injectable so
    tests can step the wall clock; `catchup_ppm` is `Config.clock_catchup_ppm`,
    `max_backward_step_ms` is `Config.clock_max_backward_step_ms`."""

    def __init__(self, wall_ns: Callable[[], int] = time.time_ns, mono_ns: Callable[[], int] = time.monotonic_ns,
                 catchup_ppm: int = 0, max_backward_step_ms: int = MAX_BACKWARD_STEP_MS) -> None:
        if isinstance(catchup_ppm, bool) or not isinstance(catchup_ppm, int) or not 0 <= catchup_ppm <= PPM:
            raise ValueError(f"catchup_ppm must be an integer in 0..{PPM}, not {catchup_ppm!r}")
        if isinstance(max_backward_step_ms, bool) or not isinstance(max_backward_step_ms, int) \
                or max_backward_step_ms < 1:
            raise ValueError(f"max_backward_step_ms must be a positive integer, not {max_backward_step_ms!r}")
        self._wall_ns = wall_ns
        self._mono_ns = mono_ns
        self._catchup_ppm = catchup_ppm
        self._max_backward_step_ms = max_backward_step_ms
        self._max_backward_step_ns = max_backward_step_ms * NS_PER_MS
        self._last_mono_ns = mono_ns()
        self._broker_ns = wall_ns()
        self._wall_at_read_ns = self._broker_ns
        self._reported_gap_ms = 0
        """The gap W - B last logged (0: in step): a new warning only for a new step."""
        self._listeners: list[RebaseListener] = []
        self.rebases = 0
        """Re-bases since start (steps back of more than `max_backward_step_ms`)."""
        self.rebased_ms = 0
        """How far re-bases have moved broker time back since start, in total."""
        self.last_rebase_ms: int | None = None
        """How far the last re-base moved broker time back (None: none yet)."""
        self.last_rebase_at_ms: int | None = None
        """Broker time just after the last re-base (the wall clock then)."""

    def _read(self) -> int:
        """Advance broker time by this reading; return it (ns). Also keeps W of this reading."""
        mono = self._mono_ns()
        wall = self._wall_ns()
        elapsed = max(0, mono - self._last_mono_ns)  # monotonic never goes back; an injected one might
        self._last_mono_ns = mono
        candidate = self._broker_ns + elapsed
        if wall > candidate and self._catchup_ppm:
            candidate += elapsed * self._catchup_ppm // PPM
        broker = max(self._broker_ns, min(wall, candidate))
        self._broker_ns = broker
        self._wall_at_read_ns = wall
        if broker - wall > self._max_backward_step_ns:
            self._rebase(candidate, wall)
            return wall
        self._report_gap((wall - broker) // NS_PER_MS)
        return broker

    def _rebase(self, ran_on_ns: int, wall_ns: int) -> None:
        """The wall clock is behind broker time by more than the setting: broker time becomes
        the wall clock, and the listeners move their stamps back by the step, in whole ms as
        they stamped. The step is measured from `ran_on_ns`, where broker time would be had the
        wall clock not gone back (the last reading plus the real time since): the real time
        between that reading and this one counts, so a stamp keeps exactly the time it had left
        however long the broker went without reading its clock."""
        step_ms = ran_on_ns // NS_PER_MS - wall_ns // NS_PER_MS
        now_ms = wall_ns // NS_PER_MS
        self._broker_ns = wall_ns
        self._reported_gap_ms = 0
        self.rebases += 1
        self.rebased_ms += step_ms
        self.last_rebase_ms = step_ms
        self.last_rebase_at_ms = now_ms
        log.error("the wall clock went back, %d ms behind broker time, more than clock_max_backward_step_ms=%d: "
                  "broker time re-based to the wall clock (moved back %d ms). Invisible durations and retention "
                  "keep the real time they had left; timers due by a delay stamped before now fire up to that "
                  "much late, never early", step_ms, self._max_backward_step_ms, step_ms)
        for listener in list(self._listeners):
            try:
                listener(step_ms, now_ms)
            except Exception:
                log.exception("a re-base listener failed; the others still run")

    def _report_gap(self, gap_ms: int) -> None:
        reported = self._reported_gap_ms
        if abs(gap_ms) <= STEP_WARNING_MS:
            if reported:
                log.info("broker time is within %d ms of the wall clock again (%d ms behind it)",
                         STEP_WARNING_MS, gap_ms)
                self._reported_gap_ms = 0
            return
        # A new step: the gap changed sign, or grew by more than the threshold. A gap shrinking
        # (the wall clock catching up a pause, or catch-up closing a forward step) is no news.
        if (gap_ms > 0) != (reported > 0) or reported == 0 or abs(gap_ms) > abs(reported) + STEP_WARNING_MS:
            if gap_ms > 0:
                log.warning("the wall clock jumped forward: broker time is %d ms behind it (timers and "
                            "redeliveries late by that much, never early) and closes the gap at "
                            "clock_catchup_ppm=%d millionths of real time (0: never)", gap_ms, self._catchup_ppm)
            else:
                log.warning("the wall clock went back: broker time is %d ms ahead of it and pauses until it "
                            "catches up (timers and redeliveries late by up to that much, never early; more "
                            "than clock_max_backward_step_ms=%d re-bases it)", -gap_ms, self._max_backward_step_ms)
            self._reported_gap_ms = gap_ms

    def now_ms(self) -> int:
        return self._read() // NS_PER_MS

    def fire_horizon_ms(self) -> int:
        broker = self._read()
        return min(broker, self._wall_at_read_ns) // NS_PER_MS

    def behind_wall_ms(self) -> int:
        """W - B in ms after a fresh reading: > 0 broker time is behind the wall clock (a forward
        step not caught up), < 0 ahead of it (paused after a step back)."""
        broker = self._read()
        return (self._wall_at_read_ns - broker) // NS_PER_MS

    def stats(self) -> dict[str, Any]:
        return {"behind_wall_ms": self.behind_wall_ms(), "max_backward_step_ms": self._max_backward_step_ms,
                "rebases": self.rebases, "rebased_ms": self.rebased_ms, "last_rebase_ms": self.last_rebase_ms,
                "last_rebase_at_ms": self.last_rebase_at_ms}

    def add_rebase_listener(self, listener: RebaseListener) -> Callable[[], None]:
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def real_wait_ms(self, deadline_ms: int) -> float:
        broker = self._read()
        return self._broker_wait_ms(deadline_ms * NS_PER_MS - broker, broker, self._wall_at_read_ns)

    def _broker_wait_ms(self, remaining_ns: int, broker: int, wall: int) -> float:
        """Real ms until broker time `broker` can have moved on by `remaining_ns`, or until it is
        worth looking again (W of the same reading is `wall`)."""
        if remaining_ns <= 0:
            return 0.0
        if wall < broker:
            # Paused: B moves again when W reaches it (in `pause` of real time), or as soon as W is
            # stepped forward again; at the earliest in `remaining`. Look every PAUSED_POLL_MS,
            # but not past the moment the pause ends by itself.
            pause_ns = broker - wall
            wait_ns = min(remaining_ns + pause_ns, max(remaining_ns, PAUSED_POLL_MS * NS_PER_MS))
        elif wall > broker and self._catchup_ppm:
            # Catching up: B runs faster than real time by catchup_ppm (until it reaches W).
            wait_ns = remaining_ns * PPM // (PPM + self._catchup_ppm)
        else:
            wait_ns = remaining_ns
        return max(wait_ns, NS_PER_MS) / NS_PER_MS

    def horizon_wait_ms(self, deadline_ms: int) -> float:
        """Real ms to wait before looking again whether `fire_horizon_ms()` has reached
        `deadline_ms`: 0 if it has; never so long that it passes unseen (but by `PAUSED_POLL_MS`
        after a paused clock is stepped forward again)."""
        broker = self._read()
        wall = self._wall_at_read_ns
        deadline_ns = deadline_ms * NS_PER_MS
        if wall >= broker:
            return self._broker_wait_ms(deadline_ns - broker, broker, wall)  # the horizon is B
        # Paused: the horizon is W, which reaches the deadline in `remaining` of real time. A
        # correction (W stepped forward) can bring it up to B at any moment; past B it moves
        # no faster than B can run. So look every PAUSED_POLL_MS while the deadline is within
        # B's reach, and no later than W gets there by itself.
        remaining_ns = deadline_ns - wall
        if remaining_ns <= 0:
            return 0.0
        beyond_broker_ns = max(0, deadline_ns - broker) * PPM // (PPM + self._catchup_ppm)
        wait_ns = min(remaining_ns, max(beyond_broker_ns, PAUSED_POLL_MS * NS_PER_MS))
        return max(wait_ns, NS_PER_MS) / NS_PER_MS

    async def sleep_until(self, deadline_ms: int) -> None:
        # Sleep in one piece; wake-ups for earlier deadlines are the caller's business (it
        # cancels or races this sleep with an event). The loop guards against an early wake-up
        # (coarse event-loop timers, a pause): return only once broker time has the deadline.
        # The deadline was computed in broker time, so a re-base meanwhile moves it back too
        # (read after the reading that may have found the re-base).
        rebased_before = self.rebased_ms
        while True:
            broker = self._read()
            deadline_ns = (deadline_ms - (self.rebased_ms - rebased_before)) * NS_PER_MS
            wait_ms = self._broker_wait_ms(deadline_ns - broker, broker, self._wall_at_read_ns)
            if wait_ms <= 0:
                return
            await asyncio.sleep(wait_ms / 1000)

    async def sleep_ms(self, interval_ms: int) -> None:
        # Real time, not broker time: a checkpoint or retention tick must not stop for the
        # length of a pause after the wall clock stepped back.
        await asyncio.sleep(interval_ms / 1000)

    async def sleep_until_horizon(self, deadline_ms: int, from_ms: int) -> None:
        from_ns = from_ms * NS_PER_MS
        while (wait_ms := self.horizon_wait_ms(deadline_ms)) > 0:
            if min(self._broker_ns, self._wall_at_read_ns) < from_ns:
                return  # the wall clock went back: what is due, and when, is the caller's to ask again
            await asyncio.sleep(wait_ms / 1000)


class WallClock:
    """The wall clock as it is, steps and all: for times that are only stamped and reported
    (the SDK's born and received times), never for a broker decision."""

    def now_ms(self) -> int:
        return time.time_ns() // NS_PER_MS


class FakeClock:
    """A clock that moves only when told. Sleepers wake in deadline order on `advance`/`set`.
    It has no wall clock apart from itself: its fire horizon is its time, and it never re-bases."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._now_ms

    def fire_horizon_ms(self) -> int:
        return self._now_ms

    def real_wait_ms(self, deadline_ms: int) -> float:
        # Fake time has no real rate; a broker-time wait on it (a long poll's wake-up for a
        # redelivery) waits the fake distance in real time, as it always did, and looks again.
        return float(max(0, deadline_ms - self._now_ms))

    def add_rebase_listener(self, listener: RebaseListener) -> Callable[[], None]:
        return _nothing  # never re-bases: nothing to call

    def stats(self) -> dict[str, Any]:
        return {"behind_wall_ms": 0, "max_backward_step_ms": None, "rebases": 0, "rebased_ms": 0,
                "last_rebase_ms": None, "last_rebase_at_ms": None}

    async def sleep_until(self, deadline_ms: int) -> None:
        if deadline_ms <= self._now_ms:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline_ms, next(self._seq), fut))
        await fut

    async def sleep_until_horizon(self, deadline_ms: int, from_ms: int) -> None:
        await self.sleep_until(deadline_ms)  # a fake clock never goes back

    async def sleep_ms(self, interval_ms: int) -> None:
        await self.sleep_until(self._now_ms + interval_ms)

    def set(self, now_ms: int) -> None:
        if now_ms < self._now_ms:
            raise ValueError(f"FakeClock cannot go back: {now_ms} < {self._now_ms}")
        self._now_ms = now_ms
        while self._sleepers and self._sleepers[0][0] <= now_ms:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    def advance(self, delta_ms: int) -> None:
        self.set(self._now_ms + delta_ms)

    def next_sleeper_deadline_ms(self) -> int | None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None


def _nothing() -> None:
    return None
