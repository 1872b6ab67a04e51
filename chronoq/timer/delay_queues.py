"""The delay-level path (RocketMQ 4): one queue per level in the schedule topic, fired at the heads.

Theory of operation: a message sent with a delay level is routed to `SCHEDULE_TOPIC_XXXX`, queue
`level - 1`, instead of the time index. Every message of a level shares one delay, so each queue
is already in due order and only its head needs looking at: the next deadline is the earliest
head, and firing takes heads while they are due. Progress (the next offset of each level to
fire) is kept by the timer engine (`engine.level_progress`), in the same atomic batch as its
`indexed_position`, and moved by the dispatch of the fired copies (a level fires a full copy,
RocketMQ 4's way, not a link; the copies carry
`TIMER_FIRED_OFFSET` and `DELAY_LEVEL`): derived from the log like the rest of the index, so a
replay or a rebuild restores it. Entries whose records are gone (expired, holes, quarantined
damage) are stepped over: none of them can be fired.

This room reads the store and the engine and never writes: the timer service appends the fired
copies it names, and tells it (`invalidate`) when a dispatch may have moved a head. Heads are
cached per level between such dispatches, because the timer loop asks for the next deadline
after every tick. No clock: `due` takes `now_ms`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

from chronoq.model import SCHEDULE_TOPIC, SYS_DELAY_LEVEL, StoredMessage
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timer.engine import TimerEngine
from chronoq.timer.levels import DelayLevels


class DelayLevelQueues:
    def __init__(self, levels: DelayLevels, store: MessageStore, engine: TimerEngine) -> None:
        self.levels = levels
        self.store = store
        self.engine = engine
        self._head_due_cache: dict[int, int | None] = {}
        self._earliest_due: int | None = None
        """The earliest of the levels' head due times (None: every level is empty), valid while
        `_earliest_known`: one comparison tells a fire step or the loop that no level has
        anything due, instead of a look at each level (18 by default) every time."""
        self._earliest_known = False
        self.fires_by_level = Counter[int]()
        """Copies named for firing per level since start (stats)."""

    def route(self, msg: PreparedMessage, delay_level: int, sysprops: dict[str, str]) -> PreparedMessage:
        """`msg` (its timer system properties already in `sysprops`) moved to its level's queue."""
        level = self.levels.clamp(delay_level)
        sysprops[SYS_DELAY_LEVEL] = str(level)
        return replace(msg, topic=SCHEDULE_TOPIC, queue_id=level - 1, queue_key=None, system_properties=sysprops)

    def invalidate(self) -> None:
        """A dispatch appended to a level queue or moved a level's progress: heads may have changed."""
        self._head_due_cache.clear()
        self._earliest_known = False

    def next_deadline_ms(self) -> int | None:
        if self._earliest_known:
            return self._earliest_due
        best: int | None = None
        for level in range(1, self.levels.max_level + 1):
            due = self._head_due(level)
            if due is not None and (best is None or due < best):
                best = due
        self._earliest_due, self._earliest_known = best, True
        return best

    def _head_due(self, level: int) -> int | None:
        """The due time of the level's head (None: the level is empty), cached until `invalidate`.
        A stale entry can only be early (retention took the head): `due` then reads the queue and
        finds the real head not due, so the cache makes nothing fire early or late."""
        cache = self._head_due_cache
        if level not in cache:
            head = next(self._head(level, 1), None)
            cache[level] = head[1].deliver_at_ms if head else None
        return cache[level]

    def due(self, now_ms: int, limit: int, firing: set[int]) -> list[tuple[int, int, StoredMessage]]:
        """Up to `limit` (level, queue offset, record) due at `now_ms`, level by level from each head.
        A level whose head is being fired by another call (its position in `firing`) is left whole
        to that call, so the level's progress (committed as max offset + 1) never skips an entry."""
        out: list[tuple[int, int, StoredMessage]] = []
        earliest = self.next_deadline_ms()
        if earliest is None or earliest > now_ms:
            return out  # no level's head is due: no level looked at
        for level in range(1, self.levels.max_level + 1):
            if len(out) >= limit:
                break
            head_due_ms = self._head_due(level)
            if head_due_ms is None or head_due_ms > now_ms:
                continue  # known from the cache: nothing due on this level, no queue read
            for off, rec in self._head(level, limit - len(out)):
                if rec.position in firing or rec.deliver_at_ms > now_ms:
                    break
                out.append((level, off, rec))
                self.fires_by_level[level] += 1
        return out

    def min_position(self) -> int | None:
        """Lowest log position a delay-level queue still needs (retention keeps it)."""
        low = None
        for level in range(1, self.levels.max_level + 1):
            head = next(self._head(level, 1), None)
            if head:
                p = head[1].position
                low = p if low is None else min(low, p)
        return low

    def stranded(self) -> dict[int, int]:
        """Levels past the configured table (`delay_levels` shortened since they were sent) that
        still hold messages not fired: level -> count. Nothing fires them, nothing counts them,
        and retention would delete them."""
        out: dict[int, int] = {}
        for topic, qid in self.store.queue_keys():
            level = qid + 1
            if topic == SCHEDULE_TOPIC and level > self.levels.max_level:
                n = self.store.queue(SCHEDULE_TOPIC, qid).next_offset - self._next_offset(level)
                if n > 0:
                    out[level] = n
        return out

    def pending_by_level(self) -> dict[str, int]:
        """Entries not yet fired, per level that has any (stats)."""
        out = {}
        for level in range(1, self.levels.max_level + 1):
            n = self.store.queue(SCHEDULE_TOPIC, level - 1).next_offset - self._next_offset(level)
            if n:
                out[str(level)] = n
        return out

    def _next_offset(self, level: int) -> int:
        cq = self.store.queue(SCHEDULE_TOPIC, level - 1)
        progress = self.engine.level_progress(level)
        return max(progress if progress is not None else cq.min_offset, cq.min_offset)

    def _head(self, level: int, limit: int) -> Iterator[tuple[int, StoredMessage]]:
        """Up to `limit` (queue offset, record) from the head of a level's queue, lazily: the
        caller stops at the first one not yet due. Entries whose records are gone (expired before
        any progress was known, holes, damage: quarantined and reported) are stepped over."""
        cq = self.store.queue(SCHEDULE_TOPIC, level - 1)
        offset = self._next_offset(level)
        found = 0
        while found < limit and offset < cq.next_offset:
            entries = cq.read_range(offset, max(limit - found, 16))
            if not entries:
                return
            for off, position, size, _ in entries:
                offset = off + 1
                msg = self.store.readable(position, size)
                if msg is not None:
                    found += 1
                    yield off, msg
                    if found >= limit:
                        return
