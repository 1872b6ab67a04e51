"""The timer service: the broker's side of timer messages, between the store and a timer engine.

Theory of operation (RocketMQ 5's shape, with RocksDB in place of the timer log + wheel):
1. Accept: `route()` rewrites a timer message to the system timer topic, keeping the real topic,
   queue and due time in system properties; the broker appends it, so it is durable when acked.
   Delay-level messages go instead to the schedule topic, one queue per level (RocketMQ 4).
2. Index: every durable record is dispatched to `index` (`chronoq/dispatch.py`), which turns
   timer records, tombstones, link records and rolled copies into one `IndexBatch` for the
   engine (`timer/indexing.py`). The engine is
   derived state: `recover()` replays the log from `engine.indexed_position`; nothing fires then.
3. Fire: `fire_due(now_ms)` asks the engine for due entries and writes ONE link record for
   them (`store/links.py`): each timer record, where it lies, enters its real topic's queue
   (the queue the producer chose, its message group's, or the round robin) with the original
   id; readers see it as `timer/reads.py` makes it (real topic, timer bookkeeping cleared).
   RocketMQ 5 re-appends a full copy of each message instead; a link is 30 bytes, and no
   message is read, decoded or encoded again to fire it (only its frame is checked). The fire
   waits for durability; the link record's own dispatch marks the timers fired. A crash between
   the two cannot fire twice: replay sees the link record. Timers stay "firing" (no second fire
   picks them) until their link record is durable, even if the caller went away meanwhile.
   Delay-level queues are scanned at their heads and fire as full copies, RocketMQ 4's way
   (`timer/delay_queues.py`). Who fires and when the broker's loop steps in is the firing
   policy's (`timer/firing.py`: the broker, or a Spark job with the loop as its backstop). With
   a job, the job hands each timer over before it is due (`arm`, ArmTimers) and the loop fires
   the armed ones at their due time, the others by the backstop (`timer/handoff.py`).
   A timer whose record fails its checks (damaged) is marked DAMAGED, not fired.
4. Cancel: a tombstone record in the timer topic (RocketMQ 5's delete). It names the timer by
   (topic, message id, due time), the three a recall handle carries, and cancels only timers due
   then: an id reused on a topic after the dedupe window names several timers, each with its own
   handle. A cancel by id alone picks the one pending timer of that id, and is refused
   (`TimerIdAmbiguous`, with each one's due time and handle) when there are several. While the
   tombstone is being made durable the fire loop holds that timer back, so a cancel racing the
   fire has one winner; a cancel of a timer whose link record is being made durable is refused
   (it has fired). A caller that goes away meanwhile leaves the hold in place until the
   tombstone is durable.
5. Roll: before retention deletes a segment, pending timers in it are re-appended (rolled) so a
   timer due in 30 days outlives 72-hour segments, and the index moves to the new copy. A roll
   decides and writes one chunk (`timer_roll_batch`) at a time, in one step, skipping timers
   being fired or cancelled: so in the log a roll copy never follows the link record or the
   tombstone of its timer, and an index rebuilt from the log cannot bring either back.
The service never reads the clock: every entry point takes `now_ms`. The recall handle a send
returns is encoded by `timer/recall.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from chronoq.config import Config
from chronoq.errors import (
    CorruptRecord,
    DiskFull,
    InvalidRecallHandle,
    TimerAlreadyCancelled,
    TimerAlreadyFired,
    TimerDisabled,
    TimerIdAmbiguous,
    TimerIndexRebuilding,
    TimerNotFound,
    TimerSlotCongested,
)
from chronoq.model import (
    LINKS_TOPIC,
    SCHEDULE_TOPIC,
    SYS_DELAY_LEVEL,
    SYS_FIRED_FROM,
    SYS_FIRED_OFFSET,
    SYS_MESSAGE_GROUP,
    SYS_REAL_QUEUE_ID,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_AT_DUE,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_ENQUEUE_MS,
    SYS_TIMER_OUT_MS,
    SYS_TIMER_ROLL_TIMES,
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    MessageType,
    StoredMessage,
    TimerState,
    TimerStatus,
)
from chronoq.store.links import LinkBatch
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timefmt import instant
from chronoq.timer.delay_queues import DelayLevelQueues
from chronoq.timer.engine import DueTimers, IndexBatch, TimerEngine, TimerEntry
from chronoq.timer.firing import firing_policy
from chronoq.timer.handoff import HandOff
from chronoq.timer.indexing import index_batch
from chronoq.timer.levels import DelayLevels
from chronoq.timer.reads import delivered_properties
from chronoq.timer.recall import encode_recall_handle

log = logging.getLogger("chronoq.timer")
Append = Callable[[list[PreparedMessage]], Awaitable[list[StoredMessage]]]
__all__ = ["Append", "TimerService"]


class TimerService:
    def __init__(self, config: Config, store: MessageStore, engine: TimerEngine, append: Append) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.levels = DelayLevels(config.delay_levels_ms)
        self.delay_queues = DelayLevelQueues(self.levels, store, engine)
        self.firing = firing_policy(config)
        self.handoff = HandOff(self.firing.handoff_ms) if self.firing.firer == "job" else None
        """Which pending timers are armed (fire at their due time), when a job is the firer."""
        self._append = append
        self._holding: set[tuple[str, str, int]] = set()
        """(topic, message id, due time) with a cancel being made durable: fire and roll leave
        those timers alone."""
        self._firing: set[int] = set()
        """Positions of timers whose link record (or delay-level copy) is being made durable: no
        second fire picks them."""
        self._firing_ids: set[tuple[str, str, int]] = set()
        """(topic, message id, due time) of the timers in `_firing`: a cancel of one is refused."""
        self._settling: set[asyncio.Future[None]] = set()
        """Fires and cancels whose caller went away, waiting for their records' durability."""
        self.damaged_timers = 0
        """Timers marked DAMAGED since start (their records failed their checks when due)."""
        self.index_damaged: str | None = None
        """Why the index was found damaged while running, until the timer loop has rebuilt it.
        Dispatch skips the index meanwhile, so it may be stale (a fired timer still pending):
        nothing fires, cancels or rolls by it, and retention waits."""
        self._reserved: Counter[int] = Counter()
        """Per-second count of timers accepted but not yet indexed (for slot congestion)."""
        self.fired_by_topic: Counter[str] = Counter()
        """Fired copies appended, per real topic, since start (metrics read it at scrape time)."""

    # -- accept -----------------------------------------------------------------------------

    def route(self, msg: PreparedMessage, deliver_at_ms: int, delay_level: int | None,
              now_ms: int) -> PreparedMessage:
        """Rewrite a validated timer message to the timer or schedule topic (raises if refused)."""
        if not self.config.timer_wheel_enable:
            raise TimerDisabled()
        sysprops = {**msg.system_properties, SYS_REAL_TOPIC: msg.topic} if msg.system_properties \
            else {SYS_REAL_TOPIC: msg.topic}
        if msg.queue_id is not None:
            sysprops[SYS_REAL_QUEUE_ID] = str(msg.queue_id)
        sysprops[SYS_TIMER_OUT_MS] = str(deliver_at_ms)
        sysprops[SYS_TIMER_ENQUEUE_MS] = str(now_ms)
        if delay_level is not None and self.config.schedule_topic_levels_enable:
            return self.delay_queues.route(msg, delay_level, sysprops)
        limit = self.config.timer_congest_num_each_slot
        slot_s = deliver_at_ms // 1000
        if limit:
            # Reservations only matter to this check, so without a limit none are kept.
            if deliver_at_ms > now_ms:
                count = self.engine.slot_count(slot_s) + self._reserved[slot_s]
                if count >= limit:
                    raise TimerSlotCongested(slot_s, count, limit)
            self._reserved[slot_s] += 1
        # Built directly rather than by dataclasses.replace: this runs for every timer accepted.
        return PreparedMessage(TIMER_TOPIC, msg.message_id, msg.message_type, msg.body, msg.born_ms, msg.tag,
                               msg.keys, msg.properties, sysprops, 0, None)

    def release_reservations(self, msgs: list[PreparedMessage]) -> None:
        """Undo `route` reservations for messages that were not written after all."""
        if not self._reserved:
            return
        for m in msgs:
            if m.topic == TIMER_TOPIC:
                self._unreserve(int(m.system_properties[SYS_TIMER_OUT_MS]) // 1000)

    def _unreserve_all(self, slots_s: list[int]) -> None:
        for slot_s in slots_s:
            self._unreserve(slot_s)

    def _unreserve(self, slot_s: int) -> None:
        if self._reserved[slot_s] > 1:
            self._reserved[slot_s] -= 1
        else:
            self._reserved.pop(slot_s, None)

    # -- index ------------------------------------------------------------------------------

    def index(self, msgs: list[StoredMessage], now_ms: int | None) -> None:
        """Index durable records (`timer/indexing.py`; `now_ms` None: a replay). If the engine
        refuses (a full disk: `DiskFull`), nothing here changed and the store calls again later
        with the same records."""
        indexed = self.engine.indexed_position
        end = max(msgs[-1].position + msgs[-1].size, indexed) if msgs else indexed
        batch, indexed_seconds = index_batch(msgs, now_ms, end, self.store,
                                             settles_reservations=now_ms is not None and bool(self._reserved))
        try:
            if batch.adds or batch.cancels or batch.fired or batch.rolled or batch.level_progress or end > indexed:
                self.engine.apply(batch)
        except DiskFull:
            raise  # the same records come again: their slot reservations are released then, once
        except BaseException:
            self._unreserve_all(indexed_seconds)
            raise
        self._unreserve_all(indexed_seconds)
        handoff = self.handoff
        if handoff is not None:
            if now_ms is not None:
                for entry in batch.adds:
                    handoff.arm_on_accept(entry.position, entry.deliver_at_ms, now_ms)
            for old_position, entry in batch.rolled:
                handoff.moved(old_position, entry.position, entry.deliver_at_ms)
        if batch.level_progress or any(m.topic == SCHEDULE_TOPIC for m in msgs):
            self.delay_queues.invalidate()

    def recover(self, end: int | None = None) -> int:
        """Replay the log into the engine from its indexed position up to `end` (the log's end);
        return records replayed. Nothing fires here."""
        start = self.engine.indexed_position
        if start > self.store.log.end_position:
            raise ValueError("timer index is ahead of the log")  # caller rebuilds the index
        start = max(start, self.store.log.start_position)
        n = 0
        chunk: list[StoredMessage] = []
        for msg in self.store.scan(start, end):
            chunk.append(msg)
            if len(chunk) >= 1024:
                self.index(chunk, None)
                n += len(chunk)
                chunk = []
        if chunk:
            self.index(chunk, None)
            n += len(chunk)
        return n

    # -- fire -------------------------------------------------------------------------------

    def next_deadline_ms(self) -> int | None:
        handoff = self.handoff
        timers = (self.firing.loop_deadline_ms(self.engine.next_deadline_ms()) if handoff is None
                  else handoff.deadline_ms(self.engine.next_deadline_ms(), self.firing.backstop_ms))
        deadlines = [d for d in (timers,
                                 self.delay_queues.next_deadline_ms()) if d is not None]
        return min(deadlines) if deadlines else None

    def replace_engine(self, engine: TimerEngine) -> None:
        """Use `engine` from now on (the loop rebuilt the index): every part that reads the engine
        reads the new one, and cached level heads are forgotten (progress is read anew)."""
        self.engine = engine
        self.delay_queues.engine = engine
        self.delay_queues.invalidate()

    async def fire_due(self, now_ms: int) -> int:
        """Fire what is due at `now_ms`, up to `timer_fire_batch`; return how many fired."""
        batch = self.config.timer_fire_batch
        handoff = self.handoff
        if handoff is None:
            due = self.engine.due_timers(self.firing.loop_horizon_ms(now_ms), batch)
        else:
            # A job owns the far timers: the armed ones fire now, the rest by the backstop
            # (`timer/handoff.py`).
            handoff.start(now_ms)
            due = self.engine.due_timers(handoff.scan_horizon_ms(now_ms, self.firing.backstop_ms), batch)
            if len(due) < batch:
                due = self._with_armed(due, now_ms, batch)
        firing, busy = self._firing, self._busy
        if due.rows and (firing or self._holding or self._firing_ids):  # (none while one step follows another)
            due = due.without({position for position, key in zip(due.positions, due.ids(), strict=True)
                               if position in firing or busy(key)})
        links, keys, damaged = self._links_for(due)
        self._mark_damaged(damaged, now_ms)
        copies: list[PreparedMessage] = []
        if len(links) < batch:
            for level, off, rec in self.delay_queues.due(now_ms, batch - len(links), self._firing):
                copies.append(self.delivered_copy(rec, {SYS_FIRED_OFFSET: str(off), SYS_DELAY_LEVEL: str(level)}))
        await self._append_fired(links, keys, copies, now_ms)
        if handoff is not None and links:
            due_at = dict(zip(due.positions, due.deliver_at_ms, strict=True))
            armed = sum(1 for position in links.positions if handoff.is_armed(position, due_at[position]))
            handoff.fired_armed += armed
            handoff.fired_by_backstop += len(links) - armed
            handoff.fired(links.positions)
        return len(links) + len(copies) + len(damaged)

    def _with_armed(self, due: DueTimers, now_ms: int, batch: int) -> DueTimers:
        """`due` (from the index) plus the armed timers due at `now_ms`, up to `batch` in all, in
        (due time, position) order. An armed timer no longer pending (cancelled, rolled away)
        leaves the armed set here."""
        handoff = self.handoff
        assert handoff is not None
        have = set(due.positions)
        rows = list(due.rows)
        for position in handoff.due(now_ms, batch - len(rows) + len(have)):
            if position in have:
                continue
            entry = self._pending_at(position)
            if entry is None:
                handoff.drop(position)
                continue
            rows.append((entry.deliver_at_ms, entry.position, entry.size, entry.message_id, entry.topic,
                         entry.accepted_ms, entry.keys, entry.tag_hash, entry.queue_id, entry.group_hash))
            if len(rows) >= batch:
                break
        if len(rows) == len(due.rows):
            return due
        rows.sort(key=lambda row: (row[0], row[1]))
        return DueTimers(rows)

    def _links_for(self, due: DueTimers) -> tuple[LinkBatch, list[tuple[str, str, int]], list[TimerEntry]]:
        """The links that fire these pending timers, their (topic, id, due time), and the ones
        whose records fail their checks (damaged: logged here, marked by the caller). The
        records' frames are checked (length, position, CRC32C), not decoded: the index holds
        what a link needs (queue, group, tag hash)."""
        bad = self.store.check_records(list(zip(due.positions, due.sizes, strict=True))) if due.rows else {}
        damaged: list[TimerEntry] = []
        if bad:
            for e in due.entries():
                if e.position in bad:
                    log.error("timer message %r on topic %r due at %d cannot be delivered: its commit-log record "
                              "at position %d is damaged (%s); it is marked damaged", e.message_id, e.topic,
                              e.deliver_at_ms, e.position, bad[e.position])
                    damaged.append(e)
            due = due.without(bad)
        # Column by column (a fire step adds thousands of links): the due timers' own columns.
        links = LinkBatch()
        links.positions = list(due.positions)
        links.sizes = list(due.sizes)
        links.topics = list(due.topics)
        links.queue_ids = list(due.queue_ids)
        links.group_hashes = list(due.group_hashes)
        links.tag_hashes = list(due.tag_hashes)
        return links, due.ids(), damaged

    def _busy(self, key: tuple[str, str, int]) -> bool:
        """A cancel of this timer is being made durable, or its fire is (from any copy: a roll
        copy made durable first can move the timer to a new position while its fire from the old
        one still waits for its fsync)."""
        return key in self._holding or key in self._firing_ids

    def _read_timer(self, entry: TimerEntry, damaged: list[TimerEntry]) -> StoredMessage | None:
        """The timer record of a pending `entry`; None (and `entry` added to `damaged`) when the
        record fails its checks."""
        try:
            return self.store.read_at(entry.position, entry.size)
        except CorruptRecord as e:
            log.error("timer message %r on topic %r due at %d cannot be delivered: its commit-log record "
                      "at position %d is damaged (%s); it is marked damaged", entry.message_id, entry.topic,
                      entry.deliver_at_ms, entry.position, e.reason)
            damaged.append(entry)
            return None

    def _mark_damaged(self, entries: list[TimerEntry], now_ms: int) -> None:
        """Take damaged timers out of the pending set (one index batch), so the loop does not try
        them forever and a restart does not crash on them."""
        if entries:
            self.engine.apply(IndexBatch(damaged=[(e.position, now_ms) for e in entries],
                                         indexed_position=self.engine.indexed_position))
            self.damaged_timers += len(entries)

    async def _append_fired(self, links: LinkBatch, keys: list[tuple[str, str, int]],
                            copies: list[PreparedMessage], now_ms: int) -> None:
        """Append the link record firing `links` (`keys`: their timers' (topic, id, due time))
        and the delay levels' fired `copies`; until their dispatch has marked them fired, their
        timers count as firing, so a concurrent fire (the timer loop and `run_due`, or two Spark
        `FireTimers` calls, one a retry) cannot pick the same timers and deliver them twice."""
        if not links and not copies:
            return
        positions = set(links.positions)
        positions.update(int(c.system_properties[SYS_FIRED_FROM]) for c in copies)
        ids = set(keys)
        records = list(copies)
        # A link record per `timer_links_per_record` timers (what one damaged sector may cost;
        # fewer when they would outgrow the largest record the broker writes), all in one append.
        for part in links.split(self.config.max_message_size_bytes, self.config.timer_links_per_record):
            records.append(PreparedMessage(LINKS_TOPIC, "", MessageType.NORMAL, b"", now_ms, queue_id=0, links=part))
        self._firing |= positions
        self._firing_ids |= ids

        def release(_durable: bool) -> None:
            self._firing -= positions
            self._firing_ids -= ids

        # A caller that goes away (a FireTimers deadline) leaves the copies to become durable
        # all the same; until their dispatch marks the timers fired the index calls them
        # pending, so they stay firing until then, or the caller's retry fired them twice.
        await self._append_settled(records, release)
        # For metrics (rocketmq_timer_dequeue_total): once per batch.
        self.fired_by_topic.update(links.topics)
        self.fired_by_topic.update(copy.topic for copy in copies)

    async def _append_settled(self, records: list[PreparedMessage], settle: Callable[[bool], None]) -> None:
        """Append `records` and wait until they are durable; `settle(durable)` runs once: when
        the append returns (True) or fails (False), or, if the caller goes away while the
        records wait for their group commit (they become durable all the same), once they are
        durable or the log has failed (`_when_durable`)."""
        try:
            await self._append(records)
        except asyncio.CancelledError:
            self._when_durable(self.store.log.end_position, settle)
            raise
        except BaseException:
            settle(False)
            raise
        settle(True)

    def _when_durable(self, end: int, settle: Callable[[bool], None]) -> None:
        """`settle(True)` once the log is durable and dispatched up to `end` (the records of a
        caller that went away lie below it), `settle(False)` if it fails or closes first."""
        async def wait() -> None:
            try:
                await self.store.wait_durable(end)
            except BaseException:  # the log failed or closed: nothing more is made durable
                settle(False)
                return
            settle(True)

        task = asyncio.ensure_future(wait())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def fire_positions(self, positions: list[int], now_ms: int) -> tuple[int, int]:
        """Fire the pending timers at these positions (the Spark engine decides when).
        Returns (fired, skipped): a position not pending (fired, cancelled, unknown) is skipped,
        so a retried call fires nothing twice."""
        if self.index_damaged is not None:
            raise TimerIndexRebuilding(self.index_damaged)
        entries: list[TimerEntry] = []
        for position in dict.fromkeys(positions):
            entry = self._pending_at(position)
            if entry is None:
                continue
            key = (entry.topic, entry.message_id, entry.deliver_at_ms)
            if position in self._firing or self._busy(key) or entry.deliver_at_ms > now_ms:
                continue
            entries.append(entry)
        links, keys, damaged = self._links_for(DueTimers.of(entries))
        self._mark_damaged(damaged, now_ms)
        await self._append_fired(links, keys, [], now_ms)
        if self.handoff is not None:
            self.handoff.fired(links.positions)
        return len(links), len(positions) - len(links)

    def arm(self, timers: list[tuple[int, str, str]]) -> tuple[list[tuple[str, str | None]], int | None]:
        """Hand these timers, each (commit-log position, topic, message id), to the broker's loop:
        each fires at its due time from now on (`timer/handoff.py`). Idempotent. Returns, per
        timer in order, (result, why) and the earliest due time newly armed (the loop wakes for
        it). Results: "armed"; "already_armed" (by an earlier call, at acceptance, or because it
        is due within the horizon; with the broker as the firer every pending timer is);
        refused, with the reason: "fired", "cancelled" (a cancel wins over a later arm),
        "damaged", "unknown" (no timer of that id and topic recorded at that position)."""
        if self.index_damaged is not None:
            raise TimerIndexRebuilding(self.index_damaged)
        handoff = self.handoff
        results: list[tuple[str, str | None]] = []
        earliest: int | None = None
        for position, topic, message_id in timers:
            entry = self._pending_at(position)
            if entry is not None and entry.topic == topic and entry.message_id == message_id:
                if handoff is not None and handoff.arm(position, entry.deliver_at_ms):
                    handoff.armed_by_call += 1
                    earliest = entry.deliver_at_ms if earliest is None else min(earliest, entry.deliver_at_ms)
                    results.append(("armed", None))
                else:
                    results.append(("already_armed", None))
                continue
            if entry is not None:
                results.append(("unknown", f"the timer recorded at position {position} is {entry.message_id!r} on "
                                           f"topic {entry.topic!r}, not {message_id!r} on topic {topic!r}"))
                continue
            named = [st for st in self.engine.lookup_id(message_id, topic) if st.position == position]
            if not named:
                results.append(("unknown", f"no timer {message_id!r} on topic {topic!r} is recorded at position "
                                           f"{position} (never there, moved to a newer record by a roll, or "
                                           "finished long enough ago to be forgotten)"))
            elif named[0].state is TimerState.DELIVERED:
                results.append(("fired", f"timer {message_id!r} on topic {topic!r} (due "
                                         f"{instant(named[0].deliver_at_ms)}) has fired"))
            elif named[0].state is TimerState.CANCELLED:
                results.append(("cancelled", f"timer {message_id!r} on topic {topic!r} (due "
                                             f"{instant(named[0].deliver_at_ms)}) was cancelled; it stays cancelled"))
            elif named[0].state is TimerState.DAMAGED:
                results.append(("damaged", f"timer {message_id!r} on topic {topic!r}: its record at position "
                                           f"{position} is damaged, it cannot be delivered"))
            else:  # known there, yet not pending there: moved on by a roll
                results.append(("unknown", f"timer {message_id!r} on topic {topic!r} is no longer recorded at "
                                           f"position {position} (a roll moved it to a newer record)"))
        return results, earliest

    def _pending_at(self, position: int) -> TimerEntry | None:
        for entry in self.engine.pending_in(position, position + 1, 1):
            return entry
        return None

    def delivered_copy(self, rec: StoredMessage, extra: dict[str, str] | None = None) -> PreparedMessage:
        """The message as its consumers will see it, for the delay levels, which fire copies:
        real topic, original id, timer bookkeeping cleared (`timer/reads.py`, `delivered_properties`)."""
        real_topic = rec.system_properties[SYS_REAL_TOPIC]
        real_qid = rec.system_properties.get(SYS_REAL_QUEUE_ID)
        sp = delivered_properties(rec)
        sp.update(extra or {})
        topic = self.store.topics.get(real_topic)
        qid = int(real_qid) if real_qid is not None and topic and int(real_qid) < topic.queue_count else None
        # A message group picks its queue by hash at send time; the timer topic dropped that key,
        # so restore it here, or a group's delayed messages would scatter over queues when fired.
        return PreparedMessage(
            topic=real_topic, message_id=rec.message_id, message_type=rec.message_type, body=rec.body,
            born_ms=rec.born_ms, tag=rec.tag, keys=rec.keys, properties=rec.properties, system_properties=sp,
            queue_id=qid, queue_key=sp.get(SYS_MESSAGE_GROUP) or None)

    # -- cancel and query -------------------------------------------------------------------

    async def cancel(self, topic: str, message_id: str, now_ms: int, *, deliver_at_ms: int | None = None,
                     then: Callable[[int], None] | None = None) -> int:
        """Cancel the timer (topic, message id) due at `deliver_at_ms` (a recall handle's three),
        or, without a due time, the one timer of that id still pending; return its due time.

        The tombstone carries the due time, and cancels only timers of the id due then (a replay
        or rebuild applies the same rule), so a reused id's other timers keep their own handles.
        Timers that share topic, id and due time share one handle string too: a cancel reaches
        all of them, as RocketMQ's delete reaches its key at its delivery time.

        `then(due time)` is called once the tombstone is durable, whether or not the caller still
        waits (a caller that goes away meanwhile leaves the tombstone to become durable: the
        timer stays held back until it is, and `then` runs)."""
        if self.index_damaged is not None:
            raise TimerIndexRebuilding(self.index_damaged)
        statuses = self.engine.lookup_id(message_id, topic)
        if not statuses:
            raise TimerNotFound(topic, message_id)
        if deliver_at_ms is None:
            pending_dues = sorted({s.deliver_at_ms for s in statuses if s.state is TimerState.PENDING})
            if len(pending_dues) > 1:
                raise TimerIdAmbiguous(topic, message_id, pending_dues,
                                       [encode_recall_handle(topic, due, message_id) for due in pending_dues])
            # None pending: the newest timer of the id says why the cancel is refused.
            deliver_at_ms = pending_dues[0] if pending_dues else statuses[-1].deliver_at_ms
        named = [s for s in statuses if s.deliver_at_ms == deliver_at_ms]
        if not named:
            raise InvalidRecallHandle(
                f"it names timer message {message_id!r} on topic {topic!r} due at {instant(deliver_at_ms)}, "
                f"and none of that id there is due then (due: {', '.join(instant(s.deliver_at_ms) for s in statuses)})")
        if not any(s.state is TimerState.PENDING for s in named):
            if named[-1].state is TimerState.CANCELLED:
                raise TimerAlreadyCancelled(message_id)
            raise TimerAlreadyFired(message_id, deliver_at_ms)
        key = (topic, message_id, deliver_at_ms)
        # Its link record may be on its way to the disk while the index still says pending: the
        # timer will be delivered, so the cancel must not be acknowledged. (Checked apart from the
        # due time: a clock that disagrees with the one that fired it must not matter.)
        if deliver_at_ms <= now_ms or key in self._firing_ids:
            raise TimerAlreadyFired(message_id, deliver_at_ms)
        tombstone = PreparedMessage(
            topic=TIMER_TOPIC, message_id=message_id, message_type=MessageType.DELAY, body=b"",
            born_ms=now_ms,
            # The due time names which timer of the id this cancels (the index's rule, and the
            # Spark job's, which also finds the pending entry's state key by it).
            system_properties={SYS_REAL_TOPIC: topic, SYS_TIMER_DEL_UNIQKEY: message_id,
                               SYS_TIMER_OUT_MS: str(deliver_at_ms), SYS_TIMER_DEL_AT_DUE: "1"},
            queue_id=0)
        def settle(durable: bool) -> None:
            self._holding.discard(key)
            if durable and then is not None:
                then(key[2])

        # A caller that goes away (a client's deadline) leaves the tombstone to become durable
        # all the same: released before that, the timer could fire meanwhile (delivered after a
        # durable tombstone), and `then` (the dedupe window forgetting the id) would never run,
        # so a resend of the id was answered with the cancelled timer's result, stored nowhere.
        self._holding.add(key)
        await self._append_settled([tombstone], settle)
        return deliver_at_ms

    def query(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        """Every timer with this id (on `topic`, if given): by topic, then in log order."""
        return self.engine.lookup_id(message_id, topic)

    # -- roll -------------------------------------------------------------------------------

    async def roll_before(self, position: int, now_ms: int) -> int:
        """Re-append pending timers whose records lie below `position`; return how many.

        One chunk of `timer_roll_batch` timers at a time, so memory holds one chunk's bodies
        however many timers cross the retention horizon; each chunk is read from the index and
        written to the log in one step (no await between), and timers being fired or cancelled
        are left alone: the link record or tombstone already in the log settles them, and a roll
        copy after it would bring the timer back when the index is rebuilt from the log. What
        is left pending below `position` (skipped, or fired/cancelled after all) keeps its
        segment: `pending_below` says so, and retention waits."""
        rolled = 0
        start = self.store.log.start_position
        while True:
            entries = self.engine.pending_in(start, position, self.config.timer_roll_batch)
            if not entries:
                return rolled
            start = entries[-1].position + 1
            copies, damaged = [], []
            for entry in entries:
                if entry.position in self._firing or \
                        (entry.topic, entry.message_id, entry.deliver_at_ms) in self._holding:
                    continue
                rec = self._read_timer(entry, damaged)
                if rec is None:
                    continue
                sp = dict(rec.system_properties)
                sp[SYS_TIMER_ROLLED_FROM] = str(rec.position)
                sp[SYS_TIMER_ROLL_TIMES] = str(int(sp.get(SYS_TIMER_ROLL_TIMES, "0")) + 1)
                copies.append(PreparedMessage(
                    topic=TIMER_TOPIC, message_id=rec.message_id, message_type=rec.message_type, body=rec.body,
                    born_ms=rec.born_ms, tag=rec.tag, keys=rec.keys, properties=rec.properties,
                    system_properties=sp, queue_id=0))
            self._mark_damaged(damaged, now_ms)
            if copies:
                await self._append(copies)
                rolled += len(copies)

    def min_firing_position(self) -> int | None:
        """The lowest record position a fire in flight names (its link record or copies are not
        dispatched yet, so the index has no link floor for them): retention keeps it."""
        return min(self._firing) if self._firing else None

    def pending_below(self, position: int) -> bool:
        """Whether a pending timer's record still lies below `position` (retention must wait)."""
        return bool(self.engine.pending_in(self.store.log.start_position, position, 1))

    def min_level_position(self) -> int | None:
        """Lowest log position a delay-level queue still needs (retention keeps it)."""
        return self.delay_queues.min_position()

    def stats(self, now_ms: int) -> dict[str, Any]:
        out = self.engine.metrics(now_ms).to_dict()
        if self.handoff is not None:
            out["handoff"] = self.handoff.stats()
        out["pending_by_delay_level"] = self.delay_queues.pending_by_level()
        out["damaged"] = self.damaged_timers
        return out
