"""chronoq's batched receive (`chronoq.receive.v1.Receive/ReceiveMessages`) over real gRPC.

The call takes ReceiveMessage's request and answers its stream with the messages in one response
(several only when they exceed `max_receive_response_bytes`); it is the same receive, so what a
consumer gets, and what a bad request or an unauthenticated caller gets, matches ReceiveMessage.
chronoq's SDK consumer uses it, and falls back to ReceiveMessage for good on a server that has no
such call (the servers' calls are recorded by an interceptor, so each test sees which path ran).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from chronoq.client import AsyncConsumer, InvalidArgument, connection
from chronoq.config import Config
from chronoq.model import OutgoingMessage
from chronoq.protocol import batch_receive
from chronoq.protocol.requests import Endpoint
from chronoq.protocol.v2 import service
from chronoq.server.grpc_service import MessagingService
from chronoq.server.serve import server_options
from tests.support.brokers import open_broker
from tests.support.grpc_server import receive_request, running

BATCH = f"/{batch_receive.SERVICE_NAME}/{batch_receive.METHOD}"
STANDARD = "/apache.rocketmq.v2.MessagingService/ReceiveMessage"


async def _batched(channel: grpc.aio.Channel, request: service.ReceiveMessageRequest,
                   metadata: Any = None) -> list[Any]:
    call = channel.unary_stream(BATCH, request_serializer=service.ReceiveMessageRequest.SerializeToString,
                                response_deserializer=batch_receive.ReceiveMessagesResponse.FromString)
    return [r async for r in call(request, timeout=10, metadata=metadata)]


async def _send(broker: Any, topic: str, n: int, body: bytes = b"body") -> None:
    await broker.send_batch([OutgoingMessage(topic, body, message_id=f"m{i:03d}", tag="t", keys=(f"k{i}",),
                                             properties={"n": str(i)}) for i in range(n)])


def _comparable(m: Any) -> Any:
    """A delivered message without what differs per receive (its handle)."""
    m = type(m).FromString(m.SerializeToString())
    m.system_properties.ClearField("receipt_handle")
    return m


def test_one_response_carries_what_the_standard_stream_carries(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 40)
            batched = await _batched(h.channel, receive_request("orders", "g1", batch=64))
            standard = await h.receive(receive_request("orders", "g2", batch=64))
            assert len(batched) == 1
            assert batched[0].status.code == 20000 and batched[0].HasField("delivery_timestamp")
            assert [_comparable(m) for m in batched[0].messages] == [
                _comparable(r.message) for r in standard if r.HasField("message")]
            assert len(batched[0].messages) == 40
            # The same receive: group g1's messages are now invisible to g1, not to others.
            assert [r.status.code for r in await _batched(h.channel, receive_request("orders", "g1"))] == [40401]

    asyncio.run(body())


def test_messages_over_the_response_limit_are_spread_over_responses(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, max_receive_response_bytes=8192) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 10, b"x" * 3000)
            got = await _batched(h.channel, receive_request("orders", batch=64))
            assert [len(r.messages) for r in got] == [2, 2, 2, 2, 2]
            assert got[0].status.code == 20000 and not any(r.HasField("status") for r in got[1:])
            assert got[-1].HasField("delivery_timestamp")
            assert all(sum(m.ByteSize() for m in r.messages) <= 8192 for r in got)
            assert [m.system_properties.message_id for r in got for m in r.messages] == [
                f"m{i:03d}" for i in range(10)]

    asyncio.run(body())


def test_a_refused_batched_receive_gets_the_status_the_standard_one_gets(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, auto_create_topics=False) as h:
            for request in (receive_request("nosuchtopic"), receive_request("orders", "bad group!")):
                standard = [r.status.code for r in await h.receive(request)]
                batched = [r.status.code for r in await _batched(h.channel, request)]
                assert batched == standard and batched[0] >= 40000, (batched, standard)
            raw = await h.channel.unary_stream(BATCH)(b"\xff\xff", timeout=10).read()
            assert batch_receive.ReceiveMessagesResponse.FromString(raw).status.code == 40000

    asyncio.run(body())


def test_the_sdk_consumer_receives_through_the_batched_call(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 30)
            async with AsyncConsumer("g", "orders", server=h.address) as consumer:
                got = await consumer.receive(64)
                assert [m.message_id for m in got] == [f"m{i:03d}" for i in range(30)]
                assert got[3].properties == {"n": "3"} and got[3].keys == ("k3",) and got[3].tag == "t"
                await consumer.ack(*got)
            receives = [c for c in h.calls if "Receive" in c]
            assert receives == [BATCH]

    asyncio.run(body())


def test_the_sdk_consumer_falls_back_for_good_on_a_server_without_the_batched_call(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, batch_receive=False) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 30)
            async with AsyncConsumer("g", "orders", server=h.address) as consumer:
                first = await consumer.receive(20)
                rest = await consumer.receive(20)
            assert [m.message_id for m in first + rest] == [f"m{i:03d}" for i in range(30)]
            receives = [c for c in h.calls if "Receive" in c]
            assert receives == [BATCH, STANDARD, STANDARD]  # asked once, then the standard call only

    asyncio.run(body())


def test_batch_receive_false_uses_the_standard_call_and_the_setting_is_checked(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 5)
            async with AsyncConsumer("g", "orders", server=h.address, batch_receive=False) as consumer:
                assert len(await consumer.receive(64)) == 5
                with pytest.raises(InvalidArgument, match="batch_receive"):
                    consumer.batch_receive = "yes"  # type: ignore[assignment]
            assert [c for c in h.calls if "Receive" in c] == [STANDARD]

    asyncio.run(body())


def test_the_sdk_reads_every_response_of_a_batched_receive(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, max_receive_response_bytes=8192) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 10, b"x" * 3000)  # five responses of two
            async with AsyncConsumer("g", "orders", server=h.address) as consumer:
                got = await consumer.receive(64)
            assert [m.message_id for m in got] == [f"m{i:03d}" for i in range(10)]
            assert [c for c in h.calls if "Receive" in c] == [BATCH]

    asyncio.run(body())


def test_a_batched_response_stays_within_what_the_sdk_accepts_whatever_the_message_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scaled down: the SDK accepts 256 MiB a response and `max_message_size_bytes` may be 512
    MiB, so responses grouped up to the message limit could exceed it (RequestTooLarge, never
    retried; the messages, already invisible, came back grouped the same way until they were
    dead-lettered). Here the SDK takes 64 KiB, messages may be 256 KiB, each is 30 KB: grouped
    by `max_receive_response_bytes` (set to 32 KiB) the receive gets all three."""
    monkeypatch.setattr(connection, "MAX_GRPC_MESSAGE_BYTES", 64 * 1024)

    async def body() -> None:
        async with running(tmp_path, max_message_size_bytes=256 * 1024, max_receive_response_bytes=32 * 1024) as h:
            await h.broker.create_topic("orders", 1)
            await _send(h.broker, "orders", 3, b"x" * 30_000)
            async with AsyncConsumer("g", "orders", server=h.address) as consumer:
                assert [m.message_id for m in await consumer.receive(64)] == ["m000", "m001", "m002"]
            assert [c for c in h.calls if "Receive" in c] == [BATCH]

    asyncio.run(body())


