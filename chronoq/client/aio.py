"""The asyncio SDK: `AsyncAdmin`, `AsyncProducer`, `AsyncConsumer` over one grpc.aio channel.

Theory of operation: a client owns one `grpc.aio` channel to one chronoq server and speaks three
services on it: `apache.rocketmq.v2.MessagingService` (send, receive, ack, change-invisible,
recall) with the protobuf messages of `rocketmq-python-client` (through `chronoq.protocol.v2`);
chronoq's batched receive (`chronoq.protocol.batch_receive`: ReceiveMessage with the messages in
one response; a consumer asks for it first, and falls back to ReceiveMessage for good on a server
that lacks it); and chronoq's admin service (topics, query, cancel by id, stats, read by offset,
batched send) whose bodies are JSON. All go through generic calls (a path, a serializer, a parser), so the
generated `*_pb2_grpc` stubs are not needed. Everything that turns values into bytes and
statuses into exceptions lives in `chronoq.client.wire` and `chronoq.client.errors`; this
module only makes calls, so every gRPC failure is translated at one point (`_translate`).

The channel is opened lazily on first use, inside the running loop (grpc.aio binds a channel to
the loop that created it), and closed by `close()` / `async with`. A call still waiting when
another task closes the client (a long-polling receive, say) raises `ClientClosed` (grpc.aio
itself raises a bare CancelledError there); a cancellation of the caller's own task stays a
CancelledError. TLS: `tls=True` trusts the
system's CAs, `root_certificates=` (PEM bytes) a CA of your own, such as a self-signed server
certificate; `tls_server_name=` checks the certificate against another name than the host in
`server` (an address reached by IP whose certificate names a host). A client holds no background
tasks: nothing outlives a call. The SDK, unlike the broker core, may read the real clock: it
stamps born and received times with the wall clock as it is (`WallClock`), as any client does
(the step-proof `SystemClock` is for the broker's decisions; its timeouts are gRPC deadlines).

Credentials: with an access key and secret key (arguments, or `CHRONOQ_ACCESS_KEY` and
`CHRONOQ_SECRET_KEY`), every call carries RocketMQ ACL 2.0's signed headers
(`chronoq.protocol.signature`), made afresh per call since they carry the time.

Sends are retried (same message id, so the server's dedupe window makes a retry idempotent)
when the failure is retriable: the connection, a deadline, or a retriable server code (the
code's class in `chronoq.errors` says: 42900 throttled, 50002 the broker closing, 50401 a failed
fsync; never 50001), at most `send_attempts` times, backing off 100 ms, 200 ms, .... A consumer
retries (at most `attempts` times, on the same schedule and rule: `_attempts`, `_give_up`,
`_retrying` hold the one retry policy) a receive that failed before its first message; an ack
(idempotent: after an attempt whose outcome is unknown, a retry's "invalid receipt handle" for
an entry means the first attempt acked it, and is not raised); and a change_invisible only when
the broker refused it, never after an unknown outcome (that attempt may have replaced the handle,
and the new one never came back). Every client retries its other calls under the same policy and
`attempts`: the reads (list and describe topics, query, stats, read by offset) after any
retriable failure; create_topic, cancel and recall only when the broker refused them (after a
lost reply the first attempt may have done its work, and a repeat would answer "exists" or "not
pending" for what succeeded). `ping` is one attempt: it asks whether the server is up now; the
Spark engine's `fire_timers` is retried by Spark's own batch retry (it is idempotent). A request
gRPC refuses as too large (`RequestTooLarge`) is not retried; `send_batch` avoids making one by
cutting batches by encoded size (`max_batch_bytes`) as well as by count (`max_batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar

import grpc

from chronoq import __version__, envvars
from chronoq import errors as core
from chronoq.client import wire
from chronoq.client.errors import (
    INVALID_RECEIPT_HANDLE,
    MESSAGE_NOT_FOUND,
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
from chronoq.client.types import (
    BatchOutcome,
    FireOutcome,
    ReadResult,
    ReceivedMessage,
    SendReceipt,
    TimerInfo,
    TopicDescription,
    TopicInfo,
)
from chronoq.clock import WallClock
from chronoq.model import OutgoingMessage
from chronoq.protocol import batch_receive, signature
from chronoq.protocol.v2 import SERVICE_NAME
from chronoq.protocol.v2 import definition as pb
from chronoq.protocol.v2 import service as svc
from chronoq.timer.recall import encode_recall_handle

DEFAULT_SERVER = "127.0.0.1:8081"
SERVER_ENV = envvars.SERVER
ACCESS_KEY_ENV = envvars.ACCESS_KEY
SECRET_KEY_ENV = envvars.SECRET_KEY
ADMIN_SERVICE = "chronoq.admin.v1.Admin"
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_SEND_ATTEMPTS = 3
DEFAULT_ATTEMPTS = DEFAULT_SEND_ATTEMPTS
"""`attempts`: tries of one call other than a send (an admin call, a recall; a consumer's receive,
ack or change_invisible), see `_attempts`."""
DEFAULT_MAX_BATCH = 1024
"""Messages per request in `send_batch`; the server's own limit is `Config.max_send_batch`."""
DEFAULT_MAX_BATCH_BYTES = 4 * 1024 * 1024
"""Bytes per request in `send_batch` (`wire.encoded_size`, an upper bound, summed): a request
holds messages up to `max_batch` and up to this size; a single message larger than this goes
alone. The server refuses requests over about 2 x `max_message_size_bytes` + 1 MiB (gRPC's
limit, `chronoq.server.serve.max_request_bytes`: 9 MiB by default), so 4 MiB stays well below
the default limit while keeping requests large enough to amortize a round trip; lower it for a
server configured with a smaller `max_message_size_bytes`."""
MAX_GRPC_MESSAGE_BYTES = 256 * 1024 * 1024
RETRY_BACKOFF_MS = 100

