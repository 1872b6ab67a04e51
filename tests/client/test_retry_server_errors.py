"""The SDK retries a call the broker refused for a reason a retry outlives, knowing it by the code.

Over RocketMQ's SendMessage only a status code travels. A broker that is closing (`BrokerClosed`)
or that could not make a write durable (`FlushFailed`) must answer with a code the SDK retries
(50002, 50401: `chronoq/errors.py`'s table), not the 50001 it shares with failures no retry mends.

Real parts only: a RocksDB-backed `Broker`, a `grpc.aio` server on a loopback port, and the SDK's
`AsyncProducer` / `AsyncConsumer` over real gRPC. The broker is closed for real, or its commit
log's fsync fails for real (EIO at the system-call boundary). A server interceptor counts the
SendMessage calls that arrive (another, `Calls`, the consumer's calls) and, where a test
"restarts" the broker, opens a new `Broker` on the same data directory and puts it behind the
same port before the retry is answered: what a
supervisor restarting `chronoq serve` does, without the timing of a process start.

The consumer's calls are retried too: a receive or an ack the broker refused as closing is
tried again on the restarted broker; an ack whose reply was lost (the server acked, then the call
failed as UNAVAILABLE: `Calls.lose_reply`) is retried and its "invalid handle" answer counts as
acked; a change_invisible whose reply was lost is not retried (its handle was replaced).
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from chronoq import errors as core
from chronoq.broker import Broker
from chronoq.client import AsyncAdmin, AsyncConsumer, AsyncProducer
from chronoq.client.errors import ServerUnavailable
from chronoq.config import Config
from chronoq.protocol.requests import Endpoint
from chronoq.server.admin_service import AdminService
from chronoq.server.grpc_service import MessagingService
from chronoq.server.serve import server_options
from chronoq.store import files
from tests.support.brokers import open_broker

SEND_PATH = "/apache.rocketmq.v2.MessagingService/SendMessage"


@dataclass
class Sends(grpc.aio.ServerInterceptor):
    """Counts SendMessage calls; `before[n]` runs before the n-th (1-based) is handled."""

    count: int = 0
    before: dict[int, Callable[[], Awaitable[None]]] = field(default_factory=dict)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method == SEND_PATH:
            self.count += 1
            step = self.before.get(self.count)
            if step is not None:
                await step()
        return await continuation(details)


@dataclass
class Calls(grpc.aio.ServerInterceptor):
    """Counts the calls of every other MessagingService method, of chronoq's batched receive and
    of its admin service, by name ("AckMessage", "ReceiveMessages", "Stats"...);
    `before[(name, n)]` runs before the n-th is handled; for the n-th in `lose_reply`, the
    handler runs (its work is done) and the call then fails as UNAVAILABLE, a reply lost."""

    counts: dict[str, int] = field(default_factory=dict)
    before: dict[tuple[str, int], Callable[[], Awaitable[None]]] = field(default_factory=dict)
    lose_reply: set[tuple[str, int]] = field(default_factory=set)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        name = details.method.rpartition("/")[2]
        if details.method == SEND_PATH or not details.method.startswith(
                ("/apache.rocketmq.v2.", "/chronoq.receive.", "/chronoq.admin.")):
            return await continuation(details)
        n = self.counts[name] = self.counts.get(name, 0) + 1
        step = self.before.get((name, n))
        if step is not None:
            await step()
        handler = await continuation(details)
        if (name, n) not in self.lose_reply:
            return handler
        inner = handler.unary_unary

        async def lost(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await inner(request, context)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the reply was lost")

        return grpc.unary_unary_rpc_method_handler(lost, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


@dataclass
class Served:
    config: Config
    messaging: MessagingService
    address: str
    sends: Sends
    brokers: list[Broker]
    calls: Calls
    admin: AdminService

    async def restart(self) -> None:
        """Close the broker behind the port (if still open) and serve a new one on its data directory."""
        await self.brokers[-1].close()
        broker = await open_broker(self.config)
        self.brokers.append(broker)
        self.messaging.broker = self.admin.broker = broker


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Served]:
    config = Config(data_dir=tmp_path / "data", default_queue_count=1)
    brokers = [await open_broker(config)]
    sends, calls = Sends(), Calls()
    server = grpc.aio.server(options=server_options(config), interceptors=[sends, calls])
    try:
        port = server.add_insecure_port("127.0.0.1:0")
        messaging = MessagingService(brokers[0], config, advertised=Endpoint("127.0.0.1", port), port=port)
        admin = AdminService(brokers[0], config)
        server.add_generic_rpc_handlers((messaging.generic_handler(), messaging.batch_receive_handler(),
                                         admin.generic_handler()))
        await server.start()
        yield Served(config, messaging, f"127.0.0.1:{port}", sends, brokers, calls, admin)
    finally:
        await server.stop(0)
        for broker in brokers:
            await broker.close()


async def _received_ids(address: str, topic: str) -> list[str]:
    async with AsyncConsumer("g", topic, server=address, timeout_ms=5000) as consumer:
        return [m.message_id for m in await consumer.receive(16, wait=500)]


def test_a_send_a_closing_broker_refused_is_retried_and_stored_once_it_is_back(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            await served.brokers[0].close()  # the first attempt meets a closed broker
            served.sends.before[2] = served.restart
            async with AsyncProducer(served.address, timeout_ms=10_000) as producer:
                receipt = await producer.send("orders", b"paid", message_id="ID-CLOSED-1")
            assert served.sends.count == 2
            assert receipt.message_id == "ID-CLOSED-1"
            assert await _received_ids(served.address, "orders") == ["ID-CLOSED-1"]

    asyncio.run(body())


def test_a_broker_that_stays_closed_is_tried_send_attempts_times_then_named(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            await served.brokers[0].close()
            async with AsyncProducer(served.address, timeout_ms=10_000, send_attempts=3) as producer:
                with pytest.raises(core.BrokerClosed) as info:
                    await producer.send("orders", b"paid")
            assert served.sends.count == 3
            assert info.value.retriable and info.value.code == 50002
            assert "broker is closed" in info.value.message

    asyncio.run(body())


def test_a_send_whose_fsync_failed_is_retried_on_the_restarted_broker(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first attempt is written but its fsync fails (EIO): `FlushFailed`, not acknowledged.
    The retry reaches the restarted broker and is acknowledged. The refused record was written
    before its fsync failed, so the restart recovers it too: two copies of the message id, at
    least once (the dedupe window does not survive a restart), never lost."""
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    failing = {"on": False}

    def faulty(real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            if failing["on"] and f"/{files.COMMITLOG_DIR}/" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(fd)
        return call

    monkeypatch.setattr(os, "fsync", faulty(real_fsync))
    monkeypatch.setattr(os, "fdatasync", faulty(real_fdatasync))

    async def body() -> None:
        async with serving(tmp_path) as served:
            async def heal_and_restart() -> None:
                failing["on"] = False
                await served.restart()

            async with AsyncProducer(served.address, timeout_ms=10_000) as producer:
                await producer.send("orders", b"warm-up", message_id="ID-WARM")  # topic and segment exist
                failing["on"] = True
                served.sends.before[3] = heal_and_restart
                receipt = await producer.send("orders", b"paid", message_id="ID-FSYNC-1")
            assert served.sends.count == 3
            assert receipt.message_id == "ID-FSYNC-1"
            ids = await _received_ids(served.address, "orders")
            assert ids == ["ID-WARM", "ID-FSYNC-1", "ID-FSYNC-1"]  # the refused copy came back, and the retry's

    asyncio.run(body())


def test_a_broker_whose_fsync_failed_answers_every_retry_at_once_with_flush_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    async def body() -> None:
        async with serving(tmp_path) as served:
            async with AsyncProducer(served.address, timeout_ms=10_000, send_attempts=3) as producer:
                await producer.send("orders", b"warm-up")
                monkeypatch.setattr(os, "fdatasync", eio)
                monkeypatch.setattr(os, "fsync", eio)
                try:
                    with pytest.raises(core.FlushFailed) as info:
                        await producer.send("orders", b"paid")
                finally:
                    monkeypatch.setattr(os, "fdatasync", real_fdatasync)
                    monkeypatch.setattr(os, "fsync", real_fsync)
            assert served.sends.count == 1 + 3
            assert info.value.retriable and info.value.code == 50401
            assert info.value.message.startswith("flush failed: fsync of ")  # said once, naming the fsync

    asyncio.run(body())


async def _one_in_flight(served: Served, message_id: str) -> tuple[AsyncConsumer, Any]:
    """A consumer (open: the caller closes it) holding `message_id`, received for 1 s."""
    async with AsyncProducer(served.address, timeout_ms=10_000) as producer:
        await producer.send("orders", b"paid", message_id=message_id)
    consumer = AsyncConsumer("g", "orders", server=served.address, timeout_ms=10_000)
    [msg] = await consumer.receive(16, invisible=1000, wait=500)
    assert msg.message_id == message_id
    return consumer, msg


def test_a_receive_a_closing_broker_refused_is_retried_and_returns_the_messages(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            async with AsyncProducer(served.address, timeout_ms=10_000) as producer:
                await producer.send("orders", b"paid", message_id="ID-RECV-1")
            await served.brokers[0].close()  # the first receive meets a closed broker
            served.calls.before[("ReceiveMessages", 2)] = served.restart
            async with AsyncConsumer("g", "orders", server=served.address, timeout_ms=10_000) as consumer:
                got = await consumer.receive(16, wait=500)
            assert served.calls.counts["ReceiveMessages"] == 2 and "ReceiveMessage" not in served.calls.counts
            assert [m.message_id for m in got] == ["ID-RECV-1"]

    asyncio.run(body())


def test_a_receive_of_a_broker_that_stays_closed_is_tried_attempts_times(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            await served.brokers[0].close()
            async with AsyncConsumer("g", "orders", server=served.address, timeout_ms=10_000, attempts=2) as consumer:
                with pytest.raises(core.BrokerClosed):
                    await consumer.receive(16)
            assert served.calls.counts["ReceiveMessages"] == 2 and "ReceiveMessage" not in served.calls.counts

    asyncio.run(body())


@pytest.mark.slow
def test_an_ack_during_a_restart_is_retried_and_the_message_is_not_redelivered(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            consumer, msg = await _one_in_flight(served, "ID-ACK-1")
            async with consumer:
                await served.brokers[0].close()  # the first ack meets a closed broker
                served.calls.before[("AckMessage", 2)] = served.restart
                await consumer.ack(msg)
                assert served.calls.counts["AckMessage"] == 2
                await asyncio.sleep(1.2)  # past the 1 s invisible duration: unacked, it would be back
                assert await consumer.receive(16, wait=500) == []

    asyncio.run(body())


@pytest.mark.slow
def test_an_ack_whose_reply_was_lost_is_retried_and_its_invalid_handle_counts_as_acked(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            consumer, msg = await _one_in_flight(served, "ID-ACK-LOST")
            async with consumer:
                served.calls.lose_reply.add(("AckMessage", 1))  # acked by the server, the reply lost
                await consumer.ack(msg)
                assert served.calls.counts["AckMessage"] == 2
                with pytest.raises(core.InvalidReceiptHandle):  # a plain second ack still says so
                    await consumer.ack(msg)
                await asyncio.sleep(1.2)
                assert await consumer.receive(16, wait=500) == []

    asyncio.run(body())


def test_a_change_invisible_is_retried_after_a_refusal_but_not_after_a_lost_reply(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            consumer, msg = await _one_in_flight(served, "ID-CI-1")
            async with consumer:
                await served.brokers[0].close()
                served.calls.before[("ChangeInvisibleDuration", 2)] = served.restart
                handle = await consumer.change_invisible(msg, 30_000)
                assert served.calls.counts["ChangeInvisibleDuration"] == 2
                assert msg.receipt_handle == handle
                served.calls.lose_reply.add(("ChangeInvisibleDuration", 3))
                with pytest.raises(ServerUnavailable):  # the handle was replaced: a retry cannot succeed
                    await consumer.change_invisible(msg, 30_000)
                assert served.calls.counts["ChangeInvisibleDuration"] == 3

    asyncio.run(body())


# -- admin calls and recall: the same policy ------------------------------------------------------


def test_admin_calls_a_closing_broker_refused_are_retried_once_it_is_back(tmp_path: Path) -> None:
    """Stats (a read) and CreateTopic (a change the broker refused: nothing was done) meet a
    broker closed for a restart; each is tried again and answered by the new one. Before, the
    first refusal was raised: `chronoq stats` during a restart failed at once."""
    async def body() -> None:
        async with serving(tmp_path) as served:
            await served.brokers[0].close()
            served.calls.before[("Stats", 2)] = served.restart
            async with AsyncAdmin(served.address, timeout_ms=10_000) as admin:
                stats = await admin.stats()
                assert stats["timer"]["pending_total"] == 0
                await served.brokers[-1].close()
                served.calls.before[("CreateTopic", 2)] = served.restart
                assert (await admin.create_topic("invoices", 2)).queue_count == 2
            assert served.calls.counts["Stats"] == 2 and served.calls.counts["CreateTopic"] == 2
            assert served.brokers[-1].get_topic("invoices").queue_count == 2

    asyncio.run(body())


def test_a_read_whose_reply_was_lost_is_retried_and_a_cancel_is_not(tmp_path: Path) -> None:
    """A query is a read: after a lost reply it is asked again. A cancel whose reply was lost
    has cancelled the timer (its work was done): a repeat would answer "not pending" for a
    cancel that succeeded, so the SDK raises the lost reply instead of trying again."""
    async def body() -> None:
        async with serving(tmp_path) as served, AsyncProducer(served.address, timeout_ms=10_000) as producer:
            receipt = await producer.send("orders", b"x", message_id="ID-CANCEL-1", delay=3_600_000)
            served.calls.lose_reply.add(("QueryMessage", 1))
            [status] = await producer.query("ID-CANCEL-1", "orders")
            assert status.state == "pending" and served.calls.counts["QueryMessage"] == 2
            served.calls.lose_reply.add(("CancelMessage", 1))
            with pytest.raises(ServerUnavailable):
                await producer.cancel("orders", "ID-CANCEL-1")
            assert served.calls.counts["CancelMessage"] == 1
            [status] = await producer.query("ID-CANCEL-1", "orders")
            assert status.state == "cancelled" and status.deliver_at_ms == receipt.deliver_at_ms

    asyncio.run(body())


def test_a_recall_a_closing_broker_refused_is_retried_once_it_is_back(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served, AsyncProducer(served.address, timeout_ms=10_000) as producer:
            receipt = await producer.send("orders", b"x", message_id="ID-RECALL-1", delay=3_600_000)
            await served.brokers[0].close()
            served.calls.before[("RecallMessage", 2)] = served.restart
            assert await producer.recall("orders", receipt.recall_handle) == "ID-RECALL-1"
            assert served.calls.counts["RecallMessage"] == 2
            [status] = await producer.query("ID-RECALL-1", "orders")
            assert status.state == "cancelled"

    asyncio.run(body())
