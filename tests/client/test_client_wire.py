"""The SDK's pure parts: argument checks, protobuf/JSON encoding, status -> exception mapping.

No server: these check that what the SDK puts on the wire is what the protocol layer decodes
(`chronoq.protocol.requests.decode_message` is the real decoder, not a copy), and that replies
come back as the right chronoq exceptions.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq import errors as core
from chronoq.cli.messages import parse_at, parse_in, parse_prop
from chronoq.client import InvalidArgument, ProtocolViolation, RemoteError, SendReceipt, outgoing, wire
from chronoq.client.errors import from_status
from chronoq.config import Config
from chronoq.model import MessageType
from chronoq.protocol import requests
from chronoq.protocol.errors import Unsupported
from chronoq.protocol.v2 import definition as pb
from chronoq.validate import seconds_not_ms

NOW_MS = 1_795_300_000_123


def test_outgoing_converts_times_and_keeps_one_timer_field() -> None:
    at = datetime(2026, 11, 22, 3, 0, 0, 250_000, tzinfo=UTC)
    m = outgoing("t", "héllo", deliver_at=at, tag="a", keys="k", properties={"p": "v"})
    assert m.body == "héllo".encode()
    assert m.deliver_at_ms == int(at.timestamp() * 1000)
    assert m.keys == ("k",)
    assert m.message_id and len(m.message_id) == 34
    assert outgoing("t", b"x", delay=timedelta(seconds=1.5)).delay_ms == 1500
    assert outgoing("t", b"x", delay=250).delay_ms == 250
    with pytest.raises(core.ConflictingDelivery) as e:
        outgoing("t", b"x", delay=1, delay_level=2)
    assert e.value.details["given"] == ["delay", "delay_level"]
    # The SDK's own argument names, not the broker's (it said 'deliver_at_ms, delay_ms' to an SDK caller).
    assert e.value.message == ("a message is delayed one way at most (a delivery time, a delay or a delay level); "
                               "got delay and delay_level")


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"deliver_at": datetime(2026, 1, 1)}, "deliver_at"),           # naive: which zone?
    ({"deliver_at": -5}, "deliver_at"),
    ({"deliver_at": 1.5}, "deliver_at"),
    ({"delay": "5s"}, "delay"),
    ({"delay_level": True}, "delay_level"),
    ({"properties": {"a": 1}}, "property"),
])
def test_outgoing_refuses_bad_arguments_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        outgoing("t", b"x", **kwargs)
    assert e.value.details["name"] == name


def test_outgoing_refuses_empty_topic_and_non_bytes_body() -> None:
    with pytest.raises(InvalidArgument):
        outgoing("", b"x")
    with pytest.raises(InvalidArgument):
        outgoing("t", 42)  # type: ignore[arg-type]


def test_encoded_messages_decode_through_the_servers_decoder() -> None:
    cfg = Config()
    cases = [
        (outgoing("t", b"n", tag="tg", keys=("a", "b"), properties={"x": "y"}), MessageType.NORMAL),
        (outgoing("t", b"at", deliver_at=NOW_MS + 60_123), MessageType.DELAY),
        (outgoing("t", b"in", delay=30_000), MessageType.DELAY),
        (outgoing("t", b"lv", delay_level=3), MessageType.DELAY),
        (outgoing("t", b"fifo", message_group="g1"), MessageType.FIFO),
    ]
    for msg, mtype in cases:
        decoded = requests.decode_message(wire.encode_message(msg, NOW_MS), cfg)
        assert decoded.message_type is mtype
        assert (decoded.topic, decoded.body, decoded.message_id) == (msg.topic, msg.body, msg.message_id)
        assert decoded.born_ms == NOW_MS
        assert decoded.deliver_at_ms == msg.deliver_at_ms  # ms precision survives seconds + nanos
    assert requests.decode_message(wire.encode_message(cases[0][0], NOW_MS), cfg).keys == ("a", "b")
    assert requests.decode_message(wire.encode_message(cases[0][0], NOW_MS), cfg).tag == "tg"
    delayed = requests.decode_message(wire.encode_message(cases[2][0], NOW_MS), cfg)
    assert delayed.properties["TIMER_DELAY_MS"] == "30000"
    assert requests.decode_message(wire.encode_message(cases[3][0], NOW_MS), cfg).properties["DELAY"] == "3"


def _received(body: bytes, digest: str | None = None, digest_type: int = pb.MD5) -> pb.Message:
    m = pb.Message(topic=pb.Resource(name="t"), body=body, user_properties={"u": "1"})
    sp = m.system_properties
    sp.message_id, sp.tag, sp.receipt_handle, sp.delivery_attempt = "ID1", "tg", "RH1", 2
    sp.keys.extend(["k"])
    sp.queue_id, sp.queue_offset = 3, 17
    sp.delivery_timestamp.CopyFrom(wire.ms_to_timestamp(NOW_MS))
    sp.store_timestamp.CopyFrom(wire.ms_to_timestamp(NOW_MS - 5000))
    sp.invisible_duration.CopyFrom(wire.ms_to_duration(30_000))
    if digest is not None:
        sp.body_digest.type = digest_type
        sp.body_digest.checksum = digest
    return m


def test_decode_received_reads_every_field_and_lateness() -> None:
    body = b"payload"
    r = wire.decode_received(_received(body, hashlib.md5(body).hexdigest().upper()), NOW_MS + 12)
    assert (r.message_id, r.topic, r.body, r.tag, r.keys) == ("ID1", "t", body, "tg", ("k",))
    assert (r.queue_id, r.queue_offset, r.receipt_handle, r.delivery_attempt) == (3, 17, "RH1", 2)
    assert r.deliver_at_ms == NOW_MS and r.store_ms == NOW_MS - 5000
    assert r.invisible_duration_ms == 30_000 and r.properties == {"u": "1"}
    assert r.lateness_ms == 12
    assert r.body_digest_ok is True


def test_body_digest_mismatch_and_crc_forms() -> None:
    assert wire.decode_received(_received(b"a", "00" * 16), 0).body_digest_ok is False
    assert wire.decode_received(_received(b"a"), 0).body_digest_ok is None
    import zlib
    crc = zlib.crc32(b"a")
    assert wire.decode_received(_received(b"a", f"{crc:08X}", pb.CRC32), 0).body_digest_ok is True
    assert wire.decode_received(_received(b"a", str(crc), pb.CRC32), 0).body_digest_ok is True


def test_decode_received_without_receipt_handle_is_a_protocol_violation() -> None:
    m = _received(b"a")
    m.system_properties.receipt_handle = ""
    with pytest.raises(ProtocolViolation):
        wire.decode_received(m, 0)


def test_status_codes_map_to_chronoq_classes() -> None:
    e = from_status(40402, "topic 'x' does not exist")
    assert isinstance(e, core.TopicNotFound) and e.code == 40402 and e.message == "topic 'x' does not exist"
    assert isinstance(from_status(40012, "too far"), core.InvalidDeliveryTime)
    assert isinstance(from_status(50500, "no SQL"), Unsupported)
    # Several classes share 42800: the client knows only their common base...
    shared = from_status(42800, "already fired")
    assert type(shared) is core.TimerNotPending and shared.code == 42800
    # ...unless the admin service names the class.
    named = from_status(42800, "already fired", error="TimerAlreadyFired", retriable=False)
    assert type(named) is core.TimerAlreadyFired
    # 42900 (TOO_MANY_REQUESTS) is shared by a congested timer slot and a full disk: both back off.
    congested = from_status(42900, "slot full")
    assert type(congested) is core.Throttled and congested.retriable
    assert type(from_status(42900, "slot full", error="TimerSlotCongested")) is core.TimerSlotCongested
    unknown = from_status(59999, "odd", retriable=True)
    assert isinstance(unknown, RemoteError) and unknown.code == 59999 and unknown.retriable


def test_check_status_accepts_ok_and_refuses_missing_code() -> None:
    wire.check_status("X", pb.Status(code=pb.OK))
    wire.check_status("X", pb.Status(code=pb.MULTIPLE_RESULTS))
    with pytest.raises(ProtocolViolation):
        wire.check_status("X", pb.Status())
    with pytest.raises(core.InvalidReceiptHandle):
        wire.check_status("X", pb.Status(code=pb.INVALID_RECEIPT_HANDLE, message="gone"))


def test_admin_replies() -> None:
    assert wire.admin_result("M", {"code": 20000, "message": "OK", "x": 1})["x"] == 1
    with pytest.raises(ProtocolViolation):
        wire.admin_result("M", None)
    with pytest.raises(core.TopicExists) as e:
        wire.admin_result("M", {"code": 40000, "message": "exists", "error": "TopicExists", "retriable": False})
    assert e.value.message == "exists"
    with pytest.raises(core.InvalidBatchSize) as sized:
        wire.admin_result("M", {"code": 40000, "message": "too many", "error": "InvalidBatchSize",
                                "details": {"size": 2000, "limit": 1024, "message": "ignored", "server_code": 1}})
    # The server's values come back as details; names the exception keeps for itself are not overwritten.
    assert sized.value.details == {"size": 2000, "limit": 1024, "server_code": 40000}
    with pytest.raises(RemoteError) as unknown:
        wire.admin_result("M", {"code": 40099, "message": "new", "error": "NotAClass", "details": {"x": [1, "a"]}})
    assert unknown.value.details["x"] == [1, "a"] and unknown.value.details["server_message"] == "new"
    msg = outgoing("t", b"\x00\xff", delay_level=2, keys=("a",), tag="g")
    doc = wire.outgoing_to_json(msg)
    assert base64.b64decode(doc["body_b64"]) == b"\x00\xff" and doc["delay_level"] == 2 and doc["keys"] == ["a"]
    ok = wire.send_result_from_json({"message_id": "M1", "topic": "t", "queue_id": 1, "queue_offset": 9,
                                     "deliver_at_ms": 5, "recall_handle": "H", "duplicate": True}, msg)
    assert ok == SendReceipt("M1", "t", 9, "H", 5, 1, True)
    bad = wire.send_result_from_json({"error": {"code": 40012, "message": "m", "error": "NegativeDelay"}}, msg)
    assert isinstance(bad, core.NegativeDelay)
    garbled = wire.send_result_from_json({"message_id": "M1"}, msg)
    assert isinstance(garbled, ProtocolViolation)
    with pytest.raises(ProtocolViolation):
        wire.read_from_json({"messages": [{"message_id": 1}]})
    read = wire.read_from_json({"next_offset": 8, "messages": [{
        "message_id": "M", "topic": "t", "queue_id": 0, "queue_offset": 7, "body_b64": "aGk=",
        "born_ms": 1, "store_ms": 2}]})
    assert read.next_offset == 8 and read.messages[0].body == b"hi" and read.messages[0].deliver_at_ms is None


def test_cli_argument_types() -> None:
    assert parse_at("1795300000000") == 1_795_300_000_000
    assert parse_at("2026-11-22T03:00:00Z") == int(datetime(2026, 11, 22, 3, tzinfo=UTC).timestamp() * 1000)
    tz = timezone(timedelta(hours=1))
    assert parse_at("2026-11-22T04:00:00+01:00") == int(datetime(2026, 11, 22, 4, tzinfo=tz).timestamp() * 1000)
    assert parse_in("5m") == 300_000 and parse_in("1500ms") == 1500
    assert parse_prop("a=b=c") == ("a", "b=c")
    for bad, fn in (("tomorrow", parse_at), ("5 minutes", parse_in), ("novalue", parse_prop)):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)
    # Digits too small to be a date since 2001: a delay typed as --at, told so with the date it means.
    with pytest.raises(argparse.ArgumentTypeError, match=r"1970-01-01T00:00:01Z.*--in 1000ms"):
        parse_at("1000")
    # Epoch seconds where ms belong: told so, with the value in ms.
    with pytest.raises(argparse.ArgumentTypeError, match=r"^1795838000 looks like seconds since the epoch "
                       r"\(2026-11-28T03:53:20Z as seconds, .*\); give milliseconds \(1795838000000\)$"):
        parse_at("1795838000")


_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=12)
_reply_keys = st.sampled_from(["code", "message", "error", "retriable", "details", "topics", "topic", "queues",
                               "statuses", "messages", "next_offset", "results", "message_id"])


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_reply_keys, _json, max_size=6).map(lambda d: {**d, "code": 20000}) |
       st.dictionaries(_reply_keys, _json, max_size=6) | _json)
def test_admin_reply_decoders_only_raise_chronoq_errors(reply: object) -> None:
    """A hostile or broken server can make a call fail, but only with a chronoq error."""
    for decode in (wire.topics_from_json, wire.description_from_json, wire.statuses_from_json,
                   wire.read_from_json):
        try:
            decode(wire.admin_result("M", reply))  # type: ignore[arg-type]
        except core.ChronoqError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_received_message_decoder_only_raises_protocol_violation(data: bytes) -> None:
    try:
        m = pb.Message.FromString(data)
    except Exception:  # not a protobuf at all: grpc's parser refuses it before the SDK sees it
        return
    try:
        r = wire.decode_received(m, NOW_MS)
    except ProtocolViolation:
        return
    assert r.receipt_handle == m.system_properties.receipt_handle


_entry_keys = st.sampled_from(["message_id", "topic", "state", "deliver_at_ms", "accepted_ms", "queue_id",
                               "queue_offset", "body_b64", "name", "queue_count", "min_offset", "max_offset",
                               "recall_handle", "error", "code"])
_entry = st.dictionaries(_entry_keys, _scalar | st.just("aGk="), max_size=10)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(_entry, max_size=3), _scalar)
def test_near_valid_replies_only_raise_chronoq_errors(entries: list, next_offset: object) -> None:
    reply = {"code": 20000, "statuses": entries, "messages": entries, "topics": entries, "queues": entries,
             "topic": entries[0] if entries else {}, "next_offset": next_offset}
    for decode in (wire.topics_from_json, wire.description_from_json, wire.statuses_from_json,
                   wire.read_from_json):
        try:
            decode(reply)
        except ProtocolViolation:
            pass
    msg = outgoing("t", b"x")
    for entry in entries:
        result = wire.send_result_from_json(entry, msg)
        assert isinstance(result, SendReceipt | core.ChronoqError)


_text = st.text(st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=3000), tag=_text, keys=st.lists(_text, max_size=3),
       props=st.dictionaries(_text.filter(bool), _text, max_size=4), group=_text,
       deliver_at=st.none() | st.integers(0, 2**62).filter(lambda ms: seconds_not_ms(ms) is None))
def test_encoded_size_bounds_both_encodings(body: bytes, tag: str, keys: list[str], props: dict[str, str],
                                            group: str, deliver_at: int | None) -> None:
    """`send_batch` cuts requests by `encoded_size`: it must never be below what goes on the wire."""
    msg = outgoing("t\u00e9", body, tag=tag or None, keys=keys, properties=props, message_group=group or None,
                   deliver_at=deliver_at)
    assert wire.encoded_size(msg, json_body=False) >= len(wire.encode_message(msg, NOW_MS).SerializeToString())
    doc = json.dumps(wire.outgoing_to_json(msg), separators=(",", ":")).encode()
    assert wire.encoded_size(msg, json_body=True) >= len(doc) + 1  # + the list's separator
