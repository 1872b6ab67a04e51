"""How a fired timer reads: the timer room's answers to the store's questions about links.

Theory of operation: a timer fires by a link record (`store/links.py`) that enters its timer
record, where it lies in the log, into its real topic's queue. The store reads such an entry
through the link, and asks the writer of the links three things (`LinkedReads` in
`store/messagestore_reads.py`), which `FiredReads` answers for the timer room:
- `view`: the message a consumer sees there: its real topic, queue and offset, its original id,
  stored when it fired (the link record's store time), the timer bookkeeping cleared and
  TIMER_FIRED_FROM naming the timer record (`delivered_properties`, which the delay levels'
  fired copies carry too);
- `link_copy`: a damaged link record's links, read from the copy the timer index keeps while the
  record is retained (none while the index is being rebuilt);
- `next_read_ms`: when a record just dispatched is next read by position (a timer when it is
  due, a tombstone never), so the read cache leaves out what it would evict unread.
It also answers the delivery trace's question (`fired_in`: which timers a link record fired,
read from their records; the fire itself reads none). The broker builds one and hands it to the
store and the trace; nothing here writes.
"""

from __future__ import annotations

from typing import Protocol

from chronoq.errors import ChronoqError, CorruptRecord
from chronoq.model import (
    SYS_DELAY_LEVEL,
    SYS_FIRED_FROM,
    SYS_REAL_QUEUE_ID,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_ENQUEUE_MS,
    SYS_TIMER_ROLL_TIMES,
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    StoredMessage,
)
from chronoq.store.links import Links, decode_links
from chronoq.store.messagestore import NEVER_READ, MessageStore
from chronoq.timer.engine import TimerEngine

_TIMER_ONLY_PROPS = (SYS_REAL_TOPIC, SYS_REAL_QUEUE_ID, SYS_TIMER_ENQUEUE_MS, SYS_TIMER_ROLL_TIMES,
                     SYS_TIMER_ROLLED_FROM, SYS_DELAY_LEVEL)


class IndexHolder(Protocol):
    """The timer index as it is now (the timer loop replaces a damaged one)."""

    @property
    def engine(self) -> TimerEngine: ...

    @property
    def index_damaged(self) -> str | None: ...


class FiredReads:
    def __init__(self, store: MessageStore, index: IndexHolder) -> None:
        self.store = store
        self.index = index

    @staticmethod
    def view(rec: StoredMessage, topic: str, queue_id: int, queue_offset: int, fired_ms: int) -> StoredMessage:
        """A timer record read through the link that fired it: the message as its consumers see
        it at `queue_offset` of queue (`topic`, `queue_id`), with its original id, stored there
        when it fired (its link record's store time), and the system properties a fired copy had
        (`delivered_properties`). Its position stays the timer record's."""
        return StoredMessage(rec.message_id, topic, queue_id, queue_offset, rec.message_type, rec.tag, rec.keys,
                             rec.properties, delivered_properties(rec), rec.body, rec.born_ms, fired_ms,
                             rec.position, rec.size)

    def link_copy(self, position: int) -> tuple[Links, int] | None:
        """The links of the link record at `position` and its store time, from the engine's copy
        (what a reader falls back on when that record is damaged on disk); None when the engine
        has none, or cannot say now (being rebuilt, or waiting for disk)."""
        if self.index.index_damaged is not None:
            return None
        try:
            copy = self.index.engine.link_copy(position)
            return None if copy is None else (decode_links(copy[0], position), copy[1])
        except (ChronoqError, CorruptRecord):
            return None

    @staticmethod
    def next_read_ms(rec: StoredMessage) -> int | None:
        """When a record just dispatched is next read by position (for the read cache): a timer
        when it is due (its fire checks it, its consumers read it), a tombstone never
        (`NEVER_READ`); anything else may be read at once (None)."""
        if rec.topic != TIMER_TOPIC:
            return None
        sp = rec.system_properties
        if SYS_TIMER_DEL_UNIQKEY in sp:
            return NEVER_READ
        return rec.deliver_at_ms  # read once when the record was built; None if its text is no number

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


def delivered_properties(rec: StoredMessage) -> dict[str, str]:
    """A fired timer's system properties as its consumers see them: the timer bookkeeping
    cleared, the due time kept (TIMER_OUT_MS, so a consumer can tell how late it is), and
    TIMER_FIRED_FROM naming the timer record's position."""
    sp = dict(rec.system_properties)
    for k in _TIMER_ONLY_PROPS:
        sp.pop(k, None)
    sp[SYS_FIRED_FROM] = str(rec.position)
    return sp
