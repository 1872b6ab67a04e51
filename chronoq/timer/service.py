"""The timer service: the broker's side of timer messages, between the store and a timer engine.

Theory of operation (RocketMQ 5's shape, with RocksDB in place of the timer log + wheel):
1. Accept: `route()` rewrites a timer message to the system timer topic, keeping the real topic,
   queue and due time in system properties; the broker appends it, so it is durable when acked.
   Delay-level messages go instead to the schedule topic, one queue per level (RocketMQ 4).
2. Index: every durable record is dispatched to `on_dispatch`, which turns timer records,
   tombstones, link records and rolled copies into one `IndexBatch` for the engine. The engine is
   derived state: `recover()` replays the log from `engine.indexed_position`; nothing fires then.
3. Fire: `fire_due(now_ms)` asks the engine for due entries and writes ONE link record for
   them (`store/links.py`): each timer record, where it lies, enters its real topic's queue
   (the queue the producer chose, its message group's, or the round robin) with the original
   id; readers see it as `delivered_view` makes it (real topic, timer bookkeeping cleared).
   RocketMQ 5 re-appends a full copy of each message instead; a link is 30 bytes, and no
   message is read, decoded or encoded again to fire it (only its frame is checked). The fire
   waits for durability; the link record's own dispatch marks the timers fired. A crash between
   the two cannot fire twice: replay sees the link record. Timers stay "firing" (no second fire
   picks them) until their link record is durable, even if the caller went away meanwhile.
   Delay-level queues are scanned at their heads and fire as full copies, RocketMQ 4's way
   (`timer/delay_queues.py`). Who fires and when the broker's loop steps in is the firing
   policy's (`timer/firing.py`: the broker, or a Spark job with the loop as its backstop).
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
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from chronoq.config import Config
from chronoq.errors import (
    ChronoqError,
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
from chronoq.store.consumequeue import tag_hash
from chronoq.store.links import LinkBatch, Links, decode_links
from chronoq.store.messagestore import NEVER_READ, MessageStore, PreparedMessage
from chronoq.timefmt import instant
from chronoq.timer.delay_queues import DelayLevelQueues
from chronoq.timer.engine import DueTimers, IndexBatch, TimerEngine, TimerEntry
from chronoq.timer.firing import firing_policy
from chronoq.timer.levels import DelayLevels
from chronoq.timer.recall import encode_recall_handle

log = logging.getLogger("chronoq.timer")
Append = Callable[[list[PreparedMessage]], Awaitable[list[StoredMessage]]]
_TIMER_ONLY_PROPS = (SYS_REAL_TOPIC, SYS_REAL_QUEUE_ID, SYS_TIMER_ENQUEUE_MS, SYS_TIMER_ROLL_TIMES,
                     SYS_TIMER_ROLLED_FROM, SYS_DELAY_LEVEL)
__all__ = ["Append", "TimerService"]


class TimerService:
    def __init__(self, config: Config, store: MessageStore, engine: TimerEngine, append: Append) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.levels = DelayLevels(config.delay_levels_ms)
        self.delay_queues = DelayLevelQueues(self.levels, store, engine)
        self.firing = firing_policy(config)
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

    def on_dispatch(self, msgs: list[StoredMessage], now_ms: int | None) -> None:
        """Index durable records. If the engine refuses (a full disk: `DiskFull`), nothing here
        changed and the store calls again later with the same records."""
        indexed = self.engine.indexed_position
        end = max(msgs[-1].position + msgs[-1].size, indexed) if msgs else indexed
        batch, indexed_seconds = self._batch_for(msgs, now_ms, end)
        try:
            if batch.adds or batch.cancels or batch.fired or batch.rolled or batch.level_progress or end > indexed:
                self.engine.apply(batch)
        except DiskFull:
            raise  # the same records come again: their slot reservations are released then, once
        except BaseException:
            self._unreserve_all(indexed_seconds)
            raise
        self._unreserve_all(indexed_seconds)
        if batch.level_progress or any(m.topic == SCHEDULE_TOPIC for m in msgs):
            self.delay_queues.invalidate()

    def _batch_for(self, msgs: list[StoredMessage], now_ms: int | None,
                   indexed_position: int) -> tuple[IndexBatch, list[int]]:
        """The engine's batch for `msgs` (bringing it to `indexed_position`), and the due seconds
        whose slot reservations it settles."""
        adds: list[TimerEntry] = []
        cancels: list[tuple[str, str, int, int, int | None]] = []
        fired: list[tuple[int, int]] = []
        rolled: list[tuple[int, TimerEntry]] = []
        level_offsets: dict[int, int] = {}
        link_floors: list[tuple[int, int]] = []
        link_copies: list[tuple[int, int, bytes]] = []
        indexed_seconds: list[int] = []
        for m in msgs:
            sp = m.system_properties
            if m.topic == LINKS_TOPIC:
                # Only fires write link records: each link is a timer fired by it.
                positions = self.store.links_in(m).positions
                if positions:
                    fired.extend(zip(positions, itertools.repeat(m.store_ms, len(positions)), strict=True))
                    link_floors.append((self.store.log.segment_base(m.position), min(positions)))
                    # Kept while the link record is: read in its place if it is damaged on disk.
                    link_copies.append((m.position, m.store_ms, m.body))
                continue
            if m.topic == TIMER_TOPIC:
                if SYS_TIMER_DEL_UNIQKEY in sp:
                    # The due time names which timer of the id, on tombstones marked so. Older ones
                    # (index format version 2 and before) reach every timer of the id, as then:
                    # that cancel was acknowledged for the id (a cancel by id alone, or the first
                    # timer's own handle refused), and a rebuild must not deliver what it cancelled.
                    due_ms = sp.get(SYS_TIMER_OUT_MS) if SYS_TIMER_DEL_AT_DUE in sp else None
                    cancels.append((sp[SYS_REAL_TOPIC], sp[SYS_TIMER_DEL_UNIQKEY], m.store_ms, m.position,
                                    None if due_ms is None else int(due_ms)))
                    continue
                due = m.deliver_at_ms
                real_qid = sp.get(SYS_REAL_QUEUE_ID)
                group = sp.get(SYS_MESSAGE_GROUP)
                entry = TimerEntry(due, m.position, m.size, m.message_id, sp[SYS_REAL_TOPIC],
                                   int(sp.get(SYS_TIMER_ENQUEUE_MS, m.store_ms)), m.keys, tag_hash(m.tag),
                                   None if real_qid is None else int(real_qid), tag_hash(group) if group else None)
                if SYS_TIMER_ROLLED_FROM in sp:
                    rolled.append((int(sp[SYS_TIMER_ROLLED_FROM]), entry))  # reserved nothing: not a send
                else:
                    if now_ms is not None and self._reserved:
                        indexed_seconds.append(due // 1000)
                    adds.append(entry)
            elif SYS_FIRED_FROM in sp:
                if SYS_FIRED_OFFSET in sp and SYS_DELAY_LEVEL in sp:
                    level = int(sp[SYS_DELAY_LEVEL])
                    level_offsets[level] = max(level_offsets.get(level, 0), int(sp[SYS_FIRED_OFFSET]) + 1)
                else:
                    # A fired copy: how timers fired before link records (index format 3 and
                    # before); a log that holds them is still read so.
                    fired.append((int(sp[SYS_FIRED_FROM]), m.store_ms))
        return IndexBatch(adds=adds, cancels=cancels, fired=fired, rolled=rolled, applied_ms=now_ms,
                          level_progress=level_offsets, link_floors=link_floors, link_copies=link_copies,
                          indexed_position=indexed_position), indexed_seconds

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
                self.on_dispatch(chunk, None)
                n += len(chunk)
                chunk = []
        if chunk:
            self.on_dispatch(chunk, None)
            n += len(chunk)
        return n

    # -- fire -------------------------------------------------------------------------------

    def next_deadline_ms(self) -> int | None:
        deadlines = [d for d in (self.firing.loop_deadline_ms(self.engine.next_deadline_ms()),
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
        # When a job fires (the Spark engine) this loop is only its backstop: `timer/firing.py`.
        horizon_ms = self.firing.loop_horizon_ms(now_ms)
        due = self.engine.due_timers(horizon_ms, batch)
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
        return len(links) + len(copies) + len(damaged)

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
        return len(links), len(positions) - len(links)

    def _pending_at(self, position: int) -> TimerEntry | None:
        for entry in self.engine.pending_in(position, position + 1, 1):
            return entry
        return None

    def fired_in(self, link_record: StoredMessage) -> list[tuple[str, str, int]]:
        """(real topic, message id, due time) of each timer a link record fired, read from
        their records (the delivery trace's question; the fire path itself reads none)."""
        out = []
        links = self.store.links_in(link_record)
        for i, (position, size) in enumerate(zip(links.positions, links.sizes, strict=True)):
            rec = self.store.readable(position, size)
            due = None if rec is None else rec.deliver_at_ms
            if rec is not None and due is not None:
                out.append((links.topics[links.topic_indexes[i]], rec.message_id, due))
        return out

    @staticmethod
    def next_read_ms(rec: StoredMessage) -> int | None:
        """When a record just dispatched is next read by position (`store.next_read_ms`, for the
        read cache): a timer when it is due (its fire checks it, its consumers read it), a
        tombstone never (`NEVER_READ`); anything else may be read at once (None)."""
        if rec.topic != TIMER_TOPIC:
            return None
        sp = rec.system_properties
        if SYS_TIMER_DEL_UNIQKEY in sp:
            return NEVER_READ
        due = sp.get(SYS_TIMER_OUT_MS)
        # Never raises (it runs in dispatch): a value that is not a u63 in decimal says nothing.
        return int(due) if due is not None and len(due) <= 19 and due.isascii() and due.isdigit() else None

    def link_copy(self, position: int) -> tuple[Links, int] | None:
        """The links of the link record at `position` and its store time, from the engine's copy
        (`store.link_copy`: what a reader falls back on when that record is damaged on disk);
        None when the engine has none, or cannot say now (being rebuilt, or waiting for disk)."""
        if self.index_damaged is not None:
            return None
        try:
            copy = self.engine.link_copy(position)
            return None if copy is None else (decode_links(copy[0], position), copy[1])
        except (ChronoqError, CorruptRecord):
            return None

    @staticmethod
    def delivered_view(rec: StoredMessage, topic: str, queue_id: int, queue_offset: int,
                       fired_ms: int) -> StoredMessage:
        """A timer record read through the link that fired it (`store.linked_view`): the message
        as its consumers see it at `queue_offset` of queue (`topic`, `queue_id`), with its
        original id, stored there when it fired (its link record's store time), and the system
        properties a fired copy had (`_delivered_properties`). Its position stays the timer
        record's."""
        return StoredMessage(rec.message_id, topic, queue_id, queue_offset, rec.message_type, rec.tag, rec.keys,
                             rec.properties, _delivered_properties(rec), rec.body, rec.born_ms, fired_ms,
                             rec.position, rec.size)

    def delivered_copy(self, rec: StoredMessage, extra: dict[str, str] | None = None) -> PreparedMessage:
        """The message as its consumers will see it, for the delay levels, which fire copies:
        real topic, original id, timer bookkeeping cleared (`_delivered_properties`)."""
        real_topic = rec.system_properties[SYS_REAL_TOPIC]
        real_qid = rec.system_properties.get(SYS_REAL_QUEUE_ID)
        sp = _delivered_properties(rec)
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
        out["pending_by_delay_level"] = self.delay_queues.pending_by_level()
        out["damaged"] = self.damaged_timers
        return out


def _delivered_properties(rec: StoredMessage) -> dict[str, str]:
    """A fired timer's system properties as its consumers see them: the timer bookkeeping
    cleared, the due time kept (TIMER_OUT_MS, so a consumer can tell how late it is), and
    TIMER_FIRED_FROM naming the timer record's position."""
    sp = dict(rec.system_properties)
    for k in _TIMER_ONLY_PROPS:
        sp.pop(k, None)
    sp[SYS_FIRED_FROM] = str(rec.position)
    return sp
