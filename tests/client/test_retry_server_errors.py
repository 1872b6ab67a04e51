"""The SDK retries a send the broker refused for a reason a retry outlives, knowing it by the code.

Over RocketMQ's SendMessage only a status code travels. A broker that is closing (`BrokerClosed`)
or that could not make a write durable (`FlushFailed`) must answer with a code the SDK retries
(50002, 50401: `chronoq/errors.py`'s table), not the 50001 it shares with failures no retry mends.

Real parts only: a RocksDB-backed `Broker`, a `grpc.aio` server on a loopback port, and the SDK's
`AsyncProducer` / `AsyncConsumer` over real gRPC. The broker is closed for real, or its commit
log's fsync fails for real (EIO at the system-call boundary). A server interceptor counts the
SendMessage calls that arrive and, where a test "restarts" the broker, opens a new `Broker` on the
same data directory and puts it behind the same port before the retry is answered: what a
supervisor restarting `chronoq serve` does, without the timing of a process start.
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
from chronoq.client import AsyncConsumer, AsyncProducer
from chronoq.config import Config
from chronoq.protocol.requests import Endpoint
from chronoq.server.grpc_service import MessagingService
from chronoq.server.serve import server_options
from chronoq.store import files

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
class Served:
    config: Config
    messaging: MessagingService
    address: str
    sends: Sends
    brokers: list[Broker]

    async def restart(self) -> None:
        """Close the broker behind the port (if still open) and serve a new one on its data directory."""
        await self.brokers[-1].close()
        broker = await Broker.open(self.config)
        self.brokers.append(broker)
        self.messaging.broker = broker


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[Served]:
    config = Config(data_dir=tmp_path / "data", default_queue_count=1)
    brokers = [await Broker.open(config)]
    sends = Sends()
    server = grpc.aio.server(options=server_options(config), interceptors=[sends])
    try:
        port = server.add_insecure_port("127.0.0.1:0")
        messaging = MessagingService(brokers[0], config, advertised=Endpoint("127.0.0.1", port), port=port)
        server.add_generic_rpc_handlers((messaging.generic_handler(),))
        await server.start()
        yield Served(config, messaging, f"127.0.0.1:{port}", sends, brokers)
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
