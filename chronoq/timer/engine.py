"""The timer engine interface: what the broker asks of any time index.

Theory of operation: a timer engine is *derived state of the commit log*. The broker appends
every timer record, cancel tombstone, link record (firing) and rolled copy to the log first, and then
applies them to the engine as an `IndexBatch` that also carries `indexed_position`, the
exclusive end of the log range the batch covers. An engine applies a batch atomically (all of
it with its `indexed_position`, or none of it), so after any crash the broker replays the log
from `engine.indexed_position` and the engine converges to the same state. Nothing fires during
that replay: the engine only answers `due(now_ms, limit)` when asked, and the broker asks only
once recovery is done.

The engine never reads the clock. `due` and `metrics` take `now_ms`; `next_deadline_ms()` tells
the broker's loop how long to sleep.

Engines behind this `Protocol`: the RocksDB time index (`timer/index.py`, the default) and an
in-memory one (`timer/memory.py`, the reference model; a RIP-43 file wheel may follow). They share
the value types below and `timer/metrics.py`, and every engine listed in `ENGINES` of
`tests/timer/test_timer_index.py` runs the same semantic suite, checked step by step against the
in-memory one.

Within one batch the engine applies adds, then rolls, then fired marks, then cancels. That is
the order the log imposes on records about the *same* timer (a timer record precedes anything
that refers to it), and where a cancel and a fired mark (a link record's, or an older broker's
fired copy) for one timer meet in the same batch the fire wins: it is in the log, so consumers
can see the message, and calling it cancelled would lie. A cancel carries its tombstone's log
position and reaches only timers recorded before it (a rolled copy counts from its original's
position): a timer resent with the same id after a cancel, in the same batch, is a new timer the
cancel must not touch. It also carries the due time of the timer it cancels (the tombstone's
TIMER_OUT_MS, as RocketMQ 5 places its delete record at the timer's delivery time) and reaches
only timers due then: one id reused on a topic after the dedupe window names several timers,
and a cancel of one must not cancel the others. Only a tombstone marked TIMER_DEL_AT_DUE
(written since index format version 3) names a due time here; an older one reaches every timer
of its (topic, id), the rule its cancel was acknowledged under (a rebuild must not deliver what
it cancelled).

Delay-level progress (the next offset of each level's queue to fire) is derived state too, and
lives in the engine with `indexed_position`, written in the same atomic batch: the fired copies
(delay levels fire as copies) that move it are in the log, so a replay restores it, and it can
never be ahead of or behind the position it was derived up to (two stores with separate
write-ahead logs could disagree after a power loss, and a delay-level message would fire twice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from chronoq.model import TimerStatus
    from chronoq.timer.metrics import TimerMetricsSnapshot


@dataclass(slots=True)
class TimerEntry:
    """One pending timer as the engine keeps it. A value (never assigned to after construction);
    not frozen only because frozen construction costs ~5x (see `chronoq.model`)."""

    deliver_at_ms: int
    """Due time, already rounded UP to `timer_precision_ms` by the broker."""
    position: int
    """Commit-log position of the timer record: unique, and the acceptance order."""
    size: int
    """Record size in bytes."""
    message_id: str
    topic: str
    """The real topic (not the system timer topic)."""
    accepted_ms: int
    """When the broker stored the timer record."""
    keys: tuple[str, ...] = ()
    tag_hash: int = 0
    """The tag's hash, as the real topic's queue entry carries it (CRC32C; 0 for no tag)."""
    queue_id: int | None = None
    """The real topic's queue the producer chose, if it chose one (`REAL_QID`)."""
    group_hash: int | None = None
    """The hash of its message group, if it has one: the group chooses its queue when it fires."""


DueRow = tuple[int, int, int, str, str, int, tuple[str, ...], int, int | None, int | None]
"""A due timer as a tuple in `TimerEntry`'s field order (`TimerEntry(*row)` is the entry)."""
_NO_COLUMNS: Sequence[tuple[object, ...]] = ((),) * len(fields(TimerEntry))
"""The columns of no due timers: one empty column per `TimerEntry` field."""


