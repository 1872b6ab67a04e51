"""The Pulsar codec (chronoq/pulsar/codec.py): frames, checksums and batches round-trip, the bytes
match what Pulsar's C++ client sends, and malformed input raises `FrameError` and nothing else."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq.config import Config
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import FrameError, FrameReader, Type
from chronoq.pulsar.messages import Refused, messages_of

ROOT = Path(__file__).resolve().parents[2]


def _send(seq: int, payload: bytes, **meta: object) -> bytes:
    cmd = codec.make_command(Type.SEND, send=api.CommandSend(producer_id=0, sequence_id=seq))
    md = api.MessageMetadata(producer_name="p", sequence_id=seq, publish_time=1_795_837_227_387, **meta)
    return codec.encode_payload_command(cmd, md, payload)


def test_the_first_frame_of_the_cpp_client_decodes() -> None:
    """CONNECT as `pulsar.Client(...).create_producer(...)` sends it (45 bytes, C++ client 4.2.0)."""
    raw = bytes.fromhex("00000029 00000025 0802 1221 0a11 50756c7361722d4350502d76342e322e30 2014 2a04 6e6f6e65"
                        " 5204 0801 1001".replace(" ", ""))
    frames = FrameReader().feed(raw)
    assert len(frames) == 1
    connect = frames[0].command.connect
    assert frames[0].command.type == Type.CONNECT
    assert (connect.client_version, connect.protocol_version, connect.auth_method_name) == (
        "Pulsar-CPP-v4.2.0", 20, "none")
    assert connect.feature_flags.supports_broker_entry_metadata


def test_a_simple_command_round_trips_and_its_sizes_are_pulsars() -> None:
    cmd = codec.make_command(Type.FLOW, flow=api.CommandFlow(consumer_id=7, messagePermits=1000))
    raw = codec.encode_command(cmd)
    total, size = struct.unpack(">II", raw[:8])
    assert total == len(raw) - 4 and size == len(raw) - 8
    (frame,) = FrameReader().feed(raw)
    assert frame.command == cmd and frame.metadata is None


def test_a_send_round_trips_with_its_checksum_and_deliver_at_time() -> None:
    raw = _send(3, b"delayed-2", deliver_at_time=1_795_837_230_387)
    assert struct.unpack(">H", raw[8 + struct.unpack(">I", raw[4:8])[0]:][:2])[0] == codec.MAGIC_CRC32C
    (frame,) = FrameReader().feed(raw)
    assert frame.checksum_present and frame.payload == b"delayed-2"
    assert frame.metadata.deliver_at_time == 1_795_837_230_387 and frame.command.send.sequence_id == 3


def test_frames_split_anywhere_come_out_whole_and_in_order() -> None:
    stream = b"".join(_send(i, f"m-{i}".encode()) for i in range(5))
    for step in (1, 3, 7, 64):
        reader, out = FrameReader(), []
        for at in range(0, len(stream), step):
            out += reader.feed(stream[at:at + step])
        assert [f.payload for f in out] == [f"m-{i}".encode() for i in range(5)]
        assert reader.buffered == 0


def test_a_send_without_checksum_is_read_and_a_wrong_one_refused() -> None:
    cmd = codec.make_command(Type.SEND, send=api.CommandSend(producer_id=0, sequence_id=1))
    md = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1).SerializeToString()
    raw_cmd = cmd.SerializeToString()
    tail = struct.pack(">I", len(md)) + md + b"x"
    plain = struct.pack(">II", 4 + len(raw_cmd) + len(tail), len(raw_cmd)) + raw_cmd + tail
    (frame,) = FrameReader().feed(plain)
    assert not frame.checksum_present and frame.payload == b"x"
    good = bytearray(_send(1, b"payload"))
    good[-1] ^= 0x01
    with pytest.raises(FrameError, match="checksum mismatch"):
        FrameReader().feed(bytes(good))


def test_broker_entry_metadata_before_the_checksum_is_skipped() -> None:
    cmd = codec.make_command(Type.MESSAGE, message=api.CommandMessage(
        consumer_id=0, message_id=api.MessageIdData(ledgerId=1, entryId=2)))
    framed = codec.encode_payload_command(cmd, api.MessageMetadata(producer_name="p", sequence_id=0,
                                                                   publish_time=5), b"body")
    size = struct.unpack(">I", framed[4:8])[0]
    head, tail = framed[8:8 + size], framed[8 + size:]
    entry = b"\x08\x01\x10\x02"
    body = struct.pack(">I", len(head)) + head + struct.pack(">HI", codec.MAGIC_BROKER_ENTRY_METADATA,
                                                             len(entry)) + entry + tail
    (frame,) = FrameReader().feed(struct.pack(">I", len(body)) + body)
    assert frame.payload == b"body" and frame.checksum_present


def test_a_batch_splits_into_its_messages() -> None:
    """The layout observed from the C++ client: `00000004 1803 4000 "b-0" 00000004 1803 4002 "b-2"`."""
    observed = bytes.fromhex("00000004 1803 4000".replace(" ", "")) + b"b-0" + \
        bytes.fromhex("00000004 1803 4002".replace(" ", "")) + b"b-2"
    meta = api.MessageMetadata(num_messages_in_batch=2)
    singles = codec.split_batch(meta, observed)
    assert [(s.payload, s.metadata.sequence_id) for s in singles] == [(b"b-0", 0), (b"b-2", 2)]
    rebuilt = codec.join_batch((api.SingleMessageMetadata(sequence_id=s.metadata.sequence_id), s.payload)
                               for s in singles)
    assert rebuilt == observed


@pytest.mark.parametrize(("payload", "count", "reason"), [
    (b"\x00\x00\x00\x04\x18\x03\x40\x00b-0", 2, "cut off"),
    (b"\x00\x00\x00\x04\x18\x03\x40\x00b-0xx", 1, "bytes over"),
    (b"\x00\x00\x00\x04\x18\x09\x40\x00b-0", 1, "exceeds the payload"),
    (b"\x00\x00\x00\x02\x40\x00b-0", 1, "no payload_size"),
    (b"", 0, "num_messages_in_batch is 0"),
])
def test_a_bad_batch_is_refused(payload: bytes, count: int, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        codec.split_batch(api.MessageMetadata(num_messages_in_batch=count), payload)


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\x00\x00\x00\x02\x00\x00", "outside"),
    (b"\xff\xff\xff\xff", "outside"),
    (b"\x00\x00\x00\x08\x00\x00\x00\x09abcd", "exceeds"),
    (b"\x00\x00\x00\x06\x00\x00\x00\x02\x10\x01", "no type"),
    (b"\x00\x00\x00\x07\x00\x00\x00\x03\x08\x12\xff", "does not parse"),
    (b"\x00\x00\x00\x07\x00\x00\x00\x02\x08\x12x", "carries 1 bytes"),
    (b"\x00\x00\x00\x06\x00\x00\x00\x02\x08\x06", "no message metadata"),
    (b"\x00\x00\x00\x0b\x00\x00\x00\x07\x08\x02\x12\x03\x0a\x01\xff", "not UTF-8"),
])
def test_malformed_frames_say_what_is_wrong(raw: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        FrameReader().feed(raw)


def test_a_frame_above_the_limit_is_refused_before_it_is_buffered() -> None:
    reader = FrameReader(max_frame_bytes=1024)
    with pytest.raises(FrameError, match=r"outside 4\.\.1024"):
        reader.feed(struct.pack(">I", 1025))


def test_an_unknown_command_type_still_decodes() -> None:
    base = api.BaseCommand(type=99)
    (frame,) = FrameReader().feed(codec.encode_command(base))
    assert frame.command.type == 99 and codec.type_name(99) == "type 99"


def test_the_committed_module_is_what_protoc_makes_of_the_proto(tmp_path: Path) -> None:
    """pulsar_api_pb2.py is generated from pulsar_api.proto (its header says how)."""
    pytest.importorskip("grpc_tools")
    proto = "chronoq/pulsar/pulsar_api.proto"
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out}", proto],
                          cwd=ROOT, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    made = (out / "chronoq/pulsar/pulsar_api_pb2.py").read_text()
    committed = (ROOT / "chronoq/pulsar/pulsar_api_pb2.py").read_text()
    assert made == committed, "regenerate chronoq/pulsar/pulsar_api_pb2.py (pulsar_api.proto's header says how)"


# -- fuzz: whatever the bytes, FrameError or frames, never another exception ----------------------

VALID = [_send(1, b"x", deliver_at_time=5), codec.encode_command(codec.make_command(
    Type.PING, ping=api.CommandPing())), _send(2, codec.join_batch([(api.SingleMessageMetadata(), b"ab")]),
                                              num_messages_in_batch=1)]


CONFIG = Config()


def _decode_all(data: bytes) -> None:
    """Frames, then for each SEND what the door would store (`messages_of`): FrameError or
    Refused (a SEND_ERROR for that send alone), never another exception."""
    reader = FrameReader(max_frame_bytes=1 << 16)
    try:
        for frame in reader.feed(data):
            if frame.metadata is not None and frame.metadata.HasField("num_messages_in_batch"):
                with contextlib.suppress(FrameError):
                    codec.split_batch(frame.metadata, frame.payload)
            if frame.command.type == Type.SEND and frame.metadata is not None:
                with contextlib.suppress(Refused):
                    messages_of(frame, "orders", "p", 1_795_837_227_000, CONFIG)
    except FrameError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_all(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
       st.integers(0, 40))
def test_fuzz_mutated_valid_frames(frame: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(frame)
    for at, value in flips:
        if at < len(data):
            data[at] = value
    _decode_all(bytes(data[:len(data) - cut] if cut < len(data) else data))


@pytest.mark.slow
@settings(max_examples=5000, deadline=None)
@given(st.sampled_from(VALID), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=12),
       st.binary(max_size=64))
def test_fuzz_mutated_valid_frames_long(frame: bytes, flips: list[tuple[int, int]], extra: bytes) -> None:
    data = bytearray(frame)
    for at, value in flips:
        if at < len(data):
            data[at] = value
    _decode_all(bytes(data) + extra)


text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=120), batch=st.one_of(st.none(), st.integers(0, 4)),
       deliver_at=st.one_of(st.none(), st.integers(0, (1 << 63) - 1)), publish=st.integers(0, (1 << 63) - 1),
       compression=st.sampled_from(list(api.CompressionType.values())), null=st.booleans(),
       props=st.dictionaries(text, text, max_size=3), key=text, event_time=st.integers(0, (1 << 64) - 1))
def test_fuzz_any_send_metadata_becomes_messages_or_a_refusal(payload: bytes, batch: int | None,
                                                              deliver_at: int | None, publish: int, compression: int,
                                                              null: bool, props: dict[str, str], key: str,
                                                              event_time: int) -> None:
    """Whatever metadata a SEND carries, the door stores messages or refuses that send (Refused,
    a SEND_ERROR), never fails its producer."""
    meta: dict[str, object] = {"publish_time": publish, "compression": compression, "null_value": null,
                               "partition_key": key, "event_time": event_time,
                               "properties": [api.KeyValue(key=k, value=v) for k, v in props.items()]}
    if deliver_at is not None:
        meta["deliver_at_time"] = deliver_at
    if batch is not None:
        meta["num_messages_in_batch"] = batch
    cmd = codec.make_command(Type.SEND, send=api.CommandSend(producer_id=0, sequence_id=7))
    raw = codec.encode_payload_command(cmd, api.MessageMetadata(producer_name="p", sequence_id=7, **meta), payload)
    (frame,) = FrameReader().feed(raw)
    try:
        out = messages_of(frame, "orders", "p", 1_795_837_227_000, CONFIG)
    except Refused as exc:
        assert exc.message
        return
    assert out and all(m.topic in ("orders", "%PULSAR_NOW%orders") for m in out)
