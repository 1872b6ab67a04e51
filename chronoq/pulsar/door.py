"""chronoq's Pulsar door: Apache Pulsar's binary protocol served over the broker, on its loop.

Theory of operation: `chronoq serve --pulsar-port PORT` (setting `pulsar_port`) starts an
asyncio TCP server beside the gRPC one, on the broker's event loop (with `--tls-cert/--tls-key`,
TLS: `pulsar+ssl://`). Each connection reads frames with `codec.FrameReader` and answers them in
order; what it serves is what Pulsar's official clients send (C++ 4.x, and the Python
`pulsar-client` built on it):

- CONNECT -> CONNECTED. With `[auth] enabled`, the client's `AuthenticationBasic(access_key,
  secret_key)` (method `basic`, data `access_key:secret_key`) is checked against chronoq's
  users (`Authenticator.password`). Refused credentials are logged and still get CONNECTED, but
  the connection's first request is answered AuthenticationError with the reason, in the reply
  its caller waits for (a failed partitioned-metadata or lookup response, else ERROR), and the
  door hangs up; nothing else is served there. Pulsar's broker answers CONNECT itself with an
  ERROR, which the C++ client (and the Python client over it) never reports: the caller sees its
  operation's TimeOut. Here `pulsar.Client(...).create_producer` fails at once with
  AuthenticationError. The user's
  permissions (`Principal`) then decide each PRODUCER (publish) and SUBSCRIBE (subscribe to
  the topic, consume as the group): AuthorizationError.
- PARTITIONED_METADATA -> 0 partitions (every topic is non-partitioned); LOOKUP -> `Connect`
  to this door's own address, authoritative (there is one broker).
- PRODUCER -> PRODUCER_SUCCESS (a broker-chosen name unless the client gives one). Each SEND
  becomes chronoq messages (`messages.messages_of`: a batch is one per entry; a delayed one is
  a timer plus, for Exclusive and Failover subscriptions, an immediate copy) stored through
  `Broker.send_batch`, and SEND_RECEIPTs go back in the order of the SENDs, as the client
  requires. A producer's queued SENDs are stored together: one `Broker.send_batch` (one group
  commit) per `max_send_batch` messages (`store_groups`; a delayed SEND is two messages).
  What producers sent is counted per topic (`Broker.count_accepted`: /metrics, the console) as
  the gRPC door's sends are; the immediate copies are not.
- SUBSCRIBE -> SUCCESS. A subscription is a chronoq consumer group of the same name on the
  topic; Shared, Key_Shared (AUTO_SPLIT), Exclusive and Failover are served as
  `subscriptions.py` says. A new subscription with `initialPosition=Latest` (the Python
  client's default) starts at the queues' ends; `Earliest`, or an existing group, where it is.
- FLOW grants permits; MESSAGE carries `redelivery_count`, the delivery attempt less one (durable
  in the group store, so it survives a restart, unlike Pulsar's in-memory counter).
- ACK (individual; cumulative: every message this consumer holds from that queue up to the
  offset) acks the group's in-flight entry by its queue and offset, so an ack from before a
  door restart still lands. REDELIVER_UNACKNOWLEDGED_MESSAGES (the client's negative acks and
  ack timeouts) makes the named messages (none named: all the consumer holds) visible again
  at once; so does closing the consumer or losing its connection: another consumer gets them.
- UNSUBSCRIBE (by the subscription's only consumer) forgets the group on the topic.
  GET_LAST_MESSAGE_ID answers the id of the message that entered the topic's queues last.
  SEEK (to a message id, or a publish time) moves the group (`Broker.reset_group`: what it
  held is dropped; by id, that queue to that offset and the others to the message's time) and
  then closes the subscription's consumers, which the client resubscribes, as Pulsar does.
- PING -> PONG; CLOSE_PRODUCER / CLOSE_CONSUMER -> SUCCESS.
Every other command that carries a request id gets ERROR (NotAllowedError) naming it; one
without is logged and ignored. A malformed frame (`codec.FrameError`, a frame above the
largest message size plus room) closes that connection only, with one log line; so does a
connection silent for `KEEPALIVE_S` (clients ping every 30 s).

Named limits (config.py, `pulsar_*`): producers and consumers per connection (one more is
refused with NotAllowedError naming the setting), permits per consumer (a FLOW past it is cut
to it), SENDs waiting for receipts per connection (past it the door stops reading that
connection), and the outgoing buffer (`pulsar_max_write_buffer_bytes`: above it the door stops
pushing MESSAGEs and reading requests there until the client reads), so a client that never
reads holds at most that much of the broker's memory.

Delayed delivery follows Pulsar (held on Shared and Key_Shared, at once on Exclusive and
Failover); the design, a timer plus an immediate copy, and why: `messages.py`.

Pulsar holds an unacked message for its consumer for as long as the consumer is connected.
chronoq's in-flight messages become visible again when their invisible duration ends, so the
door receives with `default_invisible_duration_ms` and renews what its consumers hold
(`Broker.change_invisible_duration`) while they are connected. After a crash of the server the
held messages come back when that duration ends; acks that reached the group store stay.

Topics: `persistent://public/default/NAME` (or a bare `NAME`) is chronoq's topic `NAME`; other
tenants and namespaces, and `non-persistent://`, are refused with InvalidTopicName. A SEND
refused for its content (no payload, a property name chronoq reserves, compression,
encryption, chunking, a due time beyond `timer_max_delay_ms`) is answered with SEND_ERROR
`ChecksumError`, the one error the client fails that single send for (others make it reconnect
and send again); the message text and the server log say why. A delay beyond
`pulsar_max_delivery_delay_ms` is NotAllowedError, as Pulsar answers it, except to the clients
named in `pulsar_checksum_error_clients` (the C++ client and those built on it, which would
send it again until their send timeout): ChecksumError, its text starting "NotAllowed:". A broker failure a
retry can outlive answers `PersistenceError`, and the client resends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chronoq.config import Config
from chronoq.errors import ChronoqError, TopicNotFound, Unauthorized
from chronoq.model import OutgoingMessage
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import FrameError, ServerError, Type
from chronoq.pulsar.messages import (
    IMMEDIATE_LEDGER,
    Refused,
    chronoq_topic,
    immediate_name,
    matches_any,
    messages_of,
)
from chronoq.pulsar.subscriptions import Consumer, Subscription, SubType
from chronoq.server.auth import ANONYMOUS, Authenticator, Principal
from chronoq.validate import check_group_name

if TYPE_CHECKING:
    from chronoq.broker import Broker

log = logging.getLogger("chronoq.pulsar")

SERVER_VERSION = "chronoq-pulsar-door"
PROTOCOL_VERSION = 20
"""The newest protocol version the door speaks (that of the C++ client 4.x)."""
KEEPALIVE_S = 90.0
"""A connection with nothing from the client for this long is closed (clients ping every 30 s)."""
READ_CHUNK = 256 * 1024
EARLIEST = (1 << 64) - 1
"""A MessageIdData field of -1 as the client writes it (uint64): `MessageId.earliest` is (-1, -1)."""
LATEST = (1 << 63) - 1
"""`MessageId.latest` is (Long.MAX, Long.MAX)."""
NO_REQUEST = (1 << 64) - 1
"""The request id (-1) of an ERROR that answers no request (and `_request_id` of a command
that carries none)."""
STEP_SENDS = 32
"""A producer's queued SENDs stored in one step of the event loop (one `_store`, then its group
commit; more wait for the next). A step holds the loop for its CPU time (~0.2 ms a delayed SEND:
its timer and its immediate copy), which the timer loop then waits out: 32 keep that near
5 ms, where a burst of 1,024 took 30 ms and more, late timers' P99 with it. Throughput is not
bound by it: one group commit a step still allows thousands of SENDs a second."""


def store_groups(plans: list[list[OutgoingMessage] | Refused], limit: int) -> list[list[OutgoingMessage]]:
    """The messages of queued SENDs in order, cut into `Broker.send_batch` calls of at most
    `limit` (`max_send_batch`) messages, at SEND boundaries where one fits: a delayed SEND is
    two messages (its timer and its immediate copy), so as many SENDs as `max_send_batch` may
    be more messages than one call takes. A SEND of more messages than `limit` (a batch) is cut."""
    groups: list[list[OutgoingMessage]] = []
    current: list[OutgoingMessage] = []
    for plan in plans:
        if isinstance(plan, Refused):
            continue
        if current and len(current) + len(plan) > limit:
            groups.append(current)
            current = []
        current.extend(plan)
        while len(current) > limit:
            groups.append(current[:limit])
            current = current[limit:]
    if current:
        groups.append(current)
    return groups


class Hangup(Exception):
    """Close this connection; the reason was logged where it was found."""


def _error_for_send(exc: ChronoqError) -> int:
    return ServerError.PersistenceError if exc.retriable else ServerError.ChecksumError


def server_ssl(config: Config) -> ssl.SSLContext | None:
    """The door's TLS context from `tls_cert_file` / `tls_key_file` (those of the gRPC port)."""
    if not config.tls_cert_file or not config.tls_key_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    return context


