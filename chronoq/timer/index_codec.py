"""Byte encodings of the RocksDB timer index (`docs/disk-format.md`, "Timer index", documents the layouts).

Theory of operation: pure functions from values to bytes and back, no I/O. They sit on the hot
path (several per timer added or fired), so they use precompiled `struct.Struct`s and slicing
rather than a general serialiser, and check lengths instead of trusting them: anything that does
not decode raises `MalformedValue`, which the index reports as `TimerIndexCorrupt`.
"""

from __future__ import annotations

import struct
import sys
from array import array

from chronoq.model import TimerState, TimerStatus
from chronoq.timer.engine import DueRow, TimerEntry

VALUE_VERSION = 1
TIME_VALUE_VERSION = 2
"""Of `time` values (version 1, index format 3 and before, had no route: tag hash, queue, group)."""

CF_TIME = "time"
CF_ID = "id"
CF_KEY = "key"
CF_POS = "pos"
CF_HISTORY = "history"
CF_COUNTERS = "counters"
CF_META = "meta"
CF_LINKS = "links"
COLUMN_FAMILIES = (CF_TIME, CF_ID, CF_KEY, CF_POS, CF_HISTORY, CF_COUNTERS, CF_META, CF_LINKS)

META_FORMAT_VERSION = b"format_version"
META_INDEXED_POSITION = b"indexed_position"
META_HEAD_FLOOR = b"head_floor"
META_LEVEL_PREFIX = b"level:"
"""`level:` + level u16 -> u64: the next offset of that delay level's queue to fire."""
META_LIVE_LINKS_FROM = b"live_links_from"
"""u64: where retention's live segments began at its last deletion (link records below it are
past retention, and may name records it deleted)."""
LINK_COPY_VERSION = 1
LINK_COPY_HEAD = struct.Struct(">Bq")
"""A `links` value's head: version u8, the link record's store time i64; its body follows."""

STATE_PENDING, STATE_DELIVERED, STATE_CANCELLED, STATE_DAMAGED = 1, 2, 3, 4
CODE_STATE = {STATE_PENDING: TimerState.PENDING, STATE_DELIVERED: TimerState.DELIVERED,
              STATE_CANCELLED: TimerState.CANCELLED, STATE_DAMAGED: TimerState.DAMAGED}
POS_PENDING, POS_ROLLED, POS_DONE = 1, 2, 3
HIST_STATUS, HIST_REDIRECT, HIST_FIRED = 1, 2, 3
"""`history` value kinds: one finished timer (its `id` key follows), a roll redirect, timers one
batch fired at one time (their count u32, then their `id` keys one after another:
`decode_fired_history`)."""
HISTORY_FIRED_MAX = 1024
"""At most this many timers in one `HIST_FIRED` row (a fire step of 8,192 writes eight), so a
row stays small and `prune_history` forgets about `_PRUNE_CHUNK` timers a write, not rows."""

U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
I64 = struct.Struct(">q")
TIME_KEY = struct.Struct(">QQ")
ENTRY_HEAD = struct.Struct(">BQIqIiq")
"""version, position, size, accepted_ms, tag hash, queue id (-1: none), group hash (-1: none)."""
FACTS_HEAD = struct.Struct(">BqIq")
POS_PENDING_HEAD = struct.Struct(">Bq")
POS_DONE_VALUE = struct.Struct(">BBq")
POS_ROLLED_VALUE = struct.Struct(">BQq")
HISTORY_KEY = struct.Struct(">QQ")
_TIME_KEY_PACK = TIME_KEY.pack
_ENTRY_HEAD_PACK = ENTRY_HEAD.pack
_FACTS_HEAD_PACK = FACTS_HEAD.pack
_POS_PENDING_HEAD_PACK = POS_PENDING_HEAD.pack
_POS_DONE_PACK = POS_DONE_VALUE.pack
_TIME_KEY_SIZE = TIME_KEY.size
_TIME_KEY_UNPACK = TIME_KEY.unpack
_ENTRY_HEAD_SIZE = ENTRY_HEAD.size
_ENTRY_HEAD_UNPACK_FROM = ENTRY_HEAD.unpack_from
MAX_STR_BYTES = 0xFFFF


