"""The recall handle: the opaque string a send returns for a timer message, and its codec.

Theory of operation: a recall handle names one timer message (topic, due time, message id) so a
producer can cancel it later without knowing how chronoq stores it, like RocketMQ 5.3's. It is
pure (no I/O, no clock): `encode_recall_handle` on the accept path and in the dedupe window
(which recomputes it rather than keep it), `decode_recall_handle` at a cancel. Anything that does
not decode, or fails its checksum, raises `InvalidRecallHandle`, never another error. The byte
layout is written once, in `docs/disk-format.md` ("Recall handle"), and the sizes it states are
checked by `tests/store/test_disk_format.py`.
"""

from __future__ import annotations

import base64
import binascii
import struct

import crc32c

from chronoq.errors import InvalidRecallHandle

RECALL_VERSION = 1
RECALL_HEAD = struct.Struct(">BQ")
"""version u8 | deliver_at_ms u64; then topic UTF-8 | 0x00 | message id UTF-8 | crc32c u32."""
MAX_HANDLE_CHARS = 1024
"""Longer strings are refused before any decoding (a handle of the longest names is far shorter)."""
_CRC = struct.Struct(">I")
_URLSAFE = bytes.maketrans(b"+/", b"-_")


def encode_recall_handle(topic: str, deliver_at_ms: int, message_id: str) -> str:
    """Opaque, like RocketMQ 5.3's: version, due time, topic and id, with a checksum."""
    raw = RECALL_HEAD.pack(RECALL_VERSION, deliver_at_ms) + topic.encode() + b"\x00" + message_id.encode()
    encoded = binascii.b2a_base64(raw + _CRC.pack(crc32c.crc32c(raw)), newline=False)
    return encoded.translate(_URLSAFE).rstrip(b"=").decode()


def decode_recall_handle(handle: str) -> tuple[str, int, str]:
    """(topic, deliver_at_ms, message_id) or InvalidRecallHandle."""
    if not isinstance(handle, str):
        raise InvalidRecallHandle("not a chronoq recall handle")
    if not handle or len(handle) > MAX_HANDLE_CHARS:
        raise InvalidRecallHandle("not a chronoq recall handle", handle)
    try:
        raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    except (ValueError, TypeError):
        raise InvalidRecallHandle("not base64", handle) from None
    if len(raw) < RECALL_HEAD.size + 6 or crc32c.crc32c(raw[:-4]) != _CRC.unpack(raw[-4:])[0]:
        raise InvalidRecallHandle("checksum mismatch", handle)
    version, deliver_at_ms = RECALL_HEAD.unpack_from(raw)
    if version != RECALL_VERSION:
        raise InvalidRecallHandle(f"unknown version {version}", handle)
    try:
        topic, _, message_id = raw[RECALL_HEAD.size:-4].decode().partition("\x00")
    except UnicodeDecodeError:
        raise InvalidRecallHandle("not UTF-8", handle) from None
    if not topic or not message_id:
        raise InvalidRecallHandle("missing topic or message id", handle)
    return topic, deliver_at_ms, message_id
