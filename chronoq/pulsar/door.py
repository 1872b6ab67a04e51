"""chronoq's Pulsar door: Apache Pulsar's binary protocol served over the broker, on its loop.

Theory of operation: `chronoq serve --pulsar-port PORT` (setting `pulsar_port`) starts an
asyncio TCP server beside the gRPC one, on the broker's event loop. Each connection reads frames
with `codec.FrameReader` and answers them in order; what it serves is the round trip Pulsar's
official clients make (C++ 4.x, and the Python `pulsar-client` built on it):

- CONNECT -> CONNECTED; PARTITIONED_METADATA -> 0 partitions (every topic is non-partitioned);
  LOOKUP -> `Connect` to this door's own address, authoritative (there is one broker).
- PRODUCER -> PRODUCER_SUCCESS (a broker-chosen name unless the client gives one). Each SEND
  becomes chronoq messages (a batch: one per entry) stored through `Broker.send_batch`, and
  SEND_RECEIPTs go back in the order of the SENDs, as the client requires. A producer's queued
  SENDs are stored together, one group commit for all of them. `deliver_at_time` (ms since the
  epoch, which the client computes from `deliver_after` with its own clock) becomes the
  message's chronoq timer (`deliver_at_ms`): durable in the timer index, fired never before
  its time, at ms precision; one already due is stored as a plain message.
- SUBSCRIBE -> SUCCESS. A subscription is a chronoq consumer group of the same name on the
  topic; Shared, Exclusive and Failover are served (Key_Shared is refused: chronoq keeps no
  per-key consumer affinity). Exclusive admits one consumer; Failover admits several and feeds
  the first, the next taking over when it leaves. A new subscription with
  `initialPosition=Latest` (the Python client's default) starts at the queues' ends;
  `Earliest`, or an existing group, where the group is.
- FLOW grants permits; a consumer's pump receives up to its permits from the group
  (`Broker.receive`, a long poll) and pushes one MESSAGE each, `redelivery_count` being the
  delivery attempt less one (durable in the group store, so it survives a restart, unlike
  Pulsar's in-memory counter). A message id is (ledgerId = queue id, entryId = queue offset).
- ACK (individual; cumulative too: every message this consumer holds from that queue up to
  the offset) acks the group's in-flight entry by its queue and offset (`GroupStore.get`), so
  an ack from before a door restart still lands. REDELIVER_UNACKNOWLEDGED_MESSAGES makes the
  named messages (none named: all the consumer holds) visible again at once; so does closing
  the consumer or losing its connection.
- PING -> PONG; CLOSE_PRODUCER / CLOSE_CONSUMER -> SUCCESS.
Every other command that carries a request id gets ERROR (NotAllowedError) naming it; one
without is logged and ignored. A malformed frame (`codec.FrameError`) closes that connection
only, with one log line; so does a connection silent for `KEEPALIVE_S` (clients ping every 30 s).

Pulsar holds an unacked message for its consumer for as long as the consumer is connected.
chronoq's in-flight messages become visible again when their invisible duration ends, so the
door receives with `default_invisible_duration_ms` and renews what its consumers hold
(`Broker.change_invisible_duration`) while they are connected. After a crash of the server the
held messages come back when that duration ends; acks that reached the group store stay.

Delayed delivery holds on every subscription type: the timer is the message's, kept before
any subscription sees it, where Pulsar delays only on Shared and Key_Shared and hands
delayed messages to Exclusive and Failover subscriptions at once. Strict, never early, is the
only mode (Pulsar's `isDelayedDeliveryDeliverAtTimeStrict`), with no tick to round to.

Topics: `persistent://public/default/NAME` (or a bare `NAME`) is chronoq's topic `NAME`; other
tenants and namespaces, and `non-persistent://`, are refused with InvalidTopicName. A SEND
refused for its content (no payload, a property name chronoq reserves, compression,
encryption, chunking, a due time beyond `timer_max_delay_ms`) is answered with SEND_ERROR
`ChecksumError`, the one error the client fails that single send for (others make it reconnect
and send again); the message text and the server log say why. A broker failure a retry can
outlive answers `PersistenceError`, and the client resends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chronoq.config import Config
from chronoq.errors import ChronoqError, TopicNotFound
from chronoq.model import OutgoingMessage, ReceivedMessage
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import FrameError, ServerError, Type
from chronoq.validate import check_group_name, check_topic_name

if TYPE_CHECKING:
    from chronoq.broker import Broker

log = logging.getLogger("chronoq.pulsar")

SERVER_VERSION = "chronoq-pulsar-door"
PROTOCOL_VERSION = 20
"""The newest protocol version the door speaks (that of the C++ client 4.x)."""
KEEPALIVE_S = 90.0
"""A connection with nothing from the client for this long is closed (clients ping every 30 s)."""
POLL_MS = 500
"""A consumer's long poll; a message made visible again by a redelivery request or another
consumer's leaving is picked up within this."""
READ_CHUNK = 256 * 1024
PROP_PRODUCER = "PULSAR_PRODUCER"
"""The Pulsar producer's name, kept as a property of the chronoq message and given back in its
metadata; like the two below it is not shown to Pulsar consumers as a property."""
PROP_SEQUENCE_ID = "PULSAR_SEQUENCE_ID"
PROP_EVENT_TIME = "PULSAR_EVENT_TIME"
DOOR_PROPERTIES = frozenset({PROP_PRODUCER, PROP_SEQUENCE_ID, PROP_EVENT_TIME})
NAMESPACE_PREFIXES = ("persistent://public/default/", "public/default/")

