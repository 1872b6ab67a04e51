"""chronoq's admin protocol: JSON request bodies -> arguments, results -> JSON reply bodies.

Theory of operation: RocketMQ v2 has no admin RPCs, so chronoq serves `chronoq.admin.v1.Admin`
beside it on the same port, with UTF-8 JSON objects as request and reply bodies (no .proto to
compile; any gRPC client can call it with identity serializers). This module is its codec, pure
like `requests`/`responses`: `parse_request` turns bytes into a dict or raises
`MalformedRequest`; the `arg_*` readers take one field with its type checked (text must be
valid Unicode, `check_text`: JSON can spell lone UTF-16 surrogates, which nothing downstream can
encode; integers the broker stores must fit 0..2^63-1, `arg_stored_int`); the `*_json`
functions turn model values into JSON-ready dicts. Every reply is `{"code": 20000, "message":
"OK", ...result}` or `error_json(err)`: `{"code", "message", "error": class name, "retriable"}`.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from chronoq.config import Config
from chronoq.errors import ChronoqError
from chronoq.model import (
    MessageType,
    OutgoingMessage,
    SendResult,
    StoredMessage,
    TimerStatus,
    TopicConfig,
    unencodable_at,
)
from chronoq.protocol.errors import InvalidField, MalformedRequest, MissingField
from chronoq.protocol.requests import decode_topic_name
from chronoq.recurring.records import Schedule

if TYPE_CHECKING:
    from chronoq.timer.engine import TimerEntry  # the type only: the wire codec does not import the timer room

SERVICE_NAME = "chronoq.admin.v1.Admin"
OK_CODE = 20000

_MISSING = object()


def parse_request(method: str, data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode("utf-8")) if data else {}
    except (ValueError, RecursionError) as exc:
        # ValueError covers UnicodeDecodeError, JSONDecodeError, and the plain ValueError of an
        # integer literal over Python's int-conversion limit (4,300 digits): all undecodable bodies.
        raise MalformedRequest(method, f"the body is not UTF-8 JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict):
        raise MalformedRequest(method, f"the body must be a JSON object, not {type(doc).__name__}")
    return doc


def encode_reply(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def encoded_size(doc: Any) -> int:
    """Bytes `doc` takes in a reply body (`encode_reply`'s separators; ASCII, so characters are bytes)."""
    return len(json.dumps(doc, separators=(",", ":")))


def ok_json(**result: Any) -> dict[str, Any]:
    return {"code": OK_CODE, "message": "OK", **result}


def error_json(err: ChronoqError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, "error": type(err).__name__, "retriable": err.retriable,
            "details": details_json(err)}


def details_json(err: ChronoqError) -> dict[str, Any]:
    """The error's values for programs (the limit, the topic, the offending value), as JSON: numbers,
    strings, booleans and null as they are, lists of them too; anything else as its text."""
    return {str(k): _json_value(v) for k, v in err.details.items()}


def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set, frozenset)):
        items = sorted(v, key=str) if isinstance(v, (set, frozenset)) else v
        return [_json_value(x) for x in items]
    return str(v)


def internal_json(err: BaseException) -> dict[str, Any]:
    return {"code": 50000, "message": f"internal error ({type(err).__name__}); see the server log",
            "error": "InternalError", "retriable": False}


# -- typed field readers -----------------------------------------------------------------------


def check_text(name: str, value: str) -> str:
    """`value` is valid Unicode text. JSON's `\\ud800` escapes decode to lone UTF-16 surrogates,
    which json.loads accepts and nothing can encode as UTF-8 (the record, the index, a log line):
    refused here, where the JSON is read, naming the field and where the surrogate is."""
    if (at := unencodable_at(value)) is not None:
        raise InvalidField(name, f"character {at} is a lone UTF-16 surrogate (U+{ord(value[at]):04X}); "
                                 "text must be valid Unicode")
    return value


def arg_str(doc: Mapping[str, Any], name: str, *, required: bool = True) -> str | None:
    value = doc.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise MissingField(name, "admin")
        return None
    if not isinstance(value, str):
        raise InvalidField(name, f"must be a string, not {type(value).__name__}")
    return check_text(name, value)


