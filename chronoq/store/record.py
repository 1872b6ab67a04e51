"""The commit-log record: one message, framed, versioned and checksummed.

Theory of operation: `encode_record` turns a message into bytes; `decode_record` turns bytes back
and raises `CorruptRecord` (and nothing else) on any mismatch: short input, a length that runs
past the buffer, wrong magic, unknown version, bad CRC, a position that is not where the record
was read from. The store uses the same decoder for recovery (a failure at the tail is a torn
write) and for `chronoq check` (a failure elsewhere is damage). Pure functions, no I/O.

Byte layout, version 1: `docs/disk-format.md` ("Commit-log record") is its one description
(a 72-byte fixed header of big-endian integers, then message id, topic, tag, keys block,
properties blocks and body); `tests/store/test_disk_format.py` checks the sizes it states and
`tests/store/test_record.py` every field.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import crc32c

from chronoq.errors import CorruptRecord
from chronoq.model import MessageType, StoredMessage

RECORD_MAGIC = 0xC4A0
RECORD_VERSION = 1
KIND_MESSAGE = 1
HEADER = struct.Struct(">IIHBBB3xQQIQQHHHHIII")
HEADER_SIZE = HEADER.size  # 72
_PREFIX = struct.Struct(">II")
_HEADER_REST = struct.Struct(">HBBB3xQQIQQHHHHIII")
"""HEADER without its first 8 bytes (total size, CRC32C)."""
_MESSAGE_TYPES = {int(t): t for t in MessageType}
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
MAX_U16 = 0xFFFF

STORE_MS = struct.Struct(">Q")
STORE_MS_OFFSET = struct.calcsize(">IIHBBB3xQQIQ")
"""store_ms is read alone by retention (`CommitLog.opened_youngest_store_ms`), without decoding."""

assert HEADER_SIZE == 72
assert STORE_MS_OFFSET == 44
assert _PREFIX.size + _HEADER_REST.size == HEADER_SIZE


def encode_properties(props: Mapping[str, str]) -> bytes:
    if not props:
        return b""
    parts: list[bytes] = []
    cache = _KEY_FIELDS
    for key in sorted(props):
        kf = cache.get(key)
        if kf is None:
            k = key.encode()
            kf = _U16.pack(len(k)) + k
            if len(cache) < _KEY_FIELDS_MAX:
                cache[key] = kf
        v = props[key].encode()
        parts.append(kf)
        parts.append(_U32.pack(len(v)))
        parts.append(v)
    return b"".join(parts)


_KEY_FIELDS: dict[str, bytes] = {}
"""Encoded key fields (length + UTF-8) of property names seen: the system properties and a
producer's usual few, encoded once."""
_KEY_FIELDS_MAX = 1024


def decode_properties(buf: bytes | memoryview) -> dict[str, str]:
    if not buf:
        return {}
    if type(buf) is not bytes:
        buf = bytes(buf)
    out: dict[str, str] = {}
    i = 0
    n = len(buf)
    unpack_u16, unpack_u32 = _U16.unpack_from, _U32.unpack_from
    try:
        while i < n:
            if i + 2 > n:
                raise CorruptRecord("properties block ends inside a key length")
            klen = unpack_u16(buf, i)[0]
            i += 2
            if i + klen + 4 > n:
                raise CorruptRecord("properties block ends inside a key")
            key = buf[i:i + klen].decode()
            i += klen
            vlen = unpack_u32(buf, i)[0]
            i += 4
            if i + vlen > n:
                raise CorruptRecord("properties block ends inside a value")
            out[key] = buf[i:i + vlen].decode()
            i += vlen
    except UnicodeDecodeError as e:
        raise CorruptRecord(f"property is not UTF-8: {e}") from None
    return out


def encode_keys(keys: tuple[str, ...]) -> bytes:
    return "\x00".join(keys).encode() if keys else b""


def decode_keys(buf: bytes) -> tuple[str, ...]:
    return tuple(buf.decode().split("\x00")) if buf else ()


