"""The hot responses, written in protobuf's wire format by hand: pure functions, bytes out.

Theory of operation: building a `definition.Message` through the protobuf API costs ~50 µs in
Python here (every field set through the object API, nested messages copied on assignment);
serializing it costs ~1 µs. A delivered message is the one thing the server builds per message
per delivery, so `received_response` writes the serialized `ReceiveMessageResponse(message=...)`
directly: a few `struct`/`bytes` joins, ~5 µs. The gRPC handler passes the bytes through
unchanged (its serializer accepts bytes as they are).

These are the only encoders of these three responses (`responses` calls them). What they
write, presence included (a proto3 `optional` or message field written is present even when its
value is zero; a plain scalar or string at its default is left out, as protobuf leaves it):
* a delivered message: topic, user properties, body; in its system properties the tag (when
  not empty), keys, message id (when not empty), an MD5 body digest in upper-case hex, identity
  encoding, the message type, born and store timestamps (always), store host, the delivery
  timestamp (timers only), receipt handle, queue id (when not 0), queue offset, invisible
  duration and delivery attempt (always), and the message group (when it has one);
* a send: status OK, one entry per message: status OK ("duplicate" for a repeat), message id,
  queue offset, recall handle (timers);
* an ack: the top status, one entry per handle: message id, receipt handle, status.
`tests/protocol/test_protocol_fastwire.py` parses the bytes with protobuf's generated classes
and checks every field and its presence against the values given, over generated inputs; field
numbers are those of `apache.rocketmq.v2` (definition.proto, service.proto), named below.

Wire format used: a field is `key = (number << 3) | wire_type` as a varint, then a varint
(wire type 0) or a varint length and that many bytes (wire type 2). Strings are UTF-8.
"""

from __future__ import annotations

import hashlib

from chronoq.model import SYS_MESSAGE_GROUP, MessageType, ReceivedMessage

_VARINT_CACHE = tuple(bytes([n]) if n < 0x80 else bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(1 << 14))


def varint(n: int) -> bytes:
    """Unsigned LEB128 (protobuf varint) of `n` >= 0."""
    if n < 16384:
        return _VARINT_CACHE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _len_field(key: bytes, payload: bytes) -> bytes:
    return key + varint(len(payload)) + payload


def _timestamp(ms: int) -> bytes:
    """google.protobuf.Timestamp / Duration body for milliseconds >= 0 (seconds=1, nanos=2)."""
    seconds, rest_ms = divmod(ms, 1000)
    out = b"\x08" + varint(seconds) if seconds else b""
    if rest_ms:
        out += b"\x10" + varint(rest_ms * 1_000_000)
    return out


# ReceiveMessageResponse
_RESPONSE_MESSAGE = _key(2, 2)
# Message
_MESSAGE_TOPIC = _key(1, 2)
_MESSAGE_USER_PROPERTIES = _key(2, 2)
_MESSAGE_SYSTEM_PROPERTIES = _key(3, 2)
_MESSAGE_BODY = _key(4, 2)
# Resource
_RESOURCE_NAME = _key(2, 2)
# map entry
_ENTRY_KEY = _key(1, 2)
_ENTRY_VALUE = _key(2, 2)
# SystemProperties
_SP_TAG = _key(1, 2)
_SP_KEYS = _key(2, 2)
_SP_MESSAGE_ID = _key(3, 2)
_SP_BODY_DIGEST = _key(4, 2)
_SP_BODY_ENCODING_IDENTITY = _key(5, 0) + varint(1)
_SP_MESSAGE_TYPE = _key(6, 0)
_SP_BORN_TIMESTAMP = _key(7, 2)
_SP_STORE_TIMESTAMP = _key(9, 2)
_SP_STORE_HOST = _key(10, 2)
_SP_DELIVERY_TIMESTAMP = _key(11, 2)
_SP_RECEIPT_HANDLE = _key(12, 2)
_SP_QUEUE_ID = _key(13, 0)
_SP_QUEUE_OFFSET = _key(14, 0)
_SP_INVISIBLE_DURATION = _key(15, 2)
_SP_DELIVERY_ATTEMPT = _key(16, 0)
_SP_MESSAGE_GROUP = _key(17, 2)
# Digest: type=1 (MD5 = 2), checksum=2
_DIGEST_MD5 = _key(1, 0) + varint(2)
_DIGEST_CHECKSUM = _key(2, 2)


