"""Every failure a user can act on, one class each.

Theory of operation: an error names the value that was wrong and the limit it broke, so a
message like `MessageTooLarge(size_bytes=5000000, limit_bytes=4194304)` needs no log to explain.
`code` is the status a client sees on the wire: chronoq uses the numbers of the RocketMQ v2
protocol (`apache.rocketmq.v2.Code`) so the gRPC layer converts errors at one point, without a
table. `retriable` tells a client whether the same request may succeed later unchanged.

Messages are for people, `details` for programs: a time or a duration in a message is written
as a date or a duration (`chronoq.timefmt`: "2026-11-23T09:00:00Z", "3h12m"), while `details`
keeps the raw milliseconds the caller sent or the config holds.

Errors split (as h11 does) into the caller's fault (`BadRequest` and children: the request broke
a rule, nothing was stored) and the broker's state (`ServerError`: damage, shutdown).

Every error a client can see is defined here (or, for request-decoding faults, in
`chronoq/protocol/errors.py`), so the SDK finds each by the class name the admin service sends
and by code (`chronoq/client/errors.py`). Codes are the RocketMQ v2 `Code` enum's. Over the RocketMQ
protocol a client sees only the code; classes that share a code share a base class, and that base
is what a code-only client gets. `tests/client/test_error_codes.py` checks this table against
the classes, and every code against the enum.

A server error whose retry is safe never shares 50001 with one whose retry is not: over the
RocketMQ protocol the code is all a client gets, so `retriable` must follow from it. The broker's
own failures that a retry can outlive (it is closing or restarting: `BrokerClosed`; it could not
make a write durable and must be restarted: `FlushFailed`) have codes of their own, 50002 and
50401 (the code Apache's proxy answers for a broker's FLUSH_DISK_TIMEOUT), and chronoq's SDK
retries them; 50001 is left to failures no retry mends. The official clients (their
StatusChecker / MessagingResultChecker) raise InternalErrorException for 50000-50002 and
ProxyTimeoutException for 50400-50402, and their producers resend on any failure, with the same
message id, up to their max attempts (Java, Node, Go, C#: at once, TOO_MANY_REQUESTS after a
backoff; Python: any failure but TOO_MANY_REQUESTS). So for them BrokerClosed stays an
InternalErrorException, and FlushFailed becomes the ProxyTimeoutException they raise for a
RocketMQ broker's flush timeout:

    code  RocketMQ name                        a code-only client gets (the classes raised)
    40000 BAD_REQUEST                          BadRequest (InvalidBatchSize, InvalidQueueId, InvalidQueueCount,
                                               TopicExists, InvalidRecallHandle, MalformedRequest,
                                               MissingField, InvalidField, ConsoleInputError,
                                               RecallTopicMismatch, TimerIdAmbiguous, InvalidSchedule,
                                               ScheduleNeverFires, UnknownTimeZone, ScheduleIntervalTooShort,
                                               ScheduleExists, ScheduleNotFound, TooManySchedules: RocketMQ
                                               has no code for these)
    40002 ILLEGAL_TOPIC                        InvalidTopicName (SystemTopicForbidden)
    40003 ILLEGAL_CONSUMER_GROUP               InvalidGroupName
    40004 ILLEGAL_MESSAGE_TAG                  InvalidTag
    40005 ILLEGAL_MESSAGE_KEY                  InvalidKeys
    40007 ILLEGAL_MESSAGE_PROPERTY_KEY         InvalidProperty (ReservedProperty)
    40009 ILLEGAL_MESSAGE_ID                   InvalidMessageId
    40010 ILLEGAL_FILTER_EXPRESSION            InvalidFilterExpression
    40011 ILLEGAL_INVISIBLE_TIME               InvalidInvisibleDuration
    40012 ILLEGAL_DELIVERY_TIME                InvalidDeliveryTime (DeliveryTimeTooFar, NegativeDelay,
                                               InvalidDelayLevel, ConflictingDelivery)
    40013 INVALID_RECEIPT_HANDLE               InvalidReceiptHandle
    40014 MESSAGE_PROPERTY_CONFLICT_WITH_TYPE  MessageTypeMismatch (MessageTypeNotAccepted, MessageTypeConflict)
    40016 MESSAGE_CORRUPTED                    CorruptRecord
    40018 ILLEGAL_POLLING_TIME                 InvalidPollingTime
    40019 ILLEGAL_OFFSET                       InvalidOffset
    40100 UNAUTHORIZED                         Unauthorized (every cause: `details["cause"]`)
    40300 FORBIDDEN                            Forbidden (a permission; TimerDisabled)
    40401 MESSAGE_NOT_FOUND                    TimerNotFound
    40402 TOPIC_NOT_FOUND                      TopicNotFound (TopicNameTooNear)
    41301 MESSAGE_BODY_TOO_LARGE               MessageTooLarge
    41302 MESSAGE_BODY_EMPTY                   MessageBodyEmpty
    42800 PRECONDITION_FAILED                  TimerNotPending (TimerAlreadyFired, TimerAlreadyCancelled)
    42900 TOO_MANY_REQUESTS                    Throttled (TimerSlotCongested, DiskFull, TimerIndexRebuilding)
    43101 MESSAGE_PROPERTIES_TOO_LARGE         PropertiesTooLarge
    50001 INTERNAL_SERVER_ERROR                ServerError (DataDirLocked, StoreUnavailable, UnsupportedVersion,
                                               LogDamaged, IndexPositionWentBack, TimerIndexCorrupt)
    50002 HA_NOT_AVAILABLE                     BrokerClosed (TimerIndexClosed; retriable)
    50401 MASTER_PERSISTENCE_TIMEOUT           FlushFailed (FsyncFailed; retriable)
    50500 UNSUPPORTED                          Unsupported
"""