class DueTimers:
    """The timers one fire step takes (`TimerEngine.due_timers`), in (due time, position) order,
    as rows and as columns: a step fires thousands, and what it hands on (the link record, the
    timers' ids) is columns, so no `TimerEntry` is built per timer nor read field by field.
    Built once from its rows; the columns are tuples (`zip(*rows)`, in C)."""

    __slots__ = ("accepted_ms", "deliver_at_ms", "group_hashes", "keys", "message_ids", "positions", "queue_ids",
                 "rows", "sizes", "tag_hashes", "topics")

    def __init__(self, rows: list[DueRow]) -> None:
        self.rows = rows
        columns = tuple(zip(*rows, strict=True)) if rows else _NO_COLUMNS
        (self.deliver_at_ms, self.positions, self.sizes, self.message_ids, self.topics, self.accepted_ms,
         self.keys, self.tag_hashes, self.queue_ids, self.group_hashes) = columns  # type: ignore[assignment]

    @classmethod
    def of(cls, entries: Sequence[TimerEntry]) -> DueTimers:
        return cls([(e.deliver_at_ms, e.position, e.size, e.message_id, e.topic, e.accepted_ms, e.keys, e.tag_hash,
                     e.queue_id, e.group_hash) for e in entries])

    def __len__(self) -> int:
        return len(self.rows)

    def entries(self) -> list[TimerEntry]:
        return [TimerEntry(*row) for row in self.rows]

    def ids(self) -> list[tuple[str, str, int]]:
        """Each timer's (topic, message id, due time): what a cancel of it names."""
        return list(zip(self.topics, self.message_ids, self.deliver_at_ms, strict=True))

    def without(self, positions: set[int] | dict[int, object]) -> DueTimers:
        """These timers less those at `positions`."""
        return DueTimers([row for row in self.rows if row[1] not in positions])


def check_route(entry: TimerEntry) -> None:
    """Refuse a TimerEntry whose route (tag hash, queue id, group hash) no engine can hold: the
    one range check both engines apply (a tag hash is a u32, a queue id below 2**31)."""
    t, q, g = entry.tag_hash, entry.queue_id, entry.group_hash
    if not (type(t) is int and 0 <= t < 1 << 32 and (q is None or (type(q) is int and 0 <= q < 1 << 31))
            and (g is None or (type(g) is int and 0 <= g < 1 << 32))):
        raise ValueError(f"TimerEntry route out of range or not int: tag_hash={t!r} queue_id={q!r} group_hash={g!r}")


@dataclass(frozen=True, slots=True)
class IndexBatch:
    """Log records to apply atomically, with the log position they bring the index to."""

    adds: Sequence[TimerEntry] = ()
    cancels: Sequence[tuple[str, str, int, int, int | None]] = ()
    """(topic, message_id, cancelled_ms, tombstone position, deliver_at_ms). Cancels the pending
    timers with that id on that topic, due at `deliver_at_ms`, recorded before the tombstone
    (`deliver_at_ms` None: a tombstone written before the due-time rule, which reaches every due
    time)."""
    fired: Sequence[tuple[int, int]] = ()
    """(timer record position, fired_ms): a link record (or an older broker's fired copy) made it
    visible in its real topic at fired_ms."""
    rolled: Sequence[tuple[int, TimerEntry]] = ()
    """(old position, entry at its new position; same message id, topic and due time)."""
    damaged: Sequence[tuple[int, int]] = ()
    """(timer record position, when): pending timers whose record is damaged in the log. They
    leave the pending set as DAMAGED instead of firing (they cannot be read)."""
    level_progress: Mapping[int, int] = field(default_factory=dict)
    """Delay level -> the next offset of its queue to fire (only moves forward)."""
    link_floors: Sequence[tuple[int, int]] = ()
    """(base of the segment holding a link record, the lowest timer record position it links):
    the records a fire linked into their topics stay as long as its link record (`linked_floor`)."""
    link_copies: Sequence[tuple[int, int, bytes]] = ()
    """(link record position, its store time, its body): kept by the engine while the link record
    is retained, so that a link record damaged on disk is read from this copy (`link_copy`)."""
    indexed_position: int = 0
    """Exclusive end of the log range this batch covers. Must not be below the engine's."""
    applied_ms: int | None = None
    """When the broker applies a live batch (feeds the enqueue-lag histogram). None on replay:
    a record replayed after a restart did not wait in any queue, and counting its age as lag
    would drown the live numbers."""


