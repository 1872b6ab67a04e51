"""Pulsar's binary protocol as bytes in and values out: framing, checksums, batches. No I/O.

Theory of operation: a Pulsar connection is a stream of frames, each
`[totalSize u32][commandSize u32][BaseCommand]` (big-endian, `totalSize` counting everything
after itself). SEND (client to broker) and MESSAGE (broker to client) carry a payload after the
command: optionally `[0x0e02][u32 size][BrokerEntryMetadata]` (broker to client only), then
`[0x0e01][CRC32C u32][u32 metadataSize][MessageMetadata][payload]`, the checksum (Castagnoli)
covering everything after itself. A batch is one payload of `[u32 size][SingleMessageMetadata]
[payload_i]` repeated, with `MessageMetadata.num_messages_in_batch` set.

`FrameReader` cuts frames out of whatever the socket delivered (`feed` returns the complete
ones, keeps the rest) and `decode_frame` reads one. Everything a peer can get wrong about the
bytes (a size out of range or past the frame, a checksum that does not match, protobuf that
does not parse, a required field missing, a batch whose sizes do not add up) raises the one
error `FrameError`, whose text says what and where; the door closes that connection with one
log line. Nothing else escapes the decoder (tests/pulsar/test_codec.py fuzzes it). What a
well-formed frame *asks* for (an unknown topic, a compression chronoq does not read) is the
door's to answer, not an error here.

The messages are protobuf classes generated from `pulsar_api.proto` beside this file, chronoq's
own subset of Pulsar's published definitions (its field numbers; see that file's header).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import crc32c
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from chronoq.pulsar import pulsar_api_pb2 as api

BaseCommand = api.BaseCommand
MessageMetadata = api.MessageMetadata
SingleMessageMetadata = api.SingleMessageMetadata
MessageIdData = api.MessageIdData
ServerError = api.ServerError
Type = api.BaseCommand.Type

MAGIC_CRC32C = 0x0E01
MAGIC_BROKER_ENTRY_METADATA = 0x0E02
MAX_FRAME_BYTES = 5 * 1024 * 1024
"""Pulsar's largest frame (`Commands::MaxFrameSize`, its brokers' default `maxMessageSize` plus
room): the most a client sends unless CONNECTED names a larger message size."""
FRAME_OVERHEAD_BYTES = 64 * 1024
"""Room for the command and metadata around a payload of the largest message size."""

_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U32_U32 = struct.Struct(">II")


class FrameError(ValueError):
    """The bytes are not a Pulsar frame chronoq can read; `reason` says what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class Frame:
    """One decoded frame: its command, and for SEND/MESSAGE the metadata and payload."""

    command: Message  # a BaseCommand
    metadata: Message | None = None  # a MessageMetadata
    payload: bytes = b""
    checksum_present: bool = False


@dataclass(slots=True)
class SingleMessage:
    """One message of a batch: its own metadata and payload."""

    metadata: Message  # a SingleMessageMetadata
    payload: bytes


