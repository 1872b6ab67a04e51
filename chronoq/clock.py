"""Clocks: the only place chronoq reads the time.

Theory of operation: every component below the server takes `now_ms` as an argument or holds a
`Clock`; nothing else reads the time for a broker decision. `SystemClock` is the broker's real
clock, `FakeClock` lets a test jump a two-day delay in one call, `WallClock` is the plain wall
clock for stamps that are only reported (the SDK's born and received times).

Broker time B (`SystemClock`) is built from two kernel clocks: the wall clock W
(CLOCK_REALTIME, `time.time_ns`), which says what time it is but can be *stepped* (set back or
forward by an administrator, a bad NTP server, a VM restored from a snapshot), and the monotonic
clock (CLOCK_MONOTONIC, `time.monotonic_ns`), which is never stepped: NTP slews it together with
W, so while nobody steps W the two run at the same rate. B obeys three rules:
- it never goes back (a step back of S *pauses* it until W catches up: timers and redeliveries
  are late by up to S, never early);
- it never runs faster than real time, i.e. the monotonic clock, except by `catchup_ppm` while
  behind W (a step forward of S leaves B behind W by S: everything runs late, never early,
  until a restart or until the catch-up closes the gap, which shortens running delays by that
  fraction; it also keeps B with a wall clock that gains on the monotonic clock without steps,
  as this project's VM does by 0.5 %. `Config.clock_catchup_ppm` is 2 % by default; 0 never
  catches up);
- it never gets ahead of W (B is W whenever the two agree, so due times and store times are
  wall-clock times a person can read).
Each reading: `elapsed = mono - last_mono`, `candidate = B + elapsed (+ elapsed * catchup_ppm /
1e6 while W is ahead)`, `B = max(B, min(W, candidate))`. At construction B = W: a restart has no
monotonic reference to the previous run, so a step made while the broker was down is adopted.
A gap between B and W of more than `STEP_WARNING_MS` is logged once per step, not per reading.

`FakeClock.advance()` moves time forward and wakes every sleeper whose deadline has come, in
deadline order, so background loops driven by it stay deterministic.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

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


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...

    async def sleep_until(self, deadline_ms: int) -> None:
        """Return once `now_ms() >= deadline_ms` (may return later, never earlier)."""
        ...

    def real_wait_ms(self, deadline_ms: int) -> float:
        """Real (event-loop) milliseconds to wait before looking again whether `now_ms()` has
        reached `deadline_ms`: 0 if it has; otherwise never so long that the deadline passes
        unseen (except by `PAUSED_POLL_MS` after a paused clock is stepped forward again)."""
        ...


class SystemClock:
    """Broker time: see the module's theory of operation. `wall_ns`, `mono_ns` are injectable so
    tests can step the wall clock; `catchup_ppm` is `Config.clock_catchup_ppm`."""

    def __init__(self, wall_ns: Callable[[], int] = time.time_ns, mono_ns: Callable[[], int] = time.monotonic_ns,
                 catchup_ppm: int = 0) -> None:
        if isinstance(catchup_ppm, bool) or not isinstance(catchup_ppm, int) or not 0 <= catchup_ppm <= PPM:
            raise ValueError(f"catchup_ppm must be an integer in 0..{PPM}, not {catchup_ppm!r}")
        self._wall_ns = wall_ns
        self._mono_ns = mono_ns
        self._catchup_ppm = catchup_ppm
        self._last_mono_ns = mono_ns()
        self._broker_ns = wall_ns()
        self._wall_at_read_ns = self._broker_ns
        self._reported_gap_ms = 0
        """The gap W - B last logged (0: in step): a new warning only for a new step."""

    def _read(self) -> int:
        """Advance broker time by this reading; return it (ns). Also keeps W of this reading."""
        mono = self._mono_ns()
        wall = self._wall_ns()
        elapsed = max(0, mono - self._last_mono_ns)  # monotonic never goes back; an injected one might
        self._last_mono_ns = mono
        candidate = self._broker_ns + elapsed
        if wall > candidate and self._catchup_ppm:
            candidate += elapsed * self._catchup_ppm // PPM
        self._broker_ns = max(self._broker_ns, min(wall, candidate))
        self._wall_at_read_ns = wall
        self._report_gap((wall - self._broker_ns) // NS_PER_MS)
        return self._broker_ns

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
                            "catches up (timers and redeliveries late by up to that much, never early)", -gap_ms)
            self._reported_gap_ms = gap_ms

    def now_ms(self) -> int:
        return self._read() // NS_PER_MS

    def behind_wall_ms(self) -> int:
        """W - B in ms after a fresh reading: > 0 broker time is behind the wall clock (a forward
        step not caught up), < 0 ahead of it (paused after a step back)."""
        broker = self._read()
        return (self._wall_at_read_ns - broker) // NS_PER_MS

    def real_wait_ms(self, deadline_ms: int) -> float:
        broker = self._read()
        remaining_ns = deadline_ms * NS_PER_MS - broker
        if remaining_ns <= 0:
            return 0.0
        wall = self._wall_at_read_ns
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

    async def sleep_until(self, deadline_ms: int) -> None:
        # Sleep in one piece; wake-ups for earlier deadlines are the caller's business (it
        # cancels or races this sleep with an event). The loop guards against an early wake-up
        # (coarse event-loop timers, a pause): return only once broker time has the deadline.
        while (wait_ms := self.real_wait_ms(deadline_ms)) > 0:
            await asyncio.sleep(wait_ms / 1000)


class WallClock:
    """The wall clock as it is, steps and all: for times that are only stamped and reported
    (the SDK's born and received times), never for a broker decision."""

    def now_ms(self) -> int:
        return time.time_ns() // NS_PER_MS


class FakeClock:
    """A clock that moves only when told. Sleepers wake in deadline order on `advance`/`set`."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._now_ms

    def real_wait_ms(self, deadline_ms: int) -> float:
        # Fake time has no real rate; a broker-time wait on it (a long poll's wake-up for a
        # redelivery) waits the fake distance in real time, as it always did, and looks again.
        return float(max(0, deadline_ms - self._now_ms))

    async def sleep_until(self, deadline_ms: int) -> None:
        if deadline_ms <= self._now_ms:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline_ms, next(self._seq), fut))
        await fut

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
