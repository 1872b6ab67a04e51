"""chronoq's bulk send: many messages of one topic in one request, as packed columns.

Theory of operation. `chronoq.admin.v1.Admin/SendColumns` carries thousands of messages a call
(bulk scheduling from Spark, the SDK's `send_columns`). JSON would cost a dict, a base64 text and
a result object per message on both sides; this frame carries each field as one column, so a
request is a few buffers the server slices, and its reply is a few arrays. Pure, like the other
codecs: bytes in, values out; `MalformedRequest` (naming what and where) for a frame that cannot
be read, never anything else.

A request (every integer little-endian; `n` rows):

    magic      4 bytes  b"CQB1"
    flags      u8       bit 0: create a missing topic whose name is near an existing one
    due_kind   u8       0 no due time (normal messages), 1 deliver_at_ms, 2 delay_ms
    columns    u8       bit 0: tags, bit 1: keys, bit 2: properties (the others must be 0)
    reserved   u8       0
    topic      u16 length + UTF-8
    n          u32
    ids        u32 offsets[n + 1] (from 0, non-decreasing, the last = the blob's length) + blob (UTF-8)
    due        i64[n]                                   (when due_kind is not 0)
    bodies     u32 offsets[n + 1] + blob
    tags       u32 offsets[n + 1] + blob (UTF-8; empty: no tag)             (columns bit 0)
    keys       u16 counts[n], u32 offsets[sum + 1] + blob (UTF-8)           (columns bit 1)
    properties u16 counts[n], names: offsets + blob, values: offsets + blob (columns bit 2)

Nothing may follow. Text that is not valid UTF-8 is that row's error (`row_errors`), not the
frame's: the other rows go on, as one bad message of a SendBatch does not fail the others. What a
message must satisfy (id rules, sizes, due-time limits) is admission's (`chronoq/validate.py`),
which the server applies to every row exactly as to a single send.

A reply is either an admin JSON error object (a refusal of the whole request: it starts with
`{`) or, every row judged:

    magic      4 bytes  b"CQR1"
    n          u32
    status     u8[n]    STORED, DUPLICATE or REFUSED, plus HAS_HANDLE when the row is a recallable timer
    queue_id   i32[n]   (-1 for a refused row)
    offset     i64[n]   queue offset (-1 for a refused row)
    due        i64[n]   the due time the server fixed (-1: none)
    errors     u32 length + UTF-8 JSON: [[row, {admin error object}], ...] for the refused rows
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chronoq.protocol.errors import MalformedRequest

METHOD = "SendColumns"
REQUEST_MAGIC = b"CQB1"
REPLY_MAGIC = b"CQR1"

DUE_NONE = 0
DUE_AT = 1
DUE_DELAY = 2

COL_TAGS = 1
COL_KEYS = 2
COL_PROPERTIES = 4
_KNOWN_COLUMNS = COL_TAGS | COL_KEYS | COL_PROPERTIES

FLAG_CREATE_TOPIC = 1

STORED = 0
DUPLICATE = 1
REFUSED = 2
HAS_HANDLE = 0x10
"""Or'ed into a stored or duplicate row's status: a timer in the time index, recallable by the
handle `chronoq.timer.recall.encode_recall_handle(topic, due, id)` makes."""

_HEAD = struct.Struct("<4sBBBBH")
_LITTLE = sys.byteorder == "little"


@dataclass(slots=True)
class Packed:
    """A column of byte strings as one blob and `len + 1` offsets into it (from 0)."""

    offsets: array
    """array('I'): offsets[i] .. offsets[i + 1] is row i's bytes."""
    blob: bytes

    @classmethod
    def of(cls, values: Sequence[bytes | bytearray | memoryview | str]) -> Packed:
        """Pack `values` (text as UTF-8)."""
        parts = [v.encode() if isinstance(v, str) else bytes(v) for v in values]
        offsets = array("I", [0])
        total = 0
        for p in parts:
            total += len(p)
            offsets.append(total)
        return cls(offsets, b"".join(parts))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, start: int, stop: int) -> Packed:
        """Rows [start, stop) as a column of their own (offsets from 0 again)."""
        base, end = self.offsets[start], self.offsets[stop]
        offs = self.offsets[start:stop + 1]
        if base:
            offs = array("I", [o - base for o in offs])
        return Packed(offs, self.blob[base:end])

    def value(self, i: int) -> bytes:
        return self.blob[self.offsets[i]:self.offsets[i + 1]]