@dataclass(slots=True)
class FrameReader:
    """Cuts whole frames out of a byte stream. `max_frame_bytes` bounds `totalSize`, so a peer
    cannot make the reader buffer without limit."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[Frame]:
        """Add `data`; return every frame now complete, decoded, in order. Raises `FrameError`
        for the first one that is malformed (the stream cannot be resynchronised after it)."""
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        start = 0
        while len(buffer) - start >= 4:
            (total,) = _U32.unpack_from(buffer, start)
            if total < 4 or total > self.max_frame_bytes:
                raise FrameError(f"frame size {total} is outside 4..{self.max_frame_bytes}")
            if len(buffer) - start - 4 < total:
                break
            frames.append(decode_frame(bytes(buffer[start + 4:start + 4 + total])))
            start += 4 + total
        if start:
            del buffer[:start]
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buffer)


def _parse(cls: type[Message], data: bytes, what: str) -> Message:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise FrameError(f"{what} does not parse as protobuf: {exc}") from None
    _check_text(msg, what)
    return msg


def _check_text(msg: Message, what: str) -> None:
    """Refuse a string field that is not UTF-8. Protobuf's proto2 runtime hands such a field
    back as `bytes` instead of failing the parse, and every reader after this one expects `str`."""
    for fd, value in msg.ListFields():
        if fd.type == _STRING:
            for text in (value if _repeated(fd) else (value,)):
                if not isinstance(text, str):
                    raise FrameError(f"{what}: field {fd.name} is not UTF-8 text")
        elif fd.type == _MESSAGE:
            for sub in (value if _repeated(fd) else (value,)):
                _check_text(sub, what)


def _repeated(fd: FieldDescriptor) -> bool:
    return bool(fd.is_repeated)


def decode_frame(body: bytes) -> Frame:
    """One frame without its leading `totalSize`. SEND and MESSAGE must carry metadata; the
    checksum is verified when present (a client may leave it out; Pulsar brokers accept that)."""
    if len(body) < 4:
        raise FrameError(f"frame of {len(body)} bytes has no command size")
    (cmd_size,) = _U32.unpack_from(body, 0)
    if cmd_size > len(body) - 4:
        raise FrameError(f"command size {cmd_size} exceeds the frame's remaining {len(body) - 4} bytes")
    command = _parse(BaseCommand, body[4:4 + cmd_size], "the command")
    if not command.HasField("type"):
        raise FrameError("the command has no type")
    rest = body[4 + cmd_size:]
    if command.type not in (Type.SEND, Type.MESSAGE):
        if rest:
            raise FrameError(f"{type_name(command.type)} carries {len(rest)} bytes after its command")
        return Frame(command)
    return _decode_payload(command, rest)


def _decode_payload(command: Message, rest: bytes) -> Frame:
    pos = 0
    if len(rest) >= 2 and _U16.unpack_from(rest, 0)[0] == MAGIC_BROKER_ENTRY_METADATA:
        if len(rest) < 6:
            raise FrameError("broker entry metadata is cut off")
        (size,) = _U32.unpack_from(rest, 2)
        if size > len(rest) - 6:
            raise FrameError(f"broker entry metadata size {size} exceeds the frame")
        pos = 6 + size
    checksum_present = False
    if len(rest) - pos >= 2 and _U16.unpack_from(rest, pos)[0] == MAGIC_CRC32C:
        if len(rest) - pos < 6:
            raise FrameError("the checksum is cut off")
        (expected,) = _U32.unpack_from(rest, pos + 2)
        pos += 6
        actual = crc32c.crc32c(rest[pos:])
        if actual != expected:
            raise FrameError(f"checksum mismatch: the frame says {expected:#010x}, its bytes give {actual:#010x}")
        checksum_present = True
    if len(rest) - pos < 4:
        raise FrameError(f"{type_name(command.type)} has no message metadata")
    (meta_size,) = _U32.unpack_from(rest, pos)
    pos += 4
    if meta_size > len(rest) - pos:
        raise FrameError(f"metadata size {meta_size} exceeds the frame's remaining {len(rest) - pos} bytes")
    metadata = _parse(MessageMetadata, rest[pos:pos + meta_size], "the message metadata")
    return Frame(command, metadata, rest[pos + meta_size:], checksum_present)


def split_batch(metadata: Message, payload: bytes) -> list[SingleMessage]:
    """The messages of a batched payload (`num_messages_in_batch` of them), each with its own
    metadata. Sizes that do not add up to the payload raise `FrameError`."""
    count = metadata.num_messages_in_batch
    if count < 1:
        raise FrameError(f"num_messages_in_batch is {count}")
    out: list[SingleMessage] = []
    pos = 0
    for i in range(count):
        if len(payload) - pos < 4:
            raise FrameError(f"batch message {i} of {count}: its metadata size is cut off")
        (size,) = _U32.unpack_from(payload, pos)
        pos += 4
        if size > len(payload) - pos:
            raise FrameError(f"batch message {i} of {count}: metadata size {size} exceeds the payload")
        single = _parse(SingleMessageMetadata, payload[pos:pos + size], f"batch message {i}'s metadata")
        pos += size
        if not single.HasField("payload_size"):
            raise FrameError(f"batch message {i} of {count} has no payload_size")
        length = single.payload_size
        if length < 0 or length > len(payload) - pos:
            raise FrameError(f"batch message {i} of {count}: payload size {length} exceeds the payload")
        out.append(SingleMessage(single, payload[pos:pos + length]))
        pos += length
    if pos != len(payload):
        raise FrameError(f"the batch of {count} leaves {len(payload) - pos} bytes over")
    return out


def join_batch(messages: Iterable[tuple[Message, bytes]]) -> bytes:
    """A batched payload from (SingleMessageMetadata, payload) pairs; `payload_size` is set here."""
    parts: list[bytes] = []
    for single, payload in messages:
        single.payload_size = len(payload)
        raw = single.SerializeToString()
        parts += (_U32.pack(len(raw)), raw, payload)
    return b"".join(parts)


def encode_command(command: Message) -> bytes:
    """A simple frame: `[totalSize][commandSize][BaseCommand]`."""
    raw = command.SerializeToString()
    return _U32_U32.pack(len(raw) + 4, len(raw)) + raw


def encode_payload_command(command: Message, metadata: Message, payload: bytes) -> bytes:
    """A SEND or MESSAGE frame, with the CRC32C over metadata size, metadata and payload."""
    raw = command.SerializeToString()
    meta = metadata.SerializeToString()
    checked = _U32.pack(len(meta)) + meta + payload
    tail = _U16.pack(MAGIC_CRC32C) + _U32.pack(crc32c.crc32c(checked)) + checked
    return _U32_U32.pack(4 + len(raw) + len(tail), len(raw)) + raw + tail


def type_name(value: int) -> str:
    """A command type's name, or `type N` for one this protocol subset does not know."""
    try:
        return Type.Name(value)
    except ValueError:
        return f"type {value}"


def make_command(kind: int, **sub: Message) -> Message:
    """A BaseCommand of type `kind` with the one sub-command given by keyword, e.g.
    `make_command(Type.PONG, pong=api.CommandPong())`."""
    base = BaseCommand(type=kind)
    for name, value in sub.items():
        getattr(base, name).CopyFrom(value)
    return base


def properties_of(pairs: Iterable[Message]) -> dict[str, str]:
    """KeyValue pairs as a dict (a repeated key: the last one wins, as Pulsar's clients read them)."""
    return {kv.key: kv.value for kv in pairs}


def key_values(props: Mapping[str, str]) -> list[Message]:
    return [api.KeyValue(key=k, value=v) for k, v in props.items()]
