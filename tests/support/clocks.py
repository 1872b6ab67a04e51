"""A simulated machine's two clocks, for the tests of broker time and wall-clock steps.

Theory of operation: `SystemClock` reads two injected sources, the wall clock (CLOCK_REALTIME)
and the monotonic clock (CLOCK_MONOTONIC). A `Machine` holds both, in ns, and only the test moves
them: `run(ms)` lets real time pass (both move), `step(ms)` sets the wall clock as an
administrator or a bad NTP server would (only it moves). `clock()` builds the `SystemClock` that
reads them, so a day of steps and pauses runs in microseconds and exactly.
"""

from __future__ import annotations

from chronoq.clock import MAX_BACKWARD_STEP_MS, SystemClock

START_MS = 1_700_000_000_000
MS = 1_000_000  # ns
SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS


class Machine:
    """The two clocks of a simulated machine, in ns, moved only by the test."""

    def __init__(self, wall_ms: int = START_MS, mono_ms: int = 123_456) -> None:
        self.wall = wall_ms * MS
        self.mono = mono_ms * MS
        self.mono_reads = 0

    def wall_ns(self) -> int:
        return self.wall

    def mono_ns(self) -> int:
        self.mono_reads += 1
        return self.mono

    def run(self, ms: float) -> None:
        """Real time passes: both clocks move."""
        self.wall += int(ms * MS)
        self.mono += int(ms * MS)

    def step(self, ms: int) -> None:
        """The wall clock is set (settimeofday): only it moves, by `ms` (negative: back)."""
        self.wall += ms * MS

    def clock(self, catchup_ppm: int = 0, max_backward_step_ms: int = MAX_BACKWARD_STEP_MS) -> SystemClock:
        return SystemClock(wall_ns=self.wall_ns, mono_ns=self.mono_ns, catchup_ppm=catchup_ppm,
                           max_backward_step_ms=max_backward_step_ms)

    @property
    def wall_ms(self) -> int:
        return self.wall // MS
