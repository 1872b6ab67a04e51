"""Pure conversions between the SDK's values and what goes on the wire. No I/O, no clock.

Theory of operation: every function here takes what it needs (including `now_ms`) and returns a
value or raises a chronoq error, so the whole encoding can be tested without a server. Two
encodings meet here:

* `apache.rocketmq.v2` protobufs (the generated modules of `rocketmq-python-client`, reached
  through `chronoq.protocol.v2`, the one module that imports them) for send, receive, ack,
  change-invisible and recall;
* chronoq's admin service, whose request and reply bodies are JSON objects.

How the three kinds of timer travel (the RocketMQ protocol has a field for only one of them):

* `deliver_at` -> `system_properties.delivery_timestamp`, a proper `Timestamp` (seconds + nanos,
  as the Node client writes it; not the Python client's ms-in-the-seconds-field habit);
* `delay` -> the user property `TIMER_DELAY_MS`, so the *server's* clock adds the delay (a client
  whose clock is off by a minute still gets the delay it asked for);
* `delay_level` -> the user property `DELAY` (RocketMQ 4's name).

All three mark the message `DELAY`, the type a topic must accept for timer messages. The due
time the server fixed (a `delay` added to its clock, any time rounded up to its
`timer_precision_ms`) comes back in a SendBatch reply as `deliver_at_ms`; SendMessage's reply has
no field for it, but chronoq's recall handle encodes it, so a receipt reads it from there.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from json.encoder import encode_basestring_ascii
from typing import Any

from chronoq import errors as core
from chronoq.client.errors import InvalidArgument, ProtocolViolation, from_status
from chronoq.client.types import (
    QueueInfo,
    ReadResult,
    ReceivedMessage,
    SendReceipt,
    StoredRecord,
    TimerInfo,
    TopicDescription,
    TopicInfo,
)
from chronoq.errors import InvalidRecallHandle
from chronoq.model import (
    PROP_DELAY_LEVEL,
    PROP_TIMER_DELAY_MS,
    SYS_TIMER_OUT_MS,
    MessageType,
    OutgoingMessage,
    new_message_id,
)
from chronoq.protocol.requests import EPOCH_SECONDS_MIN
from chronoq.protocol.v2 import Duration, Timestamp, set_duration_ms, set_timestamp_ms
from chronoq.protocol.v2 import definition as pb
from chronoq.timer.recall import decode_recall_handle
from chronoq.validate import seconds_not_ms

ADMIN_OK = 20000
EARLIEST_DELIVERY_TIMESTAMP_MS = EPOCH_SECONDS_MIN * 1000
"""A `delivery_timestamp` before this (2001-09-09) is not a time the server reads (`protocol/requests.py`
refuses it, with the dates); the CLI's `--at` checks against it to say so before sending."""

# -- times ----------------------------------------------------------------------------------


def deliver_at_to_ms(deliver_at: datetime | int) -> int:
    """An absolute time as ms since the epoch. A naive datetime is refused: which zone it means
    is a guess the SDK will not make (the CLI, which talks to a person, reads it as local time)."""
    if isinstance(deliver_at, datetime):
        if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
            raise InvalidArgument("deliver_at", deliver_at, "a datetime needs a timezone (tzinfo)")
        return int(deliver_at.timestamp() * 1000)
    if isinstance(deliver_at, int) and not isinstance(deliver_at, bool):
        if deliver_at < 0:
            raise InvalidArgument("deliver_at", deliver_at, "ms since the epoch cannot be negative")
        seconds = seconds_not_ms(deliver_at)
        if seconds is not None:
            # Sent as it is, it would be refused as `delivery_timestamp.seconds=<ms // 1000>` (a
            # field the caller never wrote), or, through SendBatch, by the same rule server-side.
            raise InvalidArgument("deliver_at", deliver_at, seconds)
        return deliver_at
    raise InvalidArgument("deliver_at", deliver_at, "give a timezone-aware datetime or ms since the epoch (int)")