def _string(key: bytes, text: str) -> bytes:
    return _len_field(key, text.encode())


def md5_digest(body: bytes) -> bytes:
    """The body digest RocketMQ clients check: MD5, upper-case hex."""
    return _DIGEST_MD5 + _len_field(_DIGEST_CHECKSUM, hashlib.md5(body).hexdigest().upper().encode())


def received_response(received: ReceivedMessage, invisible_duration_ms: int, store_host: str) -> bytes:
    """The serialized `ReceiveMessageResponse(message=...)` for one delivered message.
    Written inline (locals, the varint table indexed directly): it runs once per delivery."""
    stored = received.message
    v = _VARINT_CACHE
    sp = []
    if stored.tag:
        tag = stored.tag.encode()
        sp.append(_SP_TAG + varint(len(tag)) + tag)
    for key in stored.keys:
        sp.append(_string(_SP_KEYS, key))
    if stored.message_id:
        mid = stored.message_id.encode()
        sp.append(_SP_MESSAGE_ID + varint(len(mid)) + mid)
    checksum = hashlib.md5(stored.body).hexdigest().upper().encode()
    sp.append(_SP_BODY_DIGEST_MD5_HEAD + checksum)  # 32 hex characters: a fixed-size field
    sp.append(_SP_ENCODING_AND_TYPE[stored.message_type])
    born = _timestamp(stored.born_ms) if stored.born_ms > 0 else b""
    sp.append(_SP_BORN_TIMESTAMP + v[len(born)] + born)
    store = _timestamp(stored.store_ms) if stored.store_ms > 0 else b""
    sp.append(_SP_STORE_TIMESTAMP + v[len(store)] + store)
    sp.append(_store_host_field(store_host))
    deliver_at_ms = stored.deliver_at_ms
    if deliver_at_ms is not None:
        due = _timestamp(deliver_at_ms) if deliver_at_ms > 0 else b""
        sp.append(_SP_DELIVERY_TIMESTAMP + v[len(due)] + due)
    handle = received.receipt_handle.encode()
    sp.append(_SP_RECEIPT_HANDLE + varint(len(handle)) + handle)
    if stored.queue_id:
        sp.append(_SP_QUEUE_ID + varint(stored.queue_id))
    sp.append(_SP_QUEUE_OFFSET + varint(stored.queue_offset))
    invisible = _timestamp(invisible_duration_ms) if invisible_duration_ms > 0 else b""
    sp.append(_SP_INVISIBLE_DURATION + v[len(invisible)] + invisible)
    sp.append(_SP_DELIVERY_ATTEMPT + varint(received.delivery_attempt))
    group = stored.system_properties.get(SYS_MESSAGE_GROUP) if stored.system_properties else None
    if group:
        sp.append(_string(_SP_MESSAGE_GROUP, group))
    system = b"".join(sp)
    topic = stored.topic.encode()
    resource = _RESOURCE_NAME + varint(len(topic)) + topic
    parts = [_MESSAGE_TOPIC + v[len(resource)] + resource if len(resource) < 16384 else
             _len_field(_MESSAGE_TOPIC, resource)]
    if stored.properties:
        for name, value in stored.properties.items():
            parts.append(_len_field(_MESSAGE_USER_PROPERTIES, _string(_ENTRY_KEY, name) + _string(_ENTRY_VALUE, value)))
    parts.append(_MESSAGE_SYSTEM_PROPERTIES + varint(len(system)) + system)
    body = stored.body
    if body:
        parts.append(_MESSAGE_BODY + varint(len(body)) + body)
    message = b"".join(parts)
    return _RESPONSE_MESSAGE + varint(len(message)) + message


_SP_BODY_DIGEST_MD5_HEAD = (_SP_BODY_DIGEST + varint(len(_DIGEST_MD5) + 2 + 32) + _DIGEST_MD5 + _DIGEST_CHECKSUM
                            + varint(32))