@dataclass(slots=True)
class BulkRequest:
    """A decoded SendColumns request: one topic, `len(ids)` rows, columns by row."""

    topic: str
    ids: list[str | None]
    """A row's id, or None where its bytes are not UTF-8 (its error is in `row_errors`)."""
    bodies: list[bytes]
    due_kind: int = DUE_NONE
    due: Sequence[int] | None = None
    tags: list[str] | None = None
    keys: list[tuple[str, ...]] | None = None
    properties: list[dict[str, str]] | None = None
    create_topic: bool = False
    row_errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Row -> (its field, why): a field whose bytes are not valid UTF-8, the decoder's only
    finding that refuses a row rather than the frame."""


@dataclass(slots=True)
class BulkReply:
    status: bytes
    queue_ids: Sequence[int]
    offsets: Sequence[int]
    due: Sequence[int]
    errors: list[tuple[int, dict[str, Any]]]


# -- encoding -------------------------------------------------------------------------------------------


def _u32s(values: array) -> bytes:
    if values.itemsize != 4:
        values = array("I", values)
    if not _LITTLE:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _typed(typecode: str, values: Sequence[int]) -> bytes:
    out = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    if not _LITTLE:
        out = array(typecode, out)
        out.byteswap()
    return out.tobytes()


def _packed(values: Packed | Sequence[Any]) -> Packed:
    return values if isinstance(values, Packed) else Packed.of(values)


def _packed_bytes(col: Packed) -> bytes:
    return _u32s(col.offsets) + col.blob


def encode_request(topic: str, ids: Packed | Sequence[str], bodies: Packed | Sequence[bytes | str], *,
                   due_kind: int = DUE_NONE, due: Sequence[int] | None = None,
                   tags: Sequence[str | None] | None = None, keys: Sequence[Sequence[str]] | None = None,
                   properties: Sequence[dict[str, str] | None] | None = None, create_topic: bool = False) -> bytes:
    """A SendColumns request body. `ids` and `bodies` as values or already `Packed`; `due` (ms)
    when `due_kind` is DUE_AT or DUE_DELAY."""
    id_col, body_col = _packed(ids), _packed(bodies)
    n = len(id_col)
    if len(body_col) != n:
        raise ValueError(f"{n} ids but {len(body_col)} bodies")
    if (due_kind == DUE_NONE) != (due is None) or due_kind not in (DUE_NONE, DUE_AT, DUE_DELAY):
        raise ValueError(f"due_kind {due_kind} and the due column ({'absent' if due is None else 'given'}) disagree")
    columns = (COL_TAGS if tags is not None else 0) | (COL_KEYS if keys is not None else 0) \
        | (COL_PROPERTIES if properties is not None else 0)
    topic_bytes = topic.encode()
    parts = [_HEAD.pack(REQUEST_MAGIC, FLAG_CREATE_TOPIC if create_topic else 0, due_kind, columns, 0,
                        len(topic_bytes)), topic_bytes, struct.pack("<I", n), _packed_bytes(id_col)]
    if due is not None:
        if len(due) != n:
            raise ValueError(f"{n} rows but {len(due)} due times")
        parts.append(_typed("q", due))
    parts.append(_packed_bytes(body_col))
    if tags is not None:
        if len(tags) != n:
            raise ValueError(f"{n} rows but {len(tags)} tags")
        parts.append(_packed_bytes(Packed.of([t or "" for t in tags])))
    if keys is not None:
        if len(keys) != n:
            raise ValueError(f"{n} rows but {len(keys)} key lists")
        parts.append(_typed("H", [len(k) for k in keys]))
        parts.append(_packed_bytes(Packed.of([k for row in keys for k in row])))
    if properties is not None:
        if len(properties) != n:
            raise ValueError(f"{n} rows but {len(properties)} property maps")
        rows = [p or {} for p in properties]
        parts.append(_typed("H", [len(p) for p in rows]))
        parts.append(_packed_bytes(Packed.of([k for p in rows for k in p])))
        parts.append(_packed_bytes(Packed.of([v for p in rows for v in p.values()])))
    return b"".join(parts)


def encode_reply(status: bytes | bytearray, queue_ids: Sequence[int], offsets: Sequence[int], due: Sequence[int],
                 errors: Sequence[tuple[int, dict[str, Any]]]) -> bytes:
    n = len(status)
    if not len(queue_ids) == len(offsets) == len(due) == n:
        raise ValueError("every reply column has a value for every row")
    text = json.dumps([[i, e] for i, e in errors], separators=(",", ":")).encode()
    return b"".join((REPLY_MAGIC, struct.pack("<I", n), bytes(status), _typed("i", queue_ids), _typed("q", offsets),
                     _typed("q", due), struct.pack("<I", len(text)), text))


# -- decoding -------------------------------------------------------------------------------------------


class _Reader:
    """A cursor over a frame; every short read is `MalformedRequest` naming the part and the offset."""

    __slots__ = ("data", "pos", "rpc")

    def __init__(self, data: bytes, rpc: str) -> None:
        self.data = data
        self.pos = 0
        self.rpc = rpc

    def take(self, size: int, what: str) -> bytes:
        end = self.pos + size
        if size < 0 or end > len(self.data):
            raise MalformedRequest(self.rpc, f"{what} needs {size} bytes at offset {self.pos}; "
                                             f"the frame has {len(self.data) - self.pos} left")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def ints(self, typecode: str, count: int, what: str) -> array:
        out = array(typecode)
        out.frombytes(self.take(count * out.itemsize, what))
        if not _LITTLE:
            out.byteswap()
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def packed(self, count: int, what: str) -> Packed:
        offsets = self.ints("I", count + 1, f"{what} offsets")
        if offsets[0] != 0:
            raise MalformedRequest(self.rpc, f"{what} offsets must start at 0, not {offsets[0]}")
        previous = 0
        for i, o in enumerate(offsets):
            if o < previous:
                raise MalformedRequest(self.rpc, f"{what} offset {i} ({o}) is below offset {i - 1} ({previous})")
            previous = o
        return Packed(offsets, self.take(offsets[-1], f"{what} blob"))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise MalformedRequest(self.rpc, f"{len(self.data) - self.pos} bytes follow the frame's last column "
                                             f"(at offset {self.pos})")


def _texts(col: Packed, count: int, what: str, errors: dict[int, tuple[str, str]],
           row_of: Sequence[int] | None = None) -> list[str | None]:
    """Each value as text; a value that is not UTF-8 is None and its row (`row_of[i]`, else i) is
    noted in `errors` with the field `what`."""
    blob, offs = col.blob, col.offsets
    if blob.isascii():
        text = blob.decode("ascii")
        return [text[offs[i]:offs[i + 1]] for i in range(count)]
    out: list[str | None] = []
    for i in range(count):
        try:
            out.append(blob[offs[i]:offs[i + 1]].decode("utf-8"))
        except UnicodeDecodeError as e:
            errors.setdefault(row_of[i] if row_of is not None else i,
                              (what, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
            out.append(None)
    return out


def _rows_of(counts: array) -> list[int]:
    """The row of each value of a nested column (row i has counts[i] values)."""
    return [i for i, c in enumerate(counts) for _ in range(c)]


def _grouped(counts: array, flat: list[str | None]) -> list[list[str | None]]:
    out = []
    at = 0
    for c in counts:
        out.append(flat[at:at + c])
        at += c
    return out


def decode_request(data: bytes) -> BulkRequest:
    """A SendColumns body -> its rows' columns, or `MalformedRequest` saying what is wrong and where."""
    r = _Reader(bytes(data), METHOD)
    magic, flags, due_kind, columns, reserved, topic_len = _HEAD.unpack(r.take(_HEAD.size, "the header"))
    if magic != REQUEST_MAGIC:
        raise MalformedRequest(METHOD, f"the frame starts with {magic!r}, not {REQUEST_MAGIC!r}")
    if flags & ~FLAG_CREATE_TOPIC:
        raise MalformedRequest(METHOD, f"unknown flags {flags:#04x}")
    if due_kind not in (DUE_NONE, DUE_AT, DUE_DELAY):
        raise MalformedRequest(METHOD, f"due kind {due_kind} is not 0 (none), 1 (deliver_at_ms) or 2 (delay_ms)")
    if columns & ~_KNOWN_COLUMNS or reserved:
        raise MalformedRequest(METHOD, f"unknown columns {columns:#04x} or reserved byte {reserved}")
    try:
        topic = r.take(topic_len, "the topic").decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedRequest(METHOD, f"the topic is not UTF-8 ({e.reason} at byte {e.start})") from None
    n = r.u32("the row count")
    # Every row takes at least 8 bytes of offsets: a count the frame cannot hold is refused
    # before anything is allocated for it.
    if n * 8 > len(r.data):
        raise MalformedRequest(METHOD, f"{n} rows cannot fit a frame of {len(r.data)} bytes")
    errors: dict[int, tuple[str, str]] = {}
    ids = _texts(r.packed(n, "message id"), n, "message_id", errors)
    due = r.ints("q", n, "due times") if due_kind != DUE_NONE else None
    body_col = r.packed(n, "body")
    blob, offs = body_col.blob, body_col.offsets
    bodies = [blob[offs[i]:offs[i + 1]] for i in range(n)]
    tags = keys = properties = None
    if columns & COL_TAGS:
        tags = [t or "" for t in _texts(r.packed(n, "tag"), n, "tag", errors)]
    if columns & COL_KEYS:
        counts = r.ints("H", n, "key counts")
        total = sum(counts)
        col = r.packed(total, "key")  # read first: it proves the frame holds `total` values
        flat = _texts(col, total, "keys", errors, _rows_of(counts))
        keys = [tuple(k or "" for k in ks) for ks in _grouped(counts, flat)]
    if columns & COL_PROPERTIES:
        counts = r.ints("H", n, "property counts")
        total = sum(counts)
        name_col = r.packed(total, "property name")
        value_col = r.packed(total, "property value")
        rows = _rows_of(counts)
        names = _grouped(counts, _texts(name_col, total, "properties", errors, rows))
        values = _grouped(counts, _texts(value_col, total, "properties", errors, rows))
        properties = [{k or "": v or "" for k, v in zip(ks, vs, strict=True)} for ks, vs in zip(names, values,
                                                                                                  strict=True)]
    r.end()
    return BulkRequest(topic, ids, bodies, due_kind, due, tags, keys, properties,
                       bool(flags & FLAG_CREATE_TOPIC), errors)


