"""An in-memory `TimerEngine`: the contract of `timer/engine.py` in plain dicts.

Theory of operation: the same semantics as the RocksDB index (`timer/index.py`), with none of
its storage: every timer ever applied keeps a row by log position (pending, done with its state
and time, or rolled to a new position) until `prune_history` forgets it; pending timers are
found by scanning that table. A batch is checked whole, then applied to copies that replace the
live tables only at the end (rows are replaced, never changed in place), so a batch that fails
half-way changes nothing (atomicity). The
state lives in a `MemoryTimerState` the caller keeps, so closing an engine and opening another
on the same state is a restart without a disk (what a durable engine's reopen gives).

It is the reference model the engine suite (`tests/timer/test_timer_index.py`) runs beside every
durable engine, and an engine a broker can run on (`timer_engine = "memory"`, `timer/engines.py`):
the broker-level timer suites run over it and RocksDB alike. It is not for production: `due`,
`next_deadline_ms` and the counters scan every pending timer (O(pending)), and nothing survives
the process (a broker on it replays the whole retained log into a new one at every start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chronoq.errors import IndexPositionWentBack, TimerIndexClosed
from chronoq.model import TimerState, TimerStatus
from chronoq.timer.engine import DueTimers, IndexBatch, TimerEntry, check_route
from chronoq.timer.metrics import TimerLatencies, TimerMetricsSnapshot, pending_by_due

_MAX_ROLL_HOPS = 1024
"""As the RocksDB index (`index_txn.py`): a redirect chain longer than this is taken as a loop."""


@dataclass(slots=True)
class _Row:
    entry: TimerEntry
    """The timer's facts as added (for a rolled-away row: the copy it moved to)."""
    state: TimerState | None = TimerState.PENDING
    """None: rolled away to `entry.position`."""
    done_ms: int | None = None


@dataclass(slots=True)
class MemoryTimerState:
    """What a durable engine would keep on disk."""

    indexed_position: int = 0
    rows: dict[int, _Row] = field(default_factory=dict)
    """Log position -> the timer recorded there (or where it rolled to)."""
    history: list[tuple[int, int]] = field(default_factory=list)
    """(done_ms, position) of finished timers and roll redirects, for `prune_history`."""
    levels: dict[int, int] = field(default_factory=dict)
    link_floors: dict[int, int] = field(default_factory=dict)
    """Segment base -> the lowest timer record position a link record in that segment names."""
    link_copies: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    """Link record position -> (its body, its store time)."""
    live_links_from: int | None = None


