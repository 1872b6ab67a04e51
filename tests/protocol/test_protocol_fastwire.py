"""The hand-written wire encoding of a delivered message means exactly what the protobuf API builds.

`fastwire.received_response` writes `ReceiveMessageResponse(message=...)` bytes directly; parsed
back with the generated classes it must equal the object version `responses.encode_received`
field for field, presence included, for any message a broker can deliver.
"""

from __future__ import annotations

import pytest
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
from chronoq.protocol.responses import BROKER_NAME, encode_received

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


@settings(max_examples=300, deadline=None)
@given(r=received(), invisible_ms=st.integers(0, 43_200_000))
def test_the_hand_encoding_parses_to_what_the_protobuf_api_builds(r: ReceivedMessage, invisible_ms: int) -> None:
    fast = service.ReceiveMessageResponse.FromString(fastwire.received_response(r, invisible_ms, BROKER_NAME))
    slow = service.ReceiveMessageResponse(message=encode_received(r, invisible_ms))
    assert fast == slow
    # Presence, which == on messages also compares, spelled out for the fields clients test.
    for field in ("born_timestamp", "store_timestamp", "delivery_timestamp", "invisible_duration", "queue_offset",
                  "delivery_attempt", "receipt_handle", "tag", "message_group", "body_digest"):
        assert fast.message.system_properties.HasField(field) == slow.message.system_properties.HasField(field), field


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
def test_the_send_response_bytes_mean_what_the_protobuf_api_builds(results: list[SendResult]) -> None:
    fast = service.SendMessageResponse.FromString(responses.send_response_wire(results))
    assert fast == responses.send_response(results)


ack_entries = st.lists(st.tuples(st.one_of(st.just(""), names), st.one_of(st.just(""), names),
                                 st.sampled_from([20000, 40013, 50001]), text), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(entries=ack_entries)
def test_the_ack_response_bytes_mean_what_the_protobuf_api_builds(entries: list[tuple[str, str, int, str]]) -> None:
    fast = service.AckMessageResponse.FromString(responses.ack_response_wire(entries))
    slow = responses.ack_response([(m, h, definition.Status(code=c, message=t)) for m, h, c, t in entries])
    assert fast == slow


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