@dataclass(slots=True, eq=False)
class Producer:
    producer_id: int
    topic: str
    name: str
    queue: asyncio.Queue[codec.Frame] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None


class PulsarDoor:
    def __init__(self, broker: Broker, config: Config, *, authenticator: Authenticator | None = None) -> None:
        self.broker = broker
        self.config = config
        self.authenticator = authenticator
        self.subscriptions: dict[tuple[str, str], Subscription] = {}
        self.connections: set[Connection] = set()
        self.tls = server_ssl(config)
        self._server: asyncio.Server | None = None
        self._renewals: asyncio.Task[None] | None = None
        self._names = itertools.count()
        self._name_prefix = os.urandom(3).hex()
        self._made_topics: set[str] = set()
        self.invisible_ms = config.default_invisible_duration_ms

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port."""
        self._server = await asyncio.start_server(self._accept, host or None, port, reuse_address=True, ssl=self.tls)
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

    async def ensure_topic(self, topic: str, queue_count: int | None = None) -> None:
        """Create a topic the door needs (an immediate-copy topic) unless it exists."""
        if topic in self._made_topics:
            return
        try:
            self.broker.get_topic(topic)
        except TopicNotFound:
            with contextlib.suppress(ChronoqError):
                await self.broker.create_topic(topic, queue_count)
        self._made_topics.add(topic)

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
                    held.handle = await self.broker.change_invisible_duration(sub.name, held.topic, held.handle,
                                                                              self.invisible_ms)
                    held.visible_ms = now + self.invisible_ms
                except ChronoqError:
                    sub.held.pop(key, None)  # acked elsewhere, dead-lettered, or expired by retention

    async def release(self, sub: Subscription, keys: list[tuple[int, int]]) -> None:
        """Make held messages visible again now (their attempt stays; the next delivery counts it)."""
        for key in keys:
            held = sub.held.pop(key, None)
            if held is not None:
                with contextlib.suppress(ChronoqError):
                    await self.broker.make_visible(sub.name, held.topic, held.handle)
        sub.wake.set()

    async def ack(self, sub: Subscription, keys: list[tuple[int, int]]) -> int:
        """Ack the group's in-flight entries at these (ledger, entry) keys; returns how many."""
        handles: dict[str, list[str]] = {}
        for ledger, entry in keys:
            sub.held.pop((ledger, entry), None)
            topic = sub.topic_of(ledger)
            qid = ledger - IMMEDIATE_LEDGER if ledger >= IMMEDIATE_LEDGER else ledger
            handle = self.broker.inflight_handle(sub.name, topic, qid, entry)
            if handle is not None:
                handles.setdefault(topic, []).append(handle)
        done = 0
        for topic, some in handles.items():
            outcomes = await self.broker.ack_many(sub.name, topic, some)
            done += sum(1 for o in outcomes if o is None)
        return done

    def subscription(self, topic: str, name: str, sub_type: int) -> Subscription:
        return Subscription(self.broker, self.config.max_receive_batch, self.invisible_ms, topic, name, sub_type,
                            immediate_name(topic, self.config))


