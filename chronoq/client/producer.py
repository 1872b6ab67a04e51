"""`AsyncProducer`: sends normal and timer messages, one or in batches.

Theory of operation: a send returns once the server has made the message durable. One message
goes as RocketMQ's SendMessage (or, with a `delay_level`, chronoq's SendBatch, the one call that
carries the level as its own field); `send_batch` cuts its messages into requests of at most
`max_batch` messages and `max_batch_bytes` encoded bytes (`_chunks`), sent as SendBatch or, with
`batch_via="grpc"`, SendMessage. Sends are retried with the same message ids (the server's
dedupe window makes a retry idempotent), at most `send_attempts` times under the SDK's retry rule
(`client/retry.py`), and only the messages whose failure was retriable go again
(`_with_retries`). A server whose `max_send_batch` is below `max_batch` names its limit, and the
producer goes on in requests of that size.

A send to a missing topic whose name is near an existing topic's (`ordres` beside `orders`) is
refused by the server with `TopicNameTooNear`, creating nothing (`chronoq/topics.py`). A
producer made with `create_topics=True` asks for its topics: its sends then go as SendBatch,
the request that carries the ask (`"create_topic": true`), and such a topic is auto-created.

Apart from `client/admin.py` (what every client may ask) and `client/consumer.py`: sending is
its own concern, with its own settings (`send_attempts`, `max_batch`, `max_batch_bytes`,
`batch_via`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from chronoq import errors as core
from chronoq.client import wire
from chronoq.client.admin import AsyncAdmin
from chronoq.client.connection import DEFAULT_TIMEOUT_MS, Setting, check_at_least_one, check_batch_via, check_flag
from chronoq.client.errors import BatchSendError, ProtocolViolation
from chronoq.client.retry import DEFAULT_ATTEMPTS, DEFAULT_SEND_ATTEMPTS, attempt_numbers, give_up
from chronoq.client.types import BatchOutcome, SendReceipt
from chronoq.model import OutgoingMessage
from chronoq.protocol.v2 import service as svc

DEFAULT_MAX_BATCH = 1024
"""Messages per request in `send_batch`; the server's own limit is `Config.max_send_batch`."""
DEFAULT_MAX_BATCH_BYTES = 4 * 1024 * 1024
"""Bytes per request in `send_batch` (`wire.encoded_size`, an upper bound, summed): a request
holds messages up to `max_batch` and up to this size; a single message larger than this goes
alone. The server refuses requests over about 2 x `max_message_size_bytes` + 1 MiB (gRPC's
limit, `chronoq.server.serve.max_request_bytes`: 9 MiB by default), so 4 MiB stays well below
the default limit while keeping requests large enough to amortize a round trip; lower it for a
server configured with a smaller `max_message_size_bytes`."""


