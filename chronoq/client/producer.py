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

import asyncio
import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from chronoq import errors as core
from chronoq.client import wire
from chronoq.client.admin import AsyncAdmin
from chronoq.client.connection import DEFAULT_TIMEOUT_MS, Setting, check_at_least_one, check_batch_via, check_flag
from chronoq.client.errors import BatchSendError, InvalidArgument, ProtocolViolation
from chronoq.client.retry import DEFAULT_ATTEMPTS, DEFAULT_SEND_ATTEMPTS, attempt_numbers, give_up
from chronoq.client.types import BatchOutcome, BulkOutcome, SendReceipt
from chronoq.model import OutgoingMessage, new_message_id
from chronoq.protocol import bulk
from chronoq.protocol.errors import MalformedRequest
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

DEFAULT_MAX_BULK_ROWS = 4096
"""Rows per SendColumns request in `send_columns` (the server's default limit is 8,192)."""
DEFAULT_BULK_IN_FLIGHT = 2
"""SendColumns requests in flight at once: the next is framed while the server stores the last."""


class AsyncProducer(AsyncAdmin):
    """Sends normal and timer messages; recalls and cancels timer messages."""

    SETTINGS: ClassVar[frozenset[str]] = AsyncAdmin.SETTINGS | {"send_attempts", "max_batch", "max_batch_bytes",
                                                                 "batch_via", "create_topics", "max_bulk_rows",
                                                                 "bulk_in_flight"}
    send_attempts = Setting(check_at_least_one)
    max_batch = Setting(check_at_least_one)
    max_batch_bytes = Setting(check_at_least_one)
    batch_via = Setting(check_batch_via)
    create_topics = Setting(check_flag)
    max_bulk_rows = Setting(check_at_least_one)
    """Rows per SendColumns request in `send_columns` (the server's limit: `max_bulk_send_rows`)."""
    bulk_in_flight = Setting(check_at_least_one)
    """SendColumns requests one `send_columns` keeps in flight at once."""
    """True: a send to a missing topic whose name is near an existing topic's creates it (with the
    server's auto-create on) rather than being refused with `TopicNameTooNear`; sends go as
    SendBatch, whatever `batch_via` says. False (the default): such a send is refused."""

    def __init__(self, server: str | None = None, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 send_attempts: int = DEFAULT_SEND_ATTEMPTS, max_batch: int = DEFAULT_MAX_BATCH,
                 max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, batch_via: str = "admin", tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 attempts: int = DEFAULT_ATTEMPTS, create_topics: bool = False,
                 max_bulk_rows: int = DEFAULT_MAX_BULK_ROWS, bulk_in_flight: int = DEFAULT_BULK_IN_FLIGHT) -> None:
        super().__init__(server, timeout_ms=timeout_ms, tls=tls, root_certificates=root_certificates,
                         tls_server_name=tls_server_name, access_key=access_key, secret_key=secret_key,
                         attempts=attempts)
        self.send_attempts = send_attempts
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.batch_via = batch_via
        self.create_topics = create_topics
        self.max_bulk_rows = max_bulk_rows
        self.bulk_in_flight = bulk_in_flight

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

    async def send_columns(self, topic: str, bodies: bulk.Packed | Sequence[bytes | str], *,
                           message_ids: Sequence[str] | None = None, deliver_at_ms: Sequence[int] | None = None,
                           delay_ms: Sequence[int] | None = None, tags: Sequence[str | None] | None = None,
                           keys: Sequence[Sequence[str]] | None = None,
                           properties: Sequence[Mapping[str, str] | None] | None = None) -> BulkOutcome:
        """Store many messages of one topic given as columns (one value a row), through the
        bulk send (SendColumns, `chronoq.protocol.bulk`): requests of up to `max_bulk_rows` rows
        and about `max_batch_bytes` bytes, `bulk_in_flight` of them at once. The server judges
        each row by the rules of a single send; nothing is raised for a refused row: the outcome
        says, per row, stored, duplicate or refused (with its error). Durable like every send:
        the reply comes after the group commit.

        `bodies` as bytes or text (UTF-8), or already `Packed`; `message_ids` (made here when
        absent, so a retry repeats them); at most one of `deliver_at_ms` (ms since the epoch) and
        `delay_ms`; optional `tags`, `keys` and `properties`. A request that fails retriably is
        sent again with the same ids (the server's dedupe window answers what it already
        stored), as are rows refused retriably, under the SDK's retry rule (`send_attempts`)."""
        body_col = bodies if isinstance(bodies, bulk.Packed) else bulk.Packed.of(bodies)
        n = len(body_col)
        ids = list(message_ids) if message_ids is not None else [new_message_id() for _ in range(n)]
        if deliver_at_ms is not None and delay_ms is not None:
            raise core.ConflictingDelivery(["deliver_at_ms", "delay_ms"])
        due = deliver_at_ms if deliver_at_ms is not None else delay_ms
        due_kind = bulk.DUE_AT if deliver_at_ms is not None else bulk.DUE_DELAY if delay_ms is not None \
            else bulk.DUE_NONE
        for name, col in (("message_ids", ids), ("due times", due), ("tags", tags), ("keys", keys),
                          ("properties", properties)):
            if col is not None and len(col) != n:
                raise InvalidArgument(name, len(col), f"{len(col)} values for {n} bodies")
        columns = _Columns(topic, ids, body_col, due_kind, due, tags, keys, properties, self.create_topics)
        outcome = BulkOutcome(topic, ids, ["refused"] * n, [-1] * n, [-1] * n, [None] * n, [False] * n)
        gate = asyncio.Semaphore(self.bulk_in_flight)

        async def one(start: int, stop: int) -> None:
            async with gate:
                await self._send_rows(columns, list(range(start, stop)), outcome)

        await asyncio.gather(*(one(a, b) for a, b in columns.chunks(self.max_bulk_rows, self.max_batch_bytes)))
        return outcome

    async def _send_rows(self, columns: _Columns, rows: list[int], outcome: BulkOutcome) -> None:
        """Rows `rows` in one request (a smaller server limit splits them), retried as `send_batch`."""
        pending = rows
        async with contextlib.aclosing(attempt_numbers(self.send_attempts)) as tries:
            async for attempt in tries:
                try:
                    raw = await self._admin_bytes(bulk.METHOD, columns.frame(pending))
                except core.InvalidBatchSize as e:
                    # A server whose `max_bulk_send_rows` is below `max_bulk_rows` names its
                    # limit: learn it and send these rows in requests of that size.
                    limit = (e.details or {}).get("max_batch_size")
                    if not isinstance(limit, int) or not 1 <= limit < len(pending):
                        raise
                    self.max_bulk_rows = limit
                    for at in range(0, len(pending), limit):
                        await self._send_rows(columns, pending[at:at + limit], outcome)
                    return
                except core.ChronoqError as e:
                    if give_up(e, attempt, self.send_attempts):
                        raise
                    continue
                try:
                    reply = bulk.decode_reply(raw, len(pending))
                except MalformedRequest as e:
                    raise ProtocolViolation(bulk.METHOD, e.message) from None
                errors = {i: wire.error_from_json(doc) for i, doc in reply.errors}
                for j, row in enumerate(pending):
                    code = reply.status[j]
                    kind = code & 0x0F
                    if kind == bulk.REFUSED:
                        outcome.errors[row] = errors.get(j) or ProtocolViolation(bulk.METHOD, "a refusal without "
                                                                                              "its error")
                        continue
                    outcome.errors.pop(row, None)
                    outcome.status[row] = "duplicate" if kind == bulk.DUPLICATE else "stored"
                    outcome.queue_ids[row] = reply.queue_ids[j]
                    outcome.offsets[row] = reply.offsets[j]
                    outcome.deliver_at_ms[row] = reply.due[j] if reply.due[j] >= 0 else None
                    outcome.recallable[row] = bool(code & bulk.HAS_HANDLE)
                pending = [row for row in pending if getattr(outcome.errors.get(row), "retriable", False)]
                if not pending:
                    return

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


