"""The Pulsar door (chronoq/pulsar/door.py) in process: a broker on a temp directory, the door on a
free port, and a client made of the codec speaking the frames Pulsar's C++ client sends. The
official client's own run is tests/interop/test_pulsar_interop.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from chronoq.broker import Broker
from chronoq.config import Config
from chronoq.model import OutgoingMessage
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import Frame, ServerError, Type
from chronoq.pulsar.door import PulsarDoor, store_groups
from chronoq.pulsar.messages import Refused
from chronoq.server.auth import AuthConfig, Authenticator, User
from tests.support.brokers import arun

TOPIC = "persistent://public/default/orders"


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = codec.FrameReader()
        self.pending: list[Frame] = []
        self.request_id = 0

    @classmethod
    async def connect(cls, port: int, client_version: str = "test") -> Client:
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.send(Type.CONNECT, connect=api.CommandConnect(client_version=client_version, protocol_version=20,
                                                             auth_method_name="none"))
        assert (await client.next()).command.type == Type.CONNECTED
        return client

    def send(self, kind: int, **sub: object) -> None:
        self.writer.write(codec.encode_command(codec.make_command(kind, **sub)))

    def rid(self) -> int:
        self.request_id += 1
        return self.request_id

    async def next(self, timeout: float = 5) -> Frame:
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                raise ConnectionError("closed by the door")
            self.pending += self.frames.feed(data)
        return self.pending.pop(0)

    async def closed(self) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), 5) == b""
        except ConnectionError:
            return True

    async def producer(self, producer_id: int = 0) -> str:
        self.send(Type.PRODUCER, producer=api.CommandProducer(topic=TOPIC, producer_id=producer_id,
                                                              request_id=self.rid()))
        reply = await self.next()
        assert reply.command.type == Type.PRODUCER_SUCCESS, reply.command
        return reply.command.producer_success.producer_name

    def publish(self, seq: int, payload: bytes, producer_id: int = 0, **meta: object) -> None:
        cmd = codec.make_command(Type.SEND, send=api.CommandSend(producer_id=producer_id, sequence_id=seq))
        md = api.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=int(time.time() * 1000), **meta)
        self.writer.write(codec.encode_payload_command(cmd, md, payload))

    async def subscribe(self, name: str, sub_type: int = api.CommandSubscribe.Shared, consumer_id: int = 0,
                        initial: int = api.CommandSubscribe.Earliest) -> Frame:
        self.send(Type.SUBSCRIBE, subscribe=api.CommandSubscribe(
            topic=TOPIC, subscription=name, subType=sub_type, consumer_id=consumer_id, request_id=self.rid(),
            initialPosition=initial))
        return await self.next()

    def flow(self, permits: int, consumer_id: int = 0) -> None:
        self.send(Type.FLOW, flow=api.CommandFlow(consumer_id=consumer_id, messagePermits=permits))

    def ack(self, *ids: api.MessageIdData, consumer_id: int = 0) -> None:
        self.send(Type.ACK, ack=api.CommandAck(consumer_id=consumer_id, ack_type=api.CommandAck.Individual,
                                               message_id=list(ids)))


@asynccontextmanager
async def door(tmp_path: Path, **settings: object) -> AsyncIterator[tuple[Broker, int]]:
    config = Config(data_dir=tmp_path / "data", **settings)
    broker = await Broker.open(config)
    the_door = PulsarDoor(broker, config)
    port = await the_door.start("127.0.0.1", 0)
    try:
        yield broker, port
    finally:
        await the_door.stop()
        await broker.close()


def test_lookup_answers_this_door_and_topics_outside_public_default_are_refused(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            c.send(Type.PARTITIONED_METADATA, partitionMetadata=api.CommandPartitionedTopicMetadata(
                topic=TOPIC, request_id=c.rid()))
            meta = (await c.next()).command.partitionMetadataResponse
            assert (meta.partitions, meta.response) == (0, meta.Success)
            c.send(Type.LOOKUP, lookupTopic=api.CommandLookupTopic(topic=TOPIC, request_id=c.rid()))
            lookup = (await c.next()).command.lookupTopicResponse
            assert lookup.brokerServiceUrl == f"pulsar://127.0.0.1:{port}"
            assert lookup.response == lookup.Connect and lookup.authoritative
            c.send(Type.LOOKUP, lookupTopic=api.CommandLookupTopic(topic="persistent://acme/ns/t", request_id=9))
            refused = (await c.next()).command.lookupTopicResponse
            assert (refused.response, refused.error) == (refused.Failed, ServerError.InvalidTopicName)
            assert "public/default" in refused.message

    arun(run())


def test_sends_are_receipted_in_order_and_a_delayed_message_waits_for_its_time(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            assert (await c.subscribe("sub")).command.type == Type.SUCCESS
            await c.producer()
            due = int(time.time() * 1000) + 400
            c.publish(0, b"delayed", deliver_at_time=due)
            batch = codec.join_batch([(api.SingleMessageMetadata(sequence_id=1), b"b-1"),
                                      (api.SingleMessageMetadata(sequence_id=2), b"b-2")])
            c.publish(1, batch, num_messages_in_batch=2)
            c.publish(3, b"plain", properties=[api.KeyValue(key="color", value="red")])
            receipts = [(await c.next()).command for _ in range(3)]
            assert [r.type for r in receipts] == [Type.SEND_RECEIPT] * 3
            assert [r.send_receipt.sequence_id for r in receipts] == [0, 1, 3]
            c.flow(10)
            got = {}
            for _ in range(4):
                frame = await c.next()
                assert frame.command.type == Type.MESSAGE
                got[frame.payload] = (int(time.time() * 1000), frame)
            assert set(got) == {b"delayed", b"b-1", b"b-2", b"plain"}
            assert got[b"delayed"][0] >= due
            plain = got[b"plain"][1]
            assert codec.properties_of(plain.metadata.properties) == {"color": "red"}
            assert plain.command.message.redelivery_count == 0 and plain.metadata.producer_name == "p"

    arun(run())


def test_redelivery_on_request_counts_and_an_ack_sticks(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            await c.subscribe("sub")
            await c.producer()
            c.publish(0, b"one")
            await c.next()
            c.flow(10)
            first = await c.next()
            mid = first.command.message.message_id
            c.send(Type.REDELIVER_UNACKNOWLEDGED_MESSAGES, redeliverUnacknowledgedMessages=(
                api.CommandRedeliverUnacknowledgedMessages(consumer_id=0, message_ids=[mid])))
            again = await c.next()
            assert again.payload == b"one" and again.command.message.redelivery_count == 1
            c.ack(again.command.message.message_id)
            c.send(Type.REDELIVER_UNACKNOWLEDGED_MESSAGES, redeliverUnacknowledgedMessages=(
                api.CommandRedeliverUnacknowledgedMessages(consumer_id=0)))
            c.send(Type.PING, ping=api.CommandPing())
            assert (await c.next()).command.type == Type.PONG  # nothing redelivered ahead of it
            try:
                extra = await c.next(timeout=1.5)
            except TimeoutError:
                extra = None
            assert extra is None, extra.command

    arun(run())


def test_unserved_requests_get_error_and_a_malformed_frame_closes_only_its_connection(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            other = await Client.connect(port)
            c.send(Type.GET_SCHEMA, getSchema=api.RequestAt1(request_id=41))
            err = (await c.next()).command.error
            assert (err.request_id, err.error) == (41, ServerError.NotAllowedError) and "GET_SCHEMA" in err.message
            assert (await c.subscribe("ex", sub_type=api.CommandSubscribe.Exclusive)).command.type == Type.SUCCESS
            busy = await c.subscribe("ex", sub_type=api.CommandSubscribe.Exclusive, consumer_id=1)
            assert busy.command.error.error == ServerError.ConsumerBusy
            c.writer.write(b"\x00\x00\x00\x08\x00\x00\x00\x09garbage!")
            assert await c.closed()
            other.send(Type.PING, ping=api.CommandPing())
            assert (await other.next()).command.type == Type.PONG

    arun(run())


def test_a_message_chronoq_refuses_fails_that_send_alone(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            await c.producer()
            c.publish(0, b"")  # chronoq stores no empty body
            c.publish(1, b"x", compression=api.ZLIB)
            c.publish(2, b"fine")
            replies = [(await c.next()).command for _ in range(3)]
            assert [r.type for r in replies] == [Type.SEND_ERROR, Type.SEND_ERROR, Type.SEND_RECEIPT]
            assert replies[0].send_error.error == ServerError.ChecksumError
            assert "MessageBodyEmpty" in replies[0].send_error.message
            assert "compression ZLIB" in replies[1].send_error.message

    arun(run())


def test_a_delay_past_the_maximum_is_not_allowed_in_the_code_each_client_fails_the_send_for(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path, pulsar_max_delivery_delay_ms=60_000) as (_, port):
            replies = {}
            for version in ("Pulsar-Java-v3.3.1", "Pulsar-CPP-v4.2.0"):
                c = await Client.connect(port, client_version=version)
                await c.producer()
                now = int(time.time() * 1000)
                c.publish(0, b"far", deliver_at_time=now + 61_000)
                c.publish(1, b"near", deliver_at_time=now + 59_000)
                replies[version] = [(await c.next()).command for _ in range(2)]
            for version, (far, near) in replies.items():
                assert far.type == Type.SEND_ERROR and near.type == Type.SEND_RECEIPT, version
                assert "Exceeds max allowed delivery delay of 60000 milliseconds" in far.send_error.message
            java, cpp = replies["Pulsar-Java-v3.3.1"][0], replies["Pulsar-CPP-v4.2.0"][0]
            # Pulsar's own code where the client fails the send for it; ChecksumError for the C++
            # client, which fails a single send for nothing else (pulsar_checksum_error_clients).
            assert java.send_error.error == ServerError.NotAllowedError
            assert cpp.send_error.error == ServerError.ChecksumError
            assert cpp.send_error.message.startswith("NotAllowed: Exceeds")

    arun(run())


def test_a_latest_subscription_starts_after_what_is_already_there(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            c = await Client.connect(port)
            await c.producer()
            c.publish(0, b"old")
            await c.next()
            await c.subscribe("late", initial=api.CommandSubscribe.Latest)
            c.publish(1, b"new")
            await c.next()
            c.flow(10)
            assert (await c.next()).payload == b"new"

    arun(run())


def test_failover_feeds_one_consumer_and_the_next_takes_over_with_what_it_held(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path) as (_, port):
            a, b = await Client.connect(port), await Client.connect(port)
            failover = api.CommandSubscribe.Failover
            assert (await a.subscribe("fo", sub_type=failover)).command.type == Type.SUCCESS
            assert (await b.subscribe("fo", sub_type=failover)).command.type == Type.SUCCESS
            await a.producer()
            a.publish(0, b"m0")
            await a.next()
            a.flow(10)
            b.flow(10)
            assert (await a.next()).payload == b"m0"
            try:
                early = await b.next(timeout=1.0)
            except TimeoutError:
                early = None
            assert early is None, "the standby consumer received while the active one was there"
            a.send(Type.CLOSE_CONSUMER, close_consumer=api.CommandCloseConsumer(consumer_id=0, request_id=a.rid()))
            assert (await a.next()).command.type == Type.SUCCESS
            taken = await b.next(timeout=5)
            assert taken.payload == b"m0" and taken.command.message.redelivery_count == 1

    arun(run())


def test_with_auth_on_refused_credentials_fail_the_first_request_and_serve_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        config = Config(data_dir=tmp_path / "data")
        broker = await Broker.open(config)
        auth = Authenticator(AuthConfig(enabled=True, users=(User("alice", "secret"),)))
        the_door = PulsarDoor(broker, config, authenticator=auth)
        port = await the_door.start("127.0.0.1", 0)
        try:
            c = Client(*await asyncio.open_connection("127.0.0.1", port))
            c.send(Type.CONNECT, connect=api.CommandConnect(client_version="test", protocol_version=20))
            # CONNECTED, so that the client sends the request whose reply it reports ...
            assert (await c.next()).command.type == Type.CONNECTED
            c.send(Type.PARTITIONED_METADATA, partitionMetadata=api.CommandPartitionedTopicMetadata(
                topic=TOPIC, request_id=7))
            meta = (await c.next()).command.partitionMetadataResponse
            assert (meta.request_id, meta.response, meta.error) == (7, meta.Failed, ServerError.AuthenticationError)
            assert "auth method 'none'" in meta.message and "basic" in meta.message
            # ... and nothing else: the door hangs up after that answer.
            assert await c.closed()
            # A wrong secret is refused the same way, on whatever request comes first.
            d = Client(*await asyncio.open_connection("127.0.0.1", port))
            d.send(Type.CONNECT, connect=api.CommandConnect(client_version="test", protocol_version=20,
                                                            auth_method_name="basic", auth_data=b"alice:guess"))
            assert (await d.next()).command.type == Type.CONNECTED
            d.send(Type.PRODUCER, producer=api.CommandProducer(topic=TOPIC, producer_id=0, request_id=3))
            refused = (await d.next()).command.error
            assert (refused.request_id, refused.error) == (3, ServerError.AuthenticationError)
            assert "alice" in refused.message
            assert await d.closed()
            assert not broker.stats()["topics"], "a refused connection created something"
        finally:
            await the_door.stop()
            await broker.close()

    arun(run())


def test_producers_and_consumers_past_the_connection_limits_are_refused_naming_the_setting(tmp_path: Path) -> None:
    async def run() -> None:
        async with door(tmp_path, pulsar_max_producers_per_connection=1,
                        pulsar_max_consumers_per_connection=1) as (_, port):
            c = await Client.connect(port)
            await c.producer(0)
            c.send(Type.PRODUCER, producer=api.CommandProducer(topic=TOPIC, producer_id=1, request_id=c.rid()))
            refused = (await c.next()).command.error
            assert refused.error == ServerError.NotAllowedError
            assert "pulsar_max_producers_per_connection = 1" in refused.message
            assert (await c.subscribe("a")).command.type == Type.SUCCESS
            second = (await c.subscribe("b", consumer_id=1)).command.error
            assert second.error == ServerError.NotAllowedError
            assert "pulsar_max_consumers_per_connection = 1" in second.message

    arun(run())


def test_a_client_that_never_reads_holds_at_most_the_write_buffer_limit(tmp_path: Path) -> None:
    limit = 256 * 1024
    body = b"x" * 4096

    async def run() -> None:
        config = Config(data_dir=tmp_path / "data", pulsar_max_write_buffer_bytes=limit)
        broker = await Broker.open(config)
        the_door = PulsarDoor(broker, config)
        port = await the_door.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.transport.pause_reading()  # this client never reads what the door sends
            c = Client(reader, writer)
            c.send(Type.CONNECT, connect=api.CommandConnect(client_version="test", protocol_version=20))
            c.send(Type.SUBSCRIBE, subscribe=api.CommandSubscribe(
                topic=TOPIC, subscription="slow", subType=api.CommandSubscribe.Shared, consumer_id=0,
                request_id=1, initialPosition=api.CommandSubscribe.Earliest))
            c.flow(100_000)
            await asyncio.sleep(0.3)
            for _ in range(10):
                await broker.send_batch([OutgoingMessage("orders", body) for _ in range(500)])
            await asyncio.sleep(2)
            (conn,) = the_door.connections
            buffered = conn.writer.transport.get_write_buffer_size()
            # One receive batch may go out past the limit before the pump waits.
            assert buffered <= limit + config.max_receive_batch * (len(body) + 512), buffered
            stats = {(g["group"], g["topic"]): g for g in broker.group_stats()}
            assert stats[("slow", "orders")]["lag"] > 0, "everything was pushed: nothing held the pump back"
            writer.close()
        finally:
            await the_door.stop()
            await broker.close()

    arun(run())


def test_traffic_is_counted_under_the_topic_as_the_grpc_doors_is(tmp_path: Path) -> None:
    """Accepted, timers and deliveries per topic (what /metrics and the console read): a delayed
    message counts once, not once more for its immediate copy; a copy an Exclusive subscription
    receives counts under the topic, and the fired timer it skips does not count."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from chronoq.http.metrics import make_registry
    from chronoq.http.scope import SYSTEM_TOPIC_PREFIXES, console_topics
    from chronoq.pulsar.messages import IMMEDIATE_PREFIX

    async def run() -> None:
        async with door(tmp_path) as (broker, port):
            c = await Client.connect(port)
            assert (await c.subscribe("shared")).command.type == Type.SUCCESS
            assert (await c.subscribe("excl", sub_type=api.CommandSubscribe.Exclusive,
                                      consumer_id=1)).command.type == Type.SUCCESS
            await c.producer()
            due = int(time.time() * 1000) + 300
            for seq in range(5):
                c.publish(seq, f"m{seq}".encode(), **({"deliver_at_time": due} if seq < 2 else {}))
            assert [(await c.next()).command.type for _ in range(5)] == [Type.SEND_RECEIPT] * 5
            c.flow(10, consumer_id=0)
            c.flow(10, consumer_id=1)
            by_consumer: dict[int, list[api.MessageIdData]] = {0: [], 1: []}
            for _ in range(10):
                frame = await c.next()
                msg = frame.command.message
                by_consumer[msg.consumer_id].append(msg.message_id)
            for consumer_id, ids in by_consumer.items():
                assert len(ids) == 5, (consumer_id, ids)
                c.ack(*ids, consumer_id=consumer_id)
            # The Shared subscription received the fired timers, so they are in the topic's queues;
            # the Exclusive subscription's pump receives them too, and skips them.
            end = time.monotonic() + 5
            while time.monotonic() < end:
                lags = {(g["group"], g["topic"]): g for g in broker.group_stats()}
                if lags[("excl", "orders")]["lag"] == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            assert broker.accepted_by_topic == {"orders": 5}
            assert broker.timers_by_topic == {"orders": 2}
            assert broker.delivered_by_topic == {"orders": 10}
            assert broker.fired_by_topic.get("orders") == 2
            scraped = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(generate_latest(make_registry(broker)).decode())
                       for s in f.samples}
            assert scraped[("chronoq_messages_accepted_total", (("topic", "orders"),))] == 5
            assert scraped[("chronoq_messages_delivered_total", (("topic", "orders"),))] == 10
            assert scraped[("rocketmq_timer_enqueue_total", (("topic", "orders"),))] == 2
            copies = IMMEDIATE_PREFIX + "orders"
            assert copies in {t.name for t in broker.list_topics()}
            counted_copies = [key for key in scraped if key[0].startswith("chronoq_messages_")
                              and ("topic", copies) in key[1]]
            assert counted_copies == []
            assert IMMEDIATE_PREFIX in SYSTEM_TOPIC_PREFIXES
            assert console_topics(t.name for t in broker.list_topics()) == ["orders"]

    arun(run())