class TimerEngine(Protocol):
    @property
    def indexed_position(self) -> int:
        """Exclusive end of the commit-log range applied so far; never decreases."""
        ...

    def apply(self, batch: IndexBatch) -> None:
        """Apply `batch` atomically. Replaying a batch already applied changes nothing."""
        ...

    def due(self, now_ms: int, limit: int) -> list[TimerEntry]:
        """Up to `limit` pending entries with `deliver_at_ms <= now_ms`, ordered by
        (deliver_at_ms, position). Does not change what is pending: the broker marks them
        fired by applying the link records that fire them."""
        ...

    def due_timers(self, now_ms: int, limit: int) -> DueTimers:
        """`due(now_ms, limit)` as a fire step takes it: the same timers, as rows and columns."""
        ...

    def next_deadline_ms(self) -> int | None:
        """The earliest pending due time, or None. O(1): cached, kept true by `apply`."""
        ...

    def lookup(self, topic: str, message_id: str) -> TimerStatus | None:
        """The newest timer with this id on this topic (by log position), or None."""
        ...

    def lookup_id(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        """Every timer with this id (on `topic`, if given), ordered by topic, then log position:
        an id reused after the dedupe window names several timers, each with its own state."""
        ...

    def lookup_key(self, key: str) -> list[TimerStatus]:
        """Every timer that carries `key`, in log order."""
        ...

    def slot_count(self, slot_s: int) -> int:
        """Pending timers due within second `slot_s` (deliver_at_ms // 1000 == slot_s)."""
        ...

    def pending_in(self, start_position: int, end_position: int, limit: int | None = None) -> list[TimerEntry]:
        """Pending entries whose timer record lies in [start_position, end_position), in log
        order, at most `limit`: what must be rolled forward before that stretch of log is deleted."""
        ...

    def pending_due_before_s(self, slot_s: int) -> int:
        """Pending timers due in seconds < `slot_s`, from counters (no scan of the entries)."""
        ...

    def pending_between(self, from_ms: int, to_ms: int, topic: str | None, limit: int,
                        max_scanned: int) -> tuple[list[TimerEntry], bool]:
        """Pending timers due in [from_ms, to_ms), of `topic` (None: all), earliest first, at most
        `limit`; reads at most `max_scanned` entries. The flag is True when the search stopped at
        a bound with more entries left in the range (the console says so)."""
        ...

    def level_progress(self, level: int) -> int | None:
        """The next offset of delay level `level`'s queue to fire; None if none has fired."""
        ...

    def metrics(self, now_ms: int) -> TimerMetricsSnapshot: ...

    def linked_floor(self, segment_base: int) -> int | None:
        """The lowest timer record position named by a link record in the segments based at or
        after `segment_base`, or None: retention, about to keep the log from that segment on,
        keeps it from there, so no link outlives the record it names (links only point back).
        Kept per segment, so a retention step reads a row per segment, not per link record."""
        ...

    def forget_links_below(self, position: int, live_from: int | None = None) -> None:
        """Forget the floors of segments based below `position` and the copies of link records
        there (retention deleted them); remember `live_from`, where retention's live segments
        began (`live_links_from`)."""
        ...

    def link_copy(self, position: int) -> tuple[bytes, int] | None:
        """The body and store time of the link record at `position`, as applied (None: no link
        record applied there, or retention deleted it): what a reader falls back on when the
        record itself is damaged on disk."""
        ...

    def link_copies_in(self, start: int, end: int) -> list[int]:
        """Positions of the link records in [start, end) the engine keeps copies of, in order."""
        ...

    def live_links_from(self) -> int | None:
        """Where retention's live segments began at its last deletion (None: none since the
        engine was built): link records below it are past retention, and the records their
        links name may be gone (`chronoq check` tells those from lost ones by it)."""
        ...

    def prune_history(self, before_ms: int) -> int:
        """Forget delivered/cancelled statuses whose fired/cancelled time is before
        `before_ms`; returns how many were forgotten. Pending timers are never pruned."""
        ...

    def close(self) -> None: ...
