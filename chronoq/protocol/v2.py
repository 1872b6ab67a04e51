"""The RocketMQ v2 protobuf modules, and the few conversions every codec needs.

Theory of operation: chronoq does not compile or copy the `apache.rocketmq.v2` protos; it uses the
generated modules shipped in the PyPI package `rocketmq-python-client` (pinned in pyproject). This
module is the only place that imports them, so a change of source touches one file (only the
message modules: the `*_pb2_grpc` stubs import grpc, which the pure codecs must not). The helpers
here convert protobuf `Duration`/`Timestamp` values to chronoq's integer milliseconds and back,
and refuse values a well-behaved client never sends (negative durations, nanos outside
[0, 1e9)), because `Duration`/`Timestamp` are plain int fields on the wire and a hostile peer
can put anything there.

Importing `rocketmq.grpc_protocol` imports the `rocketmq` package, which creates
`~/logs/rocketmq_python`; that is the price of not copying the generated files. The same protos
cannot be loaded twice in one process, so the official clients used by the interop tests run in
their own processes.
"""

from __future__ import annotations

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from rocketmq.grpc_protocol import definition_pb2 as definition
from rocketmq.grpc_protocol import service_pb2 as service

from chronoq.model import MessageType

__all__ = ["Code", "Duration", "Timestamp", "definition", "service"]

Code = definition.Code
"""The `apache.rocketmq.v2.Code` enum; chronoq's error codes use the same numbers."""

SERVICE_NAME = "apache.rocketmq.v2.MessagingService"
NANOS_PER_MS = 1_000_000
NANOS_PER_SECOND = 1_000_000_000
MAX_DURATION_SECONDS = 315_576_000_000
"""Protobuf's own bound on `Duration.seconds` (10,000 years)."""

# chronoq's model uses the protocol's numbers for the four types it supports (NORMAL=1 ...
# TRANSACTION=4); LITE and PRIORITY exist on the wire but not in chronoq.
WIRE_TO_MODEL_TYPE = {int(t): t for t in MessageType}
MODEL_TO_WIRE_TYPE = {t: int(t) for t in MessageType}


class WireValueError(ValueError):
    """A protobuf field holds a value that no valid request holds. Codecs turn it into the
    specific `ChronoqError` of the field it came from."""


def duration_ms(duration: Duration) -> int:
    """A non-negative protobuf Duration in whole milliseconds (sub-millisecond parts dropped)."""
    seconds, nanos = duration.seconds, duration.nanos
    if seconds < 0 or nanos < 0:
        raise WireValueError(f"negative duration ({seconds} s, {nanos} ns)")
    if nanos >= NANOS_PER_SECOND:
        raise WireValueError(f"duration nanos {nanos} is outside [0, {NANOS_PER_SECOND})")
    if seconds > MAX_DURATION_SECONDS:
        raise WireValueError(f"duration {seconds} s exceeds protobuf's limit of {MAX_DURATION_SECONDS} s")
    return seconds * 1000 + nanos // NANOS_PER_MS


def set_duration_ms(target: Duration, value_ms: int) -> None:
    """Fill a Duration message in place from milliseconds (>= 0)."""
    value_ms = max(0, value_ms)
    target.seconds = value_ms // 1000
    target.nanos = (value_ms % 1000) * NANOS_PER_MS


def timestamp_parts(timestamp: Timestamp) -> tuple[int, int]:
    """(seconds, nanos) of a Timestamp, nanos checked; seconds may be anything (see callers)."""
    seconds, nanos = timestamp.seconds, timestamp.nanos
    if not 0 <= nanos < NANOS_PER_SECOND:
        raise WireValueError(f"timestamp nanos {nanos} is outside [0, {NANOS_PER_SECOND})")
    return seconds, nanos


def set_timestamp_ms(target: Timestamp, value_ms: int) -> None:
    target.seconds = value_ms // 1000
    target.nanos = (value_ms % 1000) * NANOS_PER_MS
