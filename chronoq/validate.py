"""Admission: turn a producer's `OutgoingMessage` into a `PreparedMessage`, or refuse it.

Theory of operation: every rule a message must satisfy is checked here, at the edge, before
anything is written; a refusal raises the specific `ChronoqError` naming the value and the limit,
and changes nothing. Pure functions of (message, topic, config, now_ms): no I/O, no clock.
Timer requests (deliver-at, delay, delay level, or their RocketMQ properties) are resolved to one
absolute due time here; the broker then routes the message to the timer or schedule topic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chronoq.config import Config
from chronoq.errors import (
    ChronoqError,
    ConflictingDelivery,
    DeliveryTimeTooFar,
    InvalidDelayLevel,
    InvalidDeliveryTime,
    InvalidGroupName,
    InvalidKeys,
    InvalidMessageId,
    InvalidProperty,
    InvalidTag,
    InvalidTopicName,
    MessageBodyEmpty,
    MessageTooLarge,
    NegativeDelay,
    PropertiesTooLarge,
    ReservedProperty,
    SystemTopicForbidden,
    TimerDisabled,
)
from chronoq.model import (
    PROP_DELAY_LEVEL,
    PROP_TIMER_DELAY_MS,
    PROP_TIMER_DELAY_SEC,
    PROP_TIMER_DELIVER_MS,
    RESERVED_PREFIX,
    RESERVED_PROPERTIES,
    SYS_MESSAGE_GROUP,
    MessageType,
    OutgoingMessage,
    dlq_topic,
    is_system_topic,
    new_message_id,
    topic_name_problem,
    unencodable_at,
)
from chronoq.store.groups import LEGACY_SCHEDULE_GROUP
from chronoq.store.messagestore import PreparedMessage
from chronoq.store.record import HEADER_SIZE, MAX_U16, encode_keys, encode_properties
from chronoq.timefmt import MAX_EPOCH_MS, instant
from chronoq.timer.levels import DelayLevels

EPOCH_SECONDS_MIN = 1_000_000_000
EPOCH_SECONDS_END = 100_000_000_000
"""Epoch seconds from 2001-09-09 up to year 5138: as milliseconds the same numbers are 1970-01-12 ..
1973-03-03, a due time nobody means. A deliver-at in ms that falls here is epoch seconds by mistake
(`check_deliver_at_unit`); gRPC's `delivery_timestamp.seconds` in this range is read as seconds."""
EPOCH_MILLIS_MIN = EPOCH_SECONDS_MIN * 1000
EPOCH_MILLIS_END = EPOCH_SECONDS_END * 1000


@dataclass(slots=True)
class TimerRequest:
    deliver_at_ms: int
    """The absolute due time, rounded up to the timer precision (never early)."""
    delay_level: int | None = None
    """Set for RocketMQ 4 delay-level messages (after clamping to the table's top)."""


def check_topic_name(topic: str, config: Config) -> None:
    """The topic-name rule, for every door (gRPC, admin JSON, in process). An over-long name is
    quoted only in part: the error goes back to whoever sent it, and into logs."""
    if not isinstance(topic, str):
        raise InvalidTopicName(str(topic), "not a string")
    problem = topic_name_problem(topic, config.max_topic_name_length)
    if problem:
        raise InvalidTopicName(topic[: config.max_topic_name_length + 16], problem)


def check_group_name(group: str, config: Config) -> None:
    """Consumer groups follow the topic rule (same characters), short enough that the group's
    dead-letter topic (`%DLQ%<group>`) is a valid topic name too; `%SCHEDULE%` is the broker's
    own (the delay-level progress of old data directories, cleared at every open)."""
    prefix = len(dlq_topic(""))
    limit = config.max_topic_name_length - prefix
    problem = topic_name_problem(group, config.max_topic_name_length) if isinstance(group, str) else "not a string"
    if not problem and len(group) > limit:
        problem = (f"{len(group)} characters; the limit is {limit}: max_topic_name_length "
                   f"({config.max_topic_name_length}) less the {prefix} of its dead-letter topic's prefix")
    if not problem and group == LEGACY_SCHEDULE_GROUP:
        problem = "reserved for the broker"
    if problem:
        raise InvalidGroupName(str(group)[: config.max_topic_name_length + 16], problem)