class AsyncProducer(AsyncAdmin):
    """Sends normal and timer messages; recalls and cancels timer messages."""

    SETTINGS: ClassVar[frozenset[str]] = AsyncAdmin.SETTINGS | {"send_attempts", "max_batch", "max_batch_bytes",
                                                                 "batch_via", "create_topics"}
    send_attempts = Setting(check_at_least_one)
    max_batch = Setting(check_at_least_one)
    max_batch_bytes = Setting(check_at_least_one)
    batch_via = Setting(check_batch_via)
    create_topics = Setting(check_flag)
    """True: a send to a missing topic whose name is near an existing topic's creates it (with the
    server's auto-create on) rather than being refused with `TopicNameTooNear`; sends go as
    SendBatch, whatever `batch_via` says. False (the default): such a send is refused."""

    def __init__(self, server: str | None = None, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 send_attempts: int = DEFAULT_SEND_ATTEMPTS, max_batch: int = DEFAULT_MAX_BATCH,
                 max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, batch_via: str = "admin", tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 attempts: int = DEFAULT_ATTEMPTS, create_topics: bool = False) -> None:
        super().__init__(server, timeout_ms=timeout_ms, tls=tls, root_certificates=root_certificates,
                         tls_server_name=tls_server_name, access_key=access_key, secret_key=secret_key,
                         attempts=attempts)
        self.send_attempts = send_attempts
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.batch_via = batch_via
        self.create_topics = create_topics

    async def __aenter__(self) -> AsyncProducer:
        self._open()
        return self

    async def send(self, topic: str, body: bytes | str, *, deliver_at: datetime | int | None = None,
                   delay: timedelta | int | None = None, delay_level: int | None = None, tag: str | None = None,
                   keys: str | Iterable[str] = (), properties: Mapping[str, str] | None = None,
                   message_id: str | None = None, message_group: str | None = None) -> SendReceipt:
        """Store one message; returns once the server has made it durable.

        At most one of `deliver_at` (timezone-aware datetime, or ms since the epoch), `delay`
        (timedelta or ms, added by the server's clock) and `delay_level` (RocketMQ 4 level, 1-based;
        a level above the server's table is refused with `InvalidDelayLevel`). The receipt's
        `deliver_at_ms` is the due time the server fixed; `recall_handle` is None for a
        delay-level message (it waits in its level's queue, as in RocketMQ 4, and cannot be
        recalled or queried)."""
        msg = wire.outgoing(topic, body, deliver_at=deliver_at, delay=delay, delay_level=delay_level, tag=tag,
                            keys=keys, properties=properties, message_id=message_id, message_group=message_group)
        # RocketMQ's protocol carries a level only as the DELAY property, which clamps a level above
        # the table's top to the top (RocketMQ 4's rule, kept for its clients). `delay_level=` is
        # chronoq's own field, which refuses such a level; only SendBatch carries that field, and
        # its receipt names the due time the server fixed.
        send = self._send_admin if delay_level is not None or self.create_topics else self._send_grpc
        result = (await self._with_retries(send, [msg]))[0]
        if isinstance(result, Exception):
            raise result
        return result

    async def send_batch(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]:
        """Store many messages (build each with `chronoq.client.outgoing(...)`), in order, in
        requests of at most `max_batch` messages and `max_batch_bytes` bytes (as encoded for
        `batch_via`; a message larger than that goes in a request of its own).

        `batch_via="admin"` (the default) uses the admin service's SendBatch: the server judges
        each message alone, and if any is refused `BatchSendError` carries a receipt or an error
        for every message while the others are stored. `batch_via="grpc"` sends RocketMQ's
        SendMessage with many messages: one malformed message refuses its whole request (raised
        as that message's error; earlier requests stay stored), and a `delay_level` travels as
        RocketMQ's `DELAY` property, which clamps a level above the table's top instead of
        refusing it. SendBatch is the default because
        it was as fast or faster in `bench/bench_sdk.py` (100-byte bodies, batches of 256: about
        6,700 vs 5,500 timer messages/s, interleaved runs on a loaded 2-core machine) and costs
        the client less CPU (JSON encoding beats building protobuf objects in Python); with large
        bodies base64's third more bytes may tip it the other way."""
        send = self._send_grpc if self.batch_via == "grpc" and not self.create_topics else self._send_admin
        results: list[SendReceipt | Exception] = []
        while len(results) < len(messages):
            chunk = next(self._chunks(messages[len(results):]))
            try:
                results.extend(await self._with_retries(send, chunk))
            except core.InvalidBatchSize as e:
                # A server whose `max_send_batch` is below `max_batch` names its limit (SendBatch
                # does): learn it and go on in smaller requests, rather than fail every batch.
                limit = (e.details or {}).get("max_batch_size")
                if not isinstance(limit, int) or not 1 <= limit < len(chunk):
                    raise
                self.max_batch = limit
        outcome = BatchOutcome(tuple(results))
        if outcome.errors:
            raise BatchSendError(outcome)
        return outcome.receipts

    def _chunks(self, messages: Sequence[OutgoingMessage]) -> Iterator[list[OutgoingMessage]]:
        """`messages` in order, cut before the request would pass `max_batch` messages or
        `max_batch_bytes` bytes (`wire.encoded_size` in the encoding `batch_via` uses)."""
        json_body = self.batch_via != "grpc" or self.create_topics
        chunk: list[OutgoingMessage] = []
        size = 0
        for msg in messages:
            msg_size = wire.encoded_size(msg, json_body=json_body)
            if chunk and (len(chunk) >= self.max_batch or size + msg_size > self.max_batch_bytes):
                yield chunk
                chunk, size = [], 0
            chunk.append(msg)
            size += msg_size
        if chunk:
            yield chunk

    async def _with_retries(self, send: Any, msgs: list[OutgoingMessage]) -> list[SendReceipt | Exception]:
        """Send, then resend only the messages whose failure was retriable (same ids)."""
        results: list[SendReceipt | Exception | None] = [None] * len(msgs)
        pending = list(range(len(msgs)))
        async with contextlib.aclosing(attempt_numbers(self.send_attempts)) as tries:
            async for attempt in tries:
                try:
                    got = await send([msgs[i] for i in pending])
                except core.ChronoqError as e:
                    if give_up(e, attempt, self.send_attempts):
                        raise
                    continue
                for i, r in zip(pending, got, strict=True):
                    results[i] = r
                pending = [i for i in pending if isinstance(results[i], Exception) and results[i].retriable]  # type: ignore[union-attr]
                if not pending:
                    break
        return [r if r is not None else ProtocolViolation("send", "no result") for r in results]

    async def _send_grpc(self, msgs: list[OutgoingMessage]) -> list[SendReceipt | core.ChronoqError]:
        now_ms = self._clock.now_ms()
        req = svc.SendMessageRequest(messages=[wire.encode_message(m, now_ms) for m in msgs])
        resp = await self._rpc("SendMessage", req)
        if len(resp.entries) != len(msgs):
            # A request-level refusal comes without entries; it applies to every message.
            wire.check_status("SendMessage", resp.status)
            raise ProtocolViolation("SendMessage", f"{len(resp.entries)} result entries for {len(msgs)} messages")
        return [wire.decode_send_entry(e, m) for e, m in zip(resp.entries, msgs, strict=True)]

    async def _send_admin(self, msgs: list[OutgoingMessage]) -> list[SendReceipt | core.ChronoqError]:
        request: dict[str, Any] = {"messages": [wire.outgoing_to_json(m) for m in msgs]}
        if self.create_topics:
            request["create_topic"] = True
        reply = await self._admin("SendBatch", request)
        entries = reply.get("results")
        if not isinstance(entries, list) or len(entries) != len(msgs):
            raise ProtocolViolation("SendBatch", f"expected {len(msgs)} results")
        return [wire.send_result_from_json(e, m) if isinstance(e, dict)
                else ProtocolViolation("SendBatch", "result entry is not an object")
                for e, m in zip(entries, msgs, strict=True)]
