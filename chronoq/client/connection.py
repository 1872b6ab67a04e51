"""A client's connection to one chronoq server: the channel, its calls, credentials, settings.

Theory of operation: `Connection` is the base of every async client (`AsyncAdmin`, and through it
`AsyncProducer` and `AsyncConsumer`). It owns one `grpc.aio` channel and makes every call through
generic callables (a path, a serializer, a parser), so the generated `*_pb2_grpc` stubs are not
needed: `_rpc` for a RocketMQ MessagingService call, `_admin` for one of chronoq's admin service,
whose bodies are JSON. Every gRPC failure is translated at one point (`_translate`) into the
`chronoq.errors` / `chronoq.client.errors` class that names it.

The channel is opened lazily on first use, inside the running loop (grpc.aio binds a channel to
the loop that created it), and closed by `close()` / `async with`. A call still waiting when
another task closes the client (a long-polling receive, say) raises `ClientClosed` (grpc.aio
itself raises a bare CancelledError there); a cancellation of the caller's own task stays a
CancelledError. TLS: `tls=True` trusts the system's CAs, `root_certificates=` (PEM bytes) a CA
of your own, such as a self-signed server certificate; `tls_server_name=` checks the certificate
against another name than the host in `server` (an address reached by IP whose certificate names
a host). A client holds no background tasks: nothing outlives a call. The SDK, unlike the broker
core, may read the real clock: it stamps born and received times with the wall clock as it is
(`WallClock`), as any client does (the step-proof `SystemClock` is for the broker's decisions;
its timeouts are gRPC deadlines).

Credentials: with an access key and secret key (arguments, or `CHRONOQ_ACCESS_KEY` and
`CHRONOQ_SECRET_KEY`), every call carries RocketMQ ACL 2.0's signed headers
(`chronoq.protocol.signature`), made afresh per call since they carry the time.

Settings a program may change between calls (`timeout_ms`, `attempts`, and the subclasses' own)
are `Setting` descriptors: every write, the constructor's included, is checked.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

import grpc

from chronoq import __version__, envvars
from chronoq import errors as core
from chronoq.client import wire
from chronoq.client.errors import (
    ClientClosed,
    InvalidArgument,
    ProtocolViolation,
    RemoteError,
    RequestTimedOut,
    RequestTooLarge,
    ServerUnavailable,
)
from chronoq.client.retry import DEFAULT_ATTEMPTS, retrying
from chronoq.clock import WallClock
from chronoq.protocol import signature
from chronoq.protocol.v2 import SERVICE_NAME
from chronoq.protocol.v2 import service as svc

DEFAULT_SERVER = "127.0.0.1:8081"
SERVER_ENV = envvars.SERVER
ACCESS_KEY_ENV = envvars.ACCESS_KEY
SECRET_KEY_ENV = envvars.SECRET_KEY
ADMIN_SERVICE = "chronoq.admin.v1.Admin"
DEFAULT_TIMEOUT_MS = 10_000
MAX_GRPC_MESSAGE_BYTES = 256 * 1024 * 1024

_client_seq = itertools.count(1)

_GRPC_RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


class Setting:
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


def check_at_least_one(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(name, value, "a whole number, at least 1")


def check_batch_via(name: str, value: Any) -> None:
    if value not in ("grpc", "admin"):
        raise InvalidArgument(name, value, "'grpc' (SendMessage) or 'admin' (SendBatch)")


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidArgument(name, value, "True or False")


def check_text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidArgument(name, value, "a str is required")


def check_name(name: str, value: Any) -> None:
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
    if any(marker in detail for marker in _HTTP1_SERVER):
        return ("is it the console/metrics port, --http-port? The gRPC port is the one `chronoq serve` prints "
                "first, \"chronoq serving on HOST:PORT\": 8081 unless --port sets it")
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


_TLS_MISMATCH = ("CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER")
"""gRPC's detail text for a TLS handshake that fails the same way every time: the server's
certificate is not trusted, or the server does not speak TLS."""
_HTTP1_SERVER = ("Trying to connect an http1.x server", "Expected SETTINGS frame")
"""gRPC's detail text for a port that answered the HTTP/2 preface with HTTP/1.x (an HTTP server:
chronoq's console and /metrics port, say). It answers the same way every time."""
NOT_GRPC_DETAIL = "this port answers HTTP/1.1, not gRPC"


def unavailable_retriable(detail: str) -> bool:
    """Whether an UNAVAILABLE may go away by itself. A refused or reset connection may (the server
    restarting); a TLS mismatch will not, until the client is given the CA certificate or told not
    to use TLS, so retrying it only delays the hint."""
    return not any(marker in detail for marker in (*_TLS_MISMATCH, *_HTTP1_SERVER))


def _json_bytes(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def serialize(message: Any) -> bytes:
    return message.SerializeToString()


def _json_reply(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        # A reply that is not JSON is the server's protocol error; say so at the call.
        return None


class Connection:
    """One server, one channel (module docstring); the base of every async client."""

    SETTINGS: ClassVar[frozenset[str]] = frozenset({"timeout_ms", "attempts"})
    """What may be changed after construction (each call reads it afresh). The rest (`server`,
    TLS, credentials, a consumer's `topic`) is fixed when the client is made."""
    timeout_ms = Setting(check_at_least_one)
    attempts = Setting(check_at_least_one)

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
            call = factory(f"/{SERVICE_NAME}/{method}", request_serializer=serialize,
                           response_deserializer=response_type.FromString)
            self._calls[method] = call
        return call

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        self._calls.clear()
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
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
            if any(marker in detail for marker in _HTTP1_SERVER):  # gRPC's own words are an HTTP/2 parse error
                return ServerUnavailable(self.server, NOT_GRPC_DETAIL, unavailable_hint(detail, self._tls),
                                         retriable=False)
            return ServerUnavailable(self.server, detail, unavailable_hint(detail, self._tls),
                                     retriable=unavailable_retriable(detail))
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
        return await self._unary(method, self._method(method), request, timeout_ms)

    async def _unary(self, method: str, call: Any, request: Any, timeout_ms: int | None) -> Any:
        """One unary call with the client's deadline and credentials, its gRPC error translated, and a
        cancel caused by this client's own close reported as `ClientClosed`."""
        deadline_ms = timeout_ms or self.timeout_ms
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
        return wire.admin_result(method, await self._unary(method, call, body, timeout_ms))

    async def _admin_bytes(self, method: str, body: bytes, *, timeout_ms: int | None = None) -> bytes:
        """An admin call whose request and reply are bytes of their own format (SendColumns,
        `chronoq.protocol.bulk`); a reply that is an admin JSON object is its error, raised."""
        key = f"admin-bytes:{method}"
        call = self._calls.get(key)
        if call is None:
            call = self._open().unary_unary(f"/{ADMIN_SERVICE}/{method}")
            self._calls[key] = call
        raw = await self._unary(method, call, body, timeout_ms)
        if raw[:1] == b"{":
            wire.admin_result(method, _json_reply(raw))
            raise ProtocolViolation(method, "a JSON reply that is not an error")
        return raw

    async def _admin_retried(self, method: str, body: Mapping[str, Any], *, after_unknown: bool) -> dict[str, Any]:
        """`_admin` under the retry policy (`attempts`): a read is retried after any retriable
        failure; a call that changes something (`after_unknown=False`) only when the broker
        refused it, since after a lost reply it may have done its work, and its repeat would
        answer "exists" or "not pending" for what succeeded."""
        return await retrying(self.attempts, lambda _unknown: self._admin(method, body), after_unknown=after_unknown)
