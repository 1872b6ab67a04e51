"""Client-side errors, and the one place a server status becomes a chronoq exception.

Theory of operation: a remote failure is raised as the same `chronoq.errors` class the broker
raised when the client can tell which one it was: the admin service names the class
(`"error": "TopicNotFound"`), the RocketMQ protocol only gives a code, and a code that maps to
exactly one class gets that class. Otherwise the client raises `RemoteError` with the code. Either
way the exception carries the server's `code`, `message` and `retriable` flag, so callers can
catch by class (`except TopicNotFound`) or decide generically (`if err.retriable: retry`).

Failures that never reached a broker verdict (the connection, a deadline, a malformed reply)
are client-only classes here; they subclass `ChronoqError` too, so one `except ChronoqError`
covers everything the SDK raises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from chronoq import errors as core
from chronoq.client.types import BatchOutcome
from chronoq.protocol import errors as protocol_errors
from chronoq.timefmt import byte_size, duration

OK_CODES = frozenset({20000, 30000})
"""RocketMQ v2: OK and MULTIPLE_RESULTS both mean success."""
MESSAGE_NOT_FOUND = 40401
"""On ReceiveMessage this is not an error: nothing was available before the long poll ended."""
INVALID_RECEIPT_HANDLE = 40013
"""On AckMessage retried after an unknown outcome: the handle may be gone because the first try acked it."""


class ClientError(core.ChronoqError):
    """Something went wrong on the client's side of the wire."""

    code = 0


class RemoteError(core.ChronoqError):
    """The server answered with a status the client has no more specific class for."""

    def __init__(self, code: int, message: str, retriable: bool = False, error: str | None = None) -> None:
        super().__init__(f"[{code}{' ' + error if error else ''}] {message}", server_message=message, error=error)
        self.code = code
        self.retriable = retriable


class ServerUnavailable(ClientError):
    """The server could not be reached (connection refused, reset, TLS failure). Retriable, except
    when the TLS handshake failed on something the next attempt meets again (an untrusted
    certificate, TLS against a plain server): `retriable=False` then, and the hint says what to fix."""

    retriable = True

    def __init__(self, server: str, detail: str, hint: str | None = None, *, retriable: bool = True) -> None:
        super().__init__(f"cannot reach chronoq server at {server}: {detail}" + (f" ({hint})" if hint else ""),
                         server=server, detail=detail, hint=hint)
        self.retriable = retriable


class RequestTimedOut(ClientError):
    """No answer within the request deadline; the request may or may not have taken effect."""

    retriable = True

    def __init__(self, method: str, timeout_ms: int) -> None:
        super().__init__(f"{method} got no answer within {duration(timeout_ms)}", method=method, timeout_ms=timeout_ms)


class RequestTooLarge(ClientError):
    """gRPC refused the request as larger than the server's message limit (RESOURCE_EXHAUSTED
    "larger than max"; the server's limit is about 2 x its `max_message_size_bytes` + 1 MiB). Not
    retriable: the same request is as large next time. `send_batch` keeps each request within
    the producer's `max_batch_bytes`; lower that for a server with a smaller limit."""

    def __init__(self, method: str, detail: str) -> None:
        sizes = _GRPC_SIZES.search(detail)  # gRPC's own "(20000086 vs. 9437184)", said in bytes here
        said = f"{byte_size(int(sizes[1]))}, above its limit of {byte_size(int(sizes[2]))}" if sizes else detail
        advice = ("one message may be at most the server's max_message_size_bytes (4 MiB unless set)"
                  if method == "SendMessage" else
                  "send fewer or smaller messages per request (AsyncProducer(max_batch_bytes=...))")
        super().__init__(f"{method} refused: the request is larger than the server accepts ({said}); {advice}",
                         method=method, detail=detail)


_GRPC_SIZES = re.compile(r"\((\d+) vs\. (\d+)\)")


