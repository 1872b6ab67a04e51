"""The asyncio SDK: `AsyncAdmin`, `AsyncProducer`, `AsyncConsumer` over one grpc.aio channel.

Theory of operation: a client owns one `grpc.aio` channel to one chronoq server and speaks three
services on it: `apache.rocketmq.v2.MessagingService` (send, receive, ack, change-invisible,
recall) with the protobuf messages of `rocketmq-python-client` (through `chronoq.protocol.v2`);
chronoq's batched receive (`chronoq.protocol.batch_receive`: ReceiveMessage with the messages in
one response; a consumer asks for it first, and falls back to ReceiveMessage for good on a server
that lacks it); and chronoq's admin service (topics, query, cancel by id, stats, read by offset,
batched send) whose bodies are JSON. Everything that turns values into bytes and statuses into
exceptions lives in `chronoq.client.wire` and `chronoq.client.errors`; the clients only make
calls.

The SDK is written in layers, one module each, and this module gathers their public names so
that `from chronoq.client.aio import AsyncProducer` (and the rest below) is the one import:
- `client/connection.py`: `Connection`, the base of every client: the channel (opened lazily,
  TLS), credentials (signed headers), the generic calls, the one place gRPC failures become
  chronoq errors, and the settings a program may change between calls;
- `client/retry.py`: the one retry policy (which failures are tried again, how often, how long
  apart), and which call applies it how;
- `client/admin.py`: `AsyncAdmin`: topics, timer queries, cancel and recall, stats, read by
  offset: what every client may ask;
- `client/producer.py`: `AsyncProducer`: send and send_batch, cut by count and encoded size,
  retried per message;
- `client/consumer.py`: `AsyncConsumer`: receive (batched, or RocketMQ's stream), ack,
  change_invisible.
"""

from __future__ import annotations

from chronoq.client.admin import AsyncAdmin
from chronoq.client.connection import (
    ACCESS_KEY_ENV,
    ADMIN_SERVICE,
    DEFAULT_SERVER,
    DEFAULT_TIMEOUT_MS,
    MAX_GRPC_MESSAGE_BYTES,
    SECRET_KEY_ENV,
    SERVER_ENV,
    Connection,
    default_server,
    parse_server,
    unavailable_hint,
)
from chronoq.client.consumer import AsyncConsumer
from chronoq.client.producer import DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH_BYTES, AsyncProducer
from chronoq.client.retry import DEFAULT_ATTEMPTS, DEFAULT_SEND_ATTEMPTS, RETRY_BACKOFF_MS

__all__ = [
    "ACCESS_KEY_ENV",
    "ADMIN_SERVICE",
    "DEFAULT_ATTEMPTS",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_BATCH_BYTES",
    "DEFAULT_SEND_ATTEMPTS",
    "DEFAULT_SERVER",
    "DEFAULT_TIMEOUT_MS",
    "MAX_GRPC_MESSAGE_BYTES",
    "RETRY_BACKOFF_MS",
    "SECRET_KEY_ENV",
    "SERVER_ENV",
    "AsyncAdmin",
    "AsyncConsumer",
    "AsyncProducer",
    "Connection",
    "default_server",
    "parse_server",
    "unavailable_hint",
]