def arg_int(doc: Mapping[str, Any], name: str, *, required: bool = True) -> int | None:
    value = doc.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise MissingField(name, "admin")
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidField(name, f"must be an integer, not {type(value).__name__}")
    return value


def arg_bool(doc: Mapping[str, Any], name: str) -> bool:
    """An optional true/false field: absent or null is false; anything but a JSON boolean is refused."""
    value = doc.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidField(name, f"must be true or false, not {type(value).__name__}")
    return value


MAX_STORED_INT = 2**63 - 1
"""The largest time or position the broker stores (a signed 64-bit field on disk and in the index)."""


def show_int(value: int) -> str:
    """An integer for an error message: in full up to 30 digits, else its sign and digit count."""
    text = str(value)
    return text if len(text) <= 30 else f"{'-' if value < 0 else ''}a {len(text.lstrip('-'))}-digit number"


def arg_stored_int(doc: Mapping[str, Any], name: str, what: str) -> int:
    """A required integer the broker stores or indexes (a time in ms, a commit-log position):
    0 <= value <= MAX_STORED_INT, refused here with the field's name rather than met by the
    index's encoder. `what` says what the value is, for the error."""
    value = arg_int(doc, name) or 0  # required: arg_int raises MissingField rather than return None
    if not 0 <= value <= MAX_STORED_INT:
        raise InvalidField(name, f"{show_int(value)} is not a {what} in 0..2^63-1")
    return value


def arg_topic(doc: Mapping[str, Any], config: Config, name: str = "topic") -> str:
    return decode_topic_name(arg_str(doc, name) or "", config)


def arg_message_types(doc: Mapping[str, Any]) -> list[MessageType] | None:
    value = doc.get("message_types")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidField("message_types", "must be a list of strings")
    types = []
    for v in value:
        if v.upper() not in MessageType.__members__:
            raise InvalidField("message_types", f"{v!r} is not one of {', '.join(MessageType.__members__)}")
        types.append(MessageType[v.upper()])
    return types