def _request_id(cmd: api.BaseCommand) -> int:
    """The request id of the command's sub-command, or `NO_REQUEST` if it carries none."""
    fd = api.BaseCommand.DESCRIPTOR.fields_by_number.get(cmd.type)
    if fd is not None and fd.message_type is not None and cmd.HasField(fd.name):
        sub = getattr(cmd, fd.name)
        if "request_id" in sub.DESCRIPTOR.fields_by_name and sub.HasField("request_id"):
            return int(sub.request_id)
    return NO_REQUEST


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
        self.principal: Principal = ANONYMOUS
        self.fails_sends_on_checksum_only = False
        """The client (its CONNECT's `client_version`) is one of `pulsar_checksum_error_clients`."""
        self.refusal: str | None = None
        """Why CONNECT's credentials were refused (None: they were not)."""
        self.producers: dict[int, Producer] = {}
        self.consumers: dict[int, Consumer] = {}
        self.pending_sends = 0
        self.sends_room = asyncio.Event()
        self._ignored: set[int] = set()
        self._permits_cut_logged = False
        self.max_message_size = min(self.config.max_message_size_bytes, codec.MAX_FRAME_BYTES)
        self.frames = codec.FrameReader(max_frame_bytes=max(codec.MAX_FRAME_BYTES,
                                                            self.max_message_size + codec.FRAME_OVERHEAD_BYTES))
        writer.transport.set_write_buffer_limits(high=self.config.pulsar_max_write_buffer_bytes)

    def abort(self) -> None:
        self.writer.transport.abort()

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        """Wait while the outgoing buffer is above `pulsar_max_write_buffer_bytes`."""
        if not self.writer.is_closing():
            await self.writer.drain()

    def send(self, kind: int, **sub: object) -> None:
        self.write(codec.encode_command(codec.make_command(kind, **sub)))

    def error(self, request_id: int, error: int, message: str) -> None:
        self.send(Type.ERROR, error=api.CommandError(request_id=request_id, error=error, message=message))

    async def run(self) -> None:
        try:
            while True:
                await self.drain()  # a client that does not read its replies is not read either
                data = await asyncio.wait_for(self.reader.read(READ_CHUNK), KEEPALIVE_S)
                if not data:
                    break
                for frame in self.frames.feed(data):
                    await self.handle(frame)
                while self.pending_sends >= self.config.pulsar_max_pending_sends_per_connection:
                    self.sends_room.clear()
                    await self.sends_room.wait()
        except FrameError as exc:
            log.warning("pulsar door: closing the connection from %s: malformed frame: %s", self.peer, exc.reason)
        except Hangup:
            pass
        except TimeoutError:
            log.info("pulsar door: closing the connection from %s: nothing heard for %.0f s", self.peer, KEEPALIVE_S)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
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
        if self.refusal is not None:
            self.refuse_request(cmd)
            return
        handler = self._handlers.get(kind)
        if handler is not None:
            await handler(self, frame)
            return
        self.refuse_unserved(cmd)

    def refuse_request(self, cmd: api.BaseCommand) -> None:
        """On a connection whose credentials were refused: the first request is answered with
        AuthenticationError and the reason, in the reply the client waits for, then the door
        hangs up. Nothing else is served there."""
        kind, reason = cmd.type, self.refusal or ""
        if kind == Type.PING:
            self.send(Type.PONG, pong=api.CommandPong())
            return
        if kind == Type.PARTITIONED_METADATA:
            Meta = api.CommandPartitionedTopicMetadataResponse
            self.send(Type.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=Meta(
                request_id=cmd.partitionMetadata.request_id, response=Meta.Failed,
                error=ServerError.AuthenticationError, message=reason))
        elif kind == Type.LOOKUP:
            Lookup = api.CommandLookupTopicResponse
            self.send(Type.LOOKUP_RESPONSE, lookupTopicResponse=Lookup(
                request_id=cmd.lookupTopic.request_id, response=Lookup.Failed,
                error=ServerError.AuthenticationError, message=reason))
        else:
            self.error(_request_id(cmd), ServerError.AuthenticationError, reason)
        raise Hangup()

    def refuse_unserved(self, cmd: api.BaseCommand) -> None:
        kind = cmd.type
        request_id = _request_id(cmd)
        if request_id != NO_REQUEST:
            self.error(request_id, ServerError.NotAllowedError,
                       f"chronoq's Pulsar door does not serve {codec.type_name(kind)}")
            return
        if kind not in self._ignored:
            self._ignored.add(kind)
            log.warning("pulsar door: %s from %s ignored: the door does not serve it", codec.type_name(kind), self.peer)

    def on_connect(self, connect: api.CommandConnect) -> None:
        authenticator = self.door.authenticator
        if authenticator is not None and authenticator.enabled:
            try:
                self.principal = self._authenticate(authenticator, connect)
            except ChronoqError as exc:
                log.warning("pulsar door: refused a connection from %s: %s", self.peer, exc)
                # Answered on the connection's first request, where the client reports it.
                self.refusal = str(exc)
        self.connected = True
        self.fails_sends_on_checksum_only = matches_any(connect.client_version,
                                                        self.config.pulsar_checksum_error_clients)
        version = min(connect.protocol_version, PROTOCOL_VERSION)
        self.send(Type.CONNECTED, connected=api.CommandConnected(
            server_version=SERVER_VERSION, protocol_version=version, max_message_size=self.max_message_size))

    @staticmethod
    def _authenticate(authenticator: Authenticator, connect: api.CommandConnect) -> Principal:
        """The user of `AuthenticationBasic`: method `basic`, data `access_key:secret_key`."""
        method = connect.auth_method_name or "none"
        if method != "basic":
            raise Unauthorized(f"auth method {method!r}: chronoq's auth is on and its Pulsar door accepts "
                               "'basic' (pulsar.AuthenticationBasic(access_key, secret_key))", cause="malformed")
        access_key, colon, secret_key = connect.auth_data.decode("utf-8", "replace").partition(":")
        if not colon:
            raise Unauthorized("basic auth data is not 'access_key:secret_key'", cause="malformed")
        return authenticator.password(access_key, secret_key)

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
        url = self.own_url()
        reply = Response(request_id=req.request_id, brokerServiceUrl=url, response=Response.Connect,
                         authoritative=True, proxy_through_service_url=False)
        if self.door.tls is not None:
            reply.brokerServiceUrlTls = url
        self.send(Type.LOOKUP_RESPONSE, lookupTopicResponse=reply)

    def own_url(self) -> str:
        """This door as the client reached it (the socket's local address: right for a wildcard bind too)."""
        local = self.writer.get_extra_info("sockname")
        host, port = local[0], local[1]
        scheme = "pulsar+ssl" if self.door.tls is not None else "pulsar"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

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
            if not self.principal.may_publish(topic):
                raise Refused(ServerError.AuthorizationError,
                              f"access key {self.principal.name!r} may not publish to topic {topic!r}")
            limit = self.config.pulsar_max_producers_per_connection
            if req.producer_id not in self.producers and len(self.producers) >= limit:
                raise Refused(ServerError.NotAllowedError,
                              f"this connection has {len(self.producers)} producers, the limit "
                              f"(pulsar_max_producers_per_connection = {limit})")
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
        self.pending_sends += 1
        producer.queue.put_nowait(frame)

    async def _store_sends(self, producer: Producer) -> None:
        """Store a producer's SENDs, those queued meanwhile together, and answer in their order."""
        queue = producer.queue
        while True:
            frames = [await queue.get()]
            while not queue.empty() and len(frames) < min(self.config.max_send_batch, STEP_SENDS):
                frames.append(queue.get_nowait())
            try:
                await self._store(producer, frames)
            finally:
                self.pending_sends -= len(frames)
                self.sends_room.set()

    async def _store(self, producer: Producer, frames: list[codec.Frame]) -> None:
        now = self.broker.now_ms()
        plans: list[list[OutgoingMessage] | Refused] = []
        flat: list[OutgoingMessage] = []
        for frame in frames:
            try:
                msgs = messages_of(frame, producer.topic, producer.name, now, self.config)
            except Refused as exc:
                plans.append(exc)
                continue
            plans.append(msgs)
            flat.extend(msgs)
        for topic in {m.topic for m in flat if m.topic != producer.topic}:
            await self.door.ensure_topic(topic, 1)
        outcomes: list[object] = []
        for part in store_groups(plans, self.config.max_send_batch):
            try:
                stored = await self.broker.send_batch(part, partial=True, count=False)
            except ChronoqError as exc:
                stored = [exc] * len(part)
            else:
                # What the producers sent, not the immediate copies stored beside the timers.
                self.broker.count_accepted((o for o, m in zip(stored, part, strict=True) if m.topic == producer.topic),
                                           now)
            outcomes.extend(stored)
        at = 0
        for frame, plan in zip(frames, plans, strict=True):
            send = frame.command.send
            if isinstance(plan, Refused):
                self._send_error(producer, send, plan.error, plan.message)
                continue
            mine = outcomes[at:at + len(plan)]
            at += len(plan)
            bad = next((o for o in mine if isinstance(o, ChronoqError)), None)
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
        if error == ServerError.NotAllowedError and self.fails_sends_on_checksum_only:
            error, message = ServerError.ChecksumError, f"NotAllowed: {message}"
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

    # -- consumers ---------------------------------------------------------------------------

    async def on_subscribe(self, frame: codec.Frame) -> None:
        req = frame.command.subscribe
        if req.consumer_id in self.consumers:  # the client's retry of a subscribe that succeeded
            self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))
            return
        try:
            limit = self.config.pulsar_max_consumers_per_connection
            if len(self.consumers) >= limit:
                raise Refused(ServerError.NotAllowedError,
                              f"this connection has {len(self.consumers)} consumers, the limit "
                              f"(pulsar_max_consumers_per_connection = {limit})")
            sub = await self._subscription(req)
        except Refused as exc:
            self.error(req.request_id, exc.error, exc.message)
            return
        consumer = Consumer(self, req.consumer_id, req.consumer_name, sub)
        self.consumers[req.consumer_id] = consumer
        sub.join(consumer)
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def _subscription(self, req: api.CommandSubscribe) -> Subscription:
        topic = chronoq_topic(req.topic, self.config)
        sub_type = req.subType
        if sub_type == SubType.Key_Shared and req.HasField("keySharedMeta") and req.keySharedMeta.keySharedMode != 0:
            raise Refused(ServerError.NotAllowedError,
                          "Key_Shared STICKY mode (hash ranges chosen by the consumer) is not supported; "
                          "chronoq serves AUTO_SPLIT")
        if not req.durable or req.HasField("start_message_id"):
            raise Refused(ServerError.NotAllowedError, "readers (non-durable subscriptions) are not supported")
        try:
            check_group_name(req.subscription, self.config)
        except ChronoqError as exc:
            raise Refused(ServerError.NotAllowedError, str(exc)) from None
        if not self.principal.may_subscribe(topic) or not self.principal.may_use_group(req.subscription):
            raise Refused(ServerError.AuthorizationError,
                          f"access key {self.principal.name!r} may not subscribe to topic {topic!r} as "
                          f"{req.subscription!r}")
        try:
            self.broker.get_topic(topic)
        except TopicNotFound:
            if not (self.config.auto_create_topics and req.force_topic_creation):
                raise Refused(ServerError.TopicNotFound, f"no topic {topic!r}") from None
            await self.door.ensure_topic(topic)
            try:
                self.broker.get_topic(topic)
            except TopicNotFound as exc:
                raise Refused(ServerError.TopicNotFound, str(exc)) from None
        key = (topic, req.subscription)
        sub = self.door.subscriptions.get(key)
        if sub is not None and sub.consumers and sub.sub_type != sub_type:
            raise Refused(ServerError.ConsumerBusy,
                          f"subscription {req.subscription!r} is {SubType.Name(sub.sub_type)} while it has "
                          f"consumers, not {SubType.Name(sub_type)}")
        if sub is not None and sub_type == SubType.Exclusive and sub.consumers:
            raise Refused(ServerError.ConsumerBusy, f"exclusive subscription {req.subscription!r} has a consumer")
        if sub is None or not sub.consumers:
            new = self.door.subscription(topic, req.subscription, sub_type)
            if sub is not None:
                new.held = sub.held
            sub = new
            if sub.immediate is not None and sub.single_active():
                await self.door.ensure_topic(sub.immediate, 1)
            if req.initialPosition == api.CommandSubscribe.Latest:
                for name in (topic, sub.immediate):
                    if name is not None and (name == topic or sub.single_active()):
                        await self.broker.start_group_at_end(req.subscription, name)
            self.door.subscriptions[key] = sub
        return sub

    async def on_flow(self, frame: codec.Frame) -> None:
        req = frame.command.flow
        consumer = self.consumers.get(req.consumer_id)
        if consumer is not None:
            limit = self.config.pulsar_max_permits_per_consumer
            consumer.permits = min(consumer.permits + req.messagePermits, limit)
            if consumer.permits == limit and not self._permits_cut_logged:
                self._permits_cut_logged = True
                log.info("pulsar door: consumer %d from %s holds %d permits, the limit "
                         "(pulsar_max_permits_per_consumer); more are not granted", req.consumer_id, self.peer, limit)
            consumer.sub.flowed(consumer)

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
        pending = {k for k, _ in consumer.pending}
        if pending & set(keys):
            consumer.pending = type(consumer.pending)((k, rm) for k, rm in consumer.pending if k not in keys)
        await self.door.release(sub, keys)
        consumer.wake.set()

    async def on_close_consumer(self, frame: codec.Frame) -> None:
        req = frame.command.close_consumer
        consumer = self.consumers.get(req.consumer_id)
        if consumer is not None:
            await self._drop_consumer(consumer)
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def _drop_consumer(self, consumer: Consumer) -> None:
        self.consumers.pop(consumer.consumer_id, None)
        sub = consumer.sub
        await self.door.release(sub, await sub.leave(consumer))

    async def on_unsubscribe(self, frame: codec.Frame) -> None:
        req = frame.command.unsubscribe
        consumer = self.consumers.get(req.consumer_id)
        if consumer is None:
            self.error(req.request_id, ServerError.ConsumerNotFound, f"no consumer {req.consumer_id} here")
            return
        sub = consumer.sub
        others = [c for c in sub.consumers if c is not consumer]
        if others and not req.force:
            self.error(req.request_id, ServerError.ConsumerBusy,
                       f"subscription {sub.name!r} has {len(others)} other consumers; it is not removed")
            return
        for other in others:
            await other.conn._drop_consumer(other)
        self.consumers.pop(consumer.consumer_id, None)
        await sub.leave(consumer)
        sub.held.clear()
        try:
            for name in (sub.topic, sub.immediate):
                if name is not None and (name == sub.topic or sub.single_active()):
                    await self.broker.reset_group(sub.name, name, None)
        except ChronoqError as exc:
            self.error(req.request_id, ServerError.PersistenceError, f"{type(exc).__name__}: {exc}")
            return
        self.door.subscriptions.pop((sub.topic, sub.name), None)
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))

    async def on_get_last_message_id(self, frame: codec.Frame) -> None:
        req = frame.command.getLastMessageId
        consumer = self.consumers.get(req.consumer_id)
        if consumer is None:
            self.error(req.request_id, ServerError.ConsumerNotFound, f"no consumer {req.consumer_id} here")
            return
        last = await self._last_message_id(consumer.sub.topic)
        self.send(Type.GET_LAST_MESSAGE_ID_RESPONSE, getLastMessageIdResponse=api.CommandGetLastMessageIdResponse(
            request_id=req.request_id, last_message_id=api.MessageIdData(ledgerId=last[0], entryId=last[1])))

    async def _last_message_id(self, topic: str) -> tuple[int, int]:
        """The (queue, offset) of the message that entered the topic's queues last; (-1, -1) if none."""
        best: tuple[int, int, int] | None = None
        for qid in range(self.broker.get_topic(topic).queue_count):
            low, high = self.broker.queue_offsets(topic, qid)
            if high <= low:
                continue
            found = await self.broker.read(topic, qid, high - 1, 1)
            entered = max(found[0].store_ms, found[0].deliver_at_ms or 0) if found else 0
            if best is None or entered >= best[0]:
                best = (entered, qid, high - 1)
        return (EARLIEST, EARLIEST) if best is None else (best[1], best[2])

    async def on_seek(self, frame: codec.Frame) -> None:
        req = frame.command.seek
        consumer = self.consumers.get(req.consumer_id)
        if consumer is None:
            self.error(req.request_id, ServerError.ConsumerNotFound, f"no consumer {req.consumer_id} here")
            return
        sub = consumer.sub
        try:
            targets = await self._seek_targets(sub, req)
            for topic, offsets in targets.items():
                await self.broker.reset_group(sub.name, topic, offsets)
        except (ChronoqError, Refused) as exc:
            error = exc.error if isinstance(exc, Refused) else ServerError.UnknownError
            self.error(req.request_id, error, str(exc))
            return
        sub.held.clear()
        self.send(Type.SUCCESS, success=api.CommandSuccess(request_id=req.request_id))
        # As Pulsar does after a reset: the consumers are closed, and the clients subscribe again
        # (a fresh FLOW; what they had prefetched from before the seek is dropped).
        for member in list(sub.consumers):
            member.conn.send(Type.CLOSE_CONSUMER, close_consumer=api.CommandCloseConsumer(
                consumer_id=member.consumer_id))
            await member.conn._drop_consumer(member)

    async def _seek_targets(self, sub: Subscription, req: api.CommandSeek) -> dict[str, dict[int, int]]:
        """Per chronoq topic the subscription reads, each queue's new next offset."""
        topics = [sub.topic] + ([sub.immediate] if sub.immediate is not None and sub.single_active() else [])
        if req.HasField("message_publish_time"):
            return {t: await self._offsets_at(t, req.message_publish_time) for t in topics}
        if not req.HasField("message_id"):
            raise Refused(ServerError.MetadataError, "SEEK names neither a message id nor a publish time")
        ledger, entry = req.message_id.ledgerId, req.message_id.entryId
        if ledger == EARLIEST:
            return {t: await self._offsets_at(t, 0) for t in topics}
        if ledger >= LATEST:
            return {t: {q: self.broker.queue_offsets(t, q)[1] for q in range(self.broker.get_topic(t).queue_count)}
                    for t in topics}
        topic = sub.topic_of(ledger)
        qid = ledger - IMMEDIATE_LEDGER if ledger >= IMMEDIATE_LEDGER else ledger
        found = await self.broker.read(topic, qid, entry, 1)
        if not found or found[0].queue_offset != entry:
            raise Refused(ServerError.MetadataError, f"no message ({ledger}, {entry}) in {topic!r} to seek to")
        msg = found[0]
        at_ms = max(msg.store_ms, msg.deliver_at_ms or 0)
        out = {t: await self._offsets_at(t, at_ms) for t in topics}
        out[topic][qid] = entry
        return out

    async def _offsets_at(self, topic: str, at_ms: int) -> dict[int, int]:
        count = self.broker.get_topic(topic).queue_count
        return {q: await self.broker.offset_at_time(topic, q, at_ms) for q in range(count)}

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
        Type.UNSUBSCRIBE: on_unsubscribe,
        Type.GET_LAST_MESSAGE_ID: on_get_last_message_id,
        Type.SEEK: on_seek,
    }
