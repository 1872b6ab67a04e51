"""Simple-consumer semantics (RocketMQ 5 "pop"): receive, ack, change invisible duration, retry, DLQ.

Theory of operation: a receive first hands out in-flight messages whose invisible duration has
ended (attempt + 1), then new messages from the group's offsets, queue by queue. Every handed-out
message becomes an in-flight entry with a fresh nonce; its receipt handle names (queue, offset,
nonce), so a handle stops working the moment the message is acked, renewed or redelivered.
All state changes of one call go to `GroupStore.commit` in one atomic batch.
A message that reaches `max_delivery_attempts` is not delivered again: the caller copies it to
`%DLQ%<group>` (an append, so it waits for durability) and only then drops the in-flight entry.
Pure decisions over the store: takes `now_ms`, never reads the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from chronoq.config import Config
from chronoq.errors import (
    ChronoqError,
    InvalidBatchSize,
    InvalidFilterExpression,
    InvalidInvisibleDuration,
    InvalidQueueId,
    InvalidReceiptHandle,
)
from chronoq.model import ReceivedMessage, StoredMessage, TopicConfig
from chronoq.store.consumequeue import tag_hash
from chronoq.store.groups import GroupStore, InFlight, new_nonce
from chronoq.store.messagestore import MessageStore
from chronoq.timer.levels import DelayLevels


@dataclass(frozen=True, slots=True)
class TagFilter:
    """`*` (everything) or `a || b || c` (any of these tags)."""

    tags: frozenset[str] | None

    @classmethod
    def parse(cls, expression: str) -> TagFilter:
        expr = (expression or "*").strip()
        if expr == "*":
            return cls(None)
        parts = [p.strip() for p in expr.split("||")]
        if any(not p or "|" in p or p == "*" for p in parts):
            raise InvalidFilterExpression(expression, "use '*' or tags separated by '||'")
        return cls(frozenset(parts))

    def hashes(self) -> frozenset[int] | None:
        return None if self.tags is None else frozenset(tag_hash(t) for t in self.tags)

    def matches(self, tag: str) -> bool:
        return self.tags is None or tag in self.tags


@dataclass
class ReceiveOutcome:
    delivered: list[ReceivedMessage]
    exhausted: list[tuple[InFlight, StoredMessage]]
    """Past max_delivery_attempts: the caller writes each to the DLQ, then calls `drop`."""
    more: bool = False
    """The step stopped at `max_receive_scan_entries` with entries left to look at: receive
    again (after giving the loop back), the offsets have moved past what was looked at."""


class ConsumerGroups:
    def __init__(self, config: Config, store: MessageStore, groups: GroupStore, levels: DelayLevels) -> None:
        self.config = config
        self.levels = levels
        self.store = store
        self.groups = groups
        self._rotation: dict[tuple[str, str], int] = {}

    def check_invisible(self, invisible_ms: int) -> None:
        c = self.config
        if not c.min_invisible_duration_ms <= invisible_ms <= c.max_invisible_duration_ms:
            raise InvalidInvisibleDuration(invisible_ms, c.min_invisible_duration_ms, c.max_invisible_duration_ms)

    def invisible_for(self, attempt: int) -> int:
        """The invisible duration the broker chooses when the consumer names none: the retry
        backoff of RocketMQ's delay levels, level 3 + reconsume times (10 s, 30 s, 1 min, ... with
        the default table), within the configured bounds. So an unacked message comes back later
        and later, as RocketMQ's retries do."""
        c = self.config
        return min(max(self.levels.retry_delay_ms(attempt), c.min_invisible_duration_ms), c.max_invisible_duration_ms)

    def receive(self, group: str, topic: TopicConfig, tag_filter: TagFilter, batch_size: int,
                invisible_ms: int | None, now_ms: int, queue_id: int | None = None) -> ReceiveOutcome:
        """`invisible_ms=None`: the broker chooses per message (`invisible_for` its attempt)."""
        if not 1 <= batch_size <= self.config.max_receive_batch:
            raise InvalidBatchSize(batch_size, self.config.max_receive_batch)
        if invisible_ms is not None:
            self.check_invisible(invisible_ms)
        if queue_id is not None and not 0 <= queue_id < topic.queue_count:
            raise InvalidQueueId(topic.name, queue_id, topic.queue_count)
        delivered: list[ReceivedMessage] = []
        exhausted: list[tuple[InFlight, StoredMessage]] = []
        puts: list[InFlight] = []
        removes: list[InFlight] = []
        for old in self.groups.due(group, topic.name, now_ms, batch_size * 4, queue_id):
            if len(delivered) >= batch_size:
                break
            msg = self.store.readable_entry(old.topic, old.queue_id, old.offset, old.position, old.size)
            if msg is None:  # removed by retention while in flight, or lost to damage since
                removes.append(old)
                continue
            if old.attempt >= self.config.max_delivery_attempts:
                exhausted.append((old, msg))
                continue
            attempt = old.attempt + 1
            visible_ms = now_ms + (invisible_ms if invisible_ms is not None else self.invisible_for(attempt))
            new = replace(old, attempt=attempt, visible_ms=visible_ms, nonce=new_nonce())
            removes.append(old)
            puts.append(new)
            delivered.append(ReceivedMessage(msg, new.receipt_handle, new.attempt, visible_ms))
        offsets: list[tuple[str, str, int, int]] = []
        if len(delivered) < batch_size:
            first_visible_ms = now_ms + (invisible_ms if invisible_ms is not None else self.invisible_for(1))
            more = self._take_new(group, topic, tag_filter, batch_size - len(delivered), first_visible_ms, now_ms,
                                  queue_id, delivered, puts, offsets)
        else:
            more = False
        if puts or removes or offsets:
            self.groups.commit(offsets=offsets, put=puts, remove=removes)
        return ReceiveOutcome(delivered, exhausted, more)

    def _take_new(self, group: str, topic: TopicConfig, tag_filter: TagFilter, want: int, visible_ms: int,
                  now_ms: int, queue_id: int | None, delivered: list[ReceivedMessage], puts: list[InFlight],
                  offsets: list[tuple[str, str, int, int]]) -> bool:
        """New messages into `delivered`; True when it stopped at `max_receive_scan_entries`
        with entries left to look at."""
        hashes = tag_filter.hashes()
        qids = [queue_id] if queue_id is not None else list(range(topic.queue_count))
        start = self._rotation.get((group, topic.name), 0) % len(qids)
        self._rotation[(group, topic.name)] = start + 1
        budget = self.config.max_receive_scan_entries
        more = False
        for qid in qids[start:] + qids[:start]:
            if want <= 0:
                break
            cq = self.store.queue(topic.name, qid)
            stored = self.groups.offset(group, topic.name, qid)
            offset = max(stored if stored is not None else cq.min_offset, cq.min_offset)
            new_offset = offset
            while want > 0 and new_offset < cq.next_offset:
                if budget <= 0:
                    more = True
                    break
                entries = cq.read_range(new_offset, min(max(want, 32), budget))
                if not entries:
                    break
                budget -= len(entries)
                for off, position, size, th in entries:
                    if want <= 0:
                        break
                    new_offset = off + 1
                    if size == 0 or (hashes is not None and th not in hashes):
                        continue  # a hole (a record lost to damage), or filtered out by tag
                    # None: expired, or damaged (quarantined and reported; the queue moves on
                    # rather than failing every receive on it forever).
                    msg = self.store.readable_entry(topic.name, qid, off, position, size)
                    if msg is None or not tag_filter.matches(msg.tag):
                        continue
                    entry = InFlight(group, topic.name, qid, off, 1, visible_ms, new_nonce(), position, size, now_ms)
                    puts.append(entry)
                    delivered.append(ReceivedMessage(msg, entry.receipt_handle, 1, visible_ms))
                    want -= 1
            if new_offset != offset or stored is None:
                offsets.append((group, topic.name, qid, new_offset))
        return more

    def ack(self, group: str, topic: str, handle: str) -> InFlight:
        entry = self.groups.lookup_handle(group, topic, handle)
        self.groups.commit(remove=[entry])
        return entry

    def ack_many(self, group: str, topic: str, handles: Sequence[str]) -> list[ChronoqError | None]:
        """Ack several handles in one store commit (one RocksDB write per AckMessage request, not
        per entry). Each handle is judged alone: a refused one (expired, acked, repeated in the
        request) gets its error in the result and the others are still acked."""
        outcomes: list[ChronoqError | None] = []
        entries: dict[tuple[int, int], InFlight] = {}
        for handle in handles:
            try:
                entry = self.groups.lookup_handle(group, topic, handle)
                if (entry.queue_id, entry.offset) in entries:
                    raise InvalidReceiptHandle("the same message is acked twice in one request")
            except ChronoqError as err:
                outcomes.append(err)
                continue
            entries[(entry.queue_id, entry.offset)] = entry
            outcomes.append(None)
        if entries:
            self.groups.commit(remove=list(entries.values()))
        return outcomes

    def change_invisible(self, group: str, topic: str, handle: str, invisible_ms: int, now_ms: int) -> InFlight:
        self.check_invisible(invisible_ms)
        entry = self.groups.lookup_handle(group, topic, handle)
        new = replace(entry, visible_ms=now_ms + invisible_ms, nonce=new_nonce())
        self.groups.commit(put=[new], remove=[entry])
        return new

    def postpone(self, group: str, topic: str, handle: str, delay_ms: int, now_ms: int) -> InFlight:
        """Nack: visible again after `delay_ms` (the delay-level backoff), any bounds aside."""
        entry = self.groups.lookup_handle(group, topic, handle)
        new = replace(entry, visible_ms=now_ms + delay_ms, nonce=new_nonce())
        self.groups.commit(put=[new], remove=[entry])
        return new

    def drop(self, entries: list[InFlight]) -> None:
        if entries:
            self.groups.commit(remove=entries)

    def lag(self, group: str, topic: TopicConfig) -> int:
        """Messages not yet handed out to this group (in flight not counted)."""
        total = 0
        for qid in range(topic.queue_count):
            cq = self.store.queue(topic.name, qid)
            stored = self.groups.offset(group, topic.name, qid)
            total += cq.next_offset - max(stored if stored is not None else cq.min_offset, cq.min_offset)
        return total