from __future__ import annotations

from os import PathLike
from typing import Any

from chronoq.timefmt import byte_size, duration, duration_against, instant


class ChronoqError(Exception):
    """The base of every chronoq error, never raised as itself: each failure raises its own class
    (below), whose `code` is the status a client sees (the SDK's `RemoteError`, for a status it
    has no class for, is one too)."""

    code: int = 50000
    retriable: bool = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))


def _rebuild(cls: type[ChronoqError], message: str, details: dict[str, Any]) -> ChronoqError:
    err = cls.__new__(cls)
    ChronoqError.__init__(err, message, **details)
    return err


# --- the caller broke a rule; nothing was stored -------------------------------------------


class BadRequest(ChronoqError):
    """The caller's fault: the request broke a rule and nothing was stored or changed. The base of
    every such class below. The broker raises only those; the SDK raises this class for a status
    40000 (BAD_REQUEST) that names no class, as every RocketMQ-protocol status does."""

    code = 40000


class InvalidTopicName(BadRequest):
    """Raised when a topic name is not text, is empty, longer than `max_topic_name_length`, or
    uses characters outside `[A-Za-z0-9_%|-]` (`validate.check_topic_name`, every door)."""

    code = 40002

    def __init__(self, topic: str, reason: str) -> None:
        super().__init__(f"invalid topic name {topic!r}: {reason}", topic=topic, reason=reason)


class InvalidGroupName(BadRequest):
    """Raised when a consumer group's name breaks the topic-name rule, is too long for its
    dead-letter topic (`%DLQ%<group>`) to be a valid topic name, or is the broker's own
    `%SCHEDULE%` (`validate.check_group_name`: every receive, ack, change of invisibility,
    dead-letter and assignment, through every door)."""

    code = 40003

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"invalid consumer group {group!r}: {reason}", group=group, reason=reason)


class InvalidTag(BadRequest):
    """Raised when a message's tag is longer than `max_tag_length`, blank, or holds a '|' or a
    control character (admission, `validate.prepare`)."""

    code = 40004

    def __init__(self, tag: str, reason: str) -> None:
        super().__init__(f"invalid tag {tag!r}: {reason}", tag=tag, reason=reason)


class InvalidKeys(BadRequest):
    """Raised when a message has more than `max_keys_count` keys, a key that is empty, not text, or
    has control characters, or keys too long for the record format (admission); and when a
    lookup by key (admin QueryMessage) names a key no message can carry."""

    code = 40005

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid message keys: {reason}", reason=reason)


class InvalidMessageId(BadRequest):
    """Raised when a message id is not text, empty, longer than `max_message_id_length`, or holds
    anything but printable ASCII without spaces (`validate.check_message_id`: a send through
    every door, and a lookup or cancel by id)."""

    code = 40009

    def __init__(self, message_id: str, reason: str) -> None:
        super().__init__(f"invalid message id {message_id!r}: {reason}", message_id=message_id, reason=reason)


class InvalidFilterExpression(BadRequest):
    """Raised when a receive's tag filter is not '*' or tags separated by '||', or is of an
    unknown filter type (SQL92 is `Unsupported`)."""

    code = 40010

    def __init__(self, expression: str, reason: str) -> None:
        super().__init__(f"invalid tag filter {expression!r}: {reason}", expression=expression, reason=reason)


class InvalidInvisibleDuration(BadRequest):
    """Raised when a receive's or a change of invisibility's duration is outside
    [`min_invisible_duration_ms`, `max_invisible_duration_ms`]."""

    code = 40011

    def __init__(self, invisible_duration_ms: int, min_ms: int, max_ms: int) -> None:
        super().__init__(
            f"invisible duration {duration(invisible_duration_ms)} is outside "
            f"[{duration(min_ms)}, {duration(max_ms)}] (min_invisible_duration_ms, max_invisible_duration_ms)",
            invisible_duration_ms=invisible_duration_ms, min_ms=min_ms, max_ms=max_ms,
        )


class InvalidReceiptHandle(BadRequest):
    """Raised when an ack, a change of invisibility or a dead-letter forward names a handle that
    is malformed, names no message in flight for that group and topic (acked, or another group's
    or topic's), or was superseded (renewed, or redelivered to someone else after it expired);
    and when one ack request names the same message twice."""

    code = 40013

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid receipt handle: {reason}", reason=reason)