def _str_list(doc: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = doc.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (check_text(name, value),)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidField(name, "must be a string or a list of strings")
    return tuple(check_text(f"{name}[{i}]", v) for i, v in enumerate(value))


def _str_map(doc: Mapping[str, Any], name: str) -> dict[str, str]:
    value = doc.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidField(name, "must be an object of string values")
    for k, v in value.items():
        check_text(f"{name} key", k)
        check_text(f"{name}[{k!r}]", v)
    return dict(value)


_PLAIN_TIMER_FIELDS = frozenset(("topic", "body_b64", "message_id", "deliver_at_ms"))


def _plain_timer_message(doc: dict[str, Any], config: Config) -> OutgoingMessage | None:
    """The usual entry (topic, body, id, due time, all well-typed) decoded without the general
    path's per-field readers; None sends anything else, errors included, down that path."""
    topic, b64, mid, due = doc.get("topic"), doc.get("body_b64"), doc.get("message_id"), doc.get("deliver_at_ms")
    if (type(topic) is not str or type(b64) is not str or (mid is not None and type(mid) is not str)
            or (due is not None and type(due) is not int)):
        return None
    try:
        body = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    return OutgoingMessage(topic=decode_topic_name(topic, config), body=body, message_id=mid or None,
                           deliver_at_ms=due)


def message_from_json(doc: Any, config: Config) -> OutgoingMessage:
    """One entry of SendBatch. Limits on size, keys and properties are the broker's (it checks
    them for every path); this checks the JSON's shape and the body's encoding."""
    if not isinstance(doc, dict):
        raise InvalidField("messages[]", f"must be an object, not {type(doc).__name__}")
    if doc.keys() <= _PLAIN_TIMER_FIELDS:
        fast = _plain_timer_message(doc, config)
        if fast is not None:
            return fast
    try:
        body = base64.b64decode(arg_str(doc, "body_b64") or "", validate=True)
    except binascii.Error as exc:
        raise InvalidField("body_b64", f"not base64: {exc}") from None
    return OutgoingMessage(
        topic=arg_topic(doc, config),
        body=body,
        message_id=arg_str(doc, "message_id", required=False) or None,
        tag=arg_str(doc, "tag", required=False) or None,
        keys=_str_list(doc, "keys"),
        properties=_str_map(doc, "properties"),
        deliver_at_ms=arg_int(doc, "deliver_at_ms", required=False),
        delay_ms=arg_int(doc, "delay_ms", required=False),
        delay_level=arg_int(doc, "delay_level", required=False),
        message_group=arg_str(doc, "message_group", required=False) or None,
    )


# -- results -> JSON -------------------------------------------------------------------------------


def topic_json(topic: TopicConfig) -> dict[str, Any]:
    return {"name": topic.name, "queue_count": topic.queue_count,
            "message_types": sorted((t.name for t in topic.message_types), key=lambda n: MessageType[n]),
            "created_ms": topic.created_ms}


def send_result_json(result: SendResult) -> dict[str, Any]:
    return {"message_id": result.message_id, "topic": result.topic, "queue_id": result.queue_id,
            "queue_offset": result.queue_offset, "deliver_at_ms": result.deliver_at_ms,
            "recall_handle": result.recall_handle, "duplicate": result.duplicate}


def timer_entry_json(entry: TimerEntry) -> dict[str, Any]:
    """One row of a SearchTimers reply: a pending timer."""
    return {"message_id": entry.message_id, "topic": entry.topic, "deliver_at_ms": entry.deliver_at_ms,
            "accepted_ms": entry.accepted_ms, "keys": list(entry.keys)}


def timer_status_json(status: TimerStatus) -> dict[str, Any]:
    return {"message_id": status.message_id, "topic": status.topic, "state": status.state.value,
            "deliver_at_ms": status.deliver_at_ms, "accepted_ms": status.accepted_ms,
            "fired_ms": status.fired_ms, "cancelled_ms": status.cancelled_ms}


def stored_message_json(msg: StoredMessage) -> dict[str, Any]:
    return {"message_id": msg.message_id, "topic": msg.topic, "queue_id": msg.queue_id,
            "queue_offset": msg.queue_offset, "tag": msg.tag, "keys": list(msg.keys),
            "properties": dict(msg.properties), "system_properties": dict(msg.system_properties),
            "body_b64": base64.b64encode(msg.body).decode("ascii"), "born_ms": msg.born_ms,
            "store_ms": msg.store_ms, "deliver_at_ms": msg.deliver_at_ms, "position": msg.position}


def schedule_json(s: Schedule, upcoming: list[int] | None = None) -> dict[str, Any]:
    """A recurring schedule for the admin service's replies (body as base64, times in ms)."""
    r = s.recurrence
    out = {"name": s.name, "topic": s.topic, "body_b64": base64.b64encode(s.body).decode(),
           "every_ms": r.every_ms, "cron": r.cron, "zone": r.zone, "start_ms": r.start_ms, "end_ms": r.end_ms,
           "catch_up": s.catch_up, "jitter_ms": s.jitter_ms, "limit": s.limit, "tag": s.tag,
           "properties": dict(s.properties), "paused": s.paused, "finished": s.finished, "version": s.version,
           "created_ms": s.created_ms, "updated_ms": s.updated_ms, "count": s.count,
           "pending_due_ms": s.pending[1] if s.pending else None, "last_error": s.last_error}
    if upcoming is not None:
        out["upcoming_ms"] = upcoming
    return out


def schedule_spec_from_json(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A CreateSchedule / UpdateSchedule request's schedule fields (absent: not given)."""
    spec: dict[str, Any] = {}
    if "body_b64" in doc:
        spec["body"] = _b64(doc, "body_b64")
    for name in ("every_ms", "start_ms", "end_ms", "jitter_ms", "limit"):
        if doc.get(name) is not None:
            spec[name] = arg_int(doc, name)
    for name in ("cron", "zone", "catch_up", "tag"):
        if doc.get(name) is not None:
            spec[name] = arg_str(doc, name)
    if doc.get("properties") is not None:
        spec["properties"] = _str_map(doc, "properties")
    return spec


def _b64(doc: Mapping[str, Any], name: str) -> bytes:
    value = doc.get(name)
    if not isinstance(value, str):
        raise InvalidField(name, "must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise InvalidField(name, "is not valid base64") from None