SubType = api.CommandSubscribe.SubType


class Hangup(Exception):
    """Close this connection; the reason was logged where it was found."""


class Refused(Exception):
    """A request the door answers with a Pulsar error: `error` (a ServerError) and a message."""

    def __init__(self, error: int, message: str) -> None:
        super().__init__(message)
        self.error = error
        self.message = message


def chronoq_topic(pulsar_topic: str, config: Config) -> str:
    """The chronoq topic a Pulsar topic name maps to, or `Refused(InvalidTopicName)`."""
    name = pulsar_topic
    for prefix in NAMESPACE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    else:
        if "/" in name:
            raise Refused(ServerError.InvalidTopicName,
                          f"chronoq serves persistent://public/default/<topic> only, not {pulsar_topic!r}")
    try:
        check_topic_name(name, config)
    except ChronoqError as exc:
        raise Refused(ServerError.InvalidTopicName, str(exc)) from None
    return name


def _error_for_send(exc: ChronoqError) -> int:
    return ServerError.PersistenceError if exc.retriable else ServerError.ChecksumError


def messages_of(frame: codec.Frame, topic: str, producer_name: str, now_ms: int) -> list[OutgoingMessage]:
    """The chronoq messages of one SEND, or `Refused(ChecksumError)` saying why there are none."""
    send, meta = frame.command.send, frame.metadata
    assert meta is not None
    what = f"SEND sequence_id {send.sequence_id}"
    if meta.compression != api.NONE:
        raise Refused(ServerError.ChecksumError,
                      f"{what}: compression {api.CompressionType.Name(meta.compression)} is not supported; "
                      "send uncompressed (compression_type=None)")
    if meta.encryption_keys or send.is_chunk or meta.num_chunks_from_msg > 1 or meta.HasField("uuid"):
        raise Refused(ServerError.ChecksumError, f"{what}: encrypted and chunked messages are not supported")
    if send.txnid_most_bits or send.txnid_least_bits or send.marker:
        raise Refused(ServerError.ChecksumError, f"{what}: transactions and markers are not supported")
    deliver_at: int | None = None
    if meta.HasField("deliver_at_time") and meta.deliver_at_time > now_ms:
        deliver_at = meta.deliver_at_time  # one due already is a plain message: due means deliverable
    born = meta.publish_time if meta.publish_time > 0 else None
    base = {PROP_PRODUCER: meta.producer_name or producer_name}
    if meta.HasField("num_messages_in_batch"):
        try:
            singles = codec.split_batch(meta, frame.payload)
        except FrameError as exc:
            raise Refused(ServerError.ChecksumError, f"{what}: {exc.reason}") from None
        out = []
        for single in singles:
            md = single.metadata
            if md.null_value:
                raise Refused(ServerError.ChecksumError, f"{what}: a null value has no chronoq form")
            props = {**codec.properties_of(md.properties), **base}
            if md.HasField("sequence_id"):
                props[PROP_SEQUENCE_ID] = str(md.sequence_id)
            if md.event_time:
                props[PROP_EVENT_TIME] = str(md.event_time)
            out.append(OutgoingMessage(topic, single.payload, keys=(md.partition_key,) if md.partition_key else (),
                                       properties=props, born_ms=born, deliver_at_ms=deliver_at))
        return out
    if meta.null_value:
        raise Refused(ServerError.ChecksumError, f"{what}: a null value has no chronoq form")
    props = {**codec.properties_of(meta.properties), **base, PROP_SEQUENCE_ID: str(meta.sequence_id)}
    if meta.event_time:
        props[PROP_EVENT_TIME] = str(meta.event_time)
    return [OutgoingMessage(topic, frame.payload, keys=(meta.partition_key,) if meta.partition_key else (),
                            properties=props, born_ms=born, deliver_at_ms=deliver_at)]