class InvalidBatchSize(BadRequest):
    """Raised when a request holds more items than its limit allows, or none where one is
    needed: a send of more than `max_send_batch` messages (gRPC SendMessage, admin SendBatch, the
    in-process API), a receive whose batch size is outside 1..`max_receive_batch`, an ack of more
    than `max_send_batch` entries, an admin FireTimers of more than `max_send_batch` positions."""

    code = 40000

    def __init__(self, batch_size: int, max_batch_size: int) -> None:
        super().__init__(
            f"batch size {batch_size} is outside [1, {max_batch_size}]",
            batch_size=batch_size, max_batch_size=max_batch_size,
        )


class InvalidQueueId(BadRequest):
    """Raised when a queue id is outside the topic's queues: a send naming its queue, a receive or
    a read (admin ReadMessages) of one queue."""

    code = 40000

    def __init__(self, topic: str, queue_id: int, queue_count: int) -> None:
        super().__init__(
            f"topic {topic!r} has queues 0..{queue_count - 1}, not {queue_id}",
            topic=topic, queue_id=queue_id, queue_count=queue_count,
        )


class InvalidQueueCount(BadRequest):
    """Raised when a topic is created with a queue count outside 1..`max_queue_count`."""

    code = 40000

    def __init__(self, queue_count: int, max_queue_count: int) -> None:
        super().__init__(
            f"queue count {queue_count} is outside [1, {max_queue_count}]",
            queue_count=queue_count, max_queue_count=max_queue_count,
        )


class InvalidOffset(BadRequest):
    """RocketMQ's ILLEGAL_OFFSET. Never raised by chronoq's broker, which serves no offset RPC
    (UpdateOffset, GetOffset and QueryOffset answer `Unsupported`); the SDK raises it when a
    server answers 40019."""

    code = 40019

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"invalid offset {offset}: {reason}", offset=offset, reason=reason)


class MessageTypeMismatch(BadRequest):
    """A message's type does not fit (MESSAGE_PROPERTY_CONFLICT_WITH_TYPE): what a client that
    sees only the code gets. Raised as `MessageTypeNotAccepted` (the topic's types) or
    `chronoq.protocol.errors.MessageTypeConflict` (the message's own fields)."""

    code = 40014


class MessageTypeNotAccepted(MessageTypeMismatch):
    """Raised when a send's message type (NORMAL, FIFO, DELAY, TRANSACTION) is not one its topic
    was created with, and when a topic is created with no message type at all."""

    def __init__(self, topic: str, message_type: str, accepted: list[str]) -> None:
        super().__init__(
            f"topic {topic!r} does not accept {message_type} messages (accepts {', '.join(accepted)})",
            topic=topic, message_type=message_type, accepted=accepted,
        )


class TopicNotFound(BadRequest):
    """No such topic. `auto_create` is the broker's `auto_create_topics` when the refusing code
    knows it (None: it does not), so the message never claims a setting that is not so: with
    auto-create on, a send creates a topic but a consumer or an admin call never does.
    `candidates` are the existing topics whose names are near (`chronoq.topics.near_names`): the
    message then asks "did you mean" them rather than suggest creating a mistyped name."""

    code = 40402

    def __init__(self, topic: str, auto_create: bool | None = None, candidates: list[str] | tuple[str, ...] = ()
                 ) -> None:
        if candidates:
            hint = f"did you mean {_either(candidates)}?"
        else:
            hint = f"create it with `chronoq topics create {topic}`"
            if auto_create:
                hint += " or send to it"
            elif auto_create is False:
                hint = f"auto-create is off; {hint}"
        super().__init__(f"topic {topic!r} does not exist; {hint}", topic=topic, auto_create=auto_create,
                         candidates=list(candidates))


class TopicNameTooNear(TopicNotFound):
    """Raised when a send (any door) names a topic that does not exist, with auto-create on, and
    the name is near an existing topic's (`chronoq.topics`: a typo would otherwise become a
    topic nobody consumes). Nothing is created or stored. `candidates` are the near topics,
    nearest first. A code-only client sees TopicNotFound (40402, TOPIC_NOT_FOUND)."""

    def __init__(self, topic: str, candidates: list[str] | tuple[str, ...]) -> None:
        BadRequest.__init__(
            self,
            f"topic {topic!r} does not exist; did you mean {_either(candidates)}? (to create {topic!r}, send "
            f"with --create-topic (SDK: create_topics=True), create it with `chronoq topics create {topic}`, or "
            "set auto_create_topic_near_names = true on the server)",
            topic=topic, auto_create=True, candidates=list(candidates))


def _either(names: list[str] | tuple[str, ...]) -> str:
    """'a', 'a' or 'b', 'a', 'b' or 'c': names a person chooses among."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class TopicExists(BadRequest):
    """Raised when a topic is created under a name a topic already has (admin CreateTopic, the
    in-process `create_topic`; an auto-create finds the topic and creates nothing)."""

    code = 40000

    def __init__(self, topic: str) -> None:
        super().__init__(f"topic {topic!r} already exists", topic=topic)


class SystemTopicForbidden(InvalidTopicName):
    """Raised when a send names one of chronoq's system topics (the timer, schedule and link
    topics, which only the broker writes), when a topic of such a name is created, and when a
    consumer receives from one (its messages are not due yet: the broker delivers each to its
    real topic when it is). An illegal topic for that client (ILLEGAL_TOPIC), hence the base class."""

    def __init__(self, topic: str, *, receive: bool = False) -> None:
        who = "consumers may not receive from it: its messages are delivered to their own topics when due" \
            if receive else "producers may not write to it"
        BadRequest.__init__(self, f"topic {topic!r} is a system topic; {who}", topic=topic)


class MessageBodyEmpty(BadRequest):
    """Raised when a message's body is empty (admission, every door)."""

    code = 41302

    def __init__(self) -> None:
        super().__init__("message body is empty")


