"""Failures that only the wire protocol can produce.

Theory of operation: a RocketMQ v2 request can be wrong in ways the in-process `Broker` API cannot
express (a missing field, an unknown enum value, an RPC chronoq does not serve). Those get their
own `BadRequest` subclasses here, with the protocol's status numbers, so the servicer converts
every failure, broker or protocol, at one point via `ChronoqError.code`. The broker's own errors
live in `chronoq.errors`.
"""

from __future__ import annotations

from chronoq.errors import BadRequest, MessageTypeMismatch


class MalformedRequest(BadRequest):
    """The request's bytes are not a valid protobuf message of the RPC's request type."""

    code = 40000

    def __init__(self, rpc: str, reason: str) -> None:
        super().__init__(f"malformed {rpc} request: {reason}", rpc=rpc, reason=reason)


class MissingField(BadRequest):
    code = 40000

    def __init__(self, field_name: str, rpc: str) -> None:
        super().__init__(f"{rpc}: field {field_name!r} is required", field=field_name, rpc=rpc)


class InvalidField(BadRequest):
    """A field holds a value outside what the protocol allows (negative duration, bad nanos, an
    unknown enum number, an oversize repeated field)."""

    code = 40000

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"invalid {field_name}: {reason}", field=field_name, reason=reason)


class MessageTypeConflict(MessageTypeMismatch):
    """The message's declared type contradicts its other fields (a delivery time on a message
    declared NORMAL, a message group on a DELAY message)."""

    def __init__(self, message_type: str, reason: str) -> None:
        super().__init__(f"message declared {message_type} but {reason}", message_type=message_type, reason=reason)


class InvalidPollingTime(BadRequest):
    code = 40018

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid long polling timeout: {reason}", reason=reason)


class Unsupported(BadRequest):
    """A protocol feature chronoq does not implement (transactions, SQL filters, LITE and
    PRIORITY messages, the pull-style RPCs)."""

    code = 50500

    def __init__(self, feature: str) -> None:
        super().__init__(f"chronoq does not support {feature}", feature=feature)
