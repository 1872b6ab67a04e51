"""The hand-written wire encodings mean what protobuf reads in them.

`chronoq.protocol.fastwire` writes the SendMessage, AckMessage and delivered-message responses'
bytes directly; they are the only encoders of those shapes. Each test parses the bytes with the
generated protobuf classes (protobuf's own parser) and checks every field, its value and its
presence, against the values the encoder was given, for any message a broker can deliver and
any results a send or an ack can have; nothing else may be in the bytes (no unknown field, no
field written twice).
"""

from __future__ import annotations

import hashlib

import pytest
from google.protobuf.message import Message
from hypothesis import given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import definition_pb2 as definition
from rocketmq.grpc_protocol import service_pb2 as service

from chronoq.model import (
    SYS_MESSAGE_GROUP,
    SYS_TIMER_OUT_MS,
    MessageType,
    ReceivedMessage,
    SendResult,
    StoredMessage,
)
from chronoq.protocol import batch_receive, fastwire, responses
from chronoq.protocol.responses import BROKER_NAME

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF, blacklist_categories=("Cs",)),
                min_size=1, max_size=30)
ms = st.integers(0, 4_102_444_800_000)


@st.composite
def received(draw: st.DrawFn) -> ReceivedMessage:
    sysprops: dict[str, str] = {}
    if draw(st.booleans()):
        sysprops[SYS_TIMER_OUT_MS] = str(draw(ms))
    if draw(st.booleans()):
        sysprops[SYS_MESSAGE_GROUP] = draw(names)
    stored = StoredMessage(
        message_id=draw(st.one_of(st.just(""), names)), topic=draw(names), queue_id=draw(st.integers(0, 255)),
        queue_offset=draw(st.integers(0, 1 << 40)), message_type=draw(st.sampled_from(list(MessageType))),
        tag=draw(st.one_of(st.just(""), names)), keys=tuple(draw(st.lists(names, max_size=3))),
        properties=draw(st.dictionaries(names, text, max_size=4)), system_properties=sysprops,
        body=draw(st.binary(max_size=300)), born_ms=draw(ms), store_ms=draw(ms), position=0, size=0)
    return ReceivedMessage(stored, draw(names), draw(st.integers(1, 1 << 20)), draw(ms))


def parsed(message_type: type[Message], raw: bytes) -> Message:
    """`raw` parsed by protobuf, after checking that it holds nothing protobuf would not write
    back: no unknown field (a wrong field number) and no field written twice (the last would win)."""
    message = message_type.FromString(raw)
    known = message_type()
    known.CopyFrom(message)
    known.DiscardUnknownFields()
    assert known.ByteSize() == len(raw), "unknown or repeated fields in the bytes"
    return message


def present(message: Message) -> set[str]:
    """The names of the fields protobuf reads as present (set, or not at their default)."""
    return {field.name for field, _ in message.ListFields()}


def ms_of(stamp: Message) -> tuple[int, int]:
    return stamp.seconds, stamp.nanos


def parts(value_ms: int) -> tuple[int, int]:
    """A Timestamp's or a Duration's (seconds, nanos) for milliseconds >= 0."""
    return value_ms // 1000, value_ms % 1000 * 1_000_000


@settings(max_examples=300, deadline=None)
@given(r=received(), invisible_ms=st.integers(0, 43_200_000))
def test_a_delivered_message_s_bytes_parse_to_its_fields(r: ReceivedMessage, invisible_ms: int) -> None:
    response = parsed(service.ReceiveMessageResponse, fastwire.received_response(r, invisible_ms, BROKER_NAME))
    stored = r.message
    group = stored.system_properties.get(SYS_MESSAGE_GROUP)
    assert present(response) == {"message"}
    m = response.message
    assert present(m) == {"topic", "system_properties"} | ({"user_properties"} if stored.properties else set()) \
        | ({"body"} if stored.body else set())
    assert present(m.topic) == {"name"} and m.topic.name == stored.topic
    assert dict(m.user_properties) == dict(stored.properties)
    assert m.body == stored.body
    sp = m.system_properties
    # Presence, which the official clients test (HasField) for the optional ones.
    assert present(sp) == (
        {"body_digest", "body_encoding", "message_type", "born_timestamp", "store_timestamp", "store_host",
         "receipt_handle", "queue_offset", "invisible_duration", "delivery_attempt"}
        | ({"tag"} if stored.tag else set()) | ({"keys"} if stored.keys else set())
        | ({"message_id"} if stored.message_id else set())
        | ({"delivery_timestamp"} if stored.deliver_at_ms is not None else set())
        | ({"queue_id"} if stored.queue_id else set()) | ({"message_group"} if group else set()))
    assert (sp.tag, list(sp.keys), sp.message_id) == (stored.tag, list(stored.keys), stored.message_id)
    assert sp.body_digest == definition.Digest(type=definition.MD5,
                                               checksum=hashlib.md5(stored.body).hexdigest().upper())
    assert sp.body_encoding == definition.IDENTITY
    assert definition.MessageType.Name(sp.message_type) == stored.message_type.name
    assert ms_of(sp.born_timestamp) == parts(stored.born_ms)
    assert ms_of(sp.store_timestamp) == parts(stored.store_ms)
    assert sp.store_host == BROKER_NAME
    if stored.deliver_at_ms is not None:
        assert ms_of(sp.delivery_timestamp) == parts(stored.deliver_at_ms)
    assert sp.receipt_handle == r.receipt_handle
    assert (sp.queue_id, sp.queue_offset) == (stored.queue_id, stored.queue_offset)
    assert ms_of(sp.invisible_duration) == parts(invisible_ms)
    assert sp.delivery_attempt == r.delivery_attempt
    assert sp.message_group == (group or "")


