"""Deliver: the last rooms a message walks through, from a consumer's receive to its ack.

Theory of operation: the rules of RocketMQ 5's simple consumers (what a receive hands out,
invisible durations, attempts, acks) are `consumers.py`'s, pure decisions over the store; this
room adds what takes time and I/O around them:
- Long polls. A receive that finds nothing waits until a dispatch of its topic (the store calls
  `arrived` once records are durable and in their consume queues), the next redelivery, or
  its `wait_ms`, whichever comes first. It registers a plain future before it looks, so a
  dispatch between the look and the wait still wakes it, and that future is woken in one loop
  turn (not through the two extra tasks of `wait_for(event.wait())`). `wait_ms` is a real-time
  wait on the loop's clock; visibility is broker time.
- Dead letters. A message past `max_delivery_attempts` is appended to `%DLQ%<group>` and waits
  for durability before it leaves the group, so it is never in neither. One copy per entry: a
  receive that finds it while its copy is written skips it, and a receive cancelled meanwhile
  leaves the copy to finish and the entry to leave the group.
- Reads by offset (the admin service, Spark): a queue's records as stored, damaged ones skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.consumers import ConsumerGroups, TagFilter
from chronoq.errors import ChronoqError, InvalidQueueId
from chronoq.model import (
    ALL_MESSAGE_TYPES,
    LINKS_TOPIC,
    SYS_DLQ_ORIGIN_OFFSET,
    SYS_DLQ_ORIGIN_QUEUE_ID,
    SYS_DLQ_ORIGIN_TOPIC,
    ReceivedMessage,
    StoredMessage,
    dlq_topic,
)
from chronoq.store.groups import GroupStore, InFlight
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timer.levels import DelayLevels
from chronoq.topics import Topics
from chronoq.trace import TraceJournal
from chronoq.validate import check_group_name, check_topic_name

log = logging.getLogger("chronoq.deliver")

Append = Callable[[list[PreparedMessage]], Awaitable[list[StoredMessage]]]
_PRUNE_WAITERS_AT = 64
"""Long polls registered on a quiet topic are pruned once this many are waiting."""


class Deliver:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, groups: GroupStore, topics: Topics,
                 levels: DelayLevels, append: Append, trace: TraceJournal | None) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.groups = groups
        self.topics = topics
        self.levels = levels
        self.consumers = ConsumerGroups(config, store, groups, levels)
        self._append = append
        self.trace = trace
        self._arrivals: dict[str, list[asyncio.Future[None]]] = {}
        """Long polls waiting per topic: plain futures, woken in one loop turn by a dispatch."""
        self._dead_lettering: set[tuple[str, str]] = set()
        """(group, receipt handle) of in-flight entries whose DLQ copy is being written."""

    def arrived(self, msgs: list[StoredMessage]) -> None:
        """The long polls' step of dispatch (`chronoq/dispatch.py`): records of these topics just
        became visible, so wake the long polls waiting on them (a link record's links are records
        of the topics they were linked into: fired timers)."""
        topics = {m.topic for m in msgs}
        if LINKS_TOPIC in topics:
            for m in msgs:
                if m.topic == LINKS_TOPIC:
                    topics.update(self.store.links_in(m).topics)
        for topic in topics:
            for waiter in self._arrivals.pop(topic, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def receive(self, group: str, topic: str, *, filter_expression: str = "*", batch_size: int = 32,
                      invisible_duration_ms: int | None = None, wait_ms: int = 0,
                      queue_id: int | None = None) -> list[ReceivedMessage]:
        check_group_name(group, self.config)
        check_topic_name(topic, self.config)
        tcfg = self.topics.for_receive(topic)
        tag_filter = TagFilter.parse(filter_expression)
        invisible = invisible_duration_ms  # None: the broker's retry backoff (consumers.invisible_for)
        wait_ms = max(0, min(wait_ms, self.config.max_long_poll_ms))
        loop = asyncio.get_running_loop()
        # A long poll is a real-time wait, not a timer: it ends on the loop's monotonic clock even
        # while broker time is paused (a wall-clock step back). Visibility stays in broker time.
        deadline_s = loop.time() + wait_ms / 1000
        while True:
            # Registered before looking, so a dispatch between the look and the wait still wakes us.
            waiter: asyncio.Future[None] = loop.create_future()
            waiters = self._arrivals.setdefault(topic, [])
            if len(waiters) >= _PRUNE_WAITERS_AT:  # long polls that timed out while the topic was quiet
                waiters[:] = [w for w in waiters if not w.done()]
            waiters.append(waiter)
            now = self.clock.now_ms()
            outcome = self.consumers.receive(group, tcfg, tag_filter, batch_size, invisible, now, queue_id)
            if outcome.exhausted:
                try:
                    await self._dead_letter(group, outcome.exhausted)
                except ChronoqError as e:
                    # The messages of this receive are in flight already (the group's state is
                    # written): keep them from the consumer and they would stay hidden, each
                    # receive would hide a new batch and spend another attempt. They go out;
                    # the exhausted ones stay in flight and are tried again by the next receive.
                    if not outcome.delivered:
                        raise
                    log.warning("receive for group %r on %r: %d dead letters not written yet (%s); "
                                "retried at the next receive", group, topic, len(outcome.exhausted), e)
            if outcome.more and not outcome.delivered:
                # The step looked at `max_receive_scan_entries` (a tag filter that matches
                # little): give the loop back, then go on from where it stopped, whatever the wait.
                waiter.cancel()
                await asyncio.sleep(0)
                continue
            remaining_s = deadline_s - loop.time()
            if outcome.delivered or remaining_s <= 0:
                waiter.cancel()  # done, so the next registration's pruning drops it
                if self.trace is not None:
                    for rm in outcome.delivered:
                        due = rm.message.deliver_at_ms
                        if due is not None and rm.delivery_attempt == 1:
                            self.trace.received(rm.message.topic, rm.message.message_id, now, due)
                return outcome.delivered
            wake_s = remaining_s
            next_visible = self.groups.next_visible_ms(group, topic)
            if next_visible is not None:
                # The clock says how long in real time until broker time can reach it (a paused
                # clock is looked at every few ms, not spun on).
                wake_s = min(wake_s, max(self.clock.real_wait_ms(next_visible), 1) / 1000)
            timer = loop.call_later(wake_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()

    def ack(self, group: str, topic: str, receipt_handle: str) -> None:
        self.consumers.ack(group, topic, receipt_handle)

    def ack_many(self, group: str, topic: str, receipt_handles: Sequence[str]) -> list[ChronoqError | None]:
        """Ack several handles in one store write; per handle, None or the error refusing it."""
        return self.consumers.ack_many(group, topic, receipt_handles)

    def change_invisible_duration(self, group: str, topic: str, receipt_handle: str, invisible_duration_ms: int) -> str:
        entry = self.consumers.change_invisible(group, topic, receipt_handle, invisible_duration_ms,
                                                self.clock.now_ms())
        return entry.receipt_handle

    def nack(self, group: str, topic: str, receipt_handle: str) -> str:
        """Failed consumption: visible again after the delay level for its attempt (RocketMQ's
        level 3 + attempts). Returns the new receipt handle."""
        entry = self.groups.lookup_handle(group, topic, receipt_handle)
        delay_ms = self.levels.retry_delay_ms(entry.attempt)
        return self.consumers.postpone(group, topic, receipt_handle, delay_ms, self.clock.now_ms()).receipt_handle

    async def forward_to_dlq(self, group: str, topic: str, receipt_handle: str) -> None:
        entry = self.groups.lookup_handle(group, topic, receipt_handle)
        msg = self.store.readable_entry(entry.topic, entry.queue_id, entry.offset, entry.position, entry.size)
        if msg is None:
            self.consumers.drop([entry])
            return
        await self._dead_letter(group, [(entry, msg)])

    async def _dead_letter(self, group: str, items: list[tuple[InFlight, StoredMessage]]) -> None:
        # An entry stays in flight (and exhausted) until its DLQ copy is durable: a receive
        # meanwhile finds it again, and must not write a second copy.
        items = [item for item in items if (group, item[0].receipt_handle) not in self._dead_lettering]
        keys = [(group, entry.receipt_handle) for entry, _ in items]
        if not items:
            return
        self._dead_lettering.update(keys)
        # Shielded: a caller that goes away (a client's deadline cancels the receive) while the
        # copy waits for its group commit leaves it to finish. The copy becomes durable anyway;
        # cancelled with it, the entry stayed in the group, exhausted, and the next receive wrote
        # a second copy.
        task = asyncio.ensure_future(self._write_dead_letters(group, items))
        task.add_done_callback(lambda t: self._dead_lettering.difference_update(keys))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _write_dead_letters(self, group: str, items: list[tuple[InFlight, StoredMessage]]) -> None:
        dlq = dlq_topic(group)
        self.store.create_topic(dlq, 1, ALL_MESSAGE_TYPES, self.clock.now_ms(), exist_ok=True)
        copies = []
        for _entry, msg in items:
            sp = dict(msg.system_properties)
            sp.update({SYS_DLQ_ORIGIN_TOPIC: msg.topic, SYS_DLQ_ORIGIN_QUEUE_ID: str(msg.queue_id),
                       SYS_DLQ_ORIGIN_OFFSET: str(msg.queue_offset)})
            copies.append(PreparedMessage(
                topic=dlq, message_id=msg.message_id, message_type=msg.message_type, body=msg.body,
                born_ms=msg.born_ms, tag=msg.tag, keys=msg.keys, properties=msg.properties,
                system_properties=sp, queue_id=0))
        await self._append(copies)  # durable in the DLQ before it leaves the group
        self.consumers.drop([entry for entry, _ in items])

    def read(self, topic: str, queue_id: int, offset: int, max_messages: int) -> list[StoredMessage]:
        """Up to `max_messages` records of a queue from `offset`, as stored (holes, expired and
        damaged records skipped)."""
        tcfg = self.topics.get(topic)
        if not 0 <= queue_id < tcfg.queue_count:
            raise InvalidQueueId(topic, queue_id, tcfg.queue_count)
        cq = self.store.queue(topic, queue_id)
        out: list[StoredMessage] = []
        offset = max(offset, cq.min_offset)
        while len(out) < max_messages and offset < cq.next_offset:
            entries = cq.read_range(offset, max_messages - len(out))
            if not entries:
                break
            for off, position, size, _ in entries:
                msg = self.store.readable_entry(topic, queue_id, off, position, size)
                if msg is not None:
                    out.append(msg)
                offset = off + 1
        return out

    def queue_offsets(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self.store.queue(topic, queue_id)
        return cq.min_offset, cq.next_offset


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a shielded task's error seen: its caller may have gone away (it had its chance)."""
    if not task.cancelled():
        task.exception()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
