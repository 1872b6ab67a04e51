"""Retention: deleting whole segments once their records are past `retention_ms`, safely.

Theory of operation: a retention step asks the store how far the log is expired (by the store
times inside the segments, never file times), and lowers that limit to what must stay for its
own sake: the lowest record any consumer group holds in flight (for `retention_inflight_hold_ms`
at most: a group that went away must not keep the log for good; pinned again after the roll,
since a receive may run while it waits) and the lowest delay-level queue head not yet fired.
The segments from there on are *live*. A fired timer is read where it was accepted, through the
link record that fired it, so the limit is then lowered once more, to the lowest timer record a
link record in a live segment names (`linked_floor`), and to the lowest record a fire still in
flight names (its link record is not dispatched yet; again after the roll, since timers fire
while it waits).

That last step is taken once, not repeated: a segment kept only because a live link names a
record in it is past retention itself, and so are the link records in it. Timer records and link
records share one log, so if such a segment kept what its own links name, each kept segment
would keep an older one, back to the first, and a broker whose timers keep firing would never
delete anything. Its links are expired: a reader that meets one whose record is gone skips it as
it skips any entry retention removed. So the log holds `retention_ms` of data, plus the records
live links name (a timer fires from a record at most one retention period, plus a retention
step, older than its link: older ones were rolled), plus what in-flight messages and
delay-level heads pin.

Pending timers below the live segments are rolled forward first (`TimerService.roll_before`:
re-appended, so a timer due in 30 days outlives 72-hour segments), all of them, not only those
below the limit: one left in an expired segment would fire from there, and its link, live, would
keep that segment for another retention period. If any timer is still pending below the limit
afterwards (skipped because it was being fired or cancelled), nothing is deleted this time.
Recurring schedules' records below the live segments are rolled forward the same way
(`Schedules.roll_before`: a `put` of each, re-appended). Then the consume queues are
checkpointed, the segments and queue files below the limit deleted,
and the timer index's history older than the retention period pruned.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from chronoq.config import Config
from chronoq.store.groups import GroupStore
from chronoq.store.messagestore import MessageStore
from chronoq.timer.service import TimerService

log = logging.getLogger("chronoq.retention")


class Retention:
    def __init__(self, config: Config, store: MessageStore, groups: GroupStore, timer: TimerService, *,
                 roll_schedules: Callable[[int, int], Awaitable[int]] | None = None) -> None:
        self.config = config
        self.roll_schedules = roll_schedules
        """Re-appends the recurring schedules whose latest record lies below a position
        (`Schedules.roll_before`), so each schedule stays whole in the log."""
        self.store = store
        self.groups = groups
        self.timer = timer

    async def step(self, now_ms: int) -> None:
        if self.timer.index_damaged is not None:
            # The timer index is being rebuilt (stale until then, or closed while the disk has
            # no room to make it again): which timers are pending is unknown, so nothing is
            # rolled or deleted until it is back.
            log.info("retention: the timer index is being rebuilt; deleting nothing this time")
            return
        limit = await self.store.expired_before(now_ms)
        # In-flight messages keep their segments for `retention_inflight_hold_ms` more, not
        # for good (a group that went away would keep every later segment).
        hold_limit = await self.store.expired_before(now_ms - self.config.retention_inflight_hold_ms)
        level_pin = self.timer.min_level_position()
        if level_pin is not None:
            limit = min(limit, level_pin)
        live = self._held_in_flight(limit, hold_limit)
        if live <= self.store.log.start_position:
            return
        # Every pending timer below the live segments moves forward, not only those below the
        # limit: one left where it is would fire from there, and its link (live) would keep
        # that expired segment for another retention period.
        await self.timer.roll_before(live, now_ms)
        if self.roll_schedules is not None:
            await self.roll_schedules(live, now_ms)
        # A receive while the roll waited may have put older records in flight, and a fire
        # linked older timers: pin them too.
        live = self._held_in_flight(live, hold_limit)
        limit, live_from = await self._linked(live, now_ms)
        if limit <= self.store.log.start_position:
            return
        if self.timer.pending_below(limit):
            # A timer the roll skipped (it was being fired or cancelled) is still pending there,
            # or one failed to roll: keep the segments; the next step tries again.
            log.info("retention: pending timers remain below position %d; deleting nothing this time", limit)
            return
        self.store.checkpoint()
        self.store.delete_before(limit)
        # Link records before `live_from` are past retention: `chronoq check` tells the records
        # they name that are gone from lost ones by where the live ones begin.
        self.timer.engine.forget_links_below(self.store.log.start_position, live_from=live_from)
        self.timer.engine.prune_history(now_ms - self.config.retention_ms)

    async def _linked(self, live: int, now_ms: int) -> tuple[int, int]:
        """`live` (where the segments retained for their own sake begin) lowered to the lowest
        record a link record in those segments names (whole segments go, so the one holding
        `live` counts whole), and to the lowest a fire still in flight names: a fire that raced
        the roll links the timer's old record, and until its link record is dispatched the index
        has no floor for it (the roll copy, made durable first, leaves nothing pending there).
        Once, not again from the lowered limit: the segments below `live` are past retention,
        and so are their own links (the module's docstring). The segment being written is never
        deleted, but when all of it is past retention (nothing written for that long), so are
        its links. Returns the limit and where the live link records begin."""
        start = self.store.log.start_position
        limit = live
        firing = self.timer.min_firing_position()
        if firing is not None:
            limit = min(limit, max(firing, start))
        live_from = self.store.log.segment_base(live)
        if live_from >= self.store.log.segments()[-1].base and await self.store.active_segment_expired(now_ms):
            return limit, self.store.log.end_position
        floor = self.timer.engine.linked_floor(live_from)
        if floor is not None:
            limit = min(limit, max(floor, start))
        return limit, live_from

    def _held_in_flight(self, limit: int, hold_limit: int) -> int:
        """`limit` lowered to the lowest record a group holds in flight, but not below
        `hold_limit` (what has been expired for `retention_inflight_hold_ms` goes regardless)."""
        pin = self.groups.min_inflight_position()
        return limit if pin is None else min(limit, max(pin, hold_limit))