def test_a_delivered_timer_due_at_the_epoch_still_carries_its_delivery_timestamp() -> None:
    """Zero values of optional and message fields are written all the same: present, and empty."""
    stored = StoredMessage("", "t", 0, 0, MessageType.DELAY, "", (), {}, {SYS_TIMER_OUT_MS: "0"}, b"", 0, 0, 0, 0)
    response = parsed(service.ReceiveMessageResponse,
                      fastwire.received_response(ReceivedMessage(stored, "h", 0, 0), 0, BROKER_NAME))
    sp = response.message.system_properties
    for name in ("delivery_timestamp", "born_timestamp", "store_timestamp", "invisible_duration",
                 "queue_offset", "delivery_attempt"):
        assert sp.HasField(name), name
    assert present(sp.delivery_timestamp) == set() and sp.queue_offset == 0 and sp.delivery_attempt == 0


def test_varints_match_protobuf() -> None:
    from google.protobuf.internal import encoder

    for n in (0, 1, 127, 128, 300, 16383, 16384, 1 << 31, (1 << 63) - 1):
        assert fastwire.varint(n) == encoder._VarintBytes(n)


send_results = st.lists(st.builds(
    SendResult, message_id=st.one_of(st.just(""), names), topic=names, queue_id=st.integers(0, 7),
    queue_offset=st.integers(0, 1 << 40), position=st.integers(0, 1 << 40), deliver_at_ms=st.none() | ms,
    recall_handle=st.none() | names, duplicate=st.booleans()), max_size=20)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(results=send_results)
def test_a_send_response_s_bytes_parse_to_its_results(results: list[SendResult]) -> None:
    response = parsed(service.SendMessageResponse, responses.send_response(results))
    assert present(response) == {"status"} | ({"entries"} if results else set())
    assert (response.status.code, response.status.message) == (definition.OK, "OK")
    assert len(response.entries) == len(results)
    for entry, r in zip(response.entries, results, strict=True):
        assert present(entry) == {"status"} | ({"message_id"} if r.message_id else set()) \
            | ({"offset"} if r.queue_offset else set()) | ({"recall_handle"} if r.recall_handle else set())
        assert (entry.status.code, entry.status.message) == (definition.OK, "duplicate" if r.duplicate else "OK")
        assert (entry.message_id, entry.offset, entry.recall_handle) == (
            r.message_id, r.queue_offset, r.recall_handle or "")


ack_entries = st.lists(st.tuples(st.one_of(st.just(""), names), st.one_of(st.just(""), names),
                                 st.sampled_from([20000, 40013, 50001]), text), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(entries=ack_entries)
def test_an_ack_response_s_bytes_parse_to_its_entries(entries: list[tuple[str, str, int, str]]) -> None:
    response = parsed(service.AckMessageResponse, responses.ack_response(entries))
    assert present(response) == {"status", "entries"}
    if len({code for _, _, code, _ in entries}) == 1:
        top = (entries[0][2], entries[0][3])
    else:
        top = (definition.MULTIPLE_RESULTS, "entries have different results")
    assert (response.status.code, response.status.message) == top
    assert len(response.entries) == len(entries)
    for entry, (message_id, handle, code, message) in zip(response.entries, entries, strict=True):
        assert present(entry) == {"status"} | ({"message_id"} if message_id else set()) \
            | ({"receipt_handle"} if handle else set())
        assert (entry.message_id, entry.receipt_handle) == (message_id, handle)
        assert (entry.status.code, entry.status.message) == (code, message)


# -- the batched receive: the stream's bytes regrouped ---------------------------------------------


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(received(), max_size=12), invisible_ms=st.integers(0, 43_200_000),
       now=ms, limit=st.integers(1, 4000))
def test_a_batched_receive_carries_the_stream_s_messages_in_order_within_its_limit(
        msgs: list[ReceivedMessage], invisible_ms: int, now: int, limit: int) -> None:
    """`batch_receive.batch` only regroups `receive_responses`' bytes: parsed as
    ReceiveMessagesResponse they give the standard stream's status first, its messages in order,
    its delivery timestamp last, and no response holds more than `limit` bytes of messages
    unless it holds a single message."""
    stream = responses.receive_responses(msgs, invisible_ms, now)
    standard = [service.ReceiveMessageResponse.FromString(b) for b in stream]
    batched = [batch_receive.ReceiveMessagesResponse.FromString(b)
               for b in batch_receive.batch(stream, limit)]
    assert batched[0].status == standard[0].status
    assert not any(r.HasField("status") for r in batched[1:])
    assert [m for r in batched for m in r.messages] == [r.message for r in standard if r.HasField("message")]
    if msgs:
        assert batched[-1].delivery_timestamp == standard[-1].delivery_timestamp
        assert not any(r.HasField("delivery_timestamp") for r in batched[:-1])
    else:
        assert len(batched) == 1 and batched[0].status.code == 40401 and not batched[0].messages
    # Sizes as the server counts them: each message's own standard response, in bytes.
    sizes = [len(b) for b in stream[1:-1]]
    counts = [len(r.messages) for r in batched]
    starts = [sum(counts[:k]) for k in range(len(counts))]
    for start, count in zip(starts, counts, strict=True):
        held = sizes[start:start + count]
        assert count == 1 or sum(held) <= limit, (held, limit)
        if start + count < len(sizes):  # a new response only when the next message did not fit
            assert sum(held) + sizes[start + count] > limit, (held, sizes[start + count], limit)


def test_a_batched_receive_of_an_error_is_that_status_alone() -> None:
    status = definition.Status(code=40402, message="no topic")
    (only,) = batch_receive.batch([service.ReceiveMessageResponse(status=status).SerializeToString()], 10)
    assert batch_receive.ReceiveMessagesResponse.FromString(only).status == status