def decode_reply(data: bytes, rows: int) -> BulkReply:
    """A SendColumns reply for a request of `rows` rows (its JSON error form is the caller's)."""
    rpc = f"{METHOD} reply"
    r = _Reader(bytes(data), rpc)
    if r.take(4, "the magic") != REPLY_MAGIC:
        raise MalformedRequest(rpc, f"the reply does not start with {REPLY_MAGIC!r}")
    n = r.u32("the row count")
    if n != rows:
        raise MalformedRequest(rpc, f"{n} results for {rows} rows")
    status = r.take(n, "the statuses")
    queue_ids = r.ints("i", n, "queue ids")
    offsets = r.ints("q", n, "queue offsets")
    due = r.ints("q", n, "due times")
    text = r.take(r.u32("the errors' length"), "the errors")
    r.end()
    try:
        listed = json.loads(text.decode("utf-8"))
        errors = [(int(i), dict(e)) for i, e in listed]
    except (ValueError, TypeError, RecursionError) as e:
        raise MalformedRequest(rpc, f"the errors are not a JSON list of [row, object] ({e})") from None
    for i, _ in errors:
        if not 0 <= i < n or status[i] & 0x0F != REFUSED:
            raise MalformedRequest(rpc, f"an error names row {i}, which is not a refused row")
    return BulkReply(status, queue_ids, offsets, due, errors)
