"""The nouns every layer shares: messages, topics, send and receive results.

Theory of operation: these are plain frozen values with no I/O. A producer hands the broker an
`OutgoingMessage`; the store keeps a `StoredMessage` (the same plus where it lies and when it was
stored); a consumer gets a `ReceivedMessage` (a stored message plus its receipt handle and
delivery attempt). Property names that only chronoq may set live here, in one place.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field


class MessageType(enum.IntEnum):
    NORMAL = 1
    FIFO = 2
    DELAY = 3
    TRANSACTION = 4


ALL_MESSAGE_TYPES = frozenset(MessageType)

# -- system topics (written by the broker only) ---------------------------------------------
TIMER_TOPIC = "rmq_sys_wheel_timer"
"""Timer messages wait here (RocketMQ 5's TIMER_TOPIC) until due, real topic in properties."""
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"  # RocketMQ 4's own name for it, kept for familiarity
"""Delay-level messages wait here, one queue per level (RocketMQ 4)."""
LINKS_TOPIC = "chronoq.links"
"""Link records: each enters records already in the log into other topics' queues (a fire step's
timers into their real topics; `store/links.py`). A name no producer can give (a '.' is outside
the topic alphabet), so no topic a user made, before or since, is ever read as link records."""
SCHEDULES_TOPIC = "chronoq.schedules"
"""Recurring schedules' records (`chronoq/recurring/records.py`): each schedule's definition and
progress, replayed at open into the live table. Like `LINKS_TOPIC`, a name outside the topic
alphabet, so no user's topic is ever read as schedules. Made by the first schedule's create."""
DLQ_PREFIX = "%DLQ%"
SYSTEM_TOPICS = frozenset({TIMER_TOPIC, SCHEDULE_TOPIC, LINKS_TOPIC, SCHEDULES_TOPIC})
PROP_SCHEDULE_NAME = "SCHEDULE_NAME"
"""On a message a recurring schedule produced: the schedule's name."""
PROP_SCHEDULE_DUE_MS = "SCHEDULE_DUE_MS"
"""On a message a recurring schedule produced: the occurrence's nominal due time, ms since the
epoch (before any jitter), as decimal text."""

# -- producer-facing timer properties (RocketMQ names) ---------------------------------------
PROP_TIMER_DELIVER_MS = "TIMER_DELIVER_MS"
PROP_TIMER_DELAY_MS = "TIMER_DELAY_MS"
PROP_TIMER_DELAY_SEC = "TIMER_DELAY_SEC"
PROP_DELAY_LEVEL = "DELAY"
PRODUCER_TIMER_PROPERTIES = frozenset(
    {PROP_TIMER_DELIVER_MS, PROP_TIMER_DELAY_MS, PROP_TIMER_DELAY_SEC, PROP_DELAY_LEVEL}
)

# -- internal system properties: chronoq's bookkeeping; a producer may not set them ----------
SYS_REAL_TOPIC = "REAL_TOPIC"
SYS_REAL_QUEUE_ID = "REAL_QID"
SYS_TIMER_OUT_MS = "TIMER_OUT_MS"
"""The absolute due time of a timer message, ms since the epoch, as decimal text in the record;
read once into `StoredMessage.deliver_at_ms`."""
SYS_TIMER_ENQUEUE_MS = "TIMER_ENQUEUE_MS"
SYS_TIMER_ROLL_TIMES = "TIMER_ROLL_TIMES"
SYS_DELAY_LEVEL = "DELAY_LEVEL"
SYS_TIMER_ROLLED_FROM = "TIMER_ROLLED_FROM"
"""On a rolled timer record: the position of the record it replaces (retention is about to drop it)."""
SYS_FIRED_OFFSET = "TIMER_FIRED_OFFSET"
"""On a message delivered from a delay-level queue: the schedule queue offset it came from."""
SYS_TIMER_DEL_UNIQKEY = "TIMER_DEL_UNIQKEY"
"""On a tombstone in the timer topic: the id of the timer message it cancels (RocketMQ 5's delete)."""
SYS_TIMER_DEL_AT_DUE = "TIMER_DEL_AT_DUE"
"""On a tombstone (timer index format version 3 on): it cancels only the timers of its id due at its
TIMER_OUT_MS. A tombstone without it was written under the old rule, every timer of its id, and
keeps that meaning in every replay and rebuild (its cancel was acknowledged as such)."""
SYS_FIRED_FROM = "TIMER_FIRED_FROM"
"""On a delivered timer message: the commit-log position of the timer-topic record it came from."""
SYS_DLQ_ORIGIN_TOPIC = "DLQ_ORIGIN_TOPIC"
SYS_DLQ_ORIGIN_QUEUE_ID = "DLQ_ORIGIN_QID"
SYS_DLQ_ORIGIN_OFFSET = "DLQ_ORIGIN_OFFSET"
SYS_MESSAGE_GROUP = "MESSAGE_GROUP"
SYS_TRACE_ACCEPTED_MS = "ACCEPTED_MS"
RESERVED_PROPERTIES = frozenset({
    SYS_REAL_TOPIC, SYS_REAL_QUEUE_ID, SYS_TIMER_OUT_MS, SYS_TIMER_ENQUEUE_MS, SYS_TIMER_ROLL_TIMES,
    SYS_DELAY_LEVEL, SYS_TIMER_DEL_UNIQKEY, SYS_TIMER_ROLLED_FROM, SYS_FIRED_OFFSET, SYS_FIRED_FROM,
    SYS_DLQ_ORIGIN_TOPIC, SYS_DLQ_ORIGIN_QUEUE_ID, SYS_DLQ_ORIGIN_OFFSET, "__STARTDELIVERTIME",
})
RESERVED_PREFIX = "__CHRONOQ"

_TOPIC_RE = re.compile(r"[A-Za-z0-9_%|-]+")


def dlq_topic(group: str) -> str:
    return f"{DLQ_PREFIX}{group}"


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS


def unencodable_at(text: str) -> int | None:
    """Where `text` stops being encodable as UTF-8, or None when it is. Only a lone UTF-16
    surrogate does that (JSON's `"\\ud800"` decodes to one): nothing can store or send it (the
    record, the index, a log line), so every door refuses it (`validate.py`, the admin JSON)."""
    if text.isascii():  # the usual case needs no encoding to be sure
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def topic_name_problem(topic: str, max_length: int) -> str | None:
    """Why `topic` is not a valid name, or None."""
    if not topic:
        return "empty"
    if len(topic) > max_length:
        return f"{len(topic)} characters; the limit (max_topic_name_length) is {max_length}"
    if not _name_chars_ok(topic):
        return "only letters, digits and _ % | - are allowed"
    return None


@functools.lru_cache(maxsize=4096)
def _name_chars_ok(name: str) -> bool:
    # Cached: every message names its topic, and a broker sees few distinct names (only names
    # within the length limit get here, so the cache stays small).
    return _TOPIC_RE.fullmatch(name) is not None  # fullmatch: `$` would let a trailing "\n" through


@dataclass(frozen=True, slots=True)
class TopicConfig:
    name: str
    queue_count: int
    message_types: frozenset[MessageType] = ALL_MESSAGE_TYPES
    created_ms: int = 0


# The per-message records below (OutgoingMessage, StoredMessage, SendResult, ReceivedMessage) are
# values: nothing assigns to one after construction. They are not `frozen=True` because a frozen
# dataclass's __init__ sets every field through object.__setattr__, which measured ~5x slower to
# construct here (CPython 3.11, 11 fields: ~4.0 vs ~0.7 us), and every message accepted builds
# several of them (docs/design.md, "Accept path").
@dataclass(slots=True)
class OutgoingMessage:
    """What a producer asks the broker to store."""

    topic: str
    body: bytes
    message_id: str | None = None
    tag: str | None = None
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    queue_id: int | None = None
    message_group: str | None = None
    born_ms: int | None = None
    message_type: MessageType | None = None
    """None: derived (DELAY when a time is given, FIFO with a message group, else NORMAL)."""
    deliver_at_ms: int | None = None
    """Deliver at this absolute time (ms since the epoch). At most one of the three timer fields."""
    delay_ms: int | None = None
    delay_level: int | None = None
    """RocketMQ 4 delay level, 1-based into `Config.delay_levels`."""


@dataclass(slots=True)
class StoredMessage:
    """A message as the commit log holds it."""

    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    message_type: MessageType
    tag: str
    keys: tuple[str, ...]
    properties: Mapping[str, str]
    system_properties: Mapping[str, str]
    body: bytes
    born_ms: int
    store_ms: int
    position: int
    """Byte offset of the record in the commit log's position space."""
    size: int
    deliver_at_ms: int | None = field(init=False)
    """The due time of a timer message or tombstone (and of a message a timer delivered), ms
    since the epoch: its `TIMER_OUT_MS` system property, which the record keeps as text (the
    broker writes `str(int)`), read once, when the message is built. None when it has none, or
    text that is not a number: building a message from a record never raises for it (records
    are read in dispatch and by `chronoq check`)."""

    def __post_init__(self) -> None:
        # This runs for every record read and every message stored: the usual message has no
        # system properties, and a due time costs three string checks and one int(). Only a u63
        # in ASCII decimal is a due time (what the broker writes); anything else ("-1", "1_000",
        # " 5", other scripts' digits) is none, never an error: this runs in dispatch.
        raw = self.system_properties.get(SYS_TIMER_OUT_MS) if self.system_properties else None
        if raw is not None and len(raw) <= 19 and raw.isascii() and raw.isdigit():
            self.deliver_at_ms = int(raw)
        else:
            self.deliver_at_ms = None


@dataclass(slots=True)
class SendResult:
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    deliver_at_ms: int | None = None
    recall_handle: str | None = None
    duplicate: bool = False
    """True when this id was seen within `dedupe_window_ms` and nothing new was stored."""


class TimerState(enum.Enum):
    PENDING = "pending"
    DELIVERED = "delivered"
    CANCELLED = "cancelled"
    DAMAGED = "damaged"
    """Its commit-log record failed its checks when it was due: it cannot be delivered. The
    broker quarantined and reported it rather than stop (`store/damage.py`)."""


@dataclass(frozen=True, slots=True)
class TimerStatus:
    """What `Broker.query` knows about a timer message."""

    message_id: str
    topic: str
    state: TimerState
    deliver_at_ms: int
    accepted_ms: int
    fired_ms: int | None = None
    cancelled_ms: int | None = None
    position: int = -1


@dataclass(slots=True)
class ReceivedMessage:
    message: StoredMessage
    receipt_handle: str
    delivery_attempt: int
    invisible_until_ms: int


_id_lock = threading.Lock()
_id_seq = 0
_id_prefix = f"{os.getpid() & 0xFFFF:04X}{int.from_bytes(os.urandom(6), 'big'):012X}"


def new_message_id() -> str:
    """A 34-character upper-case hex id shaped like the RocketMQ 5 clients' (version 01):
    a per-process random prefix, seconds since 2021-01-01, and a sequence number."""
    global _id_seq
    with _id_lock:
        _id_seq = (_id_seq + 1) & 0xFFFFFFFF
        seq = _id_seq
    seconds = (int(time.time()) - 1_609_459_200) & 0xFFFFFFFF
    return f"01{_id_prefix}{seconds:08X}{seq:08X}"
