"""An in-process chronoq gRPC server over a real Broker, for the server tests.

Real parts only: a RocksDB-backed `Broker` in a temp directory, a `grpc.aio` server on a free
loopback port, and a `grpc.aio` channel using the same generated RocketMQ v2 modules as the
server (one copy of the protos per process). `clock` lets a test drive time with `FakeClock`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

from chronoq.broker import Broker
from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.protocol.requests import Endpoint
from chronoq.protocol.v2 import definition, service
from chronoq.server.admin_service import AdminService
from chronoq.server.grpc_service import MessagingService
from chronoq.server.serve import server_options
from tests.support.brokers import open_broker


@dataclass
class Harness:
    broker: Broker
    messaging: MessagingService
    channel: grpc.aio.Channel
    stub: service_grpc.MessagingServiceStub
    address: str
    calls: list[str]
    """The path of every call the server was asked for, in order (`/service/method`)."""

    async def admin(self, method: str, body: Any) -> dict[str, Any]:
        raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
        reply = await self.channel.unary_unary(f"/chronoq.admin.v1.Admin/{method}")(raw, timeout=10)
        return json.loads(reply)

    async def raw(self, method: str, data: bytes) -> bytes:
        return await self.channel.unary_unary(f"/apache.rocketmq.v2.MessagingService/{method}")(data, timeout=10)

    async def receive(self, request: service.ReceiveMessageRequest,
                      timeout_s: float = 10) -> list[service.ReceiveMessageResponse]:
        return [r async for r in self.stub.ReceiveMessage(request, timeout=timeout_s)]


class _CallRecorder(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        self.calls.append(handler_call_details.method)
        return await continuation(handler_call_details)


@contextlib.asynccontextmanager
async def running(tmp_path: Path, *, clock: Clock | None = None, background: bool = True,
                  wildcard: bool = False, batch_receive: bool = True, **settings: Any) -> AsyncIterator[Harness]:
    """`wildcard`: behave as a server bound to 0.0.0.0 (routes name the client's access point).
    `batch_receive=False`: serve without chronoq's batched receive, as a RocketMQ proxy does."""
    config = Config(data_dir=tmp_path / "data", **settings)
    broker = await open_broker(config, clock, background=background)
    recorder = _CallRecorder()
    server = grpc.aio.server(options=server_options(config), interceptors=[recorder])
    try:
        port = server.add_insecure_port("127.0.0.1:0")
        advertised = None if wildcard else Endpoint("127.0.0.1", port)
        messaging = MessagingService(broker, config, advertised=advertised, port=port)
        handlers = [messaging.generic_handler(), AdminService(broker, config).generic_handler()]
        if batch_receive:
            handlers.append(messaging.batch_receive_handler())
        server.add_generic_rpc_handlers(tuple(handlers))
        await server.start()
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            yield Harness(broker, messaging, channel, service_grpc.MessagingServiceStub(channel), address,
                          recorder.calls)
    finally:
        await server.stop(0)
        await broker.close()


def resource(name: str) -> definition.Resource:
    return definition.Resource(name=name)


def message(topic: str, body: bytes = b"body", *, message_id: str = "", tag: str = "",
            deliver_at_ms: int | None = None) -> definition.Message:
    msg = definition.Message(topic=resource(topic), body=body)
    sp = msg.system_properties
    if message_id:
        sp.message_id = message_id
    if tag:
        sp.tag = tag
    sp.body_encoding = definition.IDENTITY
    sp.message_type = definition.NORMAL
    if deliver_at_ms is not None:
        sp.message_type = definition.DELAY
        sp.delivery_timestamp.seconds = deliver_at_ms  # milliseconds in `seconds`, as the Python client does
    return msg


def receive_request(topic: str, group: str = "g", *, batch: int = 16, invisible_s: int | None = 30,
                    long_poll_s: int = 0, auto_renew: bool = False) -> service.ReceiveMessageRequest:
    req = service.ReceiveMessageRequest(group=resource(group), batch_size=batch, auto_renew=auto_renew)
    req.message_queue.topic.name = topic
    req.filter_expression.type = definition.TAG
    req.filter_expression.expression = "*"
    if invisible_s is not None:
        req.invisible_duration.seconds = invisible_s
    req.long_polling_timeout.seconds = long_poll_s
    return req


def messages_of(stream: list[service.ReceiveMessageResponse]) -> list[definition.Message]:
    return [r.message for r in stream if r.WhichOneof("content") == "message"]


def status_of(stream: list[service.ReceiveMessageResponse]) -> int:
    statuses = [r.status.code for r in stream if r.WhichOneof("content") == "status"]
    assert len(statuses) == 1, stream
    return statuses[0]
