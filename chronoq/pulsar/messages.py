"""Pulsar messages as chronoq messages and back: what one SEND stores, what one MESSAGE carries.

Theory of operation: pure functions between the Pulsar frames the door reads or writes and
chronoq's `OutgoingMessage` / `ReceivedMessage`; no I/O, no clock (the door passes `now_ms`).

Delayed delivery, as Pulsar defines it: `deliver_at_time` holds on Shared and Key_Shared
subscriptions, and Exclusive and Failover subscriptions receive the message at once (Pulsar's
dispatchers for one active consumer never track delays). chronoq keeps a delay in its durable
timer index, one timer per message, before any subscription (or gRPC consumer group) sees it:
that is what makes the delay restart-safe, never early and free of per-subscription state. So a
delayed SEND is stored twice, in one group commit:
- the timer (`deliver_at_ms`) in the topic itself, which every consumer group, Shared and
  Key_Shared subscriptions and the gRPC door's groups alike, receives at its due time; it
  carries `PROP_IMMEDIATE_COPY`;
- a plain copy in `%PULSAR_NOW%<topic>` (`immediate_topic`, one queue), which only Exclusive
  and Failover subscriptions read, at once, beside the topic; they skip the timer when it fires
  (it carries the mark), so each receives the message once.
Why this and not the message kept plain and held back per subscription: a hold per (message,
Shared subscription) is a durable entry per pair (Pulsar's per-subscription tracker, whose
memory its own maintainers call O(messages x subscriptions)), and gRPC consumers would get the
message at once; a timer read early by the few subscriptions that want it costs one more
record per delayed message in the log and nothing in memory. The price: on an Exclusive or
Failover subscription a delayed message and the plain ones around it come from two queues, so
their order between the two is the order they are received, not the order they were sent.
A topic named in `pulsar_delay_all_subscriptions_topics` gets no copy: its delay holds on
every subscription type. Nor does one whose copy's name would be too long for a topic name.

Message ids: (ledgerId = queue id, entryId = queue offset) in the topic; a copy's ledgerId is
`IMMEDIATE_LEDGER` + its queue id, so an ack names the topic it acks in.
"""

from __future__ import annotations

import fnmatch
import functools
import re

from chronoq.config import Config
from chronoq.errors import ChronoqError
from chronoq.model import OutgoingMessage, ReceivedMessage, topic_name_problem
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import FrameError, ServerError, Type
from chronoq.validate import check_topic_name

PROP_PRODUCER = "PULSAR_PRODUCER"
"""The Pulsar producer's name, kept as a property of the chronoq message and given back in its
metadata; like the others of `DOOR_PROPERTIES` it is not shown to Pulsar consumers as a property."""
PROP_SEQUENCE_ID = "PULSAR_SEQUENCE_ID"
PROP_EVENT_TIME = "PULSAR_EVENT_TIME"
PROP_IMMEDIATE_COPY = "PULSAR_IMMEDIATE_COPY"
"""On a delayed message's timer: a copy is in `immediate_topic`, for Exclusive and Failover
subscriptions, which therefore skip the timer when it fires."""
PROP_DELIVER_AT = "PULSAR_DELIVER_AT"
"""On that copy: the `deliver_at_time` it was sent with (given back in its metadata)."""
DOOR_PROPERTIES = frozenset({PROP_PRODUCER, PROP_SEQUENCE_ID, PROP_EVENT_TIME, PROP_IMMEDIATE_COPY, PROP_DELIVER_AT})
NAMESPACE_PREFIXES = ("persistent://public/default/", "public/default/")
IMMEDIATE_PREFIX = "%PULSAR_NOW%"
IMMEDIATE_LEDGER = 1 << 31
"""A message id's ledgerId at or above this names a queue of the topic's immediate copies."""


class Refused(Exception):
    """A request the door answers with a Pulsar error: `error` (a ServerError) and a message."""

    def __init__(self, error: int, message: str) -> None:
        super().__init__(message)
        self.error = error
        self.message = message


