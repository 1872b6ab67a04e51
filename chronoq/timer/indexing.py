"""Indexing: what each durable record means to the timer index, as one `IndexBatch`.

Theory of operation: the dispatch step (`chronoq/dispatch.py`) hands every run of durable
records to the timer room (`TimerLoop.index` -> `TimerService.index`), and recovery replays the
log through the same door; this module turns such a run into the engine's batch, nothing else
(pure, apart from reading link records' links through the store's cache):
- a timer record (timer topic) is an add; one carrying TIMER_ROLLED_FROM is a roll copy, which
  moves its timer to the new position;
- a tombstone (timer topic, TIMER_DEL_UNIQKEY) is a cancel of (topic, id[, due time]);
- a link record (`store/links.py`) marks each timer it links fired, records the lowest timer
  position its segment names (`link_floors`, which retention keeps) and keeps a copy of itself
  (`link_copies`, read in its place when it is damaged on disk);
- a delay level's fired copy moves that level's progress; an older broker's fired copy (before
  link records) marks its timer fired.
Nothing else in the log concerns the index.
"""

from __future__ import annotations

import itertools

from chronoq.model import (
    LINKS_TOPIC,
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
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    StoredMessage,
)
from chronoq.store.consumequeue import tag_hash
from chronoq.store.messagestore import MessageStore
from chronoq.timer.engine import IndexBatch, TimerEntry


def index_batch(msgs: list[StoredMessage], now_ms: int | None, indexed_position: int, store: MessageStore,
                *, settles_reservations: bool) -> tuple[IndexBatch, list[int]]:
    """The engine's batch for durable records `msgs` (bringing it to `indexed_position`), and,
    when `settles_reservations` (a dispatch, with slot reservations held), the due seconds of
    the timers sent among them, whose reservations it settles."""
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
            positions = store.links_in(m).positions
            if positions:
                fired.extend(zip(positions, itertools.repeat(m.store_ms, len(positions)), strict=True))
                link_floors.append((store.log.segment_base(m.position), min(positions)))
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
            if due is None:  # the broker writes every timer record's due time as str(int)
                raise ValueError(f"timer record at {m.position} has no due time: {sp.get(SYS_TIMER_OUT_MS)!r}")
            real_qid = sp.get(SYS_REAL_QUEUE_ID)
            group = sp.get(SYS_MESSAGE_GROUP)
            entry = TimerEntry(due, m.position, m.size, m.message_id, sp[SYS_REAL_TOPIC],
                               int(sp.get(SYS_TIMER_ENQUEUE_MS, m.store_ms)), m.keys, tag_hash(m.tag),
                               None if real_qid is None else int(real_qid), tag_hash(group) if group else None)
            if SYS_TIMER_ROLLED_FROM in sp:
                rolled.append((int(sp[SYS_TIMER_ROLLED_FROM]), entry))  # reserved nothing: not a send
            else:
                if settles_reservations:
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