class MessageTooLarge(BadRequest):
    """Raised when a message as the record would hold it (body, texts, and room for the system
    properties) exceeds `max_message_size_bytes` (admission), or a GZIP body inflates past it
    (gRPC SendMessage)."""

    code = 41301

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"message is {byte_size(size_bytes)}; the limit (max_message_size_bytes) is {byte_size(limit_bytes)}",
            size_bytes=size_bytes, limit_bytes=limit_bytes,
        )


class PropertiesTooLarge(BadRequest):
    """Raised when a message's user properties are more than `max_property_count` or take more
    than `max_properties_size_bytes` encoded."""

    code = 43101

    def __init__(self, reason: str, value: int, limit: int) -> None:
        super().__init__(f"message properties too large: {reason} is {value:,}, limit {limit:,}",
                         reason=reason, value=value, limit=limit)


class InvalidProperty(BadRequest):
    """Raised when a user property's key or value is not text, the key is empty or has control
    characters, either has a NUL or is not valid UTF-8; when a timer property (TIMER_DELIVER_MS,
    TIMER_DELAY_MS, TIMER_DELAY_SEC, DELAY) is not an integer; and, for the fields of the
    in-process message, when the body is not bytes, the message group not text (or has control
    characters) or the born time not ms since the epoch up to 9999-12-31 (admission)."""

    code = 40007

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"invalid property {key!r}: {reason}", key=key, reason=reason)


class ReservedProperty(InvalidProperty):
    """A producer set a property that only chronoq may set (real topic, timer bookkeeping): an
    illegal property key (ILLEGAL_MESSAGE_PROPERTY_KEY), hence the base class."""

    def __init__(self, key: str) -> None:
        BadRequest.__init__(self, f"property {key!r} is reserved for chronoq's internal use", key=key)


# --- timer requests -------------------------------------------------------------------------


class InvalidDeliveryTime(BadRequest):
    """Raised when a message's due time cannot be read: a gRPC `delivery_timestamp` that is neither
    epoch seconds nor epoch milliseconds in range, or has nanos out of range or beside epoch
    milliseconds; a `deliver_at_ms` or `delay_ms` that is not a whole number; a deliver-at time
    before the epoch. The base (ILLEGAL_DELIVERY_TIME) of the timer refusals below."""

    code = 40012

    def __init__(self, reason: str, **details: Any) -> None:
        ChronoqError.__init__(self, f"invalid delivery time: {reason}", reason=reason, **details)


class DeliveryTimeTooFar(InvalidDeliveryTime):
    """Raised when a timer message's due time lies more than `timer_max_delay_ms` after now."""

    def __init__(self, deliver_at_ms: int, now_ms: int, max_delay_ms: int) -> None:
        ahead, limit = duration_against(deliver_at_ms - now_ms, max_delay_ms)
        ChronoqError.__init__(
            self,
            f"delivery time {instant(deliver_at_ms)} is {ahead} ahead; the limit (timer_max_delay_ms) is {limit}",
            deliver_at_ms=deliver_at_ms, now_ms=now_ms, max_delay_ms=max_delay_ms,
        )


class NegativeDelay(InvalidDeliveryTime):
    """Raised when a relative delay (`delay_ms`, TIMER_DELAY_MS, TIMER_DELAY_SEC) is below zero."""

    def __init__(self, delay_ms: int) -> None:
        ChronoqError.__init__(self, f"delay {duration(delay_ms)} is negative", delay_ms=delay_ms)


class InvalidDelayLevel(InvalidDeliveryTime):
    """Delay levels start at 1: 0 or less is refused through every door. A level above the
    table's top is refused in chronoq's own `delay_level` field (SDK, CLI, admin SendBatch,
    Spark) and clamped to the top in RocketMQ 4's `DELAY` property, as RocketMQ does.
    `top_delay_ms`: the top level's delay, when the refusing code has the table."""

    def __init__(self, level: int, max_level: int, top_delay_ms: int | None = None) -> None:
        top = f"level {max_level} = {duration(top_delay_ms)}" if top_delay_ms is not None else f"level {max_level}"
        if isinstance(level, int) and not isinstance(level, bool) and level > max_level:
            text = (f"delay level {level} is above the top of the delay-level table ({top}); levels are "
                    f"1..{max_level} (delay_levels); for a longer delay give a delivery time or a delay instead")
        else:
            text = f"delay level {level!r} is invalid; levels are 1..{max_level} ({top})"
        ChronoqError.__init__(self, text, level=level, max_level=max_level, top_delay_ms=top_delay_ms)