def message_frame(consumer_id: int, rm: ReceivedMessage) -> bytes:
    """The MESSAGE frame for one received chronoq message."""
    msg = rm.message
    props = msg.properties
    meta = api.MessageMetadata(producer_name=props.get(PROP_PRODUCER) or "chronoq",
                               sequence_id=_int_or(props.get(PROP_SEQUENCE_ID), msg.queue_offset),
                               publish_time=msg.born_ms)
    meta.properties.extend(codec.key_values({k: v for k, v in props.items() if k not in DOOR_PROPERTIES}))
    if msg.keys:
        meta.partition_key = msg.keys[0]
    event_time = _int_or(props.get(PROP_EVENT_TIME), 0)
    if event_time:
        meta.event_time = event_time
    cmd = codec.make_command(Type.MESSAGE, message=api.CommandMessage(
        consumer_id=consumer_id, message_id=api.MessageIdData(ledgerId=msg.queue_id, entryId=msg.queue_offset),
        redelivery_count=max(0, rm.delivery_attempt - 1)))
    return codec.encode_payload_command(cmd, meta, msg.body)


def _int_or(text: str | None, default: int) -> int:
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 19:
        return int(text)
    return default


@dataclass(slots=True)
class Held:
    """A message a consumer of the door holds: its current receipt handle and visible time."""

    consumer: Consumer
    handle: str
    visible_ms: int


@dataclass(slots=True, eq=False)
class Subscription:
    topic: str
    name: str
    sub_type: int
    consumers: list[Consumer] = field(default_factory=list)
    held: dict[tuple[int, int], Held] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Consumer:
    conn: Connection
    consumer_id: int
    sub: Subscription
    permits: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass(slots=True, eq=False)
class Producer:
    producer_id: int
    topic: str
    name: str
    queue: asyncio.Queue[codec.Frame] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None


