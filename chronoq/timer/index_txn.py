"""One `apply` of the RocksDB timer index: how an `IndexBatch` becomes one WriteBatch.

Theory of operation: `IndexTxn` reads what it must through an overlay of its own changes, so a
later record of a batch sees an earlier one (an add and its fired mark, a roll and a fired mark
for the old copy), and builds a single RocksDB WriteBatch plus copies of the counters it moved.
Nothing touches the database or the index's in-memory state until `RocksTimerIndex.apply`
writes the batch; only then does the index swap in the new counters (`_commit`). So a batch
that fails half-way (a bad value, a corrupt record) changes nothing.

It is the index's friend: it reads the index's column families and counter mirrors directly
(the two modules are one component, split only to keep each readable).
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

from rocksdict import WriteBatch

from chronoq.timer.engine import TimerEntry
from chronoq.timer.index_codec import (
    CF_COUNTERS,
    CF_HISTORY,
    CF_ID,
    CF_KEY,
    CF_META,
    CF_POS,
    CF_TIME,
    FACTS_HEAD,
    HIST_REDIRECT,
    HIST_STATUS,
    HISTORY_FIRED_MAX,
    HISTORY_KEY,
    I64,
    META_HEAD_FLOOR,
    META_INDEXED_POSITION,
    POS_PENDING,
    POS_ROLLED,
    POS_ROLLED_VALUE,
    STATE_CANCELLED,
    STATE_DAMAGED,
    STATE_DELIVERED,
    TIME_KEY,
    U32_ARRAY,
    U64,
    MalformedValue,
    decode_pos_pending,
    empty_minute_slots,
    encode_fired_history,
    encode_minute_slots,
    encode_pending,
    facts_keys,
    id_key,
    id_key_topic,
    id_prefix,
    key_cf_key,
    pack_str,
    pos_done,
)


class IndexState(Protocol):
    """What one `apply` reads and updates of the index: its column families (through `IndexDb`)
    and the in-memory mirrors it keeps beside them. `RocksTimerIndex` is the one implementation;
    naming it here instead would make the index and its transaction import each other."""

    _cf: dict[str, Any]
    _handle: dict[str, Any]
    _indexed_position: int
    _handed: dict[int, tuple[bytes, bytes, str, int, int]]
    _minute_slots: dict[int, array[int]]
    _hour_counts: dict[int, int]
    _topic_counts: dict[str, int]
    _head: bytes | None

    def _scan(self, cf: str, prefix: bytes) -> list[tuple[bytes, bytes]]: ...

_MAX_ROLL_HOPS = 1024
"""A fired mark follows roll redirects at most this far (a chain longer than any real one)."""
_HISTORY_STATUS_KIND = bytes((HIST_STATUS,))


class IndexTxn:
    """One `apply`: the WriteBatch being built plus an overlay of what it changed, so later
    records of the same batch see earlier ones (an add and its fired mark in one batch)."""

    def __init__(self, index: IndexState) -> None:
        self.index = index
        self.h = index._handle
        self.wb = WriteBatch(raw_mode=True)
        self.pos: dict[int, bytes | None] = {}
        """position -> `pos` value as of this batch so far (None: no such timer)."""
        self.facts: dict[bytes, bytes | None] = {}
        """`id` key -> `id` value as of this batch so far (None: deleted)."""
        self.slot_delta: dict[int, int] = defaultdict(int)
        self.topic_delta: dict[str, int] = defaultdict(int)
        self.added_time_keys: list[bytes] = []
        self.added_ids: list[bytes] = []
        self.removed: set[bytes] = set()
        self.added_entries: list[TimerEntry] = []
        self.delivery_errors_ms: list[int] = []
        """fired_ms - max(due, accepted) per timer fired: the delivery error counts from the due
        time, or from the acceptance when the due time had already passed then (a deliver-at in
        the past fires at once and is late by no more than the time since it was accepted)."""
        self.finished_positions: list[int] = []
        self.new_minutes: dict[int, array[int]] = {}
        self.new_hours: dict[int, int] = {}
        self.new_topics: dict[str, int] = {}
        self._topic_str: dict[str, bytes] = {}
        self.rolled_from: dict[int, int] = {}
        """New position -> the original position of a timer rolled in this batch (for cancels)."""

    # -- reads through the overlay -----------------------------------------------------------

    def get_pos(self, position: int) -> bytes | None:
        if position not in self.pos:
            self.pos[position] = self.index._cf[CF_POS].get(U64.pack(position))
        return self.pos[position]

    def get_facts(self, ik: bytes) -> bytes | None:
        if ik not in self.facts:
            self.facts[ik] = self.index._cf[CF_ID].get(ik)
        return self.facts[ik]

    def _prefetch_pos(self, positions: list[int]) -> None:
        missing = [p for p in positions if p not in self.pos]
        if missing:
            self.pos.update(zip(missing, self.index._cf[CF_POS].get([U64.pack(p) for p in missing]), strict=True))

    # -- records -----------------------------------------------------------------------------

    def add_all(self, entries: Sequence[TimerEntry]) -> None:
        if not entries:
            return
        # A batch covers the log from the index's position on, and batches come in log order,
        # so a position at or past `indexed_position` cannot have been applied: only older
        # ones (a replay that overlaps) are looked up. Every timer ever applied keeps a `pos`
        # row (pending, done or rolled) until pruned, so that one read answers "known?".
        seen_end = self.index._indexed_position
        self._prefetch_pos([e.position for e in entries if e.position < seen_end])
        pos, topic_str = self.pos, self._topic_str
        for entry in entries:
            if entry.position in pos and pos[entry.position] is not None:
                continue  # applied before (or twice in this batch)
            packed_topic = topic_str.get(entry.topic)
            if packed_topic is None:
                packed_topic = topic_str[entry.topic] = pack_str(entry.topic)
            self._insert(entry, id_key(entry.message_id, entry.topic, entry.position, packed_topic))

    def _insert(self, entry: TimerEntry, ik: bytes, *, enqueued: bool = True) -> None:
        """A pending timer's rows. `enqueued=False` for a roll copy: the same timer moved, not a
        new one, so it is not an enqueue-lag sample (accepted days ago, it read as days of lag)."""
        h, put = self.h, self.wb.put
        position = entry.position
        tk, entry_value, facts, pos_value = encode_pending(entry, ik)
        put(tk, entry_value, h[CF_TIME])
        put(ik, facts, h[CF_ID])
        put(U64.pack(position), pos_value, h[CF_POS])
        self.facts[ik] = facts
        self.pos[position] = pos_value
        if entry.keys:
            cf_key = h[CF_KEY]
            for key in entry.keys:
                put(key_cf_key(key, position), ik, cf_key)
        self.added_ids.append(ik)
        self.slot_delta[entry.deliver_at_ms // 1000] += 1
        self.topic_delta[entry.topic] += 1
        self.added_time_keys.append(tk)
        if enqueued:
            self.added_entries.append(entry)

    def _unschedule(self, tk: bytes, position: int, deliver_at_ms: int, topic: str) -> None:
        """Take a pending timer out of the time order and the pending counters."""
        self.wb.delete(tk, self.h[CF_TIME])
        self.removed.add(tk)
        self.slot_delta[deliver_at_ms // 1000] -= 1
        self.topic_delta[topic] -= 1
        self.finished_positions.append(position)

    def _finish(self, position: int, pos_value: bytes, state: int, done_ms: int) -> int:
        """Fire or cancel the pending timer a `pos` value describes; returns its due time. Its
        `id` row (the facts) stays; `pos` now says what became of it, until pruned."""
        deliver_at_ms, ik = decode_pos_pending(pos_value)
        self._unschedule(TIME_KEY.pack(deliver_at_ms, position), position, deliver_at_ms, id_key_topic(ik))
        done = pos_done(state, done_ms)
        self.wb.put(U64.pack(position), done, self.h[CF_POS])
        self.pos[position] = done
        self.wb.put(HISTORY_KEY.pack(done_ms, position), _HISTORY_STATUS_KIND + ik, self.h[CF_HISTORY])
        return deliver_at_ms

    def fire_all(self, fired: Sequence[tuple[int, int]]) -> None:
        if not fired:
            return
        handed, pos = self.index._handed, self.pos
        # Timers `due()` handed out are known pending (anything that finished or moved them
        # since has dropped them from `handed`, or touched `pos` in this batch).
        self._prefetch_pos([position for position, _ in fired if position not in handed or position in pos])
        # The common case, inlined (`_unschedule` + the rest of `_finish`): this loop runs per
        # timer fired, and needs no read: what `due()` handed out names everything.
        wb_put, wb_delete, h = self.wb.put, self.wb.delete, self.h
        h_time, h_pos, h_history = h[CF_TIME], h[CF_POS], h[CF_HISTORY]
        slot_delta, topic_delta = self.slot_delta, self.topic_delta
        removed, finished, errors = self.removed, self.finished_positions, self.delivery_errors_ms
        pack_position = U64.pack
        done_ms, done = -1, b""
        # One `history` row per fire time (a link record fires its timers at one time) and up to
        # HISTORY_FIRED_MAX timers, not one per timer: the `id` keys of what it fired, for
        # `prune_history` to forget together. Keyed by the first timer in it: a timer fires
        # once, so no two rows share a key.
        rows: list[tuple[int, int, list[bytes]]] = []
        row_of: dict[int, list[bytes]] = {}
        iks: list[bytes] | None = None
        for position, fired_ms in fired:
            if position in pos:
                self.fire(position, fired_ms)
                continue
            tk, ik, topic, deliver_at_ms, counted_from_ms = handed[position]
            wb_delete(tk, h_time)
            removed.add(tk)
            slot_delta[deliver_at_ms // 1000] -= 1
            topic_delta[topic] -= 1
            finished.append(position)
            if fired_ms != done_ms:
                done_ms, done = fired_ms, pos_done(STATE_DELIVERED, fired_ms)
                iks = row_of.get(fired_ms)
            if iks is None or len(iks) >= HISTORY_FIRED_MAX:
                iks = row_of[fired_ms] = []
                rows.append((fired_ms, position, iks))
            wb_put(pack_position(position), done, h_pos)
            pos[position] = done
            iks.append(ik)
            errors.append(fired_ms - counted_from_ms)
        for fired_ms, first_position, keys in rows:
            wb_put(HISTORY_KEY.pack(fired_ms, first_position), encode_fired_history(keys), h_history)

    def _follow(self, position: int) -> tuple[int, bytes | None]:
        """Where the timer first recorded at `position` lives now (roll redirects followed)."""
        pos_value = self.get_pos(position)
        hops = 0
        while pos_value is not None and pos_value[0] == POS_ROLLED and hops < _MAX_ROLL_HOPS:
            _, position, _ = POS_ROLLED_VALUE.unpack(pos_value)
            pos_value = self.get_pos(position)
            hops += 1
        return position, pos_value

    def fire(self, position: int, fired_ms: int) -> None:
        """Mark the timer recorded at `position` delivered, reading what it is through `pos`.
        Fired from an old copy that a roll moved: the timer now lives at the new one."""
        position, pos_value = self._follow(position)
        if pos_value is None or pos_value[0] != POS_PENDING:
            return  # unknown, or already fired or cancelled: replay or a lost race
        facts = self.get_facts(decode_pos_pending(pos_value)[1])
        deliver_at_ms = self._finish(position, pos_value, STATE_DELIVERED, fired_ms)
        accepted_ms = FACTS_HEAD.unpack_from(facts)[3] if facts and len(facts) >= FACTS_HEAD.size else deliver_at_ms
        self.delivery_errors_ms.append(fired_ms - max(deliver_at_ms, accepted_ms))

    def damage(self, position: int, damaged_ms: int) -> None:
        """Take the pending timer recorded at `position` out of the time order as DAMAGED."""
        position, pos_value = self._follow(position)
        if pos_value is not None and pos_value[0] == POS_PENDING:
            self._finish(position, pos_value, STATE_DAMAGED, damaged_ms)

    def cancel(self, topic: str, message_id: str, cancelled_ms: int, tombstone_position: int,
               due_ms: int | None) -> None:
        """Cancel the pending timers with this id on this topic, due at `due_ms` (None: at any
        time, a tombstone written before the due-time rule), recorded before the tombstone (a rolled
        copy counts from its original). The due time is in the `pos` row read anyway: no read
        more than before."""
        prefix = id_prefix(message_id, topic)
        id_keys = {ik for ik, _ in self.index._scan(CF_ID, prefix)}
        id_keys.update(ik for ik in self.added_ids if ik[:-8] == prefix)
        for ik in sorted(id_keys):
            if self.get_facts(ik) is None:
                continue  # rolled away earlier in this batch
            position = U64.unpack(ik[-8:])[0]
            if self.rolled_from.get(position, position) >= tombstone_position:
                continue  # sent (again) after the cancel: a timer of its own
            pos_value = self.get_pos(position)
            if pos_value is None:
                raise MalformedValue(f"timer at position {position} has an `id` row but no `pos` row")
            if pos_value[0] == POS_PENDING and (due_ms is None or decode_pos_pending(pos_value)[0] == due_ms):
                self._finish(position, pos_value, STATE_CANCELLED, cancelled_ms)

    def roll(self, old_position: int, entry: TimerEntry) -> None:
        new_ik = id_key(entry.message_id, entry.topic, entry.position)
        if self.get_pos(entry.position) is not None:
            return  # the copy was applied before
        self.rolled_from[entry.position] = self.rolled_from.get(old_position, old_position)
        old_value = self.get_pos(old_position)
        if old_value is None:
            # The original lies in log the index never saw (a rebuild that starts after its
            # segment was deleted): the copy is the timer. The old position still redirects to
            # it, so a fire (a link) written from the old one (it raced the roll, so it follows the
            # copy in the log) finds the timer, and a rebuild cannot fire it twice. (A fire
            # or a cancel *before* the roll copy cannot exist: the roll skips timers being fired
            # or cancelled, and the index has them done before that.)
            self._insert(entry, new_ik, enqueued=False)
            redirect = POS_ROLLED_VALUE.pack(POS_ROLLED, entry.position, entry.deliver_at_ms)
            self.wb.put(U64.pack(old_position), redirect, self.h[CF_POS])
            self.pos[old_position] = redirect
            self.wb.put(HISTORY_KEY.pack(entry.deliver_at_ms, old_position), bytes((HIST_REDIRECT,)),
                        self.h[CF_HISTORY])
            return
        if old_value[0] != POS_PENDING:
            return  # fired or cancelled first (the copy must not revive it), or rolled already
        deliver_at_ms, old_ik = decode_pos_pending(old_value)
        self._unschedule(TIME_KEY.pack(deliver_at_ms, old_position), old_position, deliver_at_ms,
                         id_key_topic(old_ik))
        h = self.h
        old_facts = self.get_facts(old_ik)
        if old_facts is None:
            raise MalformedValue(f"pending timer at position {old_position} has no `id` row")
        for key in facts_keys(old_facts):
            self.wb.delete(key_cf_key(key, old_position), h[CF_KEY])
        self.wb.delete(old_ik, h[CF_ID])
        self.facts[old_ik] = None
        redirect = POS_ROLLED_VALUE.pack(POS_ROLLED, entry.position, deliver_at_ms)
        self.wb.put(U64.pack(old_position), redirect, h[CF_POS])
        self.pos[old_position] = redirect
        self.wb.put(HISTORY_KEY.pack(deliver_at_ms, old_position), bytes((HIST_REDIRECT,)), h[CF_HISTORY])
        self._insert(entry, new_ik, enqueued=False)

    # -- counters and position ---------------------------------------------------------------

    def finish(self, indexed_position: int) -> None:
        """Fold the batch's counter deltas into copies of the counters it touches (the index
        swaps them in only once the batch is written) and record the new log position."""
        index, new_minutes, new_hours = self.index, self.new_minutes, self.new_hours
        for second, delta in self.slot_delta.items():
            if not delta:
                continue
            minute, hour = second // 60, second // 3600
            slots = new_minutes.get(minute)
            if slots is None:
                current = index._minute_slots.get(minute)
                slots = new_minutes[minute] = (array(U32_ARRAY, current) if current is not None
                                               else empty_minute_slots())
            count = slots[second % 60] + delta
            if count < 0:
                raise MalformedValue(f"pending count of second {second} would go negative ({count})")
            slots[second % 60] = count
            new_hours[hour] = new_hours.get(hour, index._hour_counts.get(hour, 0)) + delta
        for minute, slots in new_minutes.items():
            key = b"m" + U64.pack(minute)
            if any(slots):
                self.wb.put(key, encode_minute_slots(slots), self.h[CF_COUNTERS])
            else:
                self.wb.delete(key, self.h[CF_COUNTERS])
        for hour, count in new_hours.items():
            self._put_counter(b"h" + U64.pack(hour), count)
        for topic, delta in self.topic_delta.items():
            if delta:
                self.new_topics[topic] = index._topic_counts.get(topic, 0) + delta
                self._put_counter(b"t" + topic.encode(), self.new_topics[topic])
        self.wb.put(META_INDEXED_POSITION, U64.pack(indexed_position), self.h[CF_META])
        # A key at or below every pending timer after this batch (the old head, or a lower add),
        # so an open seeks there instead of walking the tombstones fired timers left before it.
        floor = min(filter(None, (index._head, *self.added_time_keys)), default=b"")
        self.wb.put(META_HEAD_FLOOR, floor, self.h[CF_META])

    def _put_counter(self, key: bytes, count: int) -> None:
        if count < 0:
            raise MalformedValue(f"counter {key!r} would go negative ({count})")
        if count == 0:
            self.wb.delete(key, self.h[CF_COUNTERS])
        else:
            self.wb.put(key, I64.pack(count), self.h[CF_COUNTERS])