class ConflictingDelivery(InvalidDeliveryTime):
    """Raised when a message names its due time more than one way: more than one of a delivery
    time, a delay and a delay level, in fields or timer properties (admission), or in the SDK's
    `deliver_at`, `delay` and `delay_level` arguments (before anything is sent)."""

    def __init__(self, given: list[str]) -> None:
        # `given` names the fields as the caller spelt them (the SDK's deliver_at and delay, the
        # broker's deliver_at_ms and delay_ms), so the message names those, not one layer's.
        ChronoqError.__init__(self, f"a message is delayed one way at most (a delivery time, a delay or a delay "
                                    f"level); got {' and '.join(given)}", given=given)


class Forbidden(BadRequest):
    """RocketMQ's FORBIDDEN: the broker does not allow this request. Nothing changed. A permission
    the caller lacks (`Forbidden.permission`: a topic, a group, an admin method, or a client id
    that another user's auto-renewed receive holds; a batch with one forbidden topic is refused
    whole) is this class itself, whichever call refused it; a feature turned off is `TimerDisabled`."""

    code = 40300

    @classmethod
    def permission(cls, access_key: str, action: str, resource: str) -> Forbidden:
        """The authenticated caller `access_key` may not `action` the `resource`."""
        return cls(f"access key {access_key!r} may not {action} {resource}", access_key=access_key, action=action,
                   resource=resource)


class TimerDisabled(Forbidden):
    """Raised when a timer or delay-level message is sent while `timer_wheel_enable` is false."""

    def __init__(self) -> None:
        super().__init__("timer messages are disabled on this broker (timer_wheel_enable=false)")


class Throttled(ChronoqError):
    """The broker refuses for now (RocketMQ's TOO_MANY_REQUESTS): nothing was stored; the same
    request may succeed later, and RocketMQ clients back off and retry it. Raised as itself when
    an auto-renewed receive comes from a new client id while `max_renewing_clients` ids hold
    messages, and when a send finds the store's dispatch paused for want of file descriptors."""

    code = 42900
    retriable = True


class TimerSlotCongested(Throttled):
    """Raised when a timer message is sent for a second (still to come) that already holds
    `timer_congest_num_each_slot` timers, those being accepted counted."""

    def __init__(self, slot_s: int, count: int, limit: int) -> None:
        super().__init__(
            f"{count} timer messages already due in the second from {instant(slot_s * 1000)}; the limit "
            f"(timer_congest_num_each_slot) is {limit}",
            slot_s=slot_s, count=count, limit=limit,
        )


class TimerIndexRebuilding(Throttled):
    """The timer index was found damaged while running and is being rebuilt from the commit log:
    until then it may be stale, so a call that would act on it (fire by position, cancel) does
    nothing. Retry shortly."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the timer index is being rebuilt from the commit log ({reason}); retry shortly",
                         reason=reason)


class TimerNotFound(BadRequest):
    """Raised when a cancel (recall) names a message id of which the timer index knows no timer
    message on that topic."""

    code = 40401

    def __init__(self, topic: str, message_id: str) -> None:
        super().__init__(f"no timer message {message_id!r} on topic {topic!r}", topic=topic, message_id=message_id)


class TimerNotPending(BadRequest):
    """A cancel of a timer that is no longer pending (PRECONDITION_FAILED): it fired or was
    cancelled. What a client that sees only the code gets; the broker raises a subclass."""

    code = 42800


class TimerAlreadyFired(TimerNotPending):
    """Raised when a cancel came too late: the timer fired (or its fire is on its way to the disk)."""

    def __init__(self, message_id: str, deliver_at_ms: int) -> None:
        super().__init__(f"timer message {message_id!r} was due at {instant(deliver_at_ms)} and has fired or is "
                         "firing",
                         message_id=message_id, deliver_at_ms=deliver_at_ms)


class TimerAlreadyCancelled(TimerNotPending):
    """Raised when a cancel names a timer that an earlier cancel already cancelled."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"timer message {message_id!r} is already cancelled", message_id=message_id)


class TimerIdAmbiguous(BadRequest):
    """A cancel by (topic, message id) without a due time, when several timers of that id on that
    topic are pending (the id was reused after the dedupe window): which one is not guessed.
    Each one's recall handle is in `details` (and the message), so a person can cancel one."""

    code = 40000

    def __init__(self, topic: str, message_id: str, deliver_at_ms: list[int], recall_handles: list[str]) -> None:
        listed = "; ".join(f"due {instant(due)}: {handle}" for due, handle in zip(deliver_at_ms, recall_handles,
                                                                                 strict=True))
        super().__init__(f"{len(deliver_at_ms)} timer messages {message_id!r} on topic {topic!r} are pending; "
                         f"cancel one by its recall handle ({listed})",
                         topic=topic, message_id=message_id, deliver_at_ms=deliver_at_ms,
                         recall_handles=recall_handles)


class InvalidSchedule(BadRequest):
    """Raised when a schedule is malformed: its name breaks the rule (the topic alphabet, at most
    `MAX_SCHEDULE_NAME_LENGTH` characters), its cron expression or interval cannot be read, its
    start lies after its end, its limit is below 1, its catch-up policy is unknown, or its jitter
    is as long as the gap between its occurrences (`chronoq/recurring/spec.py`). Nothing is stored."""

    code = 40000

    def __init__(self, name: str, field: str, value: object, reason: str) -> None:
        super().__init__(f"schedule {name!r}: {field} {value!r} {reason}", name=name, field=field,
                         value=value if isinstance(value, (str, int, float, type(None))) else repr(value),
                         reason=reason)