class PulsarDoor:
    def __init__(self, broker: Broker, config: Config, *, auth_enabled: Callable[[], bool] = lambda: False) -> None:
        self.broker = broker
        self.config = config
        self.auth_enabled = auth_enabled
        self.subscriptions: dict[tuple[str, str], Subscription] = {}
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._renewals: asyncio.Task[None] | None = None
        self._names = itertools.count()
        self._name_prefix = os.urandom(3).hex()
        self.invisible_ms = config.default_invisible_duration_ms

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port."""
        self._server = await asyncio.start_server(self._accept, host or None, port, reuse_address=True)
        self._renewals = asyncio.create_task(self._renew_loop(), name="chronoq-pulsar-renewals")
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        if self._renewals is not None:
            self._renewals.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewals
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, reader, writer)
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    def producer_name(self) -> str:
        return f"chronoq-{self._name_prefix}-{next(self._names)}"

    # -- holding messages for connected consumers ------------------------------------------

    async def _renew_loop(self) -> None:
        """Keep what connected consumers hold invisible: extend each entry whose visible time is
        less than half the duration away (every quarter of it, so none runs out in between)."""
        period_s = max(self.invisible_ms / 4000, 0.05)
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.renew()
            except ChronoqError as exc:
                log.warning("pulsar door: renewing held messages failed: %s", exc)

    async def renew(self) -> None:
        now = self.broker.now_ms()
        for sub in list(self.subscriptions.values()):
            for key, held in list(sub.held.items()):
                if held.visible_ms - now >= self.invisible_ms // 2:
                    continue
                try:
                    held.handle = await self.broker.change_invisible_duration(sub.name, sub.topic, held.handle,
                                                                              self.invisible_ms)
                    held.visible_ms = now + self.invisible_ms
                except ChronoqError:
                    sub.held.pop(key, None)  # acked elsewhere, dead-lettered, or expired by retention

    def release(self, sub: Subscription, keys: list[tuple[int, int]]) -> None:
        """Make held messages visible again now (their attempt stays; the next delivery counts it)."""
        now = self.broker.now_ms()
        for key in keys:
            held = sub.held.pop(key, None)
            if held is None:
                continue
            with contextlib.suppress(ChronoqError):
                # Visible at once: the group's own postpone with no delay (a change of invisible
                # duration may not go below min_invisible_duration_ms).
                self.broker.consumers.postpone(sub.name, sub.topic, held.handle, 0, now)

    async def ack(self, sub: Subscription, keys: list[tuple[int, int]]) -> int:
        """Ack the group's in-flight entries at these (queue, offset) keys; returns how many."""
        handles = []
        groups = self.broker.groups
        for qid, offset in keys:
            sub.held.pop((qid, offset), None)
            entry = groups.get(sub.name, sub.topic, qid, offset)
            if entry is not None:
                handles.append(entry.receipt_handle)
        if not handles:
            return 0
        outcomes = await self.broker.ack_many(sub.name, sub.topic, handles)
        return sum(1 for o in outcomes if o is None)

    def start_at_end(self, group: str, topic: str) -> None:
        """A new subscription at `Latest`: the group's offsets at the queues' ends, unless the
        group already has an offset on the topic (then it goes on from there)."""
        config = self.broker.get_topic(topic)
        groups = self.broker.groups
        if any(groups.offset(group, topic, qid) is not None for qid in range(config.queue_count)):
            return
        offsets = [(group, topic, qid, self.broker.queue_offsets(topic, qid)[1]) for qid in range(config.queue_count)]
        groups.commit(offsets=offsets)