_client_seq = itertools.count(1)


class _BatchReceiveMissing(Exception):
    """The server has no `chronoq.receive.v1.Receive` (UNIMPLEMENTED): receive the standard way."""


T = TypeVar("T")
_GRPC_RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


class _Setting:
    """A client setting a program may change between calls (`producer.timeout_ms = 2000`): each
    call reads it afresh, and every write, the constructor's included, is checked by `check`
    (which raises `InvalidArgument` naming the value). Listed in the class's `SETTINGS`, which the
    blocking twins pass writes through for."""

    def __init__(self, check: Callable[[str, Any], None]) -> None:
        self._check = check
        self._name = self._slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._slot = name, f"_setting_{name}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self._slot)

    def __set__(self, obj: object, value: Any) -> None:
        self._check(self._name, value)
        setattr(obj, self._slot, value)


def _at_least_one(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(name, value, "a whole number, at least 1")


def _batch_via(name: str, value: Any) -> None:
    if value not in ("grpc", "admin"):
        raise InvalidArgument(name, value, "'grpc' (SendMessage) or 'admin' (SendBatch)")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(name, value, "True or False")


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidArgument(name, value, "a str is required")


def _name(name: str, value: Any) -> None:
    """A topic or group name: the server judges its characters, but an empty one is a mistake
    the client can name (the server would say only that a protobuf field is missing)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(name, value, "a non-empty string is required")


def default_server() -> str:
    return os.environ.get(SERVER_ENV) or DEFAULT_SERVER


def parse_server(server: str) -> tuple[str, int]:
    """(host, port) of a `host:port` address, or `InvalidArgument` naming it: a port must be
    decimal digits in 1-65535 (gRPC would otherwise take 84267 modulo 65536, another port). A URL's
    scheme ('http://') is refused by name: gRPC would look the whole of it up as a host name."""
    scheme, slashes, rest = server.partition("://")
    if slashes:
        raise InvalidArgument("server", server, f"drop {scheme + slashes!r}: give {rest.rstrip('/')}; TLS is set "
                              "apart: tls=True, or the CLI's --tls")
    host, sep, port = server.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise InvalidArgument("server", server, "use host:port")
    number = int(port)
    if not 1 <= number <= 65535:
        raise InvalidArgument("server", server, f"port {number} is outside 1-65535")
    return host, number


def unavailable_hint(detail: str, tls: bool) -> str | None:
    """What a person can do about a connection failure, read from gRPC's detail text (which
    names the TLS or socket error but not the likely cause)."""
    if "Connection refused" in detail:
        return "nothing listens there: is `chronoq serve` running, on this host and port?"
    if "CERTIFICATE_VERIFY_FAILED" in detail:
        return ("the server's certificate is not trusted: give the CA certificate that signed it "
                "(CLI: --ca-cert FILE or $CHRONOQ_CA_CERT; SDK: root_certificates=)")
    if "Cancelling all calls" in detail:  # the server's own shutdown ended the call (a long poll, say)
        return "the server shut down while this call was waiting: is it restarting? (the call may be retried)"
    if "WRONG_VERSION_NUMBER" in detail:
        return "the server does not seem to use TLS: connect without TLS"
    if not tls and "Socket closed" in detail:
        return ("the server may require TLS: connect with TLS (CLI: --tls, or --ca-cert FILE for a "
                "self-signed certificate; SDK: tls=True, root_certificates=)")
    return None


def _outcome_unknown(e: core.ChronoqError) -> bool:
    """Whether a failed call may still have taken effect: no broker verdict came back (the
    connection, a deadline, a bare gRPC status: `ClientError`, or `RemoteError`). A broker's own
    refusal (`BrokerClosed`, `FlushFailed`, `Throttled`: the `chronoq.errors` class its code names)
    says the request was not carried out."""
    return isinstance(e, (ClientError, RemoteError))


def _give_up(e: core.ChronoqError, attempt: int, attempts: int) -> bool:
    """The one retry rule: a failure is tried again only when it is retriable and tries remain."""
    return not e.retriable or attempt >= attempts - 1


async def _attempts(attempts: int) -> AsyncIterator[int]:
    """The one retry schedule, for every call the SDK retries: attempt numbers 0 .. attempts - 1,
    backing off 100 ms, 200 ms, 400 ms ... before each retry."""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(RETRY_BACKOFF_MS * 2 ** (attempt - 1) / 1000)
        yield attempt


async def _retrying(attempts: int, call: Callable[[bool], Awaitable[T]], *, after_unknown: bool = True) -> T:
    """`call(retrying_unknown)` under the retry rule and schedule. `retrying_unknown` is True once
    an earlier attempt failed without a broker verdict (it may have taken effect). With
    `after_unknown=False` such a failure is raised, not retried: for a call whose repeat is not
    safe once the first one may have done its work."""
    retrying_unknown = False
    async with contextlib.aclosing(_attempts(attempts)) as tries:
        async for attempt in tries:
            try:
                return await call(retrying_unknown)
            except core.ChronoqError as e:
                unknown = _outcome_unknown(e)
                if _give_up(e, attempt, attempts) or (unknown and not after_unknown):
                    raise
                retrying_unknown = retrying_unknown or unknown
    raise AssertionError("attempts is at least 1")


def _json_bytes(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def _json_reply(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        # A reply that is not JSON is the server's protocol error; say so at the call.
        return None


class AsyncAdmin:
    """Topics, timer queries, cancel by id, stats and read by offset; the base of both clients."""

    SETTINGS: ClassVar[frozenset[str]] = frozenset({"timeout_ms", "attempts"})
    """What may be changed after construction (each call reads it afresh). The rest (`server`,
    TLS, credentials, a consumer's `topic`) is fixed when the client is made."""
    timeout_ms = _Setting(_at_least_one)
    attempts = _Setting(_at_least_one)

    def __init__(self, server: str | None = None, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 tls: bool = False, root_certificates: bytes | None = None,
                 tls_server_name: str | None = None, access_key: str | None = None,
                 secret_key: str | None = None, attempts: int = DEFAULT_ATTEMPTS) -> None:
        self.server = server or default_server()
        self._access_key = access_key if access_key is not None else os.environ.get(ACCESS_KEY_ENV) or None
        self._secret_key = secret_key if secret_key is not None else os.environ.get(SECRET_KEY_ENV) or ""
        if self._access_key and not self._secret_key:
            raise InvalidArgument("secret_key", "", f"an access key needs its secret key (or ${SECRET_KEY_ENV})")
        self._host, self._port = parse_server(self.server)
        self.timeout_ms = timeout_ms
        self.attempts = attempts
        self._tls = tls or root_certificates is not None or tls_server_name is not None
        self._root_certificates = root_certificates
        self._tls_server_name = tls_server_name
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, Any] = {}
        self._clock = WallClock()
        self._metadata = (
            ("x-mq-client-id", f"{socket.gethostname()}@{os.getpid()}@{next(_client_seq)}@chronoq"),
            ("x-mq-language", "PYTHON"),
            ("x-mq-protocol", "GRPC_V2"),
            ("x-mq-client-version", f"chronoq-{__version__}"),
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        if not self._access_key:
            return self._metadata
        return self._metadata + signature.sign_headers(self._access_key, self._secret_key, self._clock.now_ms())

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            options: list[tuple[str, Any]] = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                       ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)]
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
                if self._tls_server_name:
                    options.append(("grpc.ssl_target_name_override", self._tls_server_name))
                self._channel = grpc.aio.secure_channel(self.server, creds, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self.server, options=options)
        return self._channel

    def _method(self, method: str) -> Any:
        """The callable for one MessagingService RPC. Built from the request and response types
        by name rather than through the generated `*_pb2_grpc` stub: `chronoq.protocol.v2` exposes
        only the message modules, and this needs nothing else."""
        call = self._calls.get(method)
        if call is None:
            response_type = getattr(svc, f"{method}Response")
            factory = self._open().unary_stream if method == "ReceiveMessage" else self._open().unary_unary
            call = factory(f"/{SERVICE_NAME}/{method}", request_serializer=_serialize,
                           response_deserializer=response_type.FromString)
            self._calls[method] = call
        return call

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        self._calls.clear()
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncAdmin:
        self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the one place gRPC failures become chronoq errors --------------------------------------

    def _translate(self, method: str, e: grpc.aio.AioRpcError, timeout_ms: int) -> core.ChronoqError:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestTimedOut(method, timeout_ms)
        if code == grpc.StatusCode.UNAVAILABLE:
            detail = e.details() or "unavailable"
            return ServerUnavailable(self.server, detail, unavailable_hint(detail, self._tls))
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return RemoteError(50100, f"the server does not implement {method}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or ""):
            # gRPC's size limit (either side's): retrying the same bytes cannot succeed. Other
            # RESOURCE_EXHAUSTED (a server out of some resource for now) stays retriable.
            return RequestTooLarge(method, e.details() or "")
        return RemoteError(50000, f"{method} failed with gRPC {code.name}: {e.details()}",
                           retriable=code in _GRPC_RETRIABLE)

    def _closed_under(self, channel: grpc.aio.Channel | None) -> bool:
        """After a CancelledError in a call made on `channel`: was it `close()` closing that
        channel (grpc.aio then cancels the call, and the caller sees CancelledError although
        nobody cancelled its task), rather than a cancellation of the caller's task?"""
        task = asyncio.current_task()
        return self._channel is not channel and not (task is not None and task.cancelling())

    async def _rpc(self, method: str, request: Any, *, timeout_ms: int | None = None) -> Any:
        deadline_ms = timeout_ms or self.timeout_ms
        call = self._method(method)
        channel = self._channel
        try:
            return await call(request, timeout=deadline_ms / 1000, metadata=self._call_metadata())
        except grpc.aio.AioRpcError as e:
            raise self._translate(method, e, deadline_ms) from None
        except asyncio.CancelledError:
            if self._closed_under(channel):
                raise ClientClosed(method, during=True) from None
            raise

    async def _admin(self, method: str, body: Mapping[str, Any], *, timeout_ms: int | None = None) -> dict[str, Any]:
        key = f"admin:{method}"
        call = self._calls.get(key)
        if call is None:
            call = self._open().unary_unary(f"/{ADMIN_SERVICE}/{method}", request_serializer=_json_bytes,
                                            response_deserializer=_json_reply)
            self._calls[key] = call
        deadline_ms = timeout_ms or self.timeout_ms
        channel = self._channel
        try:
            reply = await call(body, timeout=deadline_ms / 1000, metadata=self._call_metadata())
        except grpc.aio.AioRpcError as e:
            raise self._translate(method, e, deadline_ms) from None
        except asyncio.CancelledError:
            if self._closed_under(channel):
                raise ClientClosed(method, during=True) from None
            raise
        return wire.admin_result(method, reply)

    async def _admin_retried(self, method: str, body: Mapping[str, Any], *, after_unknown: bool) -> dict[str, Any]:
        """`_admin` under the retry policy (`attempts`): a read is retried after any retriable
        failure; a call that changes something (`after_unknown=False`) only when the broker
        refused it, since after a lost reply it may have done its work, and its repeat would
        answer "exists" or "not pending" for what succeeded."""
        return await _retrying(self.attempts, lambda _unknown: self._admin(method, body), after_unknown=after_unknown)

    async def ping(self) -> None:
        """One cheap admin round trip; raises `ServerUnavailable` while the server is not up."""
        await self._admin("ListTopics", {})

    # -- topics --------------------------------------------------------------------------------

    async def create_topic(self, name: str, queue_count: int | None = None,
                           message_types: Iterable[str] | None = None) -> TopicInfo:
        body: dict[str, Any] = {"name": name}
        if queue_count is not None:
            body["queue_count"] = queue_count
        if message_types is not None:
            body["message_types"] = wire.message_type_names(message_types)
        reply = await self._admin_retried("CreateTopic", body, after_unknown=False)
        return wire._shape("CreateTopic", lambda r: wire.topic_from_json(r["topic"]), reply)

    async def list_topics(self) -> list[TopicInfo]:
        return wire.topics_from_json(await self._admin_retried("ListTopics", {}, after_unknown=True))

    async def describe_topic(self, name: str) -> TopicDescription:
        return wire.description_from_json(await self._admin_retried("DescribeTopic", {"name": name},
                                                                    after_unknown=True))

    # -- timers --------------------------------------------------------------------------------

    async def query(self, message_id: str, topic: str | None = None) -> list[TimerInfo]:
        """What the server knows about a timer message (empty: no timer by that id)."""
        body = {"message_id": message_id} if topic is None else {"message_id": message_id, "topic": topic}
        return wire.statuses_from_json(await self._admin_retried("QueryMessage", body, after_unknown=True))

    async def query_key(self, key: str) -> list[TimerInfo]:
        return wire.statuses_from_json(await self._admin_retried("QueryMessage", {"key": key}, after_unknown=True))

    async def cancel(self, topic: str, message_id: str, *, deliver_at: datetime | int | None = None) -> str:
        """Cancel a pending timer message by id; returns the id. Raises `TimerAlreadyFired`,
        `TimerNotFound`... when it is too late or unknown, and `TimerIdAmbiguous` (its details list
        each one's due time and recall handle) when several timers of the id are pending.
        `deliver_at` (its due time as the server fixed it: a receipt's `deliver_at_ms`, a `query`
        row's, or the ambiguity's details) names one of them: the cancel then reaches that timer
        only, as its recall handle would."""
        if deliver_at is not None:
            handle = encode_recall_handle(topic, wire.deliver_at_to_ms(deliver_at), message_id)
            body: dict[str, Any] = {"recall_handle": handle, "topic": topic}
        else:
            body = {"topic": topic, "message_id": message_id}
        reply = await self._admin_retried("CancelMessage", body, after_unknown=False)
        return wire._shape("CancelMessage", lambda r: str(r["message_id"]), reply)

    async def cancel_handle(self, recall_handle: str) -> str:
        """Cancel by recall handle through the admin service (no topic needed)."""
        reply = await self._admin_retried("CancelMessage", {"recall_handle": recall_handle}, after_unknown=False)
        return wire._shape("CancelMessage", lambda r: str(r["message_id"]), reply)

    async def recall(self, topic: str, handle: str) -> str:
        """RocketMQ's RecallMessage: cancel a timer message by the handle its send returned."""
        req = svc.RecallMessageRequest(topic=pb.Resource(name=topic), recall_handle=handle)

        async def attempt(_unknown: bool) -> str:
            resp = await self._rpc("RecallMessage", req)
            wire.check_status("RecallMessage", resp.status)
            return str(resp.message_id)

        return await _retrying(self.attempts, attempt, after_unknown=False)

    # -- observation ---------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        reply = await self._admin_retried("Stats", {}, after_unknown=True)
        return {k: v for k, v in reply.items() if k not in ("code", "message")}

    async def read(self, topic: str, queue_id: int, offset: int, max_messages: int = 32) -> ReadResult:
        """Messages of one queue from a logical offset, without consuming them; each carries
        its commit-log `position`."""
        body = {"topic": topic, "queue_id": queue_id, "offset": offset, "max_messages": max_messages}
        return wire.read_from_json(await self._admin_retried("ReadMessages", body, after_unknown=True))

    async def fire_timers(self, positions: Sequence[int]) -> FireOutcome:
        """Fire the pending timers recorded at these commit-log positions, if due (for a timer
        engine outside the broker, `timer_engine = "spark"`). Idempotent: a position that already
        fired, or is not pending, is skipped. At most the server's `max_send_batch` positions."""
        checked = [wire.nonnegative_int("position", p) for p in positions]
        reply = await self._admin("FireTimers", {"positions": checked})
        return FireOutcome(int(reply.get("fired", 0)), int(reply.get("skipped", 0)))


class AsyncProducer(AsyncAdmin):
    """Sends normal and timer messages; recalls and cancels timer messages."""

    SETTINGS: ClassVar[frozenset[str]] = AsyncAdmin.SETTINGS | {"send_attempts", "max_batch", "max_batch_bytes",
                                                                 "batch_via"}
    send_attempts = _Setting(_at_least_one)
    max_batch = _Setting(_at_least_one)
    max_batch_bytes = _Setting(_at_least_one)
    batch_via = _Setting(_batch_via)

    def __init__(self, server: str | None = None, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 send_attempts: int = DEFAULT_SEND_ATTEMPTS, max_batch: int = DEFAULT_MAX_BATCH,
                 max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, batch_via: str = "admin", tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 attempts: int = DEFAULT_ATTEMPTS) -> None:
        super().__init__(server, timeout_ms=timeout_ms, tls=tls, root_certificates=root_certificates,
                         tls_server_name=tls_server_name, access_key=access_key, secret_key=secret_key,
                         attempts=attempts)
        self.send_attempts = send_attempts
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.batch_via = batch_via

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
        send = self._send_admin if delay_level is not None else self._send_grpc
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
        send = self._send_grpc if self.batch_via == "grpc" else self._send_admin
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
        json_body = self.batch_via != "grpc"
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
        async with contextlib.aclosing(_attempts(self.send_attempts)) as tries:
            async for attempt in tries:
                try:
                    got = await send([msgs[i] for i in pending])
                except core.ChronoqError as e:
                    if _give_up(e, attempt, self.send_attempts):
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
        reply = await self._admin("SendBatch", {"messages": [wire.outgoing_to_json(m) for m in msgs]})
        entries = reply.get("results")
        if not isinstance(entries, list) or len(entries) != len(msgs):
            raise ProtocolViolation("SendBatch", f"expected {len(msgs)} results")
        return [wire.send_result_from_json(e, m) if isinstance(e, dict)
                else ProtocolViolation("SendBatch", "result entry is not an object")
                for e, m in zip(entries, msgs, strict=True)]


class AsyncConsumer(AsyncAdmin):
    """A RocketMQ 5 simple consumer of one topic in one group: receive, ack, change_invisible."""

    SETTINGS: ClassVar[frozenset[str]] = AsyncAdmin.SETTINGS | {"group", "filter_expression", "batch_receive"}
    group = _Setting(_name)
    filter_expression = _Setting(_text)
    batch_receive = _Setting(_flag)

    def __init__(self, group: str, topic: str, *, filter_expression: str = "*", server: str | None = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, attempts: int = DEFAULT_ATTEMPTS, tls: bool = False,
                 root_certificates: bytes | None = None, tls_server_name: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, batch_receive: bool = True) -> None:
        super().__init__(server, timeout_ms=timeout_ms, tls=tls, root_certificates=root_certificates,
                         tls_server_name=tls_server_name, access_key=access_key, secret_key=secret_key,
                         attempts=attempts)
        self.group = group
        self.batch_receive = batch_receive
        self._batch_receive_missing = False
        """The server answered UNIMPLEMENTED to the batched receive: use the standard stream."""
        _name("topic", topic)
        self.topic = topic
        self.filter_expression = filter_expression
        self._queues: list[pb.MessageQueue] = []
        self._next_queue = 0

    async def __aenter__(self) -> AsyncConsumer:
        self._open()
        return self

    async def _queue(self) -> pb.MessageQueue:
        """Queues round-robin, as the official clients do (the route is fetched once)."""
        if not self._queues:
            endpoints = pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host=self._host, port=self._port)])
            resp = await self._rpc("QueryRoute", svc.QueryRouteRequest(topic=pb.Resource(name=self.topic),
                                                                        endpoints=endpoints))
            wire.check_status("QueryRoute", resp.status)
            self._queues = [q for q in resp.message_queues if q.permission in (pb.READ, pb.READ_WRITE)]
            if not self._queues:
                raise ProtocolViolation("QueryRoute", f"no readable queue for topic {self.topic!r}")
        q = self._queues[self._next_queue % len(self._queues)]
        self._next_queue += 1
        return q

    async def receive(self, max_messages: int = 32, *, invisible: timedelta | int | None = None,
                      wait: timedelta | int = 0) -> list[ReceivedMessage]:
        """Up to `max_messages` visible messages, hidden from others for `invisible` (the server's
        default if None) until acked. `wait` long-polls: the server holds the call that long when
        nothing is visible. Returns [] when nothing arrived."""
        return [m async for m in self.receive_stream(max_messages, invisible=invisible, wait=wait)]

    async def receive_stream(self, max_messages: int = 32, *, invisible: timedelta | int | None = None,
                             wait: timedelta | int = 0) -> AsyncIterator[ReceivedMessage]:
        """`receive`, yielding each message as its response arrives. With `batch_receive` (the
        default) a chronoq server sends the messages in one response (chronoq's ReceiveMessages),
        which costs both sides ~0.15 ms of CPU less per message than RocketMQ's ReceiveMessage;
        that call streams one response per message, each read in its own round trip, and is what
        this uses with `batch_receive=False` or against a server without the batched call."""
        if max_messages < 1:
            raise InvalidArgument("max_messages", max_messages, "at least 1")
        wait_ms = wire.duration_to_ms("wait", wait)
        req = svc.ReceiveMessageRequest(
            group=pb.Resource(name=self.group), message_queue=await self._queue(),
            filter_expression=pb.FilterExpression(type=pb.TAG, expression=self.filter_expression),
            batch_size=max_messages, auto_renew=False, long_polling_timeout=wire.ms_to_duration(wait_ms),
        )
        if invisible is not None:
            req.invisible_duration.CopyFrom(wire.ms_to_duration(wire.duration_to_ms("invisible", invisible)))
        deadline_ms = self.timeout_ms + wait_ms
        yielded = False
        # aclosing: a caller that stops early closes the call now (`_receive_once`'s finally), not
        # whenever the loop's finalizer gets to the abandoned generators.
        async with contextlib.aclosing(_attempts(self.attempts)) as attempts:
            async for attempt in attempts:
                try:
                    async with contextlib.aclosing(self._receive_once(req, deadline_ms)) as stream:
                        async for message in stream:
                            yielded = True
                            yield message
                    return
                except core.ChronoqError as e:
                    # Retried only before the first message: one already handed out is the caller's,
                    # and a retry would fetch other messages in its place.
                    if yielded or _give_up(e, attempt, self.attempts):
                        raise

    async def _receive_once(self, req: svc.ReceiveMessageRequest, deadline_ms: int) -> AsyncIterator[ReceivedMessage]:
        """One receive: chronoq's batched call when this consumer may use it, else (or once the
        server answered that it has no such call) the standard stream."""
        if self.batch_receive and not self._batch_receive_missing:
            try:
                async with contextlib.aclosing(self._receive_call(req, deadline_ms, batched=True)) as stream:
                    async for message in stream:
                        yield message
                return
            except _BatchReceiveMissing:
                self._batch_receive_missing = True  # a RocketMQ proxy, an older chronoq: for good
        async with contextlib.aclosing(self._receive_call(req, deadline_ms, batched=False)) as stream:
            async for message in stream:
                yield message

    async def _receive_call(self, req: svc.ReceiveMessageRequest, deadline_ms: int, *,
                            batched: bool) -> AsyncIterator[ReceivedMessage]:
        """ReceiveMessage (one response per message) or, `batched`, chronoq's ReceiveMessages
        (`chronoq.protocol.batch_receive`: the same request, the messages in one response)."""
        method = self._batch_receive_method() if batched else self._method("ReceiveMessage")
        call = method(req, timeout=deadline_ms / 1000, metadata=self._call_metadata())
        channel = self._channel
        try:
            async for resp in call:
                if resp.HasField("status"):
                    if resp.status.code == MESSAGE_NOT_FOUND:
                        continue
                    wire.check_status("ReceiveMessage", resp.status)
                if batched:
                    now_ms = self._clock.now_ms()
                    for m in resp.messages:
                        yield wire.decode_received(m, now_ms)
                elif resp.HasField("message"):
                    yield wire.decode_received(resp.message, self._clock.now_ms())
        except grpc.aio.AioRpcError as e:
            if batched and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _BatchReceiveMissing from None
            raise self._translate("ReceiveMessage", e, deadline_ms) from None
        except asyncio.CancelledError:
            if self._closed_under(channel):
                raise ClientClosed("ReceiveMessage", during=True) from None
            raise
        finally:
            call.cancel()  # a caller that stops early must not leave the stream open (no-op when done)

    def _batch_receive_method(self) -> Any:
        call = self._calls.get(batch_receive.PATH)
        if call is None:
            call = self._open().unary_stream(batch_receive.PATH, request_serializer=_serialize,
                                             response_deserializer=batch_receive.ReceiveMessagesResponse.FromString)
            self._calls[batch_receive.PATH] = call
        return call

    async def ack(self, msg: ReceivedMessage, *more: ReceivedMessage) -> None:
        """Acknowledge: the message(s) will not be delivered to this group again. Several messages
        go in one request; the server judges each, so if one handle is refused (expired, say) the
        others are still acked and the first refusal is raised.

        Retried (up to `attempts`) when the request failed retriably (the broker closing or
        restarting, the connection, a deadline): an ack is idempotent. Its in-flight state is
        stored, so a handle acks on a restarted broker as before; a handle acked already answers
        `InvalidReceiptHandle` (40013). So after an attempt whose outcome is unknown (no broker
        verdict came back: it may have acked), a 40013 for an entry counts as acked, not raised:
        the retry cannot tell that from a handle that was already invalid."""
        entries = [svc.AckMessageEntry(message_id=m.message_id, receipt_handle=m.receipt_handle) for m in (msg, *more)]
        req = svc.AckMessageRequest(group=pb.Resource(name=self.group), topic=pb.Resource(name=msg.topic),
                                    entries=entries)

        async def attempt(retrying_unknown: bool) -> None:
            resp = await self._rpc("AckMessage", req)
            forgiven = False
            for entry in resp.entries:
                if retrying_unknown and entry.status.code == INVALID_RECEIPT_HANDLE:
                    forgiven = True  # the top status then repeats 40013 (or says MULTIPLE_RESULTS)
                else:
                    wire.check_status("AckMessage", entry.status)
            if not forgiven:
                wire.check_status("AckMessage", resp.status)

        await _retrying(self.attempts, attempt)

    async def change_invisible(self, msg: ReceivedMessage, invisible: timedelta | int) -> str:
        """Hide the message for `invisible` from now (0 < invisible: extend; short: redeliver soon).
        Returns the new receipt handle and stores it in `msg`, so `ack(msg)` keeps working.

        Retried (up to `attempts`) only when the broker refused it (`BrokerClosed`, `Throttled`...:
        nothing changed). Not after a failure without a broker verdict (the connection, a deadline):
        that attempt may have replaced the handle, whose successor it never returned, and a retry
        with the old handle would only be refused as superseded; that failure is raised."""
        ms = wire.duration_to_ms("invisible", invisible)
        req = svc.ChangeInvisibleDurationRequest(
            group=pb.Resource(name=self.group), topic=pb.Resource(name=msg.topic),
            receipt_handle=msg.receipt_handle, invisible_duration=wire.ms_to_duration(ms), message_id=msg.message_id,
        )

        async def attempt(retrying_unknown: bool) -> svc.ChangeInvisibleDurationResponse:
            resp = await self._rpc("ChangeInvisibleDuration", req)
            wire.check_status("ChangeInvisibleDuration", resp.status)
            return resp

        resp = await _retrying(self.attempts, attempt, after_unknown=False)
        if not resp.receipt_handle:
            raise ProtocolViolation("ChangeInvisibleDuration", "no new receipt handle")
        msg.receipt_handle = resp.receipt_handle
        return resp.receipt_handle
