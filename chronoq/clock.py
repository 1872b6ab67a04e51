"""Clocks: the only place chronoq reads the time.

Theory of operation: every component below the server takes `now_ms` as an argument or holds a
`Clock`; nothing else calls `time.time()`. `SystemClock` is the real one. `FakeClock` lets a test
jump a two-day delay in one call: `advance()` moves time forward and wakes every sleeper whose
deadline has come, in deadline order, so background loops driven by it stay deterministic.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the Unix epoch."""
        ...

    async def sleep_until(self, deadline_ms: int) -> None:
        """Return once `now_ms() >= deadline_ms` (may return later, never earlier)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep_until(self, deadline_ms: int) -> None:
        # Sleep in one piece; wake-ups for earlier deadlines are the caller's business (it
        # cancels or races this sleep with an event). The loop below guards against an early
        # wake-up from coarse event-loop timers: never return before the deadline.
        while True:
            remaining_ms = deadline_ms - self.now_ms()
            if remaining_ms <= 0:
                return
            await asyncio.sleep(remaining_ms / 1000)


class FakeClock:
    """A clock that moves only when told. Sleepers wake in deadline order on `advance`/`set`."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> int:
        return self._now_ms

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