def duration_to_ms(name: str, value: timedelta | int) -> int:
    if isinstance(value, timedelta):
        return round(value.total_seconds() * 1000)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidArgument(name, value, "give a timedelta or a whole number of milliseconds (int)")


def ms_to_timestamp(ms: int) -> Timestamp:
    ts = Timestamp()
    set_timestamp_ms(ts, ms)
    return ts


def timestamp_to_ms(ts: Timestamp) -> int:
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def ms_to_duration(ms: int) -> Duration:
    """Negative values become 0 (`set_duration_ms`): the server then judges the zero."""
    d = Duration()
    set_duration_ms(d, ms)
    return d


def duration_pb_to_ms(d: Duration) -> int:
    return d.seconds * 1000 + d.nanos // 1_000_000


# -- outgoing -------------------------------------------------------------------------------


def outgoing(topic: str, body: bytes | str, *, deliver_at: datetime | int | None = None,
             delay: timedelta | int | None = None, delay_level: int | None = None, tag: str | None = None,
             keys: str | Iterable[str] = (), properties: Mapping[str, str] | None = None,
             message_id: str | None = None, message_group: str | None = None) -> OutgoingMessage:
    """Validate a send's arguments and build the message. Checks only what the client can know
    (types, one timer field at most); names, sizes and limits are the server's to judge."""
    if not isinstance(topic, str) or not topic:
        raise InvalidArgument("topic", topic, "a non-empty string is required")
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, bytes | bytearray | memoryview):
        raise InvalidArgument("body", type(body).__name__, "bytes or str is required")
    given = [name for name, v in (("deliver_at", deliver_at), ("delay", delay), ("delay_level", delay_level))
             if v is not None]
    if len(given) > 1:
        raise core.ConflictingDelivery(given)
    if delay_level is not None and (not isinstance(delay_level, int) or isinstance(delay_level, bool)):
        raise InvalidArgument("delay_level", delay_level, "an int (1-based level) is required")
    key_tuple = (keys,) if isinstance(keys, str) else tuple(keys)
    props = dict(properties or {})
    for k, v in props.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument("property", (k, v), "keys and values must be str")
    return OutgoingMessage(
        topic=topic, body=bytes(body), message_id=message_id or new_message_id(), tag=tag, keys=key_tuple,
        properties=props, message_group=message_group,
        deliver_at_ms=deliver_at_to_ms(deliver_at) if deliver_at is not None else None,
        delay_ms=duration_to_ms("delay", delay) if delay is not None else None,
        delay_level=delay_level,
    )



ENCODED_FIELD_OVERHEAD_BYTES = 32
"""Bound on what one text field costs beyond its own bytes: a protobuf tag and length (a map
entry's too), or a JSON name, quotes and separators."""
ENCODED_MESSAGE_OVERHEAD_BYTES = 512
"""Bound on what one message costs beyond its texts and body: its fixed fields (born time, type,
encoding, due time or delay) and their framing, in either encoding."""