class _FailFirstBatch(grpc.aio.ServerInterceptor):
    """Fails the first batched receive with UNAVAILABLE (a dropped connection), records all calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.calls.append(details.method)
        handler = await continuation(details)
        if details.method != BATCH or self.calls.count(BATCH) > 1:
            return handler

        async def unavailable(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield b""  # never reached: abort raises

        return grpc.unary_stream_rpc_method_handler(unavailable, request_deserializer=handler.request_deserializer)


def test_only_unimplemented_switches_the_consumer_to_the_standard_call(tmp_path: Path) -> None:
    """Another failure of the batched call is retried as the same call, not taken as "this
    server has no batched receive"."""
    async def body() -> None:
        config = Config(data_dir=tmp_path / "data")
        broker = await open_broker(config)
        recorder = _FailFirstBatch()
        server = grpc.aio.server(options=server_options(config), interceptors=[recorder])
        try:
            port = server.add_insecure_port("127.0.0.1:0")
            messaging = MessagingService(broker, config, advertised=Endpoint("127.0.0.1", port), port=port)
            server.add_generic_rpc_handlers((messaging.generic_handler(), messaging.batch_receive_handler()))
            await server.start()
            await broker.create_topic("orders", 1)
            await _send(broker, "orders", 4)
            async with AsyncConsumer("g", "orders", server=f"127.0.0.1:{port}") as consumer:
                assert len(await consumer.receive(2)) == 2  # UNAVAILABLE, retried
                assert len(await consumer.receive(2)) == 2
            assert [c for c in recorder.calls if "Receive" in c] == [BATCH, BATCH, BATCH]
        finally:
            await server.stop(0)
            await broker.close()

    asyncio.run(body())
