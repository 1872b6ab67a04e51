"""Pulsar subscriptions over chronoq consumer groups: who receives what, and when it is pushed.

Theory of operation: a subscription is the chronoq consumer group of its name on the topic (and,
for Exclusive and Failover, on the topic's immediate copies: `messages.py`). The door receives
from the group (`Broker.receive`, a long poll) and pushes MESSAGE frames within each consumer's
FLOW permits; what is received but not yet pushed waits in the consumer's `pending` list, held
like what was pushed (`Subscription.held`, renewed by the door while the consumer is there).
- Shared: each consumer has its own pump, receiving up to its free permits.
- Exclusive and Failover: the first consumer's pump receives, from the topic and from its
  immediate copies at once (two long polls, whichever answers first), and skips the timers
  whose copies it read; when that consumer leaves, the next one's pump starts.
- Key_Shared (AUTO_SPLIT): one pump for the subscription receives up to the free permits of
  all its consumers and gives each message to the consumer its key hashes to, on a ring of
  `RING_POINTS` points per consumer (consistent hashing, like Pulsar's default): a consumer
  joining takes about 1/n of the keys, and one leaving gives only its own to the others.
  A key is `partition_key`; messages without one share the empty key. What a leaving consumer
  held comes back and is hashed again; ordering per key holds while the consumers stay (Pulsar
  also waits for the old consumer's unacked messages before a key moves; this door does not).
  The pump stops receiving while `max_receive_batch` messages wait for permits.
Deliveries are counted (`Broker.count_delivered`, /metrics' `chronoq_messages_delivered`) as the
gRPC door's are, when received for a consumer, under the subscription's topic: an immediate copy
counts there, and a fired timer an Exclusive or Failover subscription skips does not count.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import crc32c

from chronoq.errors import ChronoqError
from chronoq.model import ReceivedMessage
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.messages import IMMEDIATE_LEDGER, is_skipped_timer, message_frame, message_id

if TYPE_CHECKING:
    from chronoq.broker import Broker


class Connection(Protocol):
    """What a subscription needs of the door's connection (`door.Connection`): write a frame,
    and wait while the connection's outgoing buffer is over its limit."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

log = logging.getLogger("chronoq.pulsar")

SubType = api.CommandSubscribe.SubType
POLL_MS = 500
"""A pump's long poll; a message made visible again by a redelivery request or another
consumer's leaving is picked up within this."""
RING_POINTS = 100
"""Points each Key_Shared consumer has on the hash ring."""
Key = tuple[int, int]


@dataclass(slots=True)
class Held:
    """A message a consumer of the door holds (pushed or pending): its receipt handle, its
    visible time and the chronoq topic it was received from."""

    consumer: Consumer
    handle: str
    visible_ms: int
    topic: str