def check_message_id(message_id: object, config: Config) -> str:
    """The message-id rule, for every door: 1..`max_message_id_length` characters of printable
    ASCII without spaces. Ids are echoed in logs, recall and receipt handles and the admin JSON,
    and RocketMQ's clients make them from hex digits; one rule, so that an id stored through one
    door is never refused through another."""
    if not isinstance(message_id, str):
        raise InvalidMessageId(repr(message_id)[:64], "must be text")
    if not message_id:
        raise InvalidMessageId(message_id, "empty")
    if len(message_id) > config.max_message_id_length:
        raise InvalidMessageId(message_id[:64], f"{len(message_id)} characters; the limit "
                                                f"(max_message_id_length) is {config.max_message_id_length}")
    if not _message_id_chars_ok(message_id):
        raise InvalidMessageId(message_id, "only printable ASCII without spaces is allowed")
    return message_id


def _message_id_chars_ok(message_id: str) -> bool:
    # isascii and isprintable are C loops; together with "no space" they are exactly 0x21..0x7E.
    return message_id.isascii() and message_id.isprintable() and " " not in message_id


def check_keys_count(count: int, config: Config) -> None:
    if count > config.max_keys_count:
        raise InvalidKeys(f"{count} keys; the limit (max_keys_count) is {config.max_keys_count}")


def check_key(key: object) -> str:
    """One message key as a lookup names it (admin QueryMessage by key): the rule every stored key
    follows (`_check_keys`), so a key no message can carry is refused rather than looked up. An
    over-long key is quoted only in part (the error goes back to whoever sent it, and into logs)."""
    if not isinstance(key, str):
        raise InvalidKeys(f"a key must be text, not {type(key).__name__}")
    if not key or not _text_ok(key[:MAX_U16 + 1]):
        raise InvalidKeys(f"key {key[:64]!r} is empty, has control characters or is not valid UTF-8")
    size = len(encode_keys((key,)))
    if size > MAX_U16:
        raise InvalidKeys(f"key {key[:64]!r}... takes {size} bytes; the record format allows {MAX_U16}")
    return key


def check_property_count(count: int, config: Config) -> None:
    if count > config.max_property_count:
        raise PropertiesTooLarge("property count", count, config.max_property_count)


def _text_ok(value: str) -> bool:
    """No control characters, and encodable as UTF-8 (`unencodable_at`: a lone surrogate used
    to fail the record's encoding, after admission)."""
    return "\x00" not in value and all(c >= " " for c in value) and unencodable_at(value) is None


def _parse_int_property(key: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidProperty(key, f"must be an integer, not {raw!r}") from None


def _whole_ms(name: str, value: object) -> int:
    # A float or a string would be stored as the due time's text and fail to parse when the
    # record is indexed, long after the producer was told "accepted": refuse it here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidDeliveryTime(f"{name} must be a whole number of milliseconds, not {value!r}",
                                  **{name: repr(value)})
    return value