FLOOD_IDLE_SOCKETS = 300
FLOOD_SLOW_READERS = 30
FLOOD_HALF_FRAMES = 50
FLOOD_GARBAGE = 30
SERVED_WITHIN_S = 5.0


def test_a_connection_flood_does_not_starve_other_clients(tmp_path: Path) -> None:
    """Sockets that never speak, clients that subscribe with every permit and never read what
    is pushed (their write buffers full), frames announced and never finished, and garbage that
    closes its connection: a normal client still produces and consumes, promptly."""
    body = b"x" * 2048

    async def run() -> None:
        async with door(tmp_path) as (broker, port):
            for _ in range(4):
                await broker.send_batch([OutgoingMessage("orders", body) for _ in range(500)])
            opened: list[asyncio.StreamWriter] = []
            for _ in range(FLOOD_IDLE_SOCKETS):
                opened.append((await asyncio.open_connection("127.0.0.1", port))[1])
            for i in range(FLOOD_SLOW_READERS):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.transport.pause_reading()
                slow = Client(reader, writer)
                slow.send(Type.CONNECT, connect=api.CommandConnect(client_version="test", protocol_version=20))
                slow.send(Type.SUBSCRIBE, subscribe=api.CommandSubscribe(
                    topic=TOPIC, subscription=f"slow{i}", subType=api.CommandSubscribe.Shared, consumer_id=0,
                    request_id=1, initialPosition=api.CommandSubscribe.Earliest))
                slow.flow(100_000)
                opened.append(writer)
            for _ in range(FLOOD_HALF_FRAMES):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write((4 * 1024 * 1024).to_bytes(4, "big") + b"\x00\x00\x00\x10" + b"\x08" * 100)
                opened.append(writer)
            for i in range(FLOOD_GARBAGE):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"\xff" * 64)
                opened.append(writer)
            await asyncio.sleep(1.0)  # the slow readers' pumps fill their buffers meanwhile
            try:
                started = time.monotonic()
                c = await Client.connect(port)
                await c.subscribe("normal", initial=api.CommandSubscribe.Latest)
                await c.producer()
                c.publish(0, b"served")
                assert (await c.next()).command.type == Type.SEND_RECEIPT
                c.flow(1)
                got = await c.next(timeout=SERVED_WITHIN_S)
                elapsed = time.monotonic() - started
                assert got.payload == b"served"
                assert elapsed < SERVED_WITHIN_S, f"a normal client waited {elapsed:.1f} s behind the flood"
                print(f"served in {elapsed * 1000:.0f} ms beside {len(opened)} flooding connections")
            finally:
                for writer in opened:
                    writer.transport.abort()

    arun(run())