class MemoryTimerEngine:
    def __init__(self, state: MemoryTimerState | None = None) -> None:
        self.state = state if state is not None else MemoryTimerState()
        self._closed = False
        self._handed: set[int] = set()
        self._latencies = TimerLatencies()

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TimerIndexClosed("memory")

    @property
    def indexed_position(self) -> int:
        return self.state.indexed_position

    @property
    def pending_total(self) -> int:
        return len(self._pending())

    # -- apply -------------------------------------------------------------------------------

    def apply(self, batch: IndexBatch) -> None:
        self._check_open()
        _check_batch(batch)
        if batch.indexed_position < self.state.indexed_position:
            raise IndexPositionWentBack(self.state.indexed_position, batch.indexed_position)
        # Copy-on-write: rows are replaced, never changed in place, so copies of the containers
        # are enough for the batch to leave the live state alone until it has all applied.
        new = MemoryTimerState(self.state.indexed_position, dict(self.state.rows), list(self.state.history),
                               dict(self.state.levels), dict(self.state.link_floors), dict(self.state.link_copies),
                               self.state.live_links_from)
        fired_times: list[tuple[int, int]] = []
        finished: list[int] = []
        rolled_from: dict[int, int] = {}
        added: list[TimerEntry] = []
        for entry in batch.adds:
            if entry.position not in new.rows:
                new.rows[entry.position] = _Row(entry)
                added.append(entry)
        for old_position, entry in batch.rolled:
            if entry.position in new.rows:
                continue
            rolled_from[entry.position] = rolled_from.get(old_position, old_position)
            old = new.rows.get(old_position)
            if old is not None and old.state is not TimerState.PENDING:
                continue  # fired or cancelled first, or rolled already: the copy must not revive it
            if old is not None:
                finished.append(old_position)
            new.rows[old_position] = _Row(entry, None)
            new.history.append((entry.deliver_at_ms, old_position))
            new.rows[entry.position] = _Row(entry)  # moved, not enqueued: no enqueue-lag sample
        for position, fired_ms in batch.fired:
            position = _follow(new, position)
            row = new.rows.get(position)
            if row is not None and row.state is TimerState.PENDING:
                _finish(new, position, TimerState.DELIVERED, fired_ms)
                finished.append(position)
                fired_times.append((max(row.entry.deliver_at_ms, row.entry.accepted_ms), fired_ms))
        for topic, message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
            for position, row in sorted(new.rows.items()):
                if (row.state is TimerState.PENDING and (row.entry.topic, row.entry.message_id) == (topic, message_id)
                        and (due_ms is None or row.entry.deliver_at_ms == due_ms)
                        and rolled_from.get(position, position) < tombstone_position):
                    _finish(new, position, TimerState.CANCELLED, cancelled_ms)
                    finished.append(position)
        for position, damaged_ms in batch.damaged:
            position = _follow(new, position)
            row = new.rows.get(position)
            if row is not None and row.state is TimerState.PENDING:
                _finish(new, position, TimerState.DAMAGED, damaged_ms)
                finished.append(position)
        for level, offset in batch.level_progress.items():
            if offset > new.levels.get(level, -1):
                new.levels[level] = offset
        for base, floor in batch.link_floors:
            new.link_floors[base] = min(floor, new.link_floors.get(base, floor))
        for position, linked_ms, body in batch.link_copies:
            new.link_copies[position] = (body, linked_ms)
        new.indexed_position = batch.indexed_position
        # The copy becomes the state.
        for name in ("indexed_position", "rows", "history", "levels", "link_floors", "link_copies"):
            setattr(self.state, name, getattr(new, name))
        self._handed.difference_update(finished)
        self._latencies.delivery_error_ms.record_many([fired - base for base, fired in fired_times])
        if batch.applied_ms is not None and added:
            self._latencies.enqueue_lag_ms.record_many([batch.applied_ms - e.accepted_ms for e in added])

    # -- queries -----------------------------------------------------------------------------

    def _pending(self) -> list[TimerEntry]:
        return sorted((r.entry for r in self.state.rows.values() if r.state is TimerState.PENDING),
                      key=lambda e: (e.deliver_at_ms, e.position))

    def due(self, now_ms: int, limit: int) -> list[TimerEntry]:
        self._check_open()
        if limit <= 0:
            return []
        out = [e for e in self._pending() if e.deliver_at_ms <= now_ms][:limit]
        lags = [now_ms - max(e.deliver_at_ms, e.accepted_ms) for e in out if e.position not in self._handed]
        self._handed.update(e.position for e in out)
        self._latencies.fire_lag_ms.record_many(lags)
        return out

    def due_timers(self, now_ms: int, limit: int) -> DueTimers:
        return DueTimers.of(self.due(now_ms, limit))

    def next_deadline_ms(self) -> int | None:
        pending = self._pending()
        return pending[0].deliver_at_ms if pending else None

    def _statuses(self, rows: list[tuple[int, _Row]]) -> list[TimerStatus]:
        return [TimerStatus(message_id=r.entry.message_id, topic=r.entry.topic, state=r.state,  # type: ignore[arg-type]
                            deliver_at_ms=r.entry.deliver_at_ms, accepted_ms=r.entry.accepted_ms, position=p,
                            fired_ms=r.done_ms if r.state is TimerState.DELIVERED else None,
                            cancelled_ms=r.done_ms if r.state is TimerState.CANCELLED else None)
                for p, r in rows]

    def _live_rows(self) -> list[tuple[int, _Row]]:
        """Rows with facts (not roll redirects), in log order."""
        return sorted((p, r) for p, r in self.state.rows.items() if r.state is not None)

    def lookup(self, topic: str, message_id: str) -> TimerStatus | None:
        rows = [(p, r) for p, r in self._live_rows() if (r.entry.topic, r.entry.message_id) == (topic, message_id)]
        return self._statuses(rows[-1:])[0] if rows else None

    def lookup_id(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        statuses = self._statuses([(p, r) for p, r in self._live_rows() if r.entry.message_id == message_id
                                   and (topic is None or r.entry.topic == topic)])
        return sorted(statuses, key=lambda s: (s.topic, s.position))

    def lookup_key(self, key: str) -> list[TimerStatus]:
        return self._statuses([(p, r) for p, r in self._live_rows() if key in r.entry.keys])

    def slot_count(self, slot_s: int) -> int:
        self._check_open()
        return sum(1 for e in self._pending() if e.deliver_at_ms // 1000 == slot_s)

    def pending_in(self, start_position: int, end_position: int, limit: int | None = None) -> list[TimerEntry]:
        if limit is not None and limit <= 0:
            return []
        out = sorted((e for e in self._pending() if start_position <= e.position < end_position),
                     key=lambda e: e.position)
        return out if limit is None else out[:limit]

    def pending_due_before_s(self, slot_s: int) -> int:
        self._check_open()
        return sum(1 for e in self._pending() if e.deliver_at_ms // 1000 < slot_s)

    def pending_between(self, from_ms: int, to_ms: int, topic: str | None, limit: int,
                        max_scanned: int) -> tuple[list[TimerEntry], bool]:
        # The RocksDB index's rule: entries in due order from `from_ms`, each one read counts
        # toward `max_scanned` whatever its topic, and stopping at a bound with entries left
        # in the range says so.
        if to_ms <= from_ms or limit <= 0:
            return [], False
        out: list[TimerEntry] = []
        scanned = 0
        for entry in self._pending():
            if entry.deliver_at_ms < from_ms:
                continue
            if entry.deliver_at_ms >= to_ms:
                break
            if len(out) >= limit or scanned >= max_scanned:
                return out, True
            scanned += 1
            if topic is None or entry.topic == topic:
                out.append(entry)
        return out, False

    def level_progress(self, level: int) -> int | None:
        return self.state.levels.get(level)

    def metrics(self, now_ms: int) -> TimerMetricsSnapshot:
        pending = self._pending()
        by_topic: dict[str, int] = {}
        for e in pending:
            by_topic[e.topic] = by_topic.get(e.topic, 0) + 1
        deadline = pending[0].deliver_at_ms if pending else None
        return TimerMetricsSnapshot(
            now_ms=now_ms, pending_total=len(pending), pending_by_topic=by_topic,
            pending_by_due=pending_by_due(now_ms, len(pending),
                                          lambda s: sum(1 for e in pending if e.deliver_at_ms // 1000 < s)),
            next_deadline_ms=deadline, oldest_overdue_ms=max(0, now_ms - deadline) if deadline is not None else 0,
            indexed_position=self.state.indexed_position, latencies=self._latencies.summaries())

    @property
    def latencies(self) -> TimerLatencies:
        return self._latencies

    def linked_floor(self, segment_base: int) -> int | None:
        return min((f for b, f in self.state.link_floors.items() if b >= segment_base), default=None)

    def forget_links_below(self, position: int, live_from: int | None = None) -> None:
        self._check_open()
        self.state.link_floors = {b: f for b, f in self.state.link_floors.items() if b >= position}
        self.state.link_copies = {p: c for p, c in self.state.link_copies.items() if p >= position}
        if live_from is not None:
            self.state.live_links_from = live_from

    def link_copy(self, position: int) -> tuple[bytes, int] | None:
        self._check_open()
        return self.state.link_copies.get(position)

    def link_copies_in(self, start: int, end: int) -> list[int]:
        self._check_open()
        return sorted(p for p in self.state.link_copies if start <= p < end)

    def live_links_from(self) -> int | None:
        return self.state.live_links_from

    def prune_history(self, before_ms: int) -> int:
        self._check_open()
        forgotten = 0
        keep = []
        for done_ms, position in self.state.history:
            if done_ms >= before_ms:
                keep.append((done_ms, position))
                continue
            row = self.state.rows.get(position)
            if row is None:
                continue
            if row.state is None or row.state is not TimerState.PENDING:
                del self.state.rows[position]
                forgotten += row.state is not None
        self.state.history = keep
        return forgotten


def _follow(state: MemoryTimerState, position: int) -> int:
    """Where the timer first recorded at `position` lives now (roll redirects followed)."""
    for _ in range(_MAX_ROLL_HOPS):
        row = state.rows.get(position)
        if row is None or row.state is not None:
            return position
        position = row.entry.position
    return position


def _finish(state: MemoryTimerState, position: int, to: TimerState, done_ms: int) -> None:
    row = state.rows[position]
    state.rows[position] = _Row(row.entry, to, done_ms)
    state.history.append((done_ms, position))


def _check_batch(batch: IndexBatch) -> None:
    """Refuse a batch with a value no engine can hold, before any of it applies (as the RocksDB
    index does: the same ranges, so the suite's refusals hold for both)."""
    end = batch.indexed_position
    if type(end) is not int or not 0 <= end < 1 << 63:
        raise ValueError(f"indexed_position must be an int in [0, 2**63), not {end!r}")
    for entry in [*batch.adds, *(e for _, e in batch.rolled)]:
        check_route(entry)
        d, p, s, a = entry.deliver_at_ms, entry.position, entry.size, entry.accepted_ms
        if not (type(d) is int and type(p) is int and type(s) is int and type(a) is int
                and 0 <= d < 1 << 63 and 0 <= p < end and 0 <= s < 1 << 32 and -(1 << 63) <= a < 1 << 63):
            raise ValueError(f"TimerEntry fields out of range or not int, or past the batch's end {end}: {entry!r}")
        for text in (entry.message_id, entry.topic, *entry.keys):
            if len(text.encode()) > 0xFFFF:
                raise ValueError(f"a TimerEntry string of {len(text.encode())} UTF-8 bytes is too long (limit 65535)")
    for position, fired_ms in batch.fired:
        if type(position) is not int or type(fired_ms) is not int or not (
                0 <= position < 1 << 63 and 0 <= fired_ms < 1 << 63):
            raise ValueError(f"fired mark ({position!r}, {fired_ms!r}) must be two ints in [0, 2**63)")
    for _topic, _message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
        for value in (cancelled_ms, tombstone_position, *(() if due_ms is None else (due_ms,))):
            if type(value) is not int or not 0 <= value < 1 << 63:
                raise ValueError(f"cancel field {value!r} must be an int in [0, 2**63)")
    for level in batch.level_progress:
        if type(level) is not int or not 0 < level < 1 << 16:
            raise ValueError(f"delay level {level!r} must be an int in [1, 65535]")
    for base, floor in batch.link_floors:
        if type(base) is not int or type(floor) is not int or not (0 <= base < 1 << 63 and 0 <= floor < end):
            raise ValueError(f"link floor ({base!r}, {floor!r}) must be two ints in [0, 2**63), the floor "
                             f"inside the batch's log range (it ends at {end})")
    for position, linked_ms, body in batch.link_copies:
        if type(position) is not int or not 0 <= position < end or not isinstance(body, bytes):
            raise ValueError(f"link copy at {position!r} must be an int inside the batch's log range (it ends "
                             f"at {end}) with a bytes body")
        if type(linked_ms) is not int or not 0 <= linked_ms < 1 << 63:
            raise ValueError(f"link record store time must be an int in [0, 2**63), not {linked_ms!r}")