def encode_record(
    *, position: int, message_id: str, topic: str, queue_id: int, queue_offset: int,
    message_type: MessageType, tag: str, keys: tuple[str, ...], properties: Mapping[str, str],
    system_properties: Mapping[str, str], body: bytes, born_ms: int, store_ms: int,
) -> bytes:
    mid = message_id.encode()
    tp = topic.encode()
    tg = tag.encode() if tag else b""
    ks = encode_keys(keys)
    pr = encode_properties(properties)
    sp = encode_properties(system_properties)
    n_mid, n_tp, n_tg, n_ks, n_pr, n_sp = len(mid), len(tp), len(tg), len(ks), len(pr), len(sp)
    if n_mid > MAX_U16 or n_tp > MAX_U16 or n_tg > MAX_U16 or n_ks > MAX_U16:
        for name, n in (("message id", n_mid), ("topic", n_tp), ("tag", n_tg), ("keys", n_ks)):
            if n > MAX_U16:
                raise ValueError(f"{name} is {n} bytes; the record format allows {MAX_U16}")
    total = HEADER_SIZE + n_mid + n_tp + n_tg + n_ks + n_pr + n_sp + len(body)
    # Everything after the (size, crc) prefix, which is what the CRC covers. (`message_type`, an
    # IntEnum, packs as its int.)
    rest = b"".join((_HEADER_REST.pack(
        RECORD_MAGIC, RECORD_VERSION, KIND_MESSAGE, message_type, position, queue_offset, queue_id, born_ms,
        store_ms, n_mid, n_tp, n_tg, n_ks, n_pr, n_sp, len(body)), mid, tp, tg, ks, pr, sp, body))
    return _PREFIX.pack(total, crc32c.crc32c(rest)) + rest


def peek_total_size(buf: bytes | memoryview, offset: int = 0) -> int | None:
    """The record's declared size, or None if fewer than 4 bytes remain."""
    if len(buf) - offset < 4:
        return None
    return int(_U32.unpack_from(buf, offset)[0])


def decode_record(buf: bytes | memoryview, offset: int = 0, *, expected_position: int | None = None) -> StoredMessage:
    """Decode the record that starts at `buf[offset]`. Trailing bytes after it are ignored;
    the caller learns the record's extent from `StoredMessage.size`."""
    avail = len(buf) - offset
    if avail < HEADER_SIZE:
        raise CorruptRecord(f"{avail} bytes left, a record header needs {HEADER_SIZE}", expected_position)
    (total, crc, magic, version, kind, mtype, position, queue_offset, queue_id, born_ms, store_ms,
     mid_len, topic_len, tag_len, keys_len, props_len, sys_len, body_len) = HEADER.unpack_from(buf, offset)
    if magic != RECORD_MAGIC:
        raise CorruptRecord(f"bad magic 0x{magic:04X}", expected_position)
    if version != RECORD_VERSION:
        raise CorruptRecord(f"unknown record version {version}", expected_position)
    if total < HEADER_SIZE or total > avail:
        raise CorruptRecord(f"record size {total} does not fit the {avail} bytes available", expected_position)
    var_len = mid_len + topic_len + tag_len + keys_len + props_len + sys_len + body_len
    if HEADER_SIZE + var_len != total:
        raise CorruptRecord(f"field lengths add to {HEADER_SIZE + var_len}, record size says {total}",
                            expected_position)
    if type(buf) is not bytes:
        buf, offset = bytes(buf[offset:offset + total]), 0
    end = offset + total
    if crc32c.crc32c(memoryview(buf)[offset + 8:end]) != crc:
        raise CorruptRecord("CRC32C mismatch", expected_position)
    if kind != KIND_MESSAGE:
        raise CorruptRecord(f"unknown record kind {kind}", expected_position)
    if expected_position is not None and position != expected_position:
        raise CorruptRecord(f"record says position {position}, read at {expected_position}", expected_position)
    message_type = _MESSAGE_TYPES.get(mtype)
    if message_type is None:
        raise CorruptRecord(f"unknown message type {mtype}", expected_position)
    # Plain slices of bytes (one copy each), decoded where text: the hot read path of delivery.
    i = offset + HEADER_SIZE
    j = i + mid_len
    k = j + topic_len
    t = k + tag_len
    ke = t + keys_len
    pe = ke + props_len
    se = pe + sys_len
    try:
        mid = buf[i:j].decode()
        topic = buf[j:k].decode()
        tag = buf[k:t].decode() if tag_len else ""
        keys = decode_keys(buf[t:ke]) if keys_len else ()
    except UnicodeDecodeError as e:
        raise CorruptRecord(f"text field is not UTF-8: {e}", expected_position) from None
    # Positional, in `StoredMessage`'s field order: keywords cost twice as much, and this runs for
    # every record read (the record round-trip tests catch two fields swapped).
    return StoredMessage(mid, topic, queue_id, queue_offset, message_type, tag, keys,
                         decode_properties(buf[ke:pe]) if props_len else {},
                         decode_properties(buf[pe:se]) if sys_len else {}, buf[se:end], born_ms, store_ms,
                         position, total)