class ScheduleNeverFires(BadRequest):
    """Raised when a schedule's expression, with its start, end and limit, has no occurrence
    (February 30th, an end before the first occurrence). Nothing is stored."""

    code = 40000

    def __init__(self, name: str, expression: str, reason: str) -> None:
        super().__init__(f"schedule {name!r}: {expression!r} never fires: {reason}", name=name,
                         expression=expression, reason=reason)


class UnknownTimeZone(BadRequest):
    """Raised when a schedule names a time zone the IANA database (`zoneinfo`) does not know."""

    code = 40000

    def __init__(self, name: str, zone: str) -> None:
        super().__init__(f"schedule {name!r}: unknown time zone {zone!r} (give an IANA name such as "
                         "'Asia/Shanghai', 'Europe/Berlin' or 'UTC')", name=name, zone=zone)


class ScheduleIntervalTooShort(BadRequest):
    """Raised when a schedule's occurrences would come closer together than
    `schedule_min_interval_ms` (an `--every` below it, or a cron expression two of whose next
    occurrences are closer)."""

    code = 40000

    def __init__(self, name: str, expression: str, interval_ms: int, min_interval_ms: int) -> None:
        value, limit = duration_against(interval_ms, min_interval_ms)
        super().__init__(f"schedule {name!r}: {expression!r} has occurrences {value} apart; the minimum "
                         f"(schedule_min_interval_ms) is {limit}", name=name, expression=expression,
                         interval_ms=interval_ms, min_interval_ms=min_interval_ms)


class ScheduleExists(BadRequest):
    """Raised when a schedule is created under a name a schedule already has (delete it first,
    or update it)."""

    code = 40000

    def __init__(self, name: str) -> None:
        super().__init__(f"schedule {name!r} already exists", name=name)


class ScheduleNotFound(BadRequest):
    """Raised when a show, update, pause, resume or delete names no schedule."""

    code = 40000

    def __init__(self, name: str) -> None:
        super().__init__(f"no schedule {name!r}", name=name)


class TooManySchedules(BadRequest):
    """Raised when a create would hold more than `schedule_max_count` schedules (each lives in
    the broker's memory)."""

    code = 40000

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"{count} schedules exist; the limit (schedule_max_count) is {limit}", count=count,
                         limit=limit)


class InvalidRecallHandle(BadRequest):
    """Raised when a recall handle does not decode (`handle` given: the text is named, cut to 40
    characters, with where a good one comes from) or names no timer of its id due at its time,
    and when a cancel names neither a handle nor both a topic and a message id."""

    code = 40000

    def __init__(self, reason: str, handle: str | None = None) -> None:
        if handle is None:
            super().__init__(f"invalid recall handle: {reason}", reason=reason)
            return
        shown = handle if len(handle) <= 40 else handle[:40] + "..."
        super().__init__(f"invalid recall handle {shown!r}: {reason}; a recall handle is a send receipt's "
                         "recall_handle (`chronoq send` prints it), copied whole", reason=reason)


# --- who may do what (chronoq/server/auth.py) -------------------------------------------------


class Unauthorized(BadRequest):
    """Every refusal of a call's credentials (RocketMQ's UNAUTHORIZED): none, or credentials the
    broker cannot verify. One class whichever call refused them (over the RocketMQ protocol a
    client sees only the code, so a name of each cause's own would show on some calls and not on
    others); the message says which, and `details["cause"]` names it for programs: `no_credentials`,
    `malformed`, `unknown_access_key`, `wrong_secret_key`, `bad_signature`, `stale_signature`. The
    classmethods below build each. The broker answers before looking at the request: nothing
    changed."""

    code = 40100

    @classmethod
    def no_credentials(cls, header: str) -> Unauthorized:
        """Auth is on and the request has no `authorization` header, or one naming an empty access
        key (the Python client sends the header even without credentials)."""
        return cls(f"authentication required: no credentials in {header!r} (configure an access key and secret key "
                   "in the client)", cause="no_credentials", header=header)

    @classmethod
    def malformed(cls, header: str, reason: str) -> Unauthorized:
        """An `authorization` or `x-mq-date-time` header that is not RocketMQ ACL 2.0's shape."""
        return cls(f"malformed {header!r} header: {reason}", cause="malformed", header=header, reason=reason)

    @classmethod
    def unknown_access_key(cls, access_key: str) -> Unauthorized:
        """Credentials (a gRPC signature, the web console's HTTP Basic) that name an access key no
        configured user has."""
        return cls(f"unknown access key {access_key!r}", cause="unknown_access_key", access_key=access_key)

    @classmethod
    def wrong_secret_key(cls, access_key: str) -> Unauthorized:
        """The secret key given with an access key (the web console's HTTP Basic credentials) is not
        the configured one."""
        return cls(f"wrong secret key for access key {access_key!r}", cause="wrong_secret_key", access_key=access_key)

    @classmethod
    def bad_signature(cls, access_key: str) -> Unauthorized:
        """The HMAC-SHA1 of `x-mq-date-time` under the access key's secret is not the one sent: a
        wrong secret key (or a header altered on the way)."""
        return cls(f"signature mismatch for access key {access_key!r} (wrong secret key?)", cause="bad_signature",
                   access_key=access_key)

    @classmethod
    def stale_signature(cls, date_time: str, skew_ms: int, max_skew_ms: int) -> Unauthorized:
        """`x-mq-date-time` is further from the server's wall clock than `auth.max_time_skew_s`: a
        replayed header, or a client clock that is badly off."""
        return cls(f"x-mq-date-time {date_time!r} is {duration(abs(skew_ms))} "
                   f"{'behind' if skew_ms < 0 else 'ahead of'} the server's clock; at most "
                   f"{duration(max_skew_ms)} is accepted (check the client's clock)",
                   cause="stale_signature", date_time=date_time, skew_ms=skew_ms, max_skew_ms=max_skew_ms)