def test_pipelined_delayed_sends_past_half_the_send_batch_limit_are_all_stored(tmp_path: Path) -> None:
    """A delayed SEND is two messages (its timer and its immediate copy): queued SENDs are stored
    in calls of at most `max_send_batch` messages, not refused as one call too large."""
    async def run() -> None:
        async with door(tmp_path, max_send_batch=16) as (broker, port):
            c = await Client.connect(port)
            await c.producer()
            due = int(time.time() * 1000) + 60_000
            for seq in range(40):
                c.publish(seq, f"d{seq}".encode(), deliver_at_time=due)
            replies = [(await c.next()).command for _ in range(40)]
            assert [r.type for r in replies] == [Type.SEND_RECEIPT] * 40, [r.send_error.message for r in replies
                                                                          if r.type == Type.SEND_ERROR][:3]
            assert [r.send_receipt.sequence_id for r in replies] == list(range(40))
            assert broker.accepted_by_topic == {"orders": 40} and broker.timers_by_topic == {"orders": 40}

    arun(run())


def test_store_groups_cut_at_send_boundaries_and_cut_a_send_larger_than_the_limit() -> None:
    def plan(n: int, tag: str) -> list[OutgoingMessage]:
        return [OutgoingMessage("t", f"{tag}{i}".encode()) for i in range(n)]

    a, b, c, big = plan(2, "a"), plan(2, "b"), plan(1, "c"), plan(7, "z")
    refused = Refused(ServerError.ChecksumError, "no")
    groups = store_groups([a, refused, b, c, big], 3)
    assert [[m.body for m in g] for g in groups] == [
        [b"a0", b"a1"], [b"b0", b"b1", b"c0"], [b"z0", b"z1", b"z2"], [b"z3", b"z4", b"z5"], [b"z6"]]
    assert store_groups([refused], 3) == []


def test_stats_lists_a_subscriptions_row_on_its_topic_before_the_one_on_the_immediate_copies() -> None:
    from chronoq.cli.stats import PULSAR_COPIES_PREFIX, _groups_line
    from chronoq.pulsar.messages import IMMEDIATE_PREFIX

    assert PULSAR_COPIES_PREFIX == IMMEDIATE_PREFIX
    line = _groups_line([{"group": "a", "topic": IMMEDIATE_PREFIX + "t", "lag": 0, "inflight": 0},
                         {"group": "b", "topic": "t", "lag": 0, "inflight": 0}])
    assert line.index("b on t") < line.index(f"a on {IMMEDIATE_PREFIX}t"), line