def resolve_timer(msg: OutgoingMessage, config: Config, now_ms: int, levels: DelayLevels) -> TimerRequest | None:
    props = msg.properties
    if not props and msg.delay_ms is None and msg.delay_level is None:
        # The usual shapes, answered without collecting the alternatives: no timer at all, or
        # an absolute due time alone.
        if msg.deliver_at_ms is None:
            return None
        deliver_at_ms = _whole_ms("deliver_at_ms", msg.deliver_at_ms)
        if not config.timer_wheel_enable:
            raise TimerDisabled()
        return _timer_at(deliver_at_ms, config, now_ms)
    given: dict[str, int] = {}
    if msg.deliver_at_ms is not None:
        given["deliver_at_ms"] = _whole_ms("deliver_at_ms", msg.deliver_at_ms)
    if msg.delay_ms is not None:
        given["delay_ms"] = _whole_ms("delay_ms", msg.delay_ms)
    if msg.delay_level is not None:
        given["delay_level"] = msg.delay_level
    if PROP_TIMER_DELIVER_MS in props:
        given[PROP_TIMER_DELIVER_MS] = _parse_int_property(PROP_TIMER_DELIVER_MS, props[PROP_TIMER_DELIVER_MS])
    if PROP_TIMER_DELAY_MS in props:
        given[PROP_TIMER_DELAY_MS] = _parse_int_property(PROP_TIMER_DELAY_MS, props[PROP_TIMER_DELAY_MS])
    if PROP_TIMER_DELAY_SEC in props:
        given[PROP_TIMER_DELAY_SEC] = _parse_int_property(PROP_TIMER_DELAY_SEC, props[PROP_TIMER_DELAY_SEC]) * 1000
    if PROP_DELAY_LEVEL in props:
        given[PROP_DELAY_LEVEL] = _parse_int_property(PROP_DELAY_LEVEL, props[PROP_DELAY_LEVEL])
    if not given:
        return None
    if not config.timer_wheel_enable:
        # Refused here, at admission, so that nothing (not even an auto-created topic) is left behind.
        raise TimerDisabled()
    if len(given) > 1:
        raise ConflictingDelivery(sorted(given))
    (kind, value), = given.items()
    level: int | None = None
    if kind in ("delay_level", PROP_DELAY_LEVEL):
        # Two doors, two rules. The RocketMQ 4 `DELAY` property clamps a level above the table's
        # top to the top, exactly as RocketMQ's broker does, so a client written for a longer
        # table keeps working. chronoq's own `delay_level` field (in-process API, admin
        # SendBatch, Spark, CLI) names the level explicitly, so a level outside 1..max is a
        # mistake worth reporting (InvalidDelayLevel) rather than a delay the caller did not ask for.
        if kind == "delay_level" and type(value) is int and value > levels.max_level:
            raise InvalidDelayLevel(value, levels.max_level, levels.levels_ms[-1])
        level = levels.clamp(value)  # < 1 (or not an int) is refused through either door
        deliver_at_ms = now_ms + levels.delay_ms(level)
    elif kind in ("deliver_at_ms", PROP_TIMER_DELIVER_MS):
        return _timer_at(value, config, now_ms, kind)
    else:
        return _timer_after(value, config, now_ms)
    return _timer_due(deliver_at_ms, level, config, now_ms)


def _timer_after(delay_ms: int, config: Config, now_ms: int) -> TimerRequest:
    """A delay in ms from `now_ms`, checked against the limits and rounded up to the precision."""
    if delay_ms < 0:
        raise NegativeDelay(delay_ms)
    return _timer_due(now_ms + delay_ms, None, config, now_ms)


