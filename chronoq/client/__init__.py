"""chronoq's Python SDK, over the RocketMQ 5 gRPC protocol plus chronoq's JSON admin service.

Async first (`AsyncProducer`, `AsyncConsumer`, `AsyncAdmin` in `chronoq.client.aio`), with
blocking twins (`Producer`, `Consumer`, `Admin` in `chronoq.client.sync`) that run the same async
code on a private loop thread. Values in `chronoq.client.types`, pure wire conversions in
`chronoq.client.wire`, errors in `chronoq.client.errors` (server failures come back as the
`chronoq.errors` class the broker raised, carrying `code`, `message` and `retriable`).

    async with AsyncProducer("127.0.0.1:8081") as p:
        r = await p.send("orders", b"ship it", delay=timedelta(minutes=5))
        await p.recall("orders", r.recall_handle)
"""

from chronoq.client.aio import DEFAULT_SERVER, SERVER_ENV, AsyncAdmin, AsyncConsumer, AsyncProducer, default_server
from chronoq.client.errors import (
    BatchSendError,
    ClientClosed,
    ClientError,
    InvalidArgument,
    ProtocolViolation,
    RemoteError,
    RequestTimedOut,
    RequestTooLarge,
    ServerUnavailable,
)
from chronoq.client.sync import Admin, Consumer, Producer
from chronoq.client.types import (
    ArmOutcome,
    ArmResult,
    BatchOutcome,
    BulkOutcome,
    FireOutcome,
    QueueInfo,
    ReadResult,
    ReceivedMessage,
    SendReceipt,
    StoredRecord,
    TimerInfo,
    TopicDescription,
    TopicInfo,
)
from chronoq.client.wire import outgoing

__all__ = [
    "DEFAULT_SERVER",
    "SERVER_ENV",
    "Admin",
    "ArmOutcome",
    "ArmResult",
    "AsyncAdmin",
    "AsyncConsumer",
    "AsyncProducer",
    "BatchOutcome",
    "BatchSendError",
    "BulkOutcome",
    "ClientClosed",
    "ClientError",
    "Consumer",
    "FireOutcome",
    "InvalidArgument",
    "Producer",
    "ProtocolViolation",
    "QueueInfo",
    "ReadResult",
    "ReceivedMessage",
    "RemoteError",
    "RequestTimedOut",
    "RequestTooLarge",
    "SendReceipt",
    "ServerUnavailable",
    "StoredRecord",
    "TimerInfo",
    "TopicDescription",
    "TopicInfo",
    "default_server",
    "outgoing",
]