def chronoq_topic(pulsar_topic: str, config: Config) -> str:
    """The chronoq topic a Pulsar topic name maps to, or `Refused(InvalidTopicName)`."""
    name = pulsar_topic
    for prefix in NAMESPACE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    else:
        if "/" in name:
            raise Refused(ServerError.InvalidTopicName,
                          f"chronoq serves persistent://public/default/<topic> only, not {pulsar_topic!r}")
    try:
        check_topic_name(name, config)
    except ChronoqError as exc:
        raise Refused(ServerError.InvalidTopicName, str(exc)) from None
    if name.startswith(IMMEDIATE_PREFIX):
        raise Refused(ServerError.InvalidTopicName, f"{name!r}: topics named {IMMEDIATE_PREFIX}... are the door's own")
    return name


def immediate_name(topic: str, config: Config) -> str | None:
    """The topic of `topic`'s immediate copies, read by its Exclusive and Failover subscriptions
    (whatever the setting says now: copies written before a change are still theirs); None when
    the name would be too long, and then no copies are written."""
    name = IMMEDIATE_PREFIX + topic
    return None if topic_name_problem(name, config.max_topic_name_length) else name


def immediate_topic(topic: str, config: Config) -> str | None:
    """Where a delayed message sent now is copied for Exclusive and Failover subscriptions; None
    when its delay holds on every subscription type (the setting, or no room for the name)."""
    if matches_any(topic, config.pulsar_delay_all_subscriptions_topics):
        return None
    return immediate_name(topic, config)


@functools.lru_cache(maxsize=1024)
def matches_any(name: str, setting: str) -> bool:
    """`name` matches one of the setting's names or shell-style globs (separated by commas)."""
    patterns = [p.strip() for p in setting.split(",") if p.strip()]
    return any(re.fullmatch(fnmatch.translate(p), name) for p in patterns)


def messages_of(frame: codec.Frame, topic: str, producer_name: str, now_ms: int,
                config: Config) -> list[OutgoingMessage]:
    """The chronoq messages of one SEND (an entry of a batch each, a delayed one's immediate
    copy after it), or `Refused` saying why there are none."""
    send, meta = frame.command.send, frame.metadata
    assert meta is not None
    what = f"SEND sequence_id {send.sequence_id}"
    if meta.compression != api.NONE:
        raise Refused(ServerError.ChecksumError,
                      f"{what}: compression {api.CompressionType.Name(meta.compression)} is not supported; "
                      "send uncompressed (compression_type=None)")
    if meta.encryption_keys or send.is_chunk or meta.num_chunks_from_msg > 1 or meta.HasField("uuid"):
        raise Refused(ServerError.ChecksumError, f"{what}: encrypted and chunked messages are not supported")
    if send.txnid_most_bits or send.txnid_least_bits or send.marker:
        raise Refused(ServerError.ChecksumError, f"{what}: transactions and markers are not supported")
    deliver_at: int | None = None
    if meta.HasField("deliver_at_time"):
        max_delay = config.pulsar_max_delivery_delay_ms
        if max_delay and meta.deliver_at_time - meta.publish_time > max_delay:
            # Pulsar's code and words (PersistentTopic, PIP-315); the door may recode it for a
            # client that fails a send only on ChecksumError (`pulsar_checksum_error_clients`).
            raise Refused(ServerError.NotAllowedError,
                          f"Exceeds max allowed delivery delay of {max_delay} milliseconds "
                          f"(pulsar_max_delivery_delay_ms; {what} asks {meta.deliver_at_time - meta.publish_time})")
        if meta.deliver_at_time > now_ms:
            deliver_at = meta.deliver_at_time  # one due already is a plain message: due means deliverable
    born = meta.publish_time if meta.publish_time > 0 else None
    base = {PROP_PRODUCER: meta.producer_name or producer_name}
    entries: list[tuple[bytes, str, dict[str, str]]] = []
    if meta.HasField("num_messages_in_batch"):
        try:
            singles = codec.split_batch(meta, frame.payload)
        except FrameError as exc:
            raise Refused(ServerError.ChecksumError, f"{what}: {exc.reason}") from None
        for single in singles:
            md = single.metadata
            if md.null_value:
                raise Refused(ServerError.ChecksumError, f"{what}: a null value has no chronoq form")
            props = {**codec.properties_of(md.properties), **base}
            if md.HasField("sequence_id"):
                props[PROP_SEQUENCE_ID] = str(md.sequence_id)
            if md.event_time:
                props[PROP_EVENT_TIME] = str(md.event_time)
            entries.append((single.payload, md.partition_key, props))
    else:
        if meta.null_value:
            raise Refused(ServerError.ChecksumError, f"{what}: a null value has no chronoq form")
        props = {**codec.properties_of(meta.properties), **base, PROP_SEQUENCE_ID: str(meta.sequence_id)}
        if meta.event_time:
            props[PROP_EVENT_TIME] = str(meta.event_time)
        entries.append((frame.payload, meta.partition_key, props))
    copies_to = immediate_topic(topic, config) if deliver_at is not None else None
    out = []
    for body, key, props in entries:
        keys = (key,) if key else ()
        if copies_to is None:
            out.append(OutgoingMessage(topic, body, keys=keys, properties=props, born_ms=born,
                                       deliver_at_ms=deliver_at))
            continue
        out.append(OutgoingMessage(topic, body, keys=keys, properties={**props, PROP_IMMEDIATE_COPY: "1"},
                                   born_ms=born, deliver_at_ms=deliver_at))
        out.append(OutgoingMessage(copies_to, body, keys=keys, properties={**props, PROP_DELIVER_AT: str(deliver_at)},
                                   born_ms=born))
    return out