def _timer_due(deliver_at_ms: int, level: int | None, config: Config, now_ms: int) -> TimerRequest:
    if deliver_at_ms - now_ms > config.timer_max_delay_ms:
        raise DeliveryTimeTooFar(deliver_at_ms, now_ms, config.timer_max_delay_ms)
    precision = config.timer_precision_ms
    deliver_at_ms = -(-deliver_at_ms // precision) * precision  # round up: never early
    return TimerRequest(deliver_at_ms, level)


def _check_tag(tag: str, config: Config) -> None:
    if len(tag) > config.max_tag_length:
        raise InvalidTag(tag, f"{len(tag)} characters; the limit (max_tag_length) is {config.max_tag_length}")
    if not _text_ok(tag) or "|" in tag or not tag.strip():
        raise InvalidTag(tag, "may not contain '|', control characters, or be blank")


def _check_keys(keys: tuple[str, ...], config: Config) -> int:
    """The keys' encoded size, or the error naming the first rule they break."""
    check_keys_count(len(keys), config)
    for key in keys:
        if not isinstance(key, str) or not key or not _text_ok(key):
            raise InvalidKeys(f"key {key!r} is empty or has control characters")
    keys_size = len(encode_keys(keys))
    if keys_size > MAX_U16:
        raise InvalidKeys(f"the keys take {keys_size} bytes; the record format allows {MAX_U16}")
    return keys_size


def _check_properties(given: Mapping[str, str], config: Config) -> tuple[dict[str, str], int]:
    """A copy of the user's properties and their encoded size, or the error naming the first rule broken."""
    props: dict[str, str] = {}
    for k, v in given.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or not _text_ok(k) or "\x00" in v \
                or unencodable_at(v) is not None:
            raise InvalidProperty(ascii(k), "keys must be non-empty text and values text without NUL, "
                                            "both valid UTF-8")
        if k in RESERVED_PROPERTIES or k.startswith(RESERVED_PREFIX):
            raise ReservedProperty(k)
        props[k] = v
    check_property_count(len(props), config)
    props_size = sum(len(k.encode()) + len(v.encode()) + 6 for k, v in props.items())
    if props_size > config.max_properties_size_bytes:
        raise PropertiesTooLarge("encoded size in bytes", props_size, config.max_properties_size_bytes)
    return props, props_size


def seconds_not_ms(deliver_at_ms: int) -> str | None:
    """Why a deliver-at in ms is plausibly epoch SECONDS (`EPOCH_SECONDS_MIN` .. `EPOCH_SECONDS_END`),
    or None: read as ms it is a moment in 1970-1973, which would make the message due at once,
    silently. The SDK (`chronoq.client.wire`) and the CLI's `--at` say the same before sending."""
    if EPOCH_SECONDS_MIN <= deliver_at_ms < EPOCH_SECONDS_END:
        return (f"looks like seconds since the epoch ({instant(deliver_at_ms * 1000)} as seconds, "
                f"{instant(deliver_at_ms)} as ms); give milliseconds ({deliver_at_ms * 1000})")
    return None


def check_deliver_at_unit(deliver_at_ms: int, name: str = "deliver_at_ms") -> None:
    reason = seconds_not_ms(deliver_at_ms)
    if reason is not None:
        raise InvalidDeliveryTime(f"{name}={deliver_at_ms} {reason}", **{name: deliver_at_ms})


def _timer_at(deliver_at_ms: int, config: Config, now_ms: int, name: str = "deliver_at_ms") -> TimerRequest:
    """An absolute due time, checked against the limits and rounded up to the precision."""
    if deliver_at_ms < 0:
        raise InvalidDeliveryTime(f"deliver-at {deliver_at_ms} ms is before the epoch (1970-01-01T00:00:00Z)",
                                  deliver_at_ms=deliver_at_ms)
    check_deliver_at_unit(deliver_at_ms, name)
    if deliver_at_ms - now_ms > config.timer_max_delay_ms:
        raise DeliveryTimeTooFar(deliver_at_ms, now_ms, config.timer_max_delay_ms)
    precision = config.timer_precision_ms
    return TimerRequest(-(-deliver_at_ms // precision) * precision)  # round up: never early


def prepare(msg: OutgoingMessage, config: Config, now_ms: int, levels: DelayLevels) -> tuple[
        PreparedMessage, TimerRequest | None]:
    """Validate `msg` and resolve its timer request. Topic existence and message-type acceptance
    are the broker's business (they depend on the topic table)."""
    check_topic_name(msg.topic, config)
    if is_system_topic(msg.topic):
        raise SystemTopicForbidden(msg.topic)
    body = msg.body
    if type(body) is not bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise InvalidProperty("body", f"must be bytes, not {type(body).__name__}")
        body = bytes(body)
    if not body:
        raise MessageBodyEmpty()
    message_id = new_message_id() if msg.message_id is None else check_message_id(msg.message_id, config)
    # The empty tag, keys and properties are the usual case: checked by truth value, so an
    # ordinary message costs no loop (this runs for every message a producer sends).
    tag = msg.tag or ""
    if tag:
        _check_tag(tag, config)
    keys: tuple[str, ...] = ()
    keys_size = 0
    if msg.keys:
        keys = tuple(msg.keys)
        keys_size = _check_keys(keys, config)
    props: dict[str, str] = {}
    props_size = 0
    if msg.properties:
        props, props_size = _check_properties(msg.properties, config)
    timer = resolve_timer(msg, config, now_ms, levels)
    if props:
        # Timer properties become system properties; they stay out of the user's property map.
        for k in (PROP_TIMER_DELIVER_MS, PROP_TIMER_DELAY_MS, PROP_TIMER_DELAY_SEC, PROP_DELAY_LEVEL):
            props.pop(k, None)
    group = msg.message_group
    if group is not None and not isinstance(group, str):
        raise InvalidProperty("message_group", f"must be text, not {type(group).__name__}")
    if group and not _text_ok(group):
        raise InvalidProperty("message_group", "may not contain control characters, and must be valid UTF-8")
    born_ms = msg.born_ms
    if born_ms is None:
        born_ms = now_ms
    elif isinstance(born_ms, bool) or not isinstance(born_ms, int) or not 0 <= born_ms <= MAX_EPOCH_MS:
        # Up to the year 9999: a born time in microseconds (or ms in a seconds field) is past
        # it, and no date can hold it (the Spark reader failed on it, for good).
        raise InvalidProperty("born_ms", f"must be ms since the epoch up to {MAX_EPOCH_MS} (9999-12-31), "
                                         f"not {born_ms!r}")
    # Encoded bytes, not characters: a multi-byte tag counts what it takes on disk (ids and topic
    # names are ASCII by their rules, so their lengths are their sizes). The message group is
    # stored as a system property, so it counts too.
    size = (HEADER_SIZE + len(body) + props_size + len(message_id) + len(msg.topic)
            + (len(tag.encode()) if tag else 0) + keys_size
            + (len(encode_properties({SYS_MESSAGE_GROUP: group})) if group else 0)
            + 256)  # 256: room for the system properties we add
    if size > config.max_message_size_bytes:
        raise MessageTooLarge(size, config.max_message_size_bytes)
    if msg.message_type is not None:
        mtype = msg.message_type
    elif timer is not None:
        mtype = MessageType.DELAY
    elif group:
        mtype = MessageType.FIFO
    else:
        mtype = MessageType.NORMAL
    # Positional: this runs for every message a producer sends.
    prepared = PreparedMessage(msg.topic, message_id, mtype, body, born_ms, tag, keys, props,
                               {SYS_MESSAGE_GROUP: group} if group else {}, msg.queue_id, group or None)
    return prepared, timer


def prepare_columns(topic: str, ids: Sequence[str | None], bodies: Sequence[bytes], config: Config, now_ms: int,
                    levels: DelayLevels, *, due_kind: str | None = None, due: Sequence[int] | None = None,
                    tags: Sequence[str] | None = None, keys: Sequence[tuple[str, ...]] | None = None,
                    properties: Sequence[Mapping[str, str]] | None = None) -> list[Any]:
    """`prepare` for every row of a bulk send (`protocol/bulk.py`): each row's (PreparedMessage,
    TimerRequest | None), or the `ChronoqError` `prepare` raises for the same message, in its
    slot. `due_kind` names the due column: "deliver_at_ms", "delay_ms" or None.

    The same rules, the same errors. A batch whose rows all have the usual shape (bytes body, text
    id, no tag, keys or properties) and all pass is judged a column at a time (`_usual_columns`:
    the common case of a bulk send, a dozen calls a row saved). Otherwise a row of the usual shape
    is checked by the very checkers `prepare` calls, in its order, with what is the same for every
    row (the topic's name and kind, whether timers are on) judged once; any other row goes through
    `prepare` itself."""
    n = len(ids)
    if not len(bodies) == n or (due is not None and len(due) != n):
        raise ValueError(f"columns of unequal length: {n} ids, {len(bodies)} bodies")
    if due_kind not in (None, "deliver_at_ms", "delay_ms") or (due_kind is None) != (due is None):
        raise ValueError(f"due kind {due_kind!r} and the due column disagree")
    try:
        check_topic_name(topic, config)
        if is_system_topic(topic):
            raise SystemTopicForbidden(topic)
    except ChronoqError as e:
        return [e] * n
    fixed_size = HEADER_SIZE + len(topic) + 256  # as `prepare` counts: 256 for the system properties
    whole = _usual_columns(topic, fixed_size, ids, bodies, config, now_ms, due_kind, due, tags, keys, properties)
    if whole is not None:
        return whole
    out: list[Any] = [None] * n
    timers_on = config.timer_wheel_enable
    max_size = config.max_message_size_bytes
    mtype = MessageType.NORMAL if due_kind is None else MessageType.DELAY
    for i in range(n):
        body, message_id = bodies[i], ids[i]
        if (type(body) is not bytes or type(message_id) is not str or (tags is not None and tags[i])
                or (keys is not None and keys[i]) or (properties is not None and properties[i])):
            msg = OutgoingMessage(topic=topic, body=body, message_id=message_id,
                                  tag=tags[i] if tags is not None else None,
                                  keys=keys[i] if keys is not None else (),
                                  properties=properties[i] if properties is not None else {},
                                  deliver_at_ms=due[i] if due is not None and due_kind == "deliver_at_ms" else None,
                                  delay_ms=due[i] if due is not None and due_kind == "delay_ms" else None)
            try:
                out[i] = prepare(msg, config, now_ms, levels)
            except ChronoqError as e:
                out[i] = e
            continue
        try:
            if not body:
                raise MessageBodyEmpty()
            check_message_id(message_id, config)
            timer = None
            if due is not None:
                if due_kind == "deliver_at_ms":
                    at = _whole_ms("deliver_at_ms", due[i])
                    if not timers_on:
                        raise TimerDisabled()
                    timer = _timer_at(at, config, now_ms)
                else:
                    delay = _whole_ms("delay_ms", due[i])
                    if not timers_on:
                        raise TimerDisabled()
                    timer = _timer_after(delay, config, now_ms)
            size = fixed_size + len(body) + len(message_id)
            if size > max_size:
                raise MessageTooLarge(size, max_size)
        except ChronoqError as e:
            out[i] = e
            continue
        out[i] = (PreparedMessage(topic, message_id, mtype, body, now_ms, "", (), {}, {}, None, None), timer)
    return out


def _usual_columns(topic: str, fixed_size: int, ids: Sequence[Any], bodies: Sequence[Any], config: Config,
                   now_ms: int, due_kind: str | None, due: Sequence[Any] | None, tags: Sequence[Any] | None,
                   keys: Sequence[Any] | None, properties: Sequence[Any] | None) -> list[Any] | None:
    """`prepare_columns`' answer when every row has the usual shape and passes every rule, judged
    a column at a time: C loops over whole columns (the lengths' min and max, the ids joined into
    one text, the due times' range) in place of a dozen calls a row. None when any row falls
    outside; the row-by-row loop then names each row's own error. Each check is the row rule's,
    widened to the column: a rule every row passes is passed by the column's extremes (`min`,
    `max`) and by the concatenation of its texts (`isascii`, `isprintable` and "no space" hold of
    a joined text exactly when they hold of every part)."""
    if (tags is not None and any(tags)) or (keys is not None and any(keys)) \
            or (properties is not None and any(properties)):
        return None
    if set(map(type, bodies)) != {bytes} or set(map(type, ids)) != {str} or not all(bodies):
        return None
    id_lengths = list(map(len, ids))
    if min(id_lengths) < 1 or max(id_lengths) > config.max_message_id_length \
            or not _message_id_chars_ok("".join(ids)):
        return None
    largest = max(map(int.__add__, map(len, bodies), id_lengths))
    if fixed_size + largest > config.max_message_size_bytes:
        return None
    if due is None:
        return [(PreparedMessage(topic, message_id, MessageType.NORMAL, body, now_ms, "", (), {}, {}, None, None),
                 None) for message_id, body in zip(ids, bodies, strict=True)]
    if not config.timer_wheel_enable or set(map(type, due)) != {int}:  # `_whole_ms`: bool is not int here
        return None
    lowest, highest = min(due), max(due)
    if due_kind == "deliver_at_ms":
        if lowest < 0 or highest - now_ms > config.timer_max_delay_ms:
            return None
        if lowest < EPOCH_SECONDS_END and highest >= EPOCH_SECONDS_MIN \
                and any(EPOCH_SECONDS_MIN <= at < EPOCH_SECONDS_END for at in due):  # `seconds_not_ms`
            return None
        due_at: Sequence[int] = due
    else:
        if lowest < 0 or highest > config.timer_max_delay_ms:  # `_timer_after`, `_timer_due`
            return None
        due_at = [now_ms + delay for delay in due]
    precision = config.timer_precision_ms
    if precision != 1:
        due_at = [-(-at // precision) * precision for at in due_at]  # round up: never early
    return [(PreparedMessage(topic, message_id, MessageType.DELAY, body, now_ms, "", (), {}, {}, None, None),
             TimerRequest(at)) for message_id, body, at in zip(ids, bodies, due_at, strict=True)]