MissingCredentials = Unauthorized
"""Deprecated alias of `Unauthorized` (every 40100 refusal is that one class; `details["cause"]`
is "no_credentials" for this one), kept for `except` clauses; to be removed in the next release."""
MalformedAuthorization = Unauthorized
"""Deprecated alias of `Unauthorized` (`details["cause"] == "malformed"`); to be removed in the next release."""
UnknownAccessKey = Unauthorized
"""Deprecated alias of `Unauthorized` (`details["cause"] == "unknown_access_key"`); to be removed in the next
release."""
BadSecretKey = Unauthorized
"""Deprecated alias of `Unauthorized` (`details["cause"] == "wrong_secret_key"`); to be removed in the next
release."""
BadSignature = Unauthorized
"""Deprecated alias of `Unauthorized` (`details["cause"] == "bad_signature"`); to be removed in the next release."""
StaleSignature = Unauthorized
"""Deprecated alias of `Unauthorized` (`details["cause"] == "stale_signature"`); to be removed in the next
release."""
PermissionDenied = Forbidden
"""Deprecated alias of `Forbidden`, the one name of a permission refusal (40300), kept for `except`
clauses (which now also catch `TimerDisabled`, a Forbidden too); to be removed in the next release."""


class RecallTopicMismatch(InvalidRecallHandle):
    """A recall or cancel names a topic that is not the topic the handle was minted for (RocketMQ
    refuses such a handle too). Nothing is cancelled."""

    def __init__(self, handle_topic: str, request_topic: str) -> None:
        BadRequest.__init__(self, f"invalid recall handle: it belongs to topic {handle_topic!r}, not to "
                            f"{request_topic!r}", handle_topic=handle_topic, request_topic=request_topic)


# --- the broker's state ---------------------------------------------------------------------


class ServerError(ChronoqError):
    """The broker's state, not the request: damage, a store that cannot open, a format it does not
    read. The base of the classes below. The broker raises only those; the SDK raises this class
    for a status 50001 (INTERNAL_SERVER_ERROR) that names no class."""

    code = 50001


class BrokerClosed(ServerError):
    """The broker is closing or closed (a shutdown or restart), or stopped taking work when a
    background task died (`chronoq serve` then exits for a supervisor to restart it). Retriable
    (RocketMQ's HA_NOT_AVAILABLE, 50002, not 50001, so a code-only client can tell): the same
    request succeeds once the broker is back. A send refused so was not acknowledged; a retry
    carries the same message id, and can store a second copy only where a timeout's retry can too
    (the records were written as the broker closed, and the retry reaches the restarted broker,
    whose dedupe window starts empty): at least once, never lost."""

    code = 50002
    retriable = True

    def __init__(self) -> None:
        super().__init__("the broker is closed (shutting down, restarting, or stopped after a failure); "
                         "retry once it is back")


class FlushFailed(ServerError):
    """The store cannot make writes durable any more (an fsync failed, or a background task
    died): the message is not acknowledged, and the broker refuses every later write until it is
    restarted (`chronoq serve` exits with status 1 for a supervisor to do so).

    Retriable (RocketMQ's MASTER_PERSISTENCE_TIMEOUT, 50401, what Apache's proxy answers for a
    broker's FLUSH_DISK_TIMEOUT): the same send may succeed once the broker is restarted. This
    process refuses a retry at once, before writing anything, so the SDK's bounded retries cost
    little. A retry is safe: nothing acknowledged is at stake, and it carries the same message id.
    The refused records may still be on disk (their fsync failed, not necessarily their write) and
    come back at the restart, so a retry that reaches the restarted broker (whose dedupe window
    starts empty) may store a second copy: at least once, as after a timeout, never lost."""

    code = 50401
    retriable = True

    def __init__(self, reason: str) -> None:
        # The store keeps why it failed as text, often an `FsyncFailed`'s message, which says
        # "flush failed: " already.
        reason = reason.removeprefix("flush failed: ")
        super().__init__(f"flush failed: {reason}", reason=reason)


class FsyncFailed(FlushFailed):
    """An fsync (or fdatasync) of `path` returned an error. The broker never retries the fsync:
    the kernel may already have dropped the pages it could not write and marked them clean, so a
    second fsync would report success for data that is gone ("fsyncgate"). The store fails for
    good. (A client's send that this refused may be retried, as `FlushFailed` says: a new
    request, to a restarted broker.)"""

    def __init__(self, path: str, errno: int | None, strerror: str) -> None:
        ChronoqError.__init__(self, f"flush failed: fsync of {path} failed: {strerror} (errno {errno}); "
                                    "the broker stops acknowledging writes until it is restarted",
                              reason=f"fsync of {path}: {strerror}", path=path, errno=errno)


