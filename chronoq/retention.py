"""Retention: deleting whole segments once their records are past `retention_ms`, safely.

Theory of operation: a retention step asks the store how far the log is expired (by the store
times inside the segments, never file times), and lowers that limit to what must stay: the lowest
record any consumer group holds in flight, and the lowest delay-level queue head not yet fired.
Pending timers below the limit are rolled forward first (`TimerService.roll_before`: re-appended,
so a timer due in 30 days outlives 72-hour segments); if any timer is still pending below the
limit afterwards (skipped because it was being fired or cancelled), nothing is deleted this
time. Then the consume queues are checkpointed, the segments and queue files below the limit
deleted, and the timer index's history older than the retention period pruned.
"""

from __future__ import annotations

import logging

from chronoq.config import Config
from chronoq.store.groups import GroupStore
from chronoq.store.messagestore import MessageStore
from chronoq.timer.service import TimerService

log = logging.getLogger("chronoq.retention")


class Retention:
    def __init__(self, config: Config, store: MessageStore, groups: GroupStore, timer: TimerService) -> None:
        self.config = config
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
        for pin in (self.groups.min_inflight_position(), self.timer.min_level_position()):
            if pin is not None:
                limit = min(limit, pin)
        if limit <= self.store.log.start_position:
            return
        await self.timer.roll_before(limit, now_ms)
        if self.timer.pending_below(limit):
            # A timer the roll skipped (it was being fired or cancelled) is still pending there,
            # or one failed to roll: keep the segments; the next step tries again.
            log.info("retention: pending timers remain below position %d; deleting nothing this time", limit)
            return
        self.store.checkpoint()
        self.store.delete_before(limit)
        self.timer.engine.prune_history(now_ms - self.config.retention_ms)
