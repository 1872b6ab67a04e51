"""The bulk send's frames (`chronoq/protocol/bulk.py`): what is encoded decodes to the same
columns; any bytes either decode or raise `MalformedRequest` (nothing else, and nothing allocated
for a row count the frame cannot hold); text that is not UTF-8 is its row's finding, not the
frame's; the reply decodes to what was encoded."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq.protocol import bulk
from chronoq.protocol.errors import MalformedRequest

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TEXT = st.text(st.characters(codec="utf-8"), max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> dict:
    n = draw(st.integers(0, 8))
    due_kind = draw(st.sampled_from([bulk.DUE_NONE, bulk.DUE_AT, bulk.DUE_DELAY]))
    out = {
        "topic": draw(_TEXT),
        "ids": draw(st.lists(_TEXT, min_size=n, max_size=n)),
        "bodies": draw(st.lists(st.binary(max_size=16), min_size=n, max_size=n)),
        "due_kind": due_kind,
        "due": draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n)) if due_kind else None,
        "create_topic": draw(st.booleans()),
    }
    if draw(st.booleans()):
        out["tags"] = draw(st.lists(_TEXT, min_size=n, max_size=n))
    if draw(st.booleans()):
        out["keys"] = draw(st.lists(st.lists(_TEXT, max_size=3).map(tuple), min_size=n, max_size=n))
    if draw(st.booleans()):
        out["properties"] = draw(st.lists(st.dictionaries(_TEXT, _TEXT, max_size=3), min_size=n, max_size=n))
    return out


@FUZZ
@given(requests())
def test_a_request_decodes_to_the_columns_encoded(req: dict) -> None:
    args = {k: v for k, v in req.items() if k not in ("topic", "ids", "bodies")}
    frame = bulk.encode_request(req["topic"], req["ids"], req["bodies"], **args)
    got = bulk.decode_request(frame)
    assert (got.topic, got.ids, got.bodies, got.due_kind, got.create_topic) == (
        req["topic"], req["ids"], req["bodies"], req["due_kind"], req["create_topic"])
    assert (list(got.due) if got.due is not None else None) == req["due"]
    assert got.tags == req.get("tags")
    assert got.keys == req.get("keys")
    assert got.properties == req.get("properties")
    assert got.row_errors == {}


@FUZZ
@given(requests(), st.data())
def test_packed_columns_and_their_row_slices_encode_as_their_values(req: dict, data: st.DataObject) -> None:
    n = len(req["ids"])
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    packed = bulk.Packed.of(req["bodies"]).rows(start, stop)
    assert [packed.value(i) for i in range(len(packed))] == req["bodies"][start:stop]
    assert bulk.encode_request("t", req["ids"][start:stop], packed) == \
        bulk.encode_request("t", req["ids"][start:stop], req["bodies"][start:stop])


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_malformed_request_only(data: bytes) -> None:
    for frame in (data, bulk.REQUEST_MAGIC + data, bulk.REQUEST_MAGIC + b"\x00\x01\x00\x00" + data):
        try:
            bulk.decode_request(frame)
        except MalformedRequest as e:
            assert e.code == 40000 and e.details["rpc"] == bulk.METHOD and str(e)


@FUZZ
@given(requests(), st.data())
def test_a_valid_frame_changed_anywhere_decodes_or_raises_malformed_request_only(req: dict,
                                                                                data: st.DataObject) -> None:
    args = {k: v for k, v in req.items() if k not in ("topic", "ids", "bodies")}
    frame = bytearray(bulk.encode_request(req["topic"], req["ids"], req["bodies"], **args))
    change = data.draw(st.sampled_from(["flip", "cut", "grow"]))
    if change == "flip" and frame:
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] ^= data.draw(st.integers(1, 255))
    elif change == "cut":
        frame = frame[:data.draw(st.integers(0, len(frame)))]
    else:
        frame += data.draw(st.binary(min_size=1, max_size=8))
    try:
        got = bulk.decode_request(bytes(frame))
    except MalformedRequest:
        return
    assert len(got.bodies) == len(got.ids)
    assert all(0 <= row < len(got.ids) for row in got.row_errors)


def test_a_row_count_the_frame_cannot_hold_is_refused_before_anything_is_allocated() -> None:
    head = bulk.encode_request("t", [], [])[:-12]  # the header and topic, without n and the two empty columns
    frame = head + struct.pack("<I", 2**32 - 1) + b"\x00" * 64
    with pytest.raises(MalformedRequest, match="cannot fit"):
        bulk.decode_request(frame)


@pytest.mark.parametrize(("frame", "says"), [
    (b"", "the header"),
    (b"XXXX" + bytes(6), "starts with"),
    (bulk.REQUEST_MAGIC + bytes([2, 0, 0, 0]) + bytes(2), "unknown flags"),
    (bulk.REQUEST_MAGIC + bytes([0, 3, 0, 0]) + bytes(2), "due kind 3"),
    (bulk.REQUEST_MAGIC + bytes([0, 0, 8, 0]) + bytes(2), "unknown columns"),
    (bulk.encode_request("t", ["a"], [b"x"]) + b"!", "follow the frame"),
])
def test_malformed_frames_say_what_is_wrong(frame: bytes, says: str) -> None:
    with pytest.raises(MalformedRequest, match=says):
        bulk.decode_request(frame)


def test_offsets_that_go_back_are_refused_naming_the_offset() -> None:
    frame = bytearray(bulk.encode_request("t", ["ab", "c"], [b"x", b"y"]))
    ids_at = 4 + 4 + 2 + 1 + 4  # header, topic "t", n
    # The ids' offsets [0, 2, 3] become [0, 3, 2].
    frame[ids_at + 4:ids_at + 8] = struct.pack("<I", 3)
    frame[ids_at + 8:ids_at + 12] = struct.pack("<I", 2)
    with pytest.raises(MalformedRequest, match=r"offset 2 \(2\) is below offset 1 \(3\)"):
        bulk.decode_request(bytes(frame))


def test_text_that_is_not_utf8_is_its_rows_finding_and_the_others_decode() -> None:
    ids = bulk.Packed.of([b"ok-1", b"bad\xff", b"ok-2"])
    frame = bulk.encode_request("t", ids, [b"a", b"b", b"c"], tags=["", "", "x"], keys=[(), ("k",), ()])
    got = bulk.decode_request(frame)
    assert got.ids == ["ok-1", None, "ok-2"]
    assert got.row_errors == {1: ("message_id", "not valid UTF-8 (invalid start byte at byte 3)")}
    assert got.bodies == [b"a", b"b", b"c"]


def test_a_reply_decodes_to_what_was_encoded() -> None:
    status = bytes([bulk.STORED | bulk.HAS_HANDLE, bulk.DUPLICATE, bulk.REFUSED])
    errors = [(2, {"code": 40000, "message": "no", "error": "InvalidMessageId", "retriable": False, "details": {}})]
    raw = bulk.encode_reply(status, [1, 0, -1], [7, 3, -1], [1_800_000_000_000, -1, -1], errors)
    got = bulk.decode_reply(raw, 3)
    assert (got.status, list(got.queue_ids), list(got.offsets), list(got.due), got.errors) == (
        status, [1, 0, -1], [7, 3, -1], [1_800_000_000_000, -1, -1], errors)
    with pytest.raises(MalformedRequest, match="3 results for 4 rows"):
        bulk.decode_reply(raw, 4)
    wrong = bulk.encode_reply(status, [1, 0, -1], [7, 3, -1], [0, -1, -1], [(0, errors[0][1])])
    with pytest.raises(MalformedRequest, match="not a refused row"):
        bulk.decode_reply(wrong, 3)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 5))
def test_arbitrary_reply_bytes_decode_or_raise_malformed_request_only(data: bytes, rows: int) -> None:
    for raw in (data, bulk.REPLY_MAGIC + struct.pack("<I", rows) + data):
        try:
            bulk.decode_reply(raw, rows)
        except MalformedRequest:
            pass
