"""Decoding: RocketMQ v2 request messages -> chronoq commands.

Theory of operation: every `decode_*` function is pure (no I/O, no clock, no broker). It takes a
parsed protobuf request and the broker's `Config` (for the limits) and returns a small frozen
command, or raises a `chronoq.errors.ChronoqError` subclass naming the field and the rule it
broke. Nothing else may escape: the servicer relies on it to answer every hostile request with a
status, and `tests/protocol/test_protocol_fuzz.py` checks it on arbitrary requests. Checks that need the
broker's state (does the topic exist, is the receipt handle current) are the broker's job; checks
of shape and range happen here, so a request refused here reaches nothing below.

Decisions the protocol leaves open, and chronoq's rule for each:

* `delivery_timestamp` (see `delivery_time_ms`): the Python client writes whatever integer it is
  given into `Timestamp.seconds`, and its docs say milliseconds while its examples use seconds.
  chronoq reads `seconds` as epoch seconds when it lies in [1e9, 1e11) (2001-09-09 .. year 5138)
  and as epoch milliseconds when it lies in [1e12, 1e14) (the same dates in ms; `nanos` must then
  be 0). Anything else (a small number that looks like a relative delay, the gap between the two
  ranges, negative values) is refused with 40012 and a message saying which rule it broke.
* Delay levels travel as the message property `DELAY` (RocketMQ 4); the properties reach the
  broker untouched and the broker interprets them.
* `resource_namespace` must be empty: chronoq has one namespace.
* `SystemProperties.queue_id` is ignored on send (clients do not set it; the broker chooses the
  queue, by message group for FIFO).
* `ReceiveMessage` is served topic-wide: the queue id in the request is ignored, so a consumer
  long-polling one queue still gets a message that became due on another (the official clients
  round-robin queues; a per-queue poll would leave a due timer waiting a whole poll).
* A long-polling timeout above `max_long_poll_ms` is shortened, not refused: "no message" after
  the shorter wait is still a correct answer. A missing invisible duration without `auto_renew`
  means `default_invisible_duration_ms`; with `auto_renew` it is None (the server chooses).
* An ack may name at most `max_send_batch` entries (the same bound as a send).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from chronoq.config import Config
from chronoq.errors import (
    InvalidBatchSize,
    InvalidDeliveryTime,
    InvalidFilterExpression,
    InvalidInvisibleDuration,
    MessageTooLarge,
)
from chronoq.model import PRODUCER_TIMER_PROPERTIES, MessageType, OutgoingMessage
from chronoq.protocol.errors import (
    InvalidField,
    InvalidPollingTime,
    MessageTypeConflict,
    MissingField,
    Unsupported,
)
from chronoq.protocol.v2 import (
    NANOS_PER_MS,
    NANOS_PER_SECOND,
    WIRE_TO_MODEL_TYPE,
    WireValueError,
    definition,
    duration_ms,
    service,
    timestamp_parts,
)
from chronoq.timefmt import instant
from chronoq.validate import (
    EPOCH_MILLIS_END,
    EPOCH_MILLIS_MIN,
    EPOCH_SECONDS_END,
    EPOCH_SECONDS_MIN,
    check_group_name,
    check_keys_count,
    check_message_id,
    check_property_count,
    check_topic_name,
)

# -- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class RouteQuery:
    topic: str
    access_point: Endpoint | None
    """The address the client used to reach us, if it said (the first of `endpoints`)."""


@dataclass(frozen=True, slots=True)
class AssignmentQuery:
    topic: str
    group: str


@dataclass(frozen=True, slots=True)
class SendCommand:
    messages: tuple[OutgoingMessage, ...]


@dataclass(frozen=True, slots=True)
class ReceiveCommand:
    group: str
    topic: str
    filter_expression: str
    batch_size: int
    invisible_duration_ms: int | None
    """None only with `auto_renew`: the server chooses and renews."""
    auto_renew: bool
    long_polling_ms: int


@dataclass(frozen=True, slots=True)
class AckEntry:
    message_id: str
    receipt_handle: str


@dataclass(frozen=True, slots=True)
class AckCommand:
    group: str
    topic: str
    entries: tuple[AckEntry, ...]


@dataclass(frozen=True, slots=True)
class ChangeInvisibleCommand:
    group: str
    topic: str
    receipt_handle: str
    invisible_duration_ms: int
    message_id: str


@dataclass(frozen=True, slots=True)
class RecallCommand:
    topic: str
    recall_handle: str


@dataclass(frozen=True, slots=True)
class DeadLetterCommand:
    group: str
    topic: str
    receipt_handle: str
    message_id: str


# -- names -------------------------------------------------------------------------------------


def _resource_name(resource: definition.Resource, field_name: str, rpc: str) -> str:
    if resource.resource_namespace:
        raise Unsupported(f"namespaces ({field_name}.resource_namespace={resource.resource_namespace!r})")
    if not resource.name:
        raise MissingField(f"{field_name}.name", rpc)
    return resource.name


def decode_topic_name(name: str, config: Config) -> str:
    check_topic_name(name, config)
    return name


def decode_topic(resource: definition.Resource, config: Config, rpc: str, field_name: str = "topic") -> str:
    return decode_topic_name(_resource_name(resource, field_name, rpc), config)


def decode_group(resource: definition.Resource, config: Config, rpc: str) -> str:
    """Group names follow the topic rule (same characters, `max_topic_name_length`)."""
    name = _resource_name(resource, "group", rpc)
    check_group_name(name, config)
    return name


def _required_string(value: str, field_name: str, rpc: str) -> str:
    if not value:
        raise MissingField(field_name, rpc)
    return value


# -- timestamps and durations -------------------------------------------------------------------


def delivery_time_ms(seconds: int, nanos: int) -> int:
    """The absolute delivery time in ms from a `delivery_timestamp` (the rule in the module doc)."""
    if not 0 <= nanos < 1_000_000_000:
        raise InvalidDeliveryTime(f"delivery_timestamp.nanos {nanos} is outside [0, 1e9)", seconds=seconds,
                                  nanos=nanos)
    if EPOCH_SECONDS_MIN <= seconds < EPOCH_SECONDS_END:
        return seconds * 1000 + nanos // NANOS_PER_MS
    if EPOCH_MILLIS_MIN <= seconds < EPOCH_MILLIS_END:
        if nanos:
            raise InvalidDeliveryTime(
                f"delivery_timestamp.seconds={seconds} reads as epoch milliseconds ({instant(seconds)}), but "
                f"nanos={nanos} is set; give either epoch seconds with nanos, or epoch milliseconds alone",
                seconds=seconds, nanos=nanos)
        return seconds
    # Dates, not the raw ranges: a person reads "1970-01-01T00:00:01Z" and sees the mistake.
    raise InvalidDeliveryTime(
        f"delivery_timestamp.seconds={seconds} is not a date chronoq reads: as epoch seconds it is "
        f"{instant(seconds * 1000)}, as epoch milliseconds {instant(seconds)}; chronoq takes either between "
        f"{instant(EPOCH_SECONDS_MIN * 1000)} and {instant(EPOCH_SECONDS_END * 1000)} (an absolute time, "
        "not a delay)",
        seconds=seconds, nanos=nanos)


def _duration_field_ms(message: object, field_name: str) -> int:
    try:
        return duration_ms(getattr(message, field_name))
    except WireValueError as exc:
        raise InvalidField(field_name, str(exc)) from None


def _invisible_duration_ms(message: object, config: Config) -> int:
    value_ms = _duration_field_ms(message, "invisible_duration")
    if not config.min_invisible_duration_ms <= value_ms <= config.max_invisible_duration_ms:
        raise InvalidInvisibleDuration(value_ms, config.min_invisible_duration_ms, config.max_invisible_duration_ms)
    return value_ms


# -- messages ------------------------------------------------------------------------------------


def _decode_body(message: definition.Message, config: Config) -> bytes:
    encoding = message.system_properties.body_encoding
    limit_bytes = config.max_message_size_bytes
    if encoding in (definition.ENCODING_UNSPECIFIED, definition.IDENTITY):
        body = message.body
    elif encoding == definition.GZIP:
        # Bounded inflation: a small hostile payload must not expand past the message limit.
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            body = inflater.decompress(message.body, limit_bytes + 1)
        except zlib.error as exc:
            raise InvalidField("body", f"GZIP body does not inflate: {exc}") from None
        if len(body) > limit_bytes:
            raise MessageTooLarge(len(body), limit_bytes)
        if not inflater.eof:
            raise InvalidField("body", "GZIP body is truncated")
    else:
        raise InvalidField("system_properties.body_encoding", f"unknown encoding {encoding}")
    # An identity body's size is admission's rule (`validate.prepare`: the whole record counts),
    # the same for every door; gRPC's receive limit (`server_options`) bounds what arrives.
    return body


def _decode_message_type(system: definition.SystemProperties) -> MessageType | None:
    wire_type = system.message_type
    if wire_type == definition.MESSAGE_TYPE_UNSPECIFIED:
        return None
    if wire_type in (definition.LITE, definition.PRIORITY):
        return _unsupported(f"{definition.MessageType.Name(wire_type)} messages")
    if wire_type == definition.TRANSACTION:
        return _unsupported("transactional messages (EndTransaction)")
    model_type = WIRE_TO_MODEL_TYPE.get(wire_type)
    if model_type is None:
        raise InvalidField("system_properties.message_type", f"unknown message type {wire_type}")
    return model_type


def _unsupported(feature: str) -> MessageType:
    raise Unsupported(feature)


def _decode_born_ms(system: definition.SystemProperties) -> int | None:
    if not system.HasField("born_timestamp"):
        return None
    try:
        seconds, nanos = timestamp_parts(system.born_timestamp)
    except WireValueError as exc:
        raise InvalidField("system_properties.born_timestamp", str(exc)) from None
    if seconds < 0:
        raise InvalidField("system_properties.born_timestamp", f"{seconds} s is before the epoch")
    return seconds * 1000 + nanos // NANOS_PER_MS


def _check_type_consistency(model_type: MessageType | None, deliver_at_ms: int | None,
                            message_group: str | None, properties: dict[str, str]) -> None:
    name = model_type.name if model_type is not None else "UNSPECIFIED"
    if deliver_at_ms is not None and model_type not in (None, MessageType.DELAY):
        raise MessageTypeConflict(name, "it carries a delivery_timestamp")
    if deliver_at_ms is not None and message_group is not None:
        raise MessageTypeConflict(name, "a timer message cannot have a message group")
    if model_type is MessageType.DELAY and deliver_at_ms is None and not PRODUCER_TIMER_PROPERTIES & properties.keys():
        raise MessageTypeConflict(name, "it has neither a delivery_timestamp nor a timer property "
                                        f"({', '.join(sorted(PRODUCER_TIMER_PROPERTIES))})")
    if model_type is MessageType.FIFO and message_group is None:
        raise MessageTypeConflict(name, "it has no message group")


_USUAL_BODY_ENCODINGS = (definition.ENCODING_UNSPECIFIED, definition.IDENTITY)


def _decode_usual(message: definition.Message, config: Config, topics_ok: set[str]) -> OutgoingMessage | None:
    """The usual message, or None for anything else: a NORMAL message, or a DELAY one with an
    epoch-seconds `delivery_timestamp`, with an id, a topic already checked in this request
    (`topics_ok`), an identity body and nothing optional but a tag and a born time. The general
    path (`decode_message`'s rest) decides everything else, errors included, from scratch: this
    one only skips its helper calls, ~2 µs of a batched send's ~30 µs per message.
    `tests/protocol/test_protocol_fuzz.py` pins that both give the same answer, at each border of
    each condition here (`test_each_border_of_the_usual_path_decodes_as_the_general_path_does`)."""
    resource = message.topic
    name = resource.name
    system = message.system_properties
    if (name not in topics_ok or resource.resource_namespace or system.lite_topic or system.keys
            or message.user_properties or system.message_group
            or system.body_encoding not in _USUAL_BODY_ENCODINGS or system.HasField("priority")):
        return None
    message_id = system.message_id
    if not message_id:
        return None
    wire_type = system.message_type
    if wire_type == definition.DELAY:
        if not system.HasField("delivery_timestamp"):
            return None
        stamp = system.delivery_timestamp
        seconds, nanos = stamp.seconds, stamp.nanos
        if not (EPOCH_SECONDS_MIN <= seconds < EPOCH_SECONDS_END and 0 <= nanos < NANOS_PER_SECOND):
            return None
        deliver_at_ms: int | None = seconds * 1000 + nanos // NANOS_PER_MS
        model_type = MessageType.DELAY
    elif wire_type == definition.NORMAL and not system.HasField("delivery_timestamp"):
        deliver_at_ms = None
        model_type = MessageType.NORMAL
    else:
        return None
    born_ms = None
    if system.HasField("born_timestamp"):
        born = system.born_timestamp
        seconds, nanos = born.seconds, born.nanos
        if seconds < 0 or not 0 <= nanos < NANOS_PER_SECOND:
            return None
        born_ms = seconds * 1000 + nanos // NANOS_PER_MS
    check_message_id(message_id, config)
    return OutgoingMessage(name, message.body, message_id, system.tag or None, (), {}, None, None, born_ms,
                           model_type, deliver_at_ms)


def decode_message(message: definition.Message, config: Config,
                   topics_ok: set[str] | None = None) -> OutgoingMessage:
    """One `apache.rocketmq.v2.Message` from a SendMessage request -> an `OutgoingMessage`.

    The wire's own rules are checked here (namespaces, encodings, timestamps, types); the rules
    every door shares (names, ids, counts) through `chronoq.validate`'s checkers, the same
    functions admission runs, so a message is refused alike whichever door it came through.
    Fields are read only when set (an empty repeated field or map still costs a conversion):
    this runs for every message a producer sends. `topics_ok`: topic names this request has
    already checked (a request's messages usually name one topic); a name that passes its check
    here is added, and a message of one takes the usual message's path (`_decode_usual`)."""
    if topics_ok is not None:
        usual = _decode_usual(message, config, topics_ok)
        if usual is not None:
            return usual
    topic = decode_topic(message.topic, config, "SendMessage")
    if topics_ok is not None:
        topics_ok.add(topic)
    system = message.system_properties
    if system.lite_topic:
        raise Unsupported("lite topics")
    if system.HasField("priority"):
        raise Unsupported("PRIORITY messages")
    message_id = system.message_id
    if message_id:
        check_message_id(message_id, config)
    wire_keys = system.keys
    keys: tuple[str, ...] = ()
    if wire_keys:
        check_keys_count(len(wire_keys), config)
        keys = tuple(wire_keys)
    wire_properties = message.user_properties
    properties: dict[str, str] = {}
    if wire_properties:
        check_property_count(len(wire_properties), config)
        properties = dict(wire_properties)
    deliver_at_ms = None
    if system.HasField("delivery_timestamp"):
        stamp = system.delivery_timestamp
        deliver_at_ms = delivery_time_ms(stamp.seconds, stamp.nanos)
    message_group = system.message_group or None  # proto3 optional: unset and "" both read ""
    model_type = _decode_message_type(system)
    _check_type_consistency(model_type, deliver_at_ms, message_group, properties)
    return OutgoingMessage(
        topic=topic,
        body=_decode_body(message, config),
        message_id=message_id or None,
        tag=system.tag or None,
        keys=keys,
        properties=properties,
        message_group=message_group,
        born_ms=_decode_born_ms(system),
        message_type=model_type,
        deliver_at_ms=deliver_at_ms,
    )


# -- requests ------------------------------------------------------------------------------------


def decode_send(request: service.SendMessageRequest, config: Config) -> SendCommand:
    """All messages or none: one bad message refuses the whole request (nothing is stored)."""
    count = len(request.messages)
    if count == 0:
        raise MissingField("messages", "SendMessage")
    if count > config.max_send_batch:
        raise InvalidBatchSize(count, config.max_send_batch)
    topics_ok: set[str] = set()
    return SendCommand(tuple(decode_message(m, config, topics_ok) for m in request.messages))


def decode_route(request: service.QueryRouteRequest, config: Config) -> RouteQuery:
    topic = decode_topic(request.topic, config, "QueryRoute")
    access_point = None
    if request.endpoints.addresses:
        first = request.endpoints.addresses[0]
        if first.host and 0 < first.port < 65536:
            access_point = Endpoint(first.host, first.port)
    return RouteQuery(topic, access_point)


def decode_assignment(request: service.QueryAssignmentRequest, config: Config) -> AssignmentQuery:
    return AssignmentQuery(decode_topic(request.topic, config, "QueryAssignment"),
                           decode_group(request.group, config, "QueryAssignment"))


def _decode_filter(request: service.ReceiveMessageRequest) -> str:
    expression = request.filter_expression
    if expression.type == definition.SQL:
        raise Unsupported("SQL92 filter expressions")
    if expression.type not in (definition.FILTER_TYPE_UNSPECIFIED, definition.TAG):
        raise InvalidFilterExpression(expression.expression, f"unknown filter type {expression.type}")
    return expression.expression.strip() or "*"


def decode_receive(request: service.ReceiveMessageRequest, config: Config) -> ReceiveCommand:
    rpc = "ReceiveMessage"
    group = decode_group(request.group, config, rpc)
    topic = decode_topic(request.message_queue.topic, config, rpc, "message_queue.topic")
    if not 1 <= request.batch_size <= config.max_receive_batch:
        raise InvalidBatchSize(request.batch_size, config.max_receive_batch)
    invisible_ms: int | None
    if request.HasField("invisible_duration"):
        invisible_ms = _invisible_duration_ms(request, config)
    else:
        invisible_ms = None if request.auto_renew else config.default_invisible_duration_ms
    long_polling_ms = 0
    if request.HasField("long_polling_timeout"):
        try:
            long_polling_ms = duration_ms(request.long_polling_timeout)
        except WireValueError as exc:
            raise InvalidPollingTime(str(exc)) from None
    return ReceiveCommand(
        group=group, topic=topic, filter_expression=_decode_filter(request), batch_size=request.batch_size,
        invisible_duration_ms=invisible_ms, auto_renew=request.auto_renew,
        long_polling_ms=min(long_polling_ms, config.max_long_poll_ms),
    )


def decode_ack(request: service.AckMessageRequest, config: Config) -> AckCommand:
    rpc = "AckMessage"
    group = decode_group(request.group, config, rpc)
    topic = decode_topic(request.topic, config, rpc)
    if not request.entries:
        raise MissingField("entries", rpc)
    if len(request.entries) > config.max_send_batch:
        raise InvalidBatchSize(len(request.entries), config.max_send_batch)
    entries = tuple(AckEntry(e.message_id, _required_string(e.receipt_handle, "entries.receipt_handle", rpc))
                    for e in request.entries)
    return AckCommand(group, topic, entries)


def decode_change_invisible(request: service.ChangeInvisibleDurationRequest,
                            config: Config) -> ChangeInvisibleCommand:
    rpc = "ChangeInvisibleDuration"
    group = decode_group(request.group, config, rpc)
    topic = decode_topic(request.topic, config, rpc)
    handle = _required_string(request.receipt_handle, "receipt_handle", rpc)
    if not request.HasField("invisible_duration"):
        raise MissingField("invisible_duration", rpc)
    return ChangeInvisibleCommand(group, topic, handle, _invisible_duration_ms(request, config),
                                  request.message_id)


def decode_recall(request: service.RecallMessageRequest, config: Config) -> RecallCommand:
    rpc = "RecallMessage"
    return RecallCommand(decode_topic(request.topic, config, rpc),
                         _required_string(request.recall_handle, "recall_handle", rpc))


def decode_dead_letter(request: service.ForwardMessageToDeadLetterQueueRequest,
                       config: Config) -> DeadLetterCommand:
    rpc = "ForwardMessageToDeadLetterQueue"
    return DeadLetterCommand(decode_group(request.group, config, rpc), decode_topic(request.topic, config, rpc),
                             _required_string(request.receipt_handle, "receipt_handle", rpc), request.message_id)