def is_skipped_timer(rm: ReceivedMessage) -> bool:
    """A fired timer whose immediate copy an Exclusive or Failover subscription received."""
    msg = rm.message
    return msg.deliver_at_ms is not None and PROP_IMMEDIATE_COPY in msg.properties


def message_id(rm: ReceivedMessage, immediate: bool) -> tuple[int, int]:
    """The (ledgerId, entryId) of a received message (`immediate`: from the copies' topic)."""
    msg = rm.message
    return (IMMEDIATE_LEDGER + msg.queue_id if immediate else msg.queue_id), msg.queue_offset


def message_frame(consumer_id: int, rm: ReceivedMessage, mid: tuple[int, int]) -> bytes:
    """The MESSAGE frame for one received chronoq message."""
    msg = rm.message
    props = msg.properties
    meta = api.MessageMetadata(producer_name=props.get(PROP_PRODUCER) or "chronoq",
                               sequence_id=_int_or(props.get(PROP_SEQUENCE_ID), msg.queue_offset),
                               publish_time=msg.born_ms)
    meta.properties.extend(codec.key_values({k: v for k, v in props.items() if k not in DOOR_PROPERTIES}))
    if msg.keys:
        meta.partition_key = msg.keys[0]
    event_time = _int_or(props.get(PROP_EVENT_TIME), 0)
    if event_time:
        meta.event_time = event_time
    deliver_at = msg.deliver_at_ms if msg.deliver_at_ms is not None else _int_or(props.get(PROP_DELIVER_AT), 0)
    if deliver_at:
        meta.deliver_at_time = deliver_at
    cmd = codec.make_command(Type.MESSAGE, message=api.CommandMessage(
        consumer_id=consumer_id, message_id=api.MessageIdData(ledgerId=mid[0], entryId=mid[1]),
        redelivery_count=max(0, rm.delivery_attempt - 1)))
    return codec.encode_payload_command(cmd, meta, msg.body)


def _int_or(text: str | None, default: int) -> int:
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 19:
        return int(text)
    return default