class ClientClosed(ClientError, RuntimeError):
    """The client was closed before `call` (a method name) started (`during` False), or while it
    was waiting (another thread or task called `close()`). Whether a send in flight took
    effect is unknown, as after a timeout. Also a RuntimeError, which a call on a closed blocking
    client raised before this class existed."""

    def __init__(self, call: str, during: bool) -> None:
        text = (f"{call} was interrupted: the chronoq client was closed while it waited" if during
                else f"{call}: this chronoq client is closed")
        super().__init__(text, call=call, during=during)


class ProtocolViolation(ClientError):
    """The server's reply broke the protocol (missing status, undecodable JSON, wrong shape)."""

    def __init__(self, method: str, reason: str) -> None:
        super().__init__(f"malformed reply to {method}: {reason}", method=method, reason=reason)


class InvalidArgument(ClientError, ValueError):
    """A call's arguments were refused before anything was sent."""

    def __init__(self, name: str, value: Any, reason: str) -> None:
        super().__init__(f"invalid {name} {value!r}: {reason}", name=name, value=value, reason=reason)


class BatchSendError(ClientError):
    """Some messages of a batch were refused; `outcome.results` has a receipt or an error for each,
    in request order (the stored ones are stored: the server decides per message)."""

    def __init__(self, outcome: BatchOutcome) -> None:
        failed = outcome.errors
        first_index, first = failed[0]
        super().__init__(
            f"{len(failed)} of {len(outcome.results)} messages refused; first (#{first_index}): {first}",
            failed=len(failed), total=len(outcome.results),
        )
        self.outcome = outcome
        self.retriable = all(getattr(err, "retriable", False) for _, err in failed)


def _classes_by_code() -> dict[int, type[core.ChronoqError]]:
    """For each status code, the most specific class every failure with that code shares: the
    class itself when one class owns the code (40402 -> TopicNotFound), their common base when
    several do (40012 -> InvalidDeliveryTime; 42800 -> BadRequest). Built from the classes, so a
    new error class is mapped without touching this module."""
    owners: dict[int, list[type[core.ChronoqError]]] = {}
    for module in (core, protocol_errors):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, core.ChronoqError) and obj is not core.ChronoqError:
                owners.setdefault(obj.code, []).append(obj)
    table: dict[int, type[core.ChronoqError]] = {}
    for code, classes in owners.items():
        common = next(base for base in classes[0].__mro__ if all(issubclass(c, base) for c in classes))
        if common is not core.ChronoqError and issubclass(common, core.ChronoqError):
            table[code] = common
    return table


_CLASS_BY_CODE = _classes_by_code()


def _core_class(name: str | None) -> type[core.ChronoqError] | None:
    if not name:
        return None
    for module in (core, protocol_errors):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, core.ChronoqError):
            return cls
    return None


def from_status(code: int, message: str, *, error: str | None = None, retriable: bool | None = None,
                details: Mapping[str, Any] | None = None) -> core.ChronoqError:
    """The exception for a non-OK server status. `error` is the class name the admin service
    sends, `retriable` the flag it sends and `details` the error's values (the RocketMQ protocol
    has none of them): they become the exception's `details`, beside `server_code`."""
    values = {str(k): v for k, v in (details or {}).items() if k not in ("message", "server_code")}
    cls = _core_class(error) or _CLASS_BY_CODE.get(code)
    if cls is None:
        flag = retriable if retriable is not None else code in (42900, 50002, 50400, 40800)
        remote = RemoteError(code, message, flag, error)
        remote.details.update({k: v for k, v in values.items() if k not in remote.details})
        return remote
    # Rebuild without the class's own __init__: its arguments (topic=, limit=...) are spread
    # over the server's message text, which already names the value and the limit; the values
    # themselves come back as `details` when the server sent them (the admin service does).
    err = cls.__new__(cls)
    core.ChronoqError.__init__(err, message, **values, server_code=code)
    err.code = code
    err.retriable = cls.retriable if retriable is None else retriable
    return err
