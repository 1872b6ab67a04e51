"""A stored message's due time: the record's `TIMER_OUT_MS` text, read once into an integer field.

The commit-log record keeps the due time as the text the broker writes (`str(int)`); a
`StoredMessage` reads it once, when it is built, into `deliver_at_ms`, which every later reader
uses. These pin that the field is the number the text says, that the record's bytes are the
same as ever (the field is not written anywhere), and that text that is not a number gives no
due time rather than an exception while a record is read.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.model import SYS_TIMER_OUT_MS, TIMER_TOPIC, MessageType, StoredMessage
from chronoq.store.record import decode_record, encode_record

FIELDS = dict(position=4096, message_id="01ABCDEF", topic=TIMER_TOPIC, queue_id=0, queue_offset=9,
              message_type=MessageType.DELAY, tag="", keys=(), properties={"p": "v"}, body=b"x",
              born_ms=1_700_000_000_000, store_ms=1_700_000_000_007)


def stored(system_properties: dict[str, str]) -> StoredMessage:
    return StoredMessage("m", TIMER_TOPIC, 0, 0, MessageType.DELAY, "", (), {}, system_properties, b"x", 0, 0, 0, 1)


@settings(max_examples=200, deadline=None)
@given(due_ms=st.integers(0, (1 << 63) - 1), others=st.dictionaries(st.sampled_from(["REAL_TOPIC", "MESSAGE_GROUP"]),
                                                                    st.text(max_size=8)))
def test_a_record_s_due_time_text_is_read_once_into_the_field(due_ms: int, others: dict[str, str]) -> None:
    system = {**others, SYS_TIMER_OUT_MS: str(due_ms)}
    blob = encode_record(**FIELDS, system_properties=system)  # type: ignore[arg-type]
    msg = decode_record(blob, expected_position=FIELDS["position"])
    assert msg.deliver_at_ms == due_ms
    assert dict(msg.system_properties) == system, "the record keeps the text"
    again = encode_record(**{**FIELDS, "system_properties": msg.system_properties})  # type: ignore[arg-type]
    assert again == blob, "the same bytes on disk"


def test_a_message_without_a_due_time_has_none() -> None:
    assert stored({}).deliver_at_ms is None
    assert stored({"REAL_TOPIC": "orders"}).deliver_at_ms is None
    blob = encode_record(**FIELDS, system_properties={})  # type: ignore[arg-type]
    assert decode_record(blob).deliver_at_ms is None


def test_text_that_is_not_a_number_is_no_due_time_and_never_raises() -> None:
    for text in ("", "soon", "12x", "1.5", "9" * 5_000, "1_000", " 5", "\u0663", "-1", "9" * 20):
        assert stored({SYS_TIMER_OUT_MS: text}).deliver_at_ms is None, text


def test_the_field_follows_the_properties_it_is_built_from() -> None:
    """Built again (a delivered view, a cached record), a message reads its own properties."""
    first = stored({SYS_TIMER_OUT_MS: "1000"})
    assert first.deliver_at_ms == 1000
    second = StoredMessage(first.message_id, "orders", 1, 2, first.message_type, first.tag, first.keys,
                           first.properties, {SYS_TIMER_OUT_MS: "2000"}, first.body, first.born_ms, 5, 0, 1)
    assert second.deliver_at_ms == 2000 and first.deliver_at_ms == 1000
