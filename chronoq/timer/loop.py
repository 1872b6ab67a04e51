"""The timer loop: when timers fire, and the timer index's life (open, replay, rebuild).

Theory of operation: `TimerService` knows *what* firing, cancelling and rolling write; this
module decides *when*, against the clock's fire horizon (`Clock.fire_horizon_ms`: broker time,
but never past the wall clock, so a due time a client stamped with its own clock waits for the
wall clock while broker time is paused after a step back). The service never reads the clock:
the loop passes the horizon in. The loop asks the service to fire what is due at the horizon,
runs again at once while a full batch fired, and otherwise sleeps until the horizon reaches the
engine's next deadline, but no sooner than `timer_fire_gap_ms` after a step that fired (timers
falling due within the gap share the next step and its fsync; design.md, "The fire gap"). The
gap is measured on the horizon too, and a horizon that went back (the wall clock stepped back)
ends it: the gap batches fires, it must not hold them for the length of a step. A dispatch that
brought timer records (a new, earlier timer, a tombstone) or a cancel wakes it
early (`poke`). It never dies of its own faults: a full disk holds firing back
(`disk_full_retry_ms`, the timers stay pending: nothing lost, nothing early), and a timer index
found damaged while running is rebuilt from the log in one step on the loop.

The index is derived state. `open_timer_service` opens the one `timer_engine` names (passed in
as an `EngineChoice`, `timer/engines.py`: this module names no implementation) and replays the
log from its `indexed_position`; missing, damaged, of another format version, or ahead of the
log or behind its retained start (files restored from different times), it is destroyed and
rebuilt. One that is not durable (the in-memory engine) starts empty and replays the whole log.
Dispatch (`index`, `chronoq/dispatch.py`) applies every durable record to it; a damaged index
there only marks it for the loop to rebuild, so senders are never held up by derived state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.errors import DiskFull, TimerIndexCorrupt
from chronoq.model import SCHEDULE_TOPIC, SYS_TIMER_DEL_UNIQKEY, TIMER_TOPIC, StoredMessage
from chronoq.store import files
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timer.engine import TimerEngine
from chronoq.timer.engines import EngineChoice
from chronoq.timer.service import TimerService

log = logging.getLogger("chronoq.timer")
Append = Callable[[list[PreparedMessage]], Awaitable[list[StoredMessage]]]


class TimerLoop:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, service: TimerService,
                 engines: EngineChoice) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.service = service
        self.engines = engines
        """How a damaged index is thrown away and opened again (`timer/engines.py`)."""
        self._wakeup = asyncio.Event()
        self.index_rebuilds = 0
        self._asleep_until_ms: float = 0
        """While the loop sleeps, the time it will wake by itself (inf: it waits for a wake-up
        only); 0 while it runs. A new timer due at or after it needs no wake-up: the loop wakes
        by then anyway and finds it in the index."""
        self._next_step_ms = 0
        """No fire step starts before the fire horizon reaches this (`timer_fire_gap_ms` after
        the horizon of the last step that fired something), unless the horizon went back."""
        self.passes = 0
        """Times the loop asked the index what is due (each costs a RocksDB seek): for `stats`
        and the tests of when the loop wakes."""
        self.sleeping = False
        """True while the loop waits (for a deadline, the fire gap, a wake-up, or a full disk's
        retry), False while it works: a test on a `FakeClock` moves the clock once it is True."""

    def poke(self) -> None:
        """Something changed what is due first (a cancel): look again now."""
        self._wakeup.set()

    def wake_for(self, due_ms: int) -> None:
        """A timer due at `due_ms` was handed to the loop (ArmTimers): wake it if it would sleep
        past that. (A running loop reads the next deadline again before it sleeps.)"""
        if due_ms < self._asleep_until_ms:
            self._wakeup.set()

    def index(self, msgs: list[StoredMessage]) -> None:
        """The timer index's step of dispatch (`chronoq/dispatch.py`): apply durable records to
        the index (before their senders are released, so an acknowledged timer is indexed, and a
        link record's timers are marked fired) and wake the loop if they touch timers."""
        if self.service.index_damaged is None:
            try:
                self.service.index(msgs, self.clock.now_ms())
            except TimerIndexCorrupt as e:
                # The records are durable in the log; only the derived index is hurt. The loop
                # rebuilds it (from the log, these records included); senders go on. The reason
                # is kept as text, never the exception: its traceback holds the failed write's
                # frames and their RocksDB handle, whose lock would refuse the rebuild's reopen.
                self.service.index_damaged = e.message
                self._wakeup.set()
        if self._wakeup.is_set():
            return
        asleep_until_ms = self._asleep_until_ms
        for m in msgs:
            topic = m.topic
            if topic == TIMER_TOPIC:
                due = m.deliver_at_ms
                # A timer due before the loop's own wake-up wakes it (a running loop reads the
                # index again before it sleeps, so it needs none); so does
                # a tombstone (the head may be cancelled; a cancel also pokes the loop itself).
                if due is None or SYS_TIMER_DEL_UNIQKEY in m.system_properties or due < asleep_until_ms:
                    self._wakeup.set()
                    return
            elif topic == SCHEDULE_TOPIC:
                self._wakeup.set()
                return

    async def run(self) -> None:
        """The background task: fire what is due, sleep until the next deadline, repeat."""
        while True:
            # A full disk is waited out after its `except` block, never in it: the error's
            # traceback holds the failed call's frames (and a RocksDB handle the retry reopens).
            if self.service.index_damaged is not None:
                try:
                    self._rebuild_index(self.service.index_damaged)
                except DiskFull as e:  # destroyed, but no room to make it again yet
                    self.store.disk.note_full("timer index rebuild", e)
                if self.service.index_damaged is not None:
                    await self._sleep(self.clock.sleep_ms(self.config.disk_full_retry_ms))
                    continue
            now = self.clock.fire_horizon_ms()
            if now < self._next_step_ms - self.config.timer_fire_gap_ms:
                self._next_step_ms = 0  # the horizon went back with the wall clock: no gap to wait for
            if now < self._next_step_ms:
                # Timers fired a moment ago: let those falling due meanwhile gather, so they
                # fire in one step. The step at the end of the gap reads the index anew, after
                # the check above (the index may have been found damaged meanwhile).
                await self._sleep(self.clock.sleep_until_horizon(self._next_step_ms, now))
                continue
            self._wakeup.clear()
            self.passes += 1
            try:
                fired: int | None = await self.service.fire_due(now)
            except TimerIndexCorrupt as e:
                self.service.index_damaged = e.message
                continue
            except DiskFull as e:
                # Fired copies (or the index) found no space: nothing fired; try again soon. The
                # timers stay pending, so nothing is lost and nothing fires early.
                self.store.disk.note_full("timer firing", e)
                fired = None
            if fired is None:
                await self._sleep(self.clock.sleep_ms(self.config.disk_full_retry_ms))
                continue
            self.store.disk.note_ok("timer firing")
            if fired >= self.config.timer_fire_batch:
                continue  # more are due now: no gap
            if fired:
                self._next_step_ms = now + self.config.timer_fire_gap_ms
            deadline = self.service.next_deadline_ms()
            if deadline is None:
                self._asleep_until_ms = math.inf
                try:
                    await self._sleep(self._wakeup.wait())
                finally:
                    self._asleep_until_ms = 0
            elif deadline > now or fired == 0 or self._next_step_ms > now:
                # fired == 0 with a past deadline: the head is held by a cancel in progress;
                # its completion (or any new timer) sets the wake-up.
                wake_ms = max(deadline, now + (fired == 0), self._next_step_ms)
                sleeper = asyncio.ensure_future(self.clock.sleep_until_horizon(wake_ms, now))
                waker = asyncio.ensure_future(self._wakeup.wait())
                self._asleep_until_ms = wake_ms
                try:
                    await self._sleep(asyncio.wait((sleeper, waker), return_when=asyncio.FIRST_COMPLETED))
                finally:
                    self._asleep_until_ms = 0
                    sleeper.cancel()
                    waker.cancel()

    async def _sleep(self, wait: Awaitable[object]) -> None:
        self.sleeping = True
        try:
            await wait
        finally:
            self.sleeping = False

    async def run_due(self) -> int:
        """Do all work due at the clock's fire horizon: fire every due timer (in batches).
        Returns the number fired. For tests with a FakeClock and no background loop."""
        total = 0
        while True:
            fired = await self.service.fire_due(self.clock.fire_horizon_ms())
            total += fired
            if fired == 0:
                return total

    def _rebuild_index(self, reason: str) -> None:
        """Replace a timer index found damaged while running by one rebuilt from the log (up to
        what has been dispatched; later records arrive through dispatch as usual). Runs in one
        step on the loop, so no fire, cancel or roll sees a half-built index."""
        log.error("%s: rebuilding it from the commit log while running", reason)
        with contextlib.suppress(Exception):
            self.service.engine.close()
        self.engines.destroy()
        self.service.replace_engine(self.engines.open())
        self.service.recover(self.store.dispatched_position)
        self.service.index_damaged = None
        self.index_rebuilds += 1


def open_timer_service(config: Config, store: MessageStore, append: Append, engines: EngineChoice) -> TimerService:
    """Open the timer index `engines` names and bring it up to the log's end (rebuilt when it
    cannot be used). An index that is not durable starts empty each time: the whole retained log
    is replayed into it."""
    path = config.data_dir / files.TIMER_DIR
    index: TimerEngine | None = None
    try:
        index = engines.open()
        if engines.durable and index.indexed_position > store.log.end_position:
            raise TimerIndexCorrupt(path, f"it covers the log up to {index.indexed_position}, past the log's "
                                          f"end {store.log.end_position}")
        if engines.durable and index.indexed_position < store.log.start_position:
            # Older than the retained log (restored from an old copy): the link records and
            # tombstones that settled some of its timers are deleted, so a replay from the log's
            # start would leave those timers pending for good, and, enough of them, starve
            # every later one of a fire step. (An empty index knows no timer to leave pending,
            # but one opened from disk cannot tell it is empty from its position alone.)
            raise TimerIndexCorrupt(path, f"it covers the log up to {index.indexed_position}, before the "
                                          f"retained log's start {store.log.start_position}")
        timer = TimerService(config, store, index, append)
        replayed = timer.recover()
        if not engines.durable:
            log.warning('timer_engine = "%s": the timer index is kept in memory only, not durable; it was rebuilt '
                        "from the whole retained commit log (%d records), as at every start", engines.name, replayed)
        return timer
    except TimerIndexCorrupt as e:
        # The error's own advice ("rebuild it from the commit log") is what happens next: say so once.
        log.warning("timer index at %s cannot be used: %s; rebuilding it from the commit log (derived state: "
                    "nothing acknowledged is lost)", e.details.get("path", path), e.details.get("reason", e.message))
        if index is not None:
            index.close()
    except BaseException:
        # Not damage (a full disk, say): keep the index as it is for the next start.
        if index is not None:
            index.close()
        raise
    engines.destroy()
    timer = TimerService(config, store, engines.open(), append)
    try:
        timer.recover()
    except BaseException:
        timer.engine.close()
        raise
    return timer