def encoded_size(msg: OutgoingMessage, *, json_body: bool) -> int:
    """An upper bound on the bytes `msg` adds to a request: as `encode_message` makes it
    (`json_body=False`) or as `outgoing_to_json` does (`json_body=True`: the body in base64, text
    as JSON escapes it). Cheap (no encoding of the body), so `send_batch` can split by size."""
    texts = [msg.topic, msg.message_id or "", msg.tag or "", msg.message_group or "", *msg.keys,
             *msg.properties.keys(), *msg.properties.values()]
    if json_body:
        body = 4 * -(-len(msg.body) // 3)
        text = sum(len(encode_basestring_ascii(t)) for t in texts)
    else:
        body = len(msg.body)
        text = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return body + text + ENCODED_FIELD_OVERHEAD_BYTES * len(texts) + ENCODED_MESSAGE_OVERHEAD_BYTES


def _ts(ms: int) -> dict[str, int]:
    seconds, rest_ms = divmod(ms, 1000)
    return {"seconds": seconds, "nanos": rest_ms * 1_000_000}


def encode_message(msg: OutgoingMessage, now_ms: int) -> pb.Message:
    """An `apache.rocketmq.v2.Message` for SendMessage.

    Built by one constructor call from plain dicts: upb then fills the whole tree in C, about
    four times faster than setting fields one by one (this runs once per message sent)."""
    props = dict(msg.properties) if msg.properties else {}
    sysp: dict[str, object] = {
        "message_id": msg.message_id or new_message_id(), "body_encoding": pb.IDENTITY,
        "born_timestamp": _ts(msg.born_ms if msg.born_ms is not None else now_ms), "born_host": "127.0.0.1",
        "message_type": pb.DELAY,
    }
    if msg.deliver_at_ms is not None:
        sysp["delivery_timestamp"] = _ts(msg.deliver_at_ms)
    elif msg.delay_ms is not None:
        props[PROP_TIMER_DELAY_MS] = str(msg.delay_ms)
    elif msg.delay_level is not None:
        props[PROP_DELAY_LEVEL] = str(msg.delay_level)
    else:
        sysp["message_type"] = pb.FIFO if msg.message_group else pb.NORMAL
    if msg.tag:
        sysp["tag"] = msg.tag
    if msg.keys:
        sysp["keys"] = list(msg.keys)
    if msg.message_group:
        sysp["message_group"] = msg.message_group
    return pb.Message(topic={"name": msg.topic}, user_properties=props, system_properties=sysp, body=msg.body)


def check_status(method: str, status: pb.Status | None) -> None:
    if status is None or status.code == pb.CODE_UNSPECIFIED:
        raise ProtocolViolation(method, "no status code")
    if status.code not in (pb.OK, pb.MULTIPLE_RESULTS):
        raise from_status(int(status.code), status.message or pb.Code.Name(status.code))


def decode_send_entry(entry: Any, msg: OutgoingMessage) -> SendReceipt | core.ChronoqError:
    """One `SendResultEntry`: a receipt, or the error for that message."""
    if entry.status.code not in (pb.OK, pb.MULTIPLE_RESULTS):
        if entry.status.code == pb.CODE_UNSPECIFIED:
            return ProtocolViolation("SendMessage", "result entry has no status code")
        return from_status(int(entry.status.code), entry.status.message or pb.Code.Name(entry.status.code))
    handle = entry.recall_handle or None
    return SendReceipt(message_id=entry.message_id or (msg.message_id or ""), topic=msg.topic,
                       offset=int(entry.offset), recall_handle=handle,
                       deliver_at_ms=due_in_handle(handle) if handle else msg.deliver_at_ms)


def due_in_handle(handle: str) -> int | None:
    """The due time the server fixed, read from its recall handle (which encodes it; the codec
    is `chronoq.timer.recall`, pure). None for a handle that is not chronoq's (another
    RocketMQ 5 server's): SendMessage carries the due time nowhere else."""
    try:
        return decode_recall_handle(handle)[1]
    except InvalidRecallHandle:
        return None


# -- received -------------------------------------------------------------------------------


def _digest_ok(body: bytes, digest: Any) -> bool | None:
    expected = digest.checksum.strip()
    if not expected:
        return None
    if digest.type == pb.MD5:
        return hashlib.md5(body).hexdigest().upper() == expected.upper()
    if digest.type == pb.SHA1:
        return hashlib.sha1(body).hexdigest().upper() == expected.upper()
    if digest.type == pb.CRC32:
        crc = zlib.crc32(body)
        # Python's client writes %08X, Node's the decimal string: accept either.
        return expected.upper() == f"{crc:08X}" or expected == str(crc)
    return None


def decode_received(m: pb.Message, received_ms: int) -> ReceivedMessage:
    sp = m.system_properties
    if not sp.receipt_handle:
        raise ProtocolViolation("ReceiveMessage", f"message {sp.message_id!r} has no receipt handle")
    deliver_at_ms: int | None = None
    if sp.HasField("delivery_timestamp"):
        deliver_at_ms = timestamp_to_ms(sp.delivery_timestamp)
    elif SYS_TIMER_OUT_MS in m.user_properties and m.user_properties[SYS_TIMER_OUT_MS].isdigit():
        deliver_at_ms = int(m.user_properties[SYS_TIMER_OUT_MS])
    return ReceivedMessage(
        message_id=sp.message_id, topic=m.topic.name, body=bytes(m.body), tag=sp.tag, keys=tuple(sp.keys),
        properties=dict(m.user_properties), queue_id=int(sp.queue_id), queue_offset=int(sp.queue_offset),
        born_ms=timestamp_to_ms(sp.born_timestamp) if sp.HasField("born_timestamp") else None,
        store_ms=timestamp_to_ms(sp.store_timestamp) if sp.HasField("store_timestamp") else None,
        deliver_at_ms=deliver_at_ms, receipt_handle=sp.receipt_handle, delivery_attempt=int(sp.delivery_attempt),
        invisible_duration_ms=duration_pb_to_ms(sp.invisible_duration) if sp.HasField("invisible_duration") else None,
        received_ms=received_ms,
        body_digest_ok=_digest_ok(bytes(m.body), sp.body_digest) if sp.HasField("body_digest") else None,
    )


# -- admin JSON -----------------------------------------------------------------------------


def _error_from_json(doc: Mapping[str, Any], fallback_code: int) -> core.ChronoqError:
    code = doc.get("code")
    error = doc.get("error")
    retriable = doc.get("retriable")
    details = doc.get("details")
    return from_status(code if isinstance(code, int) and not isinstance(code, bool) else fallback_code,
                       str(doc.get("message", "")), error=error if isinstance(error, str) else None,
                       retriable=retriable if isinstance(retriable, bool) else None,
                       details=details if isinstance(details, dict) else None)


def error_from_json(doc: Mapping[str, Any]) -> core.ChronoqError:
    """An admin error object (`{"code", "message", "error", "retriable", "details"}`) as its exception."""
    return _error_from_json(doc, 50000)


def admin_result(method: str, reply: Any) -> dict[str, Any]:
    """The reply's fields, or the chronoq exception it describes."""
    code = reply.get("code") if isinstance(reply, dict) else None
    if not isinstance(code, int) or isinstance(code, bool):
        raise ProtocolViolation(method, "the reply is not a JSON object with an integer 'code'")
    if code != ADMIN_OK:
        raise _error_from_json(reply, code)
    return reply


def outgoing_to_json(msg: OutgoingMessage) -> dict[str, Any]:
    doc: dict[str, Any] = {"topic": msg.topic, "body_b64": base64.b64encode(msg.body).decode("ascii")}
    if msg.message_id:
        doc["message_id"] = msg.message_id
    if msg.tag:
        doc["tag"] = msg.tag
    if msg.keys:
        doc["keys"] = list(msg.keys)
    if msg.properties:
        doc["properties"] = dict(msg.properties)
    if msg.deliver_at_ms is not None:
        doc["deliver_at_ms"] = msg.deliver_at_ms
    if msg.delay_ms is not None:
        doc["delay_ms"] = msg.delay_ms
    if msg.delay_level is not None:
        doc["delay_level"] = msg.delay_level
    if msg.message_group:
        doc["message_group"] = msg.message_group
    return doc


def nonnegative_int(name: str, value: Any) -> int:
    """`value` if it is an int >= 0 (not a bool), else `InvalidArgument` before anything is sent."""
    if type(value) is not int or value < 0:
        raise InvalidArgument(name, value, "a whole number >= 0 is required")
    return value


def _opt_int(doc: Mapping[str, Any], name: str) -> int | None:
    v = doc.get(name)
    return int(v) if v is not None else None


def send_result_from_json(doc: Mapping[str, Any], msg: OutgoingMessage) -> SendReceipt | core.ChronoqError:
    if "error" in doc:
        return _error_from_json(doc["error"] if isinstance(doc["error"], Mapping) else {}, 50000)
    try:
        return SendReceipt(message_id=str(doc["message_id"]), topic=str(doc.get("topic", msg.topic)),
                           offset=int(doc["queue_offset"]), recall_handle=doc.get("recall_handle") or None,
                           deliver_at_ms=_opt_int(doc, "deliver_at_ms"), queue_id=_opt_int(doc, "queue_id"),
                           duplicate=bool(doc.get("duplicate", False)))
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        return ProtocolViolation("SendBatch", f"result entry lacks or garbles {e}")


def _shape(method: str, fn: Any, doc: Any) -> Any:
    try:
        return fn(doc)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ProtocolViolation(method, f"unexpected shape ({type(e).__name__}: {e})") from None


def topic_from_json(doc: Mapping[str, Any]) -> TopicInfo:
    return TopicInfo(name=str(doc["name"]), queue_count=int(doc["queue_count"]),
                     message_types=tuple(str(t) for t in doc.get("message_types", ())),
                     created_ms=int(doc.get("created_ms", 0)))


def topics_from_json(reply: Mapping[str, Any]) -> list[TopicInfo]:
    return _shape("ListTopics", lambda r: [topic_from_json(t) for t in r["topics"]], reply)


def description_from_json(reply: Mapping[str, Any]) -> TopicDescription:
    def build(r: Mapping[str, Any]) -> TopicDescription:
        queues = tuple(QueueInfo(int(q["queue_id"]), int(q["min_offset"]), int(q["max_offset"]))
                       for q in r.get("queues", ()))
        return TopicDescription(topic_from_json(r["topic"]), queues)
    return _shape("DescribeTopic", build, reply)


def statuses_from_json(reply: Mapping[str, Any]) -> list[TimerInfo]:
    def build(r: Mapping[str, Any]) -> list[TimerInfo]:
        return [TimerInfo(message_id=str(s["message_id"]), topic=str(s["topic"]), state=str(s["state"]),
                          deliver_at_ms=int(s["deliver_at_ms"]), accepted_ms=int(s["accepted_ms"]),
                          fired_ms=_opt_int(s, "fired_ms"), cancelled_ms=_opt_int(s, "cancelled_ms"))
                for s in r["statuses"]]
    return _shape("QueryMessage", build, reply)


def read_from_json(reply: Mapping[str, Any]) -> ReadResult:
    def build(r: Mapping[str, Any]) -> ReadResult:
        msgs = tuple(StoredRecord(
            message_id=str(m["message_id"]), topic=str(m["topic"]), queue_id=int(m["queue_id"]),
            queue_offset=int(m["queue_offset"]), tag=str(m.get("tag") or ""),
            keys=tuple(m.get("keys") or ()), properties=dict(m.get("properties") or {}),
            system_properties=dict(m.get("system_properties") or {}),
            body=base64.b64decode(m["body_b64"], validate=True), born_ms=int(m.get("born_ms", 0)),
            store_ms=int(m.get("store_ms", 0)), deliver_at_ms=_opt_int(m, "deliver_at_ms"),
            position=_opt_int(m, "position"),
        ) for m in r["messages"])
        return ReadResult(msgs, int(r["next_offset"]))
    return _shape("ReadMessages", build, reply)


def message_type_names(types: Iterable[str | MessageType]) -> list[str]:
    names = []
    for t in types:
        name = t.name if isinstance(t, MessageType) else str(t).upper()
        if name not in MessageType.__members__:
            raise InvalidArgument("message type", t, f"use one of {', '.join(MessageType.__members__)}")
        names.append(name)
    return names