class MalformedValue(Exception):
    """A stored key or value does not decode."""


def pack_str(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > MAX_STR_BYTES:
        raise ValueError(f"string of {len(raw)} UTF-8 bytes does not fit the index (limit {MAX_STR_BYTES})")
    return U16.pack(len(raw)) + raw


def unpack_str(buf: bytes, offset: int) -> tuple[str, int]:
    if offset + 2 > len(buf):
        raise MalformedValue(f"string length runs past the value at {offset}")
    end = offset + 2 + (buf[offset] << 8 | buf[offset + 1])
    if end > len(buf):
        raise MalformedValue(f"string runs {end - len(buf)} bytes past the value")
    return buf[offset + 2:end].decode(), end


def pack_keys(keys: tuple[str, ...]) -> bytes:
    if not keys:
        return b"\x00\x00"
    if len(keys) > MAX_STR_BYTES:
        raise ValueError(f"{len(keys)} message keys do not fit the index (limit {MAX_STR_BYTES})")
    return U16.pack(len(keys)) + b"".join(pack_str(k) for k in keys)


def unpack_keys(buf: bytes, offset: int) -> tuple[tuple[str, ...], int]:
    if offset + 2 > len(buf):
        raise MalformedValue("key count runs past the value")
    count = buf[offset] << 8 | buf[offset + 1]
    offset += 2
    keys = []
    for _ in range(count):
        key, offset = unpack_str(buf, offset)
        keys.append(key)
    return tuple(keys), offset


# --- keys -------------------------------------------------------------------------------------


def time_key(deliver_at_ms: int, position: int) -> bytes:
    return TIME_KEY.pack(deliver_at_ms, position)


def id_prefix(message_id: str, topic: str | None = None) -> bytes:
    return pack_str(message_id) + (pack_str(topic) if topic is not None else b"")


def id_key(message_id: str, topic: str, position: int, topic_str: bytes | None = None) -> bytes:
    """`topic_str`: `pack_str(topic)` when the caller has it cached (it does, per batch)."""
    return pack_str(message_id) + (topic_str or pack_str(topic)) + U64.pack(position)


def encode_fired_history(id_keys: list[bytes]) -> bytes:
    return bytes((HIST_FIRED,)) + U32.pack(len(id_keys)) + b"".join(id_keys)


def decode_fired_history(value: bytes) -> list[bytes]:
    """The `id` keys of a `HIST_FIRED` history value (its count checked)."""
    if len(value) < 5 or value[0] != HIST_FIRED:
        raise MalformedValue(f"fired history value of {len(value)} bytes, kind {value[:1]!r}")
    keys = split_id_keys(value, 5)
    if len(keys) != U32.unpack_from(value, 1)[0]:
        raise MalformedValue(f"fired history row says {U32.unpack_from(value, 1)[0]} timers, holds {len(keys)}")
    return keys


def history_timers(value: bytes) -> int:
    """How many timers a `history` value speaks for (a fired row its count, any other one)."""
    return U32.unpack_from(value, 1)[0] if len(value) >= 5 and value[0] == HIST_FIRED else 1


def split_id_keys(buf: bytes, offset: int = 0) -> list[bytes]:
    """The `id` keys laid end to end from `offset` (a `history` row of kind `HIST_FIRED`): each
    is message id str · topic str · position u64, so its own lengths say where it ends."""
    keys: list[bytes] = []
    n = len(buf)
    while offset < n:
        end = offset
        for _ in range(2):  # the message id str, then the topic str
            if end + 2 > n:
                raise MalformedValue(f"an id key at {offset} of a fired history row runs past its {n} bytes")
            end += 2 + (buf[end] << 8 | buf[end + 1])
        end += 8  # the position u64
        if end > n:
            raise MalformedValue(f"an id key at {offset} of a fired history row runs past its {n} bytes")
        keys.append(buf[offset:end])
        offset = end
    return keys


def split_id_key(ik: bytes) -> tuple[str, str, int]:
    message_id, offset = unpack_str(ik, 0)
    topic, offset = unpack_str(ik, offset)
    if offset + 8 != len(ik):
        raise MalformedValue(f"id key has {len(ik) - offset} bytes after the topic, expected 8")
    return message_id, topic, U64.unpack_from(ik, offset)[0]


def id_key_topic(ik: bytes) -> str:
    """The topic inside an `id` key."""
    start = 2 + (ik[0] << 8 | ik[1])
    length = ik[start] << 8 | ik[start + 1]
    if start + 2 + length + 8 != len(ik):
        raise MalformedValue(f"id key of {len(ik)} bytes does not match its lengths")
    return ik[start + 2:start + 2 + length].decode()


def key_cf_key(key: str, position: int) -> bytes:
    return pack_str(key) + U64.pack(position)


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with `prefix` (None: no bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


# --- values -----------------------------------------------------------------------------------


def encode_pending(entry: TimerEntry, ik: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """Everything an added timer writes: (`time` key, `time` value, `id` value, `pos` value).
    One call for the four because this runs for every timer added. `ik` is the timer's `id`
    key, whose first part (message id str, topic str) is exactly the middle of the `time`
    value, so it is sliced rather than encoded again."""
    position, deliver_at_ms, size, accepted_ms = entry.position, entry.deliver_at_ms, entry.size, entry.accepted_ms
    packed_keys = pack_keys(entry.keys) if entry.keys else b"\x00\x00"
    queue_id, group_hash = entry.queue_id, entry.group_hash
    return (
        _TIME_KEY_PACK(deliver_at_ms, position),
        _ENTRY_HEAD_PACK(TIME_VALUE_VERSION, position, size, accepted_ms, entry.tag_hash,
                         -1 if queue_id is None else queue_id, -1 if group_hash is None else group_hash)
        + ik[:-8] + packed_keys,
        _FACTS_HEAD_PACK(VALUE_VERSION, deliver_at_ms, size, accepted_ms) + packed_keys,
        _POS_PENDING_HEAD_PACK(POS_PENDING, deliver_at_ms) + ik,
    )


def decode_entry(tk: bytes, value: bytes) -> TimerEntry:
    return TimerEntry(*decode_handed(tk, value)[0])


def decode_handed(tk: bytes, value: bytes) -> tuple[DueRow, bytes]:
    """The entry a `time` row holds, as a row (`TimerEntry`'s fields in order: a fire step takes
    thousands, as columns), and its timer's `id` key (the value holds the key's message id and
    topic verbatim, and its position): what settling it needs, read in the one pass."""
    # Inlined string reads and bound struct methods: this runs for every timer a fire step takes.
    n = len(value)
    if len(tk) != _TIME_KEY_SIZE or n < _ENTRY_HEAD_SIZE + 6:
        raise MalformedValue(f"time key of {len(tk)} bytes / value of {n} bytes")
    deliver_at_ms, position = _TIME_KEY_UNPACK(tk)
    version, stored_position, size, accepted_ms, tag_hash, queue_id, group_hash = _ENTRY_HEAD_UNPACK_FROM(value)
    if version != TIME_VALUE_VERSION or stored_position != position:
        raise MalformedValue(f"time entry version {version} (expected {TIME_VALUE_VERSION}), position "
                             f"{stored_position} under key position {position}")
    start = _ENTRY_HEAD_SIZE + 2
    end = start + (value[start - 2] << 8 | value[start - 1])
    if end + 2 > n:
        raise MalformedValue("time entry message id runs past the value")
    message_id = value[start:end].decode()
    start = end + 2
    end = start + (value[start - 2] << 8 | value[start - 1])
    topic = value[start:end].decode()
    ik = value[_ENTRY_HEAD_SIZE:end] + value[1:9]
    if end + 2 == n and value[end] == 0 and value[end + 1] == 0:
        keys: tuple[str, ...] = ()
    else:
        keys, end = unpack_keys(value, end)
        if end != n:
            raise MalformedValue(f"time entry has {n - end} bytes more or less than it says")
    return (deliver_at_ms, position, size, message_id, topic, accepted_ms, keys, tag_hash,
            None if queue_id < 0 else queue_id, None if group_hash < 0 else group_hash), ik


def pos_done(state: int, done_ms: int) -> bytes:
    """The `pos` value of a timer that was fired or cancelled at `done_ms`."""
    return _POS_DONE_PACK(POS_DONE, state, done_ms)


def facts_keys(facts: bytes) -> tuple[str, ...]:
    if len(facts) < FACTS_HEAD.size + 2 or facts[0] != VALUE_VERSION:
        raise MalformedValue(f"id value of {len(facts)} bytes, version {facts[:1].hex()}")
    keys, offset = unpack_keys(facts, FACTS_HEAD.size)
    if offset != len(facts):
        raise MalformedValue(f"id value has {len(facts) - offset} trailing bytes")
    return keys


def decode_status(ik: bytes, facts: bytes, pos_value: bytes | None) -> TimerStatus:
    """A timer's status from its `id` row (the facts fixed when it was added) and its `pos`
    value (what has become of it)."""
    message_id, topic, position = split_id_key(ik)
    facts_keys(facts)
    _, deliver_at_ms, _size, accepted_ms = FACTS_HEAD.unpack_from(facts)
    if pos_value is None or pos_value[0] not in (POS_PENDING, POS_DONE):
        raise MalformedValue(f"timer at position {position} has an `id` row but `pos` says {pos_value!r}")
    state, done_ms = STATE_PENDING, None
    if pos_value[0] == POS_DONE:
        _, state, done_ms = POS_DONE_VALUE.unpack(pos_value)
        if state not in (STATE_DELIVERED, STATE_CANCELLED, STATE_DAMAGED):
            raise MalformedValue(f"timer at position {position} is done in state {state}")
    return TimerStatus(
        message_id=message_id, topic=topic, state=CODE_STATE[state], deliver_at_ms=deliver_at_ms,
        accepted_ms=accepted_ms, position=position,
        fired_ms=done_ms if state == STATE_DELIVERED else None,
        cancelled_ms=done_ms if state == STATE_CANCELLED else None,
    )


def decode_pos_pending(value: bytes) -> tuple[int, bytes]:
    """(deliver_at_ms, id key) of a kind-1 `pos` value."""
    if len(value) < POS_PENDING_HEAD.size + 12 or value[0] != POS_PENDING:
        raise MalformedValue(f"pos value of {len(value)} bytes, kind {value[:1].hex()}")
    return POS_PENDING_HEAD.unpack_from(value)[1], value[POS_PENDING_HEAD.size:]


# The typecode of a 4-byte unsigned int on this platform (it is "I" everywhere chronoq runs).
U32_ARRAY = next(code for code in "IL" if array(code).itemsize == 4)


def empty_minute_slots() -> array[int]:
    return array(U32_ARRAY, bytes(4 * 60))


def encode_minute_slots(slots: array[int]) -> bytes:
    """60 per-second counts as 60 big-endian u32."""
    if sys.byteorder == "little":
        slots = array(U32_ARRAY, slots)
        slots.byteswap()
    return slots.tobytes()


def decode_minute_slots(value: bytes) -> array[int]:
    if len(value) != 240:
        raise MalformedValue(f"minute counter of {len(value)} bytes, expected 240")
    slots = array(U32_ARRAY, value)
    if sys.byteorder == "little":
        slots.byteswap()
    if not any(slots):
        raise MalformedValue("minute counter of zeros (it should have been deleted)")
    return slots


def encode_link_copy(linked_ms: int, body: bytes) -> bytes:
    """A `links` value: the link record's store time (when its links were entered) and its body."""
    return LINK_COPY_HEAD.pack(LINK_COPY_VERSION, linked_ms) + body


def decode_link_copy(value: bytes) -> tuple[bytes, int]:
    """(body, store time) of a `links` value."""
    if len(value) < LINK_COPY_HEAD.size or value[0] != LINK_COPY_VERSION:
        raise MalformedValue(f"link copy of {len(value)} bytes, version {value[:1]!r}")
    return value[LINK_COPY_HEAD.size:], LINK_COPY_HEAD.unpack_from(value)[1]