"""body_digest = Digest{type: MD5, checksum: <32 hex characters>}, all but the characters."""
_SP_ENCODING_AND_TYPE = {t: _SP_BODY_ENCODING_IDENTITY + _SP_MESSAGE_TYPE + varint(int(t)) for t in MessageType}
_STORE_HOST_FIELDS: dict[str, bytes] = {}


def _store_host_field(host: str) -> bytes:
    field = _STORE_HOST_FIELDS.get(host)
    if field is None:
        field = _STORE_HOST_FIELDS.setdefault(host, _string(_SP_STORE_HOST, host)) if host else b""
    return field


def _len_bytes(payload: bytes) -> bytes:
    return varint(len(payload)) + payload


# Status: code=1 (enum), message=2
_STATUS_CODE = _key(1, 0)
_STATUS_MESSAGE = _key(2, 2)
# SendMessageResponse / AckMessageResponse: status=1, entries=2
_RESPONSE_STATUS = _key(1, 2)
_RESPONSE_ENTRIES = _key(2, 2)
# SendResultEntry: status=1, message_id=2, transaction_id=3, offset=4, recall_handle=5
_SEND_ENTRY_STATUS = _key(1, 2)
_SEND_ENTRY_MESSAGE_ID = _key(2, 2)
_SEND_ENTRY_OFFSET = _key(4, 0)
_SEND_ENTRY_RECALL_HANDLE = _key(5, 2)
# AckMessageResultEntry: message_id=1, receipt_handle=2, status=3
_ACK_ENTRY_MESSAGE_ID = _key(1, 2)
_ACK_ENTRY_RECEIPT_HANDLE = _key(2, 2)
_ACK_ENTRY_STATUS = _key(3, 2)
_OK_CODE = 20000


def status(code: int, message: str) -> bytes:
    """A `Status` body (code 0 and an empty message are proto3 defaults, left out)."""
    out = _STATUS_CODE + varint(code) if code else b""
    return out + _string(_STATUS_MESSAGE, message) if message else out


_STATUS_OK = status(_OK_CODE, "OK")
_STATUS_DUPLICATE = status(_OK_CODE, "duplicate")
_RESPONSE_STATUS_OK = _len_field(_RESPONSE_STATUS, _STATUS_OK)


def send_response(results: list[tuple[str, int, str | None, bool]]) -> bytes:
    """A serialized `SendMessageResponse`: OK, one entry per (message id, queue offset, recall
    handle or None, duplicate) in order."""
    parts = [_RESPONSE_STATUS_OK]
    ok_entry_status = _len_field(_SEND_ENTRY_STATUS, _STATUS_OK)
    duplicate_entry_status = _len_field(_SEND_ENTRY_STATUS, _STATUS_DUPLICATE)
    for message_id, offset, recall_handle, duplicate in results:
        entry = duplicate_entry_status if duplicate else ok_entry_status
        if message_id:
            entry += _string(_SEND_ENTRY_MESSAGE_ID, message_id)
        if offset:
            entry += _SEND_ENTRY_OFFSET + varint(offset)
        if recall_handle:
            entry += _string(_SEND_ENTRY_RECALL_HANDLE, recall_handle)
        parts.append(_RESPONSE_ENTRIES + varint(len(entry)) + entry)
    return b"".join(parts)


def ack_response(entries: list[tuple[str, str, int, str]], top: tuple[int, str]) -> bytes:
    """A serialized `AckMessageResponse`: status `top` (code, message), one entry per (message id,
    receipt handle, status code, status message)."""
    parts = [_len_field(_RESPONSE_STATUS, status(*top))]
    for message_id, handle, code, message in entries:
        entry = b""
        if message_id:
            entry += _string(_ACK_ENTRY_MESSAGE_ID, message_id)
        if handle:
            entry += _string(_ACK_ENTRY_RECEIPT_HANDLE, handle)
        entry += _len_field(_ACK_ENTRY_STATUS, status(code, message))
        parts.append(_RESPONSE_ENTRIES + varint(len(entry)) + entry)
    return b"".join(parts)