@dataclass(slots=True, eq=False)
class Consumer:
    conn: Connection
    consumer_id: int
    name: str
    sub: Subscription
    permits: int = 0
    pending: collections.deque[tuple[Key, ReceivedMessage]] = field(default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def push(self) -> None:
        """Push what waits, within the permits."""
        while self.permits > 0 and self.pending:
            key, rm = self.pending.popleft()
            self.conn.write(message_frame(self.consumer_id, rm, key))
            self.permits -= 1

    def room(self) -> int:
        return self.permits - len(self.pending)


@dataclass(slots=True, eq=False)
class Subscription:
    broker: Broker
    receive_batch: int
    invisible_ms: int
    topic: str
    name: str
    sub_type: int
    immediate: str | None
    """The topic's immediate copies (`messages.immediate_topic`), read by Exclusive and Failover."""
    consumers: list[Consumer] = field(default_factory=list)
    held: dict[Key, Held] = field(default_factory=dict)
    ring: list[tuple[int, int, Consumer]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    """Key_Shared: the subscription's one pump."""

    def single_active(self) -> bool:
        return self.sub_type in (SubType.Exclusive, SubType.Failover)

    def topic_of(self, ledger_id: int) -> str:
        return (self.immediate or self.topic) if ledger_id >= IMMEDIATE_LEDGER else self.topic

    # -- membership ------------------------------------------------------------------------

    def join(self, consumer: Consumer) -> None:
        self.consumers.append(consumer)
        if self.sub_type == SubType.Key_Shared:
            self._build_ring()
            if self.task is None:
                self.task = asyncio.create_task(self._pump_keys(), name=f"chronoq-pulsar-key-shared-{self.name}")
        elif self.sub_type == SubType.Shared or len(self.consumers) == 1:
            self.start(consumer)

    async def leave(self, consumer: Consumer) -> list[Key]:
        """Take the consumer out (its pump stopped, the next active one started); returns the
        keys it held, for the caller to release."""
        if consumer.task is not None:
            consumer.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer.task
            consumer.task = None
        consumer.pending.clear()
        if consumer in self.consumers:
            was_active = self.consumers[0] is consumer
            self.consumers.remove(consumer)
            if self.sub_type == SubType.Key_Shared:
                self._build_ring()
                if not self.consumers and self.task is not None:
                    self.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await self.task
                    self.task = None
            elif was_active and self.single_active() and self.consumers:
                self.start(self.consumers[0])
        self.wake.set()
        return [k for k, h in self.held.items() if h.consumer is consumer]

    def start(self, consumer: Consumer) -> None:
        consumer.task = asyncio.create_task(self._pump(consumer), name=f"chronoq-pulsar-consumer-{self.name}")
        consumer.wake.set()

    def flowed(self, consumer: Consumer) -> None:
        consumer.push()
        consumer.wake.set()
        self.wake.set()

    # -- Shared, Exclusive, Failover: one pump per receiving consumer -----------------------

    async def _pump(self, consumer: Consumer) -> None:
        sources = [self.topic]
        if self.single_active() and self.immediate is not None:
            sources.append(self.immediate)
        polls: dict[str, asyncio.Task[list[ReceivedMessage]]] = {}
        try:
            while True:
                consumer.push()
                room = consumer.room()
                for source in sources:
                    if source not in polls and room > 0:
                        polls[source] = asyncio.ensure_future(self._receive(source, room))
                if not polls:
                    consumer.wake.clear()
                    await consumer.wake.wait()
                    continue
                done, _ = await asyncio.wait(polls.values(), return_when=asyncio.FIRST_COMPLETED)
                for source, task in list(polls.items()):
                    if task in done:
                        del polls[source]
                        await self._take(consumer, task.result(), immediate=source != self.topic)
                consumer.push()
                await consumer.conn.drain()
        finally:
            for task in polls.values():
                task.cancel()

    async def _receive(self, topic: str, room: int) -> list[ReceivedMessage]:
        try:
            return await self.broker.receive(self.name, topic, batch_size=min(room, self.receive_batch),
                                             invisible_duration_ms=self.invisible_ms, wait_ms=POLL_MS, count=False)
        except ChronoqError as exc:
            log.warning("pulsar door: receive for subscription %r on %r failed: %s", self.name, topic, exc)
            await asyncio.sleep(1)
            return []

    async def _take(self, consumer: Consumer, received: list[ReceivedMessage], *, immediate: bool) -> None:
        topic = self.immediate if immediate and self.immediate else self.topic
        skipped = []
        for rm in received:
            if not immediate and self.single_active() and self.immediate is not None and is_skipped_timer(rm):
                skipped.append(rm.receipt_handle)  # its immediate copy was this subscription's
                continue
            key = message_id(rm, immediate)
            self.held[key] = Held(consumer, rm.receipt_handle, rm.invisible_until_ms, topic)
            consumer.pending.append((key, rm))
        if len(received) > len(skipped):
            self.broker.count_delivered(self.topic, len(received) - len(skipped))
        if skipped:
            with contextlib.suppress(ChronoqError):
                await self.broker.ack_many(self.name, self.topic, skipped)

    # -- Key_Shared: one pump for the subscription ------------------------------------------

    def _build_ring(self) -> None:
        ring = []
        for seq, consumer in enumerate(self.consumers):
            for i in range(RING_POINTS):
                ring.append((crc32c.crc32c(f"{consumer.name}\x00{consumer.consumer_id}\x00{i}".encode()), seq,
                             consumer))
        ring.sort(key=lambda p: (p[0], p[1]))
        self.ring = ring

    def owner(self, key: str) -> Consumer:
        """The consumer a key hashes to: the first ring point at or after its hash."""
        h = crc32c.crc32c(key.encode())
        at = bisect.bisect_left(self.ring, h, key=lambda p: p[0])
        return self.ring[at % len(self.ring)][2]

    async def _pump_keys(self) -> None:
        while True:
            waiting = 0
            room = 0
            for consumer in self.consumers:
                consumer.push()
                waiting += len(consumer.pending)
                room += max(0, consumer.room())
            if room <= 0 or waiting >= self.receive_batch or not self.consumers:
                self.wake.clear()
                await self.wake.wait()
                continue
            received = await self._receive(self.topic, room)
            if not self.consumers:
                continue  # the last one left meanwhile: what came is released by its invisible time
            if received:
                self.broker.count_delivered(self.topic, len(received))
            by_consumer: dict[int, Consumer] = {}
            for rm in received:
                consumer = self.owner(rm.message.keys[0] if rm.message.keys else "")
                key = message_id(rm, False)
                self.held[key] = Held(consumer, rm.receipt_handle, rm.invisible_until_ms, self.topic)
                consumer.pending.append((key, rm))
                by_consumer[id(consumer)] = consumer
            for consumer in by_consumer.values():
                consumer.push()
                await consumer.conn.drain()