class Connection:
    def __init__(self, door: PulsarDoor, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.door = door
        self.broker = door.broker
        self.config = door.config
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.connected = False
        self.producers: dict[int, Producer] = {}
        self.consumers: dict[int, Consumer] = {}
        self._ignored: set[int] = set()
        self.max_message_size = min(self.config.max_message_size_bytes, codec.MAX_FRAME_BYTES)
        self.frames = codec.FrameReader(max_frame_bytes=max(codec.MAX_FRAME_BYTES,
                                                            self.max_message_size + codec.FRAME_OVERHEAD_BYTES))

    def abort(self) -> None:
        self.writer.transport.abort()

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    def send(self, kind: int, **sub: object) -> None:
        self.write(codec.encode_command(codec.make_command(kind, **sub)))

    def error(self, request_id: int, error: int, message: str) -> None:
        self.send(Type.ERROR, error=api.CommandError(request_id=request_id, error=error, message=message))

    async def run(self) -> None:
        try:
            while True:
                data = await asyncio.wait_for(self.reader.read(READ_CHUNK), KEEPALIVE_S)
                if not data:
                    break
                for frame in self.frames.feed(data):
                    await self.handle(frame)
        except FrameError as exc:
            log.warning("pulsar door: closing the connection from %s: malformed frame: %s", self.peer, exc.reason)
        except Hangup:
            pass
        except TimeoutError:
            log.info("pulsar door: closing the connection from %s: nothing heard for %.0f s", self.peer, KEEPALIVE_S)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self.close()

    async def close(self) -> None:
        for producer in list(self.producers.values()):
            if producer.task is not None:
                producer.task.cancel()
        self.producers.clear()
        for consumer in list(self.consumers.values()):
            await self._drop_consumer(consumer)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()

    # -- dispatch ----------------------------------------------------------------------------

    async def handle(self, frame: codec.Frame) -> None:
        cmd = frame.command
        kind = cmd.type
        if not self.connected:
            if kind != Type.CONNECT:
                raise FrameError(f"{codec.type_name(kind)} before CONNECT")
            self.on_connect(cmd.connect)
            return
        handler = self._handlers.get(kind)
        if handler is not None:
            await handler(self, frame)
            return
        self.refuse_unserved(cmd)

    def refuse_unserved(self, cmd: api.BaseCommand) -> None:
        kind = cmd.type
        fd = api.BaseCommand.DESCRIPTOR.fields_by_number.get(kind)
        if fd is not None and fd.message_type is not None and cmd.HasField(fd.name):
            sub = getattr(cmd, fd.name)
            if "request_id" in sub.DESCRIPTOR.fields_by_name and sub.HasField("request_id"):
                self.error(sub.request_id, ServerError.NotAllowedError,
                           f"chronoq's Pulsar door does not serve {codec.type_name(kind)}")
                return
        if kind not in self._ignored:
            self._ignored.add(kind)
            log.warning("pulsar door: %s from %s ignored: the door does not serve it", codec.type_name(kind), self.peer)

    def on_connect(self, connect: api.CommandConnect) -> None:
        if self.door.auth_enabled():
            log.warning("pulsar door: refused a connection from %s: chronoq's auth is on and the Pulsar door has "
                        "no authentication", self.peer)
            self.error(0, ServerError.AuthenticationError,
                       "chronoq's auth is on; its Pulsar door serves only with auth off")
            raise Hangup()
        self.connected = True
        version = min(connect.protocol_version, PROTOCOL_VERSION)
        self.send(Type.CONNECTED, connected=api.CommandConnected(
            server_version=SERVER_VERSION, protocol_version=version, max_message_size=self.max_message_size))

    async def on_ping(self, frame: codec.Frame) -> None:
        self.send(Type.PONG, pong=api.CommandPong())

    async def on_pong(self, frame: codec.Frame) -> None:
        return None

    async def on_partitioned_metadata(self, frame: codec.Frame) -> None:
        req = frame.command.partitionMetadata
        Response = api.CommandPartitionedTopicMetadataResponse
        try:
            chronoq_topic(req.topic, self.config)
        except Refused as exc:
            self.send(Type.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=Response(
                request_id=req.request_id, response=Response.Failed, error=exc.error, message=exc.message))
            return
        self.send(Type.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=Response(
            request_id=req.request_id, partitions=0, response=Response.Success))

    async def on_lookup(self, frame: codec.Frame) -> None:
        req = frame.command.lookupTopic
        Response = api.CommandLookupTopicResponse
        try:
            chronoq_topic(req.topic, self.config)
        except Refused as exc:
            self.send(Type.LOOKUP_RESPONSE, lookupTopicResponse=Response(
                request_id=req.request_id, response=Response.Failed, error=exc.error, message=exc.message))
            return
        self.send(Type.LOOKUP_RESPONSE, lookupTopicResponse=Response(
            request_id=req.request_id, brokerServiceUrl=self.own_url(), response=Response.Connect,
            authoritative=True, proxy_through_service_url=False))

    def own_url(self) -> str:
        """This door as the client reached it (the socket's local address: right for a wildcard bind too)."""
        local = self.writer.get_extra_info("sockname")
        host, port = local[0], local[1]
        return f"pulsar://[{host}]:{port}" if ":" in host else f"pulsar://{host}:{port}"

    async def on_producer(self, frame: codec.Frame) -> None:
        req = frame.command.producer
        try:
            topic = chronoq_topic(req.topic, self.config)
            if req.encrypted:
                raise Refused(ServerError.NotAllowedError, "encrypted producers are not supported")
            if req.producer_access_mode != api.Shared:
                raise Refused(ServerError.NotAllowedError,
                              f"producer access mode {api.ProducerAccessMode.Name(req.producer_access_mode)} is "
                              "not supported; chronoq's Pulsar door serves Shared producers")
            try:
                self.broker.topic_for_send(topic)
            except TopicNotFound as exc:
                raise Refused(ServerError.TopicNotFound, str(exc)) from None
        except Refused as exc:
            self.error(req.request_id, exc.error, exc.message)
            return
        producer = self.producers.get(req.producer_id)
        if producer is None:
            name = req.producer_name if req.producer_name else self.door.producer_name()
            producer = Producer(req.producer_id, topic, name)
            producer.task = asyncio.create_task(self._store_sends(producer), name=f"chronoq-pulsar-producer-{name}")
            self.producers[req.producer_id] = producer
        self.send(Type.PRODUCER_SUCCESS, producer_success=api.CommandProducerSuccess(
            request_id=req.request_id, producer_name=producer.name, last_sequence_id=-1))

    async def on_send(self, frame: codec.Frame) -> None:
        send = frame.command.send
        producer = self.producers.get(send.producer_id)
        if producer is None:
            self.send(Type.SEND_ERROR, send_error=api.CommandSendError(
                producer_id=send.producer_id, sequence_id=send.sequence_id, error=ServerError.NotAllowedError,
                message=f"no producer {send.producer_id} on this connection"))
            return
        producer.queue.put_nowait(frame)

    async def _store_sends(self, producer: Producer) -> None:
        """Store a producer's SENDs, those queued meanwhile together, and answer in their order."""
        queue = producer.queue
        while True:
            frames = [await queue.get()]
            while not queue.empty() and len(frames) < self.config.max_send_batch:
                frames.append(queue.get_nowait())
            now = self.broker.now_ms()
            plans: list[list[OutgoingMessage] | Refused] = []
            flat: list[OutgoingMessage] = []
            for frame in frames:
                try:
                    msgs = messages_of(frame, producer.topic, producer.name, now)
                except Refused as exc:
                    plans.append(exc)
                    continue
                plans.append(msgs)
                flat.extend(msgs)
            outcomes: list[object] = []
            failure: ChronoqError | None = None
            if flat:
                try:
                    outcomes = await self.broker.send_batch(flat, partial=True)
                except ChronoqError as exc:
                    failure = exc
            at = 0
            for frame, plan in zip(frames, plans, strict=True):
                send = frame.command.send
                if isinstance(plan, Refused):
                    self._send_error(producer, send, plan.error, plan.message)
                    continue
                mine = outcomes[at:at + len(plan)] if failure is None else []
                at += len(plan)
                bad = failure or next((o for o in mine if isinstance(o, ChronoqError)), None)
                if bad is not None:
                    self._send_error(producer, send, _error_for_send(bad), f"{type(bad).__name__}: {bad}")
                    continue
                first = mine[0]
                receipt = api.CommandSendReceipt(
                    producer_id=send.producer_id, sequence_id=send.sequence_id,
                    message_id=api.MessageIdData(ledgerId=first.queue_id, entryId=first.queue_offset))
                if send.HasField("highest_sequence_id"):
                    receipt.highest_sequence_id = send.highest_sequence_id
                self.send(Type.SEND_RECEIPT, send_receipt=receipt)

    def _send_error(self, producer: Producer, send: api.CommandSend, error: int, message: str) -> None:
        log.info("pulsar door: producer %s on %s: sequence_id %d refused: %s", producer.name, producer.topic,
                 send.sequence_id, message)
        self.send(Type.SEND_ERROR, send_error=api.CommandSendError(
            producer_id=send.producer_id, sequence_id=send.sequence_id, error=error, message=message))

    async def on_close_producer(self, frame: codec.Frame) -> None:
        req = frame.command.close_producer
        producer = self.producers.pop(req.producer_id, None)
        if producer is not None and producer.task is not None:
            # What was sent before the close is answered first (its receipts are written in order).
            while not producer.queue.empty():
                await asyncio.sleep(0.001)
            producer.task.cancel()
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def on_subscribe(self, frame: codec.Frame) -> None:
        req = frame.command.subscribe
        if req.consumer_id in self.consumers:  # the client's retry of a subscribe that succeeded
            self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))
            return
        try:
            sub = await self._subscription(req)
        except Refused as exc:
            self.error(req.request_id, exc.error, exc.message)
            return
        consumer = Consumer(self, req.consumer_id, sub)
        sub.consumers.append(consumer)
        self.consumers[req.consumer_id] = consumer
        if sub.sub_type == SubType.Shared or len(sub.consumers) == 1:
            self._start_pump(consumer)
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def _subscription(self, req: api.CommandSubscribe) -> Subscription:
        topic = chronoq_topic(req.topic, self.config)
        sub_type = req.subType
        if sub_type == SubType.Key_Shared:
            raise Refused(ServerError.NotAllowedError,
                          "Key_Shared subscriptions are not supported; use Shared, Exclusive or Failover")
        if not req.durable or req.HasField("start_message_id"):
            raise Refused(ServerError.NotAllowedError, "readers (non-durable subscriptions) are not supported")
        try:
            check_group_name(req.subscription, self.config)
        except ChronoqError as exc:
            raise Refused(ServerError.NotAllowedError, str(exc)) from None
        try:
            self.broker.get_topic(topic)
        except TopicNotFound:
            if not (self.config.auto_create_topics and req.force_topic_creation):
                raise Refused(ServerError.TopicNotFound, f"no topic {topic!r}") from None
            with contextlib.suppress(ChronoqError):
                await self.broker.create_topic(topic)
            try:
                self.broker.get_topic(topic)
            except TopicNotFound as exc:
                raise Refused(ServerError.TopicNotFound, str(exc)) from None
        key = (topic, req.subscription)
        sub = self.door.subscriptions.get(key)
        if sub is None:
            if req.initialPosition == api.CommandSubscribe.Latest:
                self.door.start_at_end(req.subscription, topic)
            sub = Subscription(topic, req.subscription, sub_type)
            self.door.subscriptions[key] = sub
        elif sub.consumers and sub.sub_type != sub_type:
            raise Refused(ServerError.ConsumerBusy,
                          f"subscription {req.subscription!r} is {SubType.Name(sub.sub_type)} while it has "
                          f"consumers, not {SubType.Name(sub_type)}")
        else:
            sub.sub_type = sub_type
        if sub_type == SubType.Exclusive and sub.consumers:
            raise Refused(ServerError.ConsumerBusy, f"exclusive subscription {req.subscription!r} has a consumer")
        return sub

    def _start_pump(self, consumer: Consumer) -> None:
        consumer.task = asyncio.create_task(self._pump(consumer), name=f"chronoq-pulsar-consumer-{consumer.sub.name}")
        consumer.wake.set()

    async def _pump(self, consumer: Consumer) -> None:
        """Receive up to the consumer's permits and push them, for as long as it is subscribed."""
        sub = consumer.sub
        while True:
            while consumer.permits <= 0:
                consumer.wake.clear()
                await consumer.wake.wait()
            want = min(consumer.permits, self.config.max_receive_batch)
            try:
                received = await self.broker.receive(sub.name, sub.topic, batch_size=want,
                                                     invisible_duration_ms=self.door.invisible_ms, wait_ms=POLL_MS)
            except ChronoqError as exc:
                log.warning("pulsar door: receive for subscription %r on %r failed: %s", sub.name, sub.topic, exc)
                await asyncio.sleep(1)
                continue
            if not received:
                continue
            for rm in received:
                msg = rm.message
                sub.held[(msg.queue_id, msg.queue_offset)] = Held(consumer, rm.receipt_handle, rm.invisible_until_ms)
                self.write(message_frame(consumer.consumer_id, rm))
            consumer.permits -= len(received)
            await self.writer.drain()

    async def on_flow(self, frame: codec.Frame) -> None:
        req = frame.command.flow
        consumer = self.consumers.get(req.consumer_id)
        if consumer is not None:
            consumer.permits += req.messagePermits
            consumer.wake.set()

    async def on_ack(self, frame: codec.Frame) -> None:
        req = frame.command.ack
        consumer = self.consumers.get(req.consumer_id)
        if consumer is not None:
            sub = consumer.sub
            keys = [(m.ledgerId, m.entryId) for m in req.message_id]
            if req.ack_type == api.CommandAck.Cumulative:
                keys = self._up_to(consumer, keys)
            if req.HasField("validation_error"):
                log.warning("pulsar door: consumer %d on %r discarded %d messages as invalid (validation error %d); "
                            "acked", req.consumer_id, sub.name, len(keys), req.validation_error)
            try:
                await self.door.ack(sub, keys)
            except ChronoqError as exc:
                log.warning("pulsar door: ack on subscription %r failed: %s", sub.name, exc)
        if req.HasField("request_id"):
            self.send(Type.ACK_RESPONSE, ackResponse=api.CommandAckResponse(
                consumer_id=req.consumer_id, request_id=req.request_id))

    def _up_to(self, consumer: Consumer, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A cumulative ack's messages: each held by this consumer in the named queue up to the offset."""
        out = set(keys)
        for qid, offset in keys:
            out.update(k for k, h in consumer.sub.held.items() if h.consumer is consumer and k[0] == qid
                       and k[1] <= offset)
        return sorted(out)

    async def on_redeliver(self, frame: codec.Frame) -> None:
        req = frame.command.redeliverUnacknowledgedMessages
        consumer = self.consumers.get(req.consumer_id)
        if consumer is None:
            return
        sub = consumer.sub
        if req.message_ids:
            keys = [(m.ledgerId, m.entryId) for m in req.message_ids]
        else:
            keys = [k for k, h in sub.held.items() if h.consumer is consumer]
        self.door.release(sub, keys)

    async def on_close_consumer(self, frame: codec.Frame) -> None:
        req = frame.command.close_consumer
        consumer = self.consumers.get(req.consumer_id)
        if consumer is not None:
            await self._drop_consumer(consumer)
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def _drop_consumer(self, consumer: Consumer) -> None:
        self.consumers.pop(consumer.consumer_id, None)
        if consumer.task is not None:
            consumer.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer.task
        sub = consumer.sub
        if consumer in sub.consumers:
            was_active = sub.consumers[0] is consumer
            sub.consumers.remove(consumer)
            if was_active and sub.sub_type != SubType.Shared and sub.consumers:
                sub.consumers[0].conn._start_pump(sub.consumers[0])
        self.door.release(sub, [k for k, h in sub.held.items() if h.consumer is consumer])

    _handlers: dict[int, Callable[[Connection, codec.Frame], Awaitable[None]]] = {
        Type.PING: on_ping,
        Type.PONG: on_pong,
        Type.PARTITIONED_METADATA: on_partitioned_metadata,
        Type.LOOKUP: on_lookup,
        Type.PRODUCER: on_producer,
        Type.SEND: on_send,
        Type.CLOSE_PRODUCER: on_close_producer,
        Type.SUBSCRIBE: on_subscribe,
        Type.FLOW: on_flow,
        Type.ACK: on_ack,
        Type.REDELIVER_UNACKNOWLEDGED_MESSAGES: on_redeliver,
        Type.CLOSE_CONSUMER: on_close_consumer,
    }
