"""The commit-log record codec (`chronoq/store/record.py`): whole, byte by byte, with trailing bytes.

Decoding a prefix, a flipped byte or arbitrary bytes must raise `CorruptRecord` and nothing else:
recovery tells a torn tail from a good record by that one exception, so any other exception
escaping the decoder would crash the broker at start instead of truncating the tail.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.errors import CorruptRecord
from chronoq.model import MessageType, StoredMessage
from chronoq.store.record import (
    HEADER_SIZE,
    RECORD_MAGIC,
    RECORD_VERSION,
    decode_keys,
    decode_properties,
    decode_record,
    encode_keys,
    encode_properties,
    encode_record,
    peek_total_size,
)

FIELDS = dict(
    position=123_456, message_id="01ABCDEF", topic="orders", queue_id=3, queue_offset=77,
    message_type=MessageType.DELAY, tag="paid", keys=("k1", "k2"), properties={"b": "2", "a": "1"},
    system_properties={"TIMER_OUT_MS": "1700000000500"}, body=b"hello world",
    born_ms=1_700_000_000_000, store_ms=1_700_000_000_007,
)


def sample(**changes: object) -> bytes:
    return encode_record(**{**FIELDS, **changes})  # type: ignore[arg-type]


def assert_matches(msg: StoredMessage, fields: dict, size: int) -> None:
    for name, value in fields.items():
        got = getattr(msg, name)
        if name in ("properties", "system_properties"):
            got = dict(got)
        assert got == value, name
    assert msg.size == size


def test_round_trip_whole() -> None:
    blob = sample()
    msg = decode_record(blob, expected_position=FIELDS["position"])
    assert_matches(msg, FIELDS, len(blob))
    assert peek_total_size(blob) == len(blob)


def test_layout_matches_the_documented_offsets() -> None:
    blob = sample()
    total, _crc, magic, version, kind, mtype = struct.unpack_from(">IIHBB B", blob)
    assert (total, magic, version, kind, mtype) == (len(blob), RECORD_MAGIC, RECORD_VERSION, 1, 3)
    assert blob[13:16] == b"\x00\x00\x00"
    assert struct.unpack_from(">QQIQQ", blob, 16) == (123_456, 77, 3, FIELDS["born_ms"], FIELDS["store_ms"])
    lengths = struct.unpack_from(">HHHHIII", blob, 52)
    props = encode_properties(FIELDS["properties"])
    sysprops = encode_properties(FIELDS["system_properties"])
    assert lengths == (8, 6, 4, 5, len(props), len(sysprops), 11)
    tail = b"01ABCDEF" + b"orders" + b"paid" + b"k1\x00k2" + props + sysprops + b"hello world"
    assert blob[HEADER_SIZE:] == tail
    # Properties are written sorted by key, each as (u16 len, key, u32 len, value).
    assert props == b"\x00\x01a\x00\x00\x00\x011" + b"\x00\x01b\x00\x00\x00\x012"


def test_minimal_record_round_trips() -> None:
    fields = {**FIELDS, "tag": "", "keys": (), "properties": {}, "system_properties": {}, "body": b""}
    blob = encode_record(**fields)  # type: ignore[arg-type]
    assert len(blob) == HEADER_SIZE + len("01ABCDEF") + len("orders")
    assert_matches(decode_record(blob), fields, len(blob))


@pytest.mark.parametrize("message_type", list(MessageType))
def test_every_message_type_round_trips(message_type: MessageType) -> None:
    assert decode_record(sample(message_type=message_type)).message_type is message_type


def test_every_prefix_raises_corrupt_record() -> None:
    blob = sample()
    for n in range(len(blob)):
        with pytest.raises(CorruptRecord):
            decode_record(blob[:n])


def test_trailing_bytes_are_ignored_and_size_gives_the_extent() -> None:
    blob = sample()
    for trailer in (b"\x00", b"\xff" * 100, sample(position=0)):
        msg = decode_record(blob + trailer)
        assert_matches(msg, FIELDS, len(blob))


def test_decodes_at_an_offset_inside_a_larger_buffer() -> None:
    first = sample(position=0)
    second = sample(position=len(first), body=b"second")
    buf = first + second + b"junk"
    a = decode_record(buf, 0, expected_position=0)
    b = decode_record(memoryview(buf), a.size, expected_position=a.size)
    assert (a.body, b.body, b.position, b.size) == (b"hello world", b"second", len(first), len(second))


def test_wrong_expected_position_is_corrupt() -> None:
    with pytest.raises(CorruptRecord, match="position"):
        decode_record(sample(), expected_position=FIELDS["position"] + 1)


def test_every_single_byte_flip_is_detected() -> None:
    blob = sample()
    for i in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= mask
            with pytest.raises(CorruptRecord):
                decode_record(bytes(bad), expected_position=FIELDS["position"])
            # With room to spare after it, a grown size field must still be caught.
            with pytest.raises(CorruptRecord):
                decode_record(bytes(bad) + bytes(300), expected_position=FIELDS["position"])


def test_named_failures() -> None:
    blob = bytearray(sample())
    bad_magic = bytearray(blob)
    bad_magic[8] ^= 0xFF
    with pytest.raises(CorruptRecord, match="magic"):
        decode_record(bytes(bad_magic))
    bad_version = bytearray(blob)
    bad_version[10] = 2
    with pytest.raises(CorruptRecord, match="version"):
        decode_record(bytes(bad_version))
    bad_body = bytearray(blob)
    bad_body[-1] ^= 1
    with pytest.raises(CorruptRecord, match="CRC32C"):
        decode_record(bytes(bad_body))


def test_fields_too_long_for_their_length_field_are_refused() -> None:
    with pytest.raises(ValueError, match="topic"):
        sample(topic="t" * 0x10000)
    with pytest.raises(ValueError, match="keys"):
        sample(keys=("k" * 0x10000,))


def test_properties_block_prefixes_raise_corrupt_record() -> None:
    block = encode_properties({"key": "value", "x": "y" * 40})
    assert decode_properties(block) == {"key": "value", "x": "y" * 40}
    for n in range(1, len(block)):
        if n in (len(encode_properties({"key": "value"})),):
            continue  # a whole-entry boundary is a valid shorter block
        with pytest.raises(CorruptRecord):
            decode_properties(block[:n])
    with pytest.raises(CorruptRecord):
        decode_properties(b"\x00\x01\xff\x00\x00\x00\x00")  # key not UTF-8


def test_keys_block() -> None:
    assert encode_keys(()) == b""
    assert decode_keys(b"") == ()
    assert decode_keys(encode_keys(("a", "b c", "ü"))) == ("a", "b c", "ü")


# -- properties (hypothesis) -------------------------------------------------------------------

text = st.text(max_size=40)
no_nul = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=20)
records = st.fixed_dictionaries({
    "position": st.integers(0, 2**64 - 1),
    "message_id": text,
    "topic": text,
    "queue_id": st.integers(0, 2**32 - 1),
    "queue_offset": st.integers(0, 2**64 - 1),
    "message_type": st.sampled_from(list(MessageType)),
    "tag": text,
    "keys": st.lists(no_nul, max_size=4).map(tuple),
    "properties": st.dictionaries(text, text, max_size=5),
    "system_properties": st.dictionaries(text, text, max_size=3),
    "body": st.binary(max_size=300),
    "born_ms": st.integers(0, 2**64 - 1),
    "store_ms": st.integers(0, 2**64 - 1),
})


@settings(deadline=None)
@given(records, st.binary(max_size=50))
def test_round_trip_property(fields: dict, trailer: bytes) -> None:
    blob = encode_record(**fields)
    msg = decode_record(blob + trailer, expected_position=fields["position"])
    assert_matches(msg, fields, len(blob))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(records, st.data())
def test_any_single_byte_corruption_is_detected(fields: dict, data: st.DataObject) -> None:
    blob = encode_record(**fields)
    i = data.draw(st.integers(0, len(blob) - 1), label="index")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]), label="value")
    bad = blob[:i] + bytes([value]) + blob[i + 1:]
    trailer = data.draw(st.binary(max_size=64), label="trailer")
    with pytest.raises(CorruptRecord):
        decode_record(bad + trailer, expected_position=fields["position"])


@settings(deadline=None)
@given(st.binary(max_size=400), st.integers(0, 2**20))
def test_arbitrary_bytes_raise_only_corrupt_record(buf: bytes, position: int) -> None:
    try:
        decode_record(buf, expected_position=position)
    except CorruptRecord:
        pass


@settings(deadline=None)
@given(records, st.data())
def test_header_valid_but_garbage_inside_raises_only_corrupt_record(fields: dict, data: st.DataObject) -> None:
    """Even a record whose CRC was recomputed over garbage (a bug, not a disk error) must fail
    as CorruptRecord or decode, never with another exception."""
    import crc32c

    blob = bytearray(encode_record(**fields))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(HEADER_SIZE, max(HEADER_SIZE, len(blob) - 1)))
        if i < len(blob):
            blob[i] = data.draw(st.integers(0, 255))
    blob[4:8] = struct.pack(">I", crc32c.crc32c(bytes(blob[8:])))
    try:
        decode_record(bytes(blob))
    except CorruptRecord:
        pass