class DiskFull(Throttled):
    """The data directory's file system is (nearly) full. Raised in two cases:
    - a producer send finds less free space than `disk_min_free_bytes` (checked before anything
      is written; `during` is None);
    - a write ran out of space anyway (`during` names it: a commit-log write, a consume-queue
      append, a RocksDB write, the checkpoint). The write was undone: nothing it would have
      added is visible or acknowledged.
    Not a failure of the store: reads, acks and timer firing go on as far as space allows, and
    the same request may succeed once space is freed. (An fsync that fails, with ENOSPC or
    anything else, is `FsyncFailed`, never this: see `store/fsync.py`.)"""

    def __init__(self, path: str, free_bytes: int, min_free_bytes: int, during: str | None = None) -> None:
        if during is None:
            text = (f"disk full: {path} has {byte_size(free_bytes)} free, below disk_min_free_bytes = "
                    f"{byte_size(min_free_bytes)}; "
                    "sends are refused until space is freed (reads and acks go on)")
        else:
            text = (f"disk full: {during} in {path} ran out of space ({byte_size(free_bytes)} free, "
                    f"disk_min_free_bytes = {byte_size(min_free_bytes)}); nothing was acknowledged by it; retry "
                    "once space is freed")
        super().__init__(text, path=path, free_bytes=free_bytes, min_free_bytes=min_free_bytes, during=during)


class CorruptRecord(ServerError):
    """Raised by decoders when a record on disk fails a check (length, magic, version, CRC, kind,
    position, message type, UTF-8 text); the store turns it into a truncation (torn tail), a
    quarantine or a `check` finding."""

    code = 40016

    def __init__(self, reason: str, position: int | None = None) -> None:
        where = f" at position {position}" if position is not None else ""
        super().__init__(f"corrupt record{where}: {reason}", reason=reason, position=position)
        self.reason = reason
        self.position = position


class DataDirLocked(ServerError):
    """Raised at open when another broker holds the data directory: its lock file, or the RocksDB
    lock of the consumer-group store or of the timer index."""

    def __init__(self, path: str) -> None:
        super().__init__(f"data directory {path} is in use by another broker", path=path)


class StoreUnavailable(ServerError):
    """A store could not be opened for lack of a resource other than space (too many open
    files, no permission, no memory). Not damage: nothing was moved aside or rebuilt."""

    def __init__(self, what: str, path: str, reason: str) -> None:
        super().__init__(f"cannot open the {what} at {path}: {reason}; this is not damage and nothing was "
                         "changed: fix the cause (the open-file limit is `ulimit -n`) and start again",
                         what=what, path=path, reason=reason)


class UnsupportedVersion(ServerError):
    """Raised at open when the consumer-group store's format version is not the one this chronoq
    reads (a timer index of another version is `TimerIndexCorrupt`: it is rebuilt)."""

    def __init__(self, what: str, version: int, supported: int) -> None:
        super().__init__(f"{what} has format version {version}; this chronoq reads {supported}",
                         what=what, version=version, supported=supported)


# --- raised by the store and the timer engine; here so that every error a client can see is
# --- defined in this module and mapped to a client class by code and by name


class LogDamaged(ServerError):
    """A commit-log segment other than the last is damaged: acknowledged data may be affected.
    The broker refuses to start rather than cut it; `chronoq check` says where."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"commit log damaged in {path}: {reason}", path=path, reason=reason)


class IndexPositionWentBack(ServerError):
    """A batch claimed to cover less of the log than the engine already does. Applying batches
    out of log order could persist a position past a batch that was never applied, and a
    restart would then skip its timers; so the engine refuses and changes nothing."""

    def __init__(self, indexed_position: int, batch_position: int) -> None:
        super().__init__(
            f"index batch ends at log position {batch_position}, but the index already covers "
            f"the log up to {indexed_position}; batches must be applied in log order",
            indexed_position=indexed_position, batch_position=batch_position,
        )


class TimerIndexCorrupt(ServerError):
    """The timer index at `path` is missing, damaged or of another format version. It is
    derived state: destroy it (`RocksTimerIndex.destroy`) and rebuild it from the commit log."""

    def __init__(self, path: str | PathLike[str], reason: str) -> None:
        super().__init__(f"timer index at {path} cannot be used: {reason}; rebuild it from the commit log",
                         path=str(path), reason=reason)


class TimerIndexClosed(BrokerClosed):
    """The timer index was used after `close()` (a shutdown racing a call); nothing was written.
    A broker closing, as a client sees it (50002, retriable)."""

    def __init__(self, path: str | PathLike[str]) -> None:
        ChronoqError.__init__(self, f"timer index at {path} is closed (the broker is closing); retry once it is back",
                              path=str(path))


class ConsoleInputError(BadRequest):
    """What a person typed into the web console cannot be read (a time, a range, a lookup, a
    cancel request); the message says what to type instead. Nothing changed."""