class _Columns:
    """A `send_columns` call's rows, cut into requests and framed (`chronoq.protocol.bulk`)."""

    def __init__(self, topic: str, ids: list[str], bodies: bulk.Packed, due_kind: int, due: Sequence[int] | None,
                 tags: Sequence[str | None] | None, keys: Sequence[Sequence[str]] | None,
                 properties: Sequence[Mapping[str, str] | None] | None, create_topic: bool) -> None:
        self.topic, self.ids, self.bodies, self.due_kind, self.due = topic, ids, bodies, due_kind, due
        self.tags, self.keys, self.properties, self.create_topic = tags, keys, properties, create_topic

    def chunks(self, max_rows: int, max_bytes: int) -> Iterator[tuple[int, int]]:
        """[start, stop) row ranges of at most `max_rows` rows and about `max_bytes` bytes (a
        row larger than that alone)."""
        n = len(self.ids)
        offs = self.bodies.offsets
        start = 0
        while start < n:
            stop = min(n, start + max_rows)
            # Bodies dominate a frame: cut where they pass the budget (ids and offsets ~50 bytes a row).
            while stop > start + 1 and offs[stop] - offs[start] + 64 * (stop - start) > max_bytes:
                stop = start + max(1, (stop - start) // 2)
            yield start, stop
            start = stop

    def frame(self, rows: list[int]) -> bytes:
        start, stop = rows[0], rows[-1] + 1
        if stop - start == len(rows):
            pick: Any = slice(start, stop)
            bodies = self.bodies.rows(start, stop)
        else:  # a retry of some rows
            pick = None
            bodies = bulk.Packed.of([self.bodies.value(i) for i in rows])

        def col(values: Sequence[Any] | None) -> Any:
            if values is None:
                return None
            return values[pick] if pick is not None else [values[i] for i in rows]

        props = col(self.properties)
        return bulk.encode_request(self.topic, col(self.ids), bodies, due_kind=self.due_kind, due=col(self.due),
                                   tags=col(self.tags), keys=col(self.keys),
                                   properties=[dict(p) if p else None for p in props] if props is not None else None,
                                   create_topic=self.create_topic)
