"""The file wheel's four files, byte by byte: TimerLog units, TimerWheel slots, the facts journal, the checkpoint.

Theory of operation: this module is the file wheel's disk format and nothing else (the engine's
logic is `timer/wheel.py`). RocketMQ 5's timer store (RIP-43) is two files, and chronoq keeps
their layouts:
- **TimerLog** (`timerlog.<gen>`): an append-only run of 52-byte units. A unit links back to the
  previous unit of the same wheel slot (`prev_pos`), so a slot's units form a chain read
  backwards from the slot's `last_pos`. Fields, big-endian as RocketMQ's ByteBuffer writes them:
  size (i32, always 52), prev_pos (i64, -1 ends the chain), magic (i32 flags), the slot time the
  unit is chained under (i64 ms, RocketMQ's "curr write time"), delay (i32 ms from that slot time
  to the due time, clamped to the i32 range), the commit-log position of the timer record (i64),
  its size (i32), the hash of the real topic (i32, CRC32C as an unsigned value stored in 32 bits),
  reserved (i64: chronoq puts the facts journal offset of a placement unit here, and the
  fired/cancelled time of a finishing unit).
  Magic flags: DEFAULT 1 and ROLL 2 and DELETE 4 are RocketMQ's; chronoq adds DONE 8 (the timer
  fired: a link record made it visible) and DAMAGED 16 (its record failed its checks).
- **TimerWheel** (`timerwheel.<gen>`): `slots` records of 32 bytes, slot i for the slot times t
  with (t // slot_ms) % slots == i: slot time (i64; a slot is valid only for the time stored in
  it, so the file is reused cycle after cycle as RocketMQ's is), first_pos (i64), last_pos
  (i64), count (i32), magic (i32, 0).
- **facts journal** (`timerfacts.<gen>`, chronoq's): what RocketMQ reads back from the commit
  log for every unit it fires (topic, id, keys, route), written once per timer when it is
  indexed, plus the engine's other derived state (delay-level progress, link floors and copies,
  pruning). Records: u32 length of the rest, u32 CRC32C of the rest, u8 kind, payload.
- **checkpoint** (`timercheck`, RocketMQ's file name): magic `CQWHEEL1`, u32 CRC32C of the rest,
  then format version, generation, indexed_position, timerlog_end, facts_end, read_slot_ms,
  slot_ms, slots (all fixed-width). It is written whole to a temporary file, fsynced and renamed
  over the old one, after the three other files are flushed up to the ends it names: after a
  crash the engine truncates TimerLog and facts to those ends and the broker replays the commit
  log from indexed_position.
`docs/disk-format.md` states the same layouts; `tests/timer/test_wheel_format.py` checks them.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

from chronoq.store.fsync import fdatasync, fsync, fsync_dir

UNIT = struct.Struct(">iqiqiqiiq")
UNIT_SIZE = UNIT.size
assert UNIT_SIZE == 52
SLOT = struct.Struct(">qqqii")
SLOT_SIZE = SLOT.size
assert SLOT_SIZE == 32

MAGIC_DEFAULT = 1
MAGIC_ROLL = 2
MAGIC_DELETE = 4
MAGIC_DONE = 8
MAGIC_DAMAGED = 16
FINISHING = MAGIC_DELETE | MAGIC_DONE | MAGIC_DAMAGED
"""Magic flags of a unit that finishes a timer (its reserved field is when)."""

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1

# facts journal record kinds
F_TIMER = 1
F_LEVEL = 2
F_FLOOR = 3
F_LINK_COPY = 4
F_FORGET_LINKS = 5
F_PRUNE = 6
F_FINISHED = 7
F_REDIRECT = 8

_HEAD = struct.Struct(">II")
_TIMER = struct.Struct(">QIQqIiqq")
"""position, size, deliver_at_ms, accepted_ms, tag_hash, queue_id (-1 none), group_hash (-1
none), rolled_from (-1: not a rolled copy)."""
_U16 = struct.Struct(">H")
_LEVEL = struct.Struct(">HQ")
_FLOOR = struct.Struct(">QQ")
_LINK_COPY = struct.Struct(">QQ")
_FORGET = struct.Struct(">Qq")
_PRUNE = struct.Struct(">Q")

CHECK_MAGIC = b"CQWHEEL1"
FORMAT_VERSION = 1
_CHECK = struct.Struct(">IIQQQQqqI")
"""format version, generation, indexed_position, timerlog_end, facts_end, (reserved 0),
read_slot_ms, slot_ms, slots."""


@functools.lru_cache(maxsize=4096)
def topic_hash(topic: str) -> int:
    """The unit's hash of the real topic: CRC32C of its UTF-8 bytes, as a signed i32."""
    value = crc32c(topic.encode())
    return value - (1 << 32) if value >= 1 << 31 else value


def clamp_i32(value: int) -> int:
    return I32_MIN if value < I32_MIN else I32_MAX if value > I32_MAX else value


def pack_unit(prev_pos: int, magic: int, slot_ms: int, delay_ms: int, position: int, size: int,
              topic_h: int, reserved: int) -> bytes:
    return UNIT.pack(UNIT_SIZE, prev_pos, magic, slot_ms, clamp_i32(delay_ms), position, size, topic_h, reserved)


# -- facts journal records ---------------------------------------------------------------------


def _record(kind: int, payload: bytes) -> bytes:
    body = bytes((kind,)) + payload
    return _HEAD.pack(len(body), crc32c(body)) + body


def _text(value: str) -> bytes:
    raw = value.encode()
    return _U16.pack(len(raw)) + raw


def timer_record(position: int, size: int, deliver_at_ms: int, accepted_ms: int, tag_hash: int,
                 queue_id: int | None, group_hash: int | None, rolled_from: int | None, topic: str,
                 message_id: str, keys: tuple[str, ...]) -> bytes:
    payload = _TIMER.pack(position, size, deliver_at_ms, accepted_ms, tag_hash,
                          -1 if queue_id is None else queue_id, -1 if group_hash is None else group_hash,
                          -1 if rolled_from is None else rolled_from)
    return _record(F_TIMER, payload + _text(topic) + _text(message_id) + _U16.pack(len(keys))
                   + b"".join(_text(k) for k in keys))


def level_record(level: int, offset: int) -> bytes:
    return _record(F_LEVEL, _LEVEL.pack(level, offset))


def floor_record(base: int, floor: int) -> bytes:
    return _record(F_FLOOR, _FLOOR.pack(base, floor))


def link_copy_record(position: int, linked_ms: int, body: bytes) -> bytes:
    return _record(F_LINK_COPY, _LINK_COPY.pack(position, linked_ms) + body)


def forget_links_record(below: int, live_from: int | None) -> bytes:
    return _record(F_FORGET_LINKS, _FORGET.pack(below, -1 if live_from is None else live_from))


def prune_record(before_ms: int) -> bytes:
    return _record(F_PRUNE, _PRUNE.pack(before_ms))


_FINISHED = struct.Struct(">BQ")
_REDIRECT = struct.Struct(">QQQ")


def finished_record(state: int, done_ms: int, timer: bytes) -> bytes:
    """A finished timer as a rewrite keeps it: state · done_ms · the kind-1 payload (`timer`
    is a whole kind-1 record; its payload is taken from it)."""
    return _record(F_FINISHED, _FINISHED.pack(state, done_ms) + timer[_HEAD.size + 1:])


def redirect_record(old_position: int, new_position: int, due_ms: int) -> bytes:
    return _record(F_REDIRECT, _REDIRECT.pack(old_position, new_position, due_ms))


def decode_finished(payload: memoryview) -> tuple[int, int, TimerFacts]:
    state, done_ms = _FINISHED.unpack_from(payload, 0)
    return state, done_ms, decode_timer(payload[_FINISHED.size:])


def decode_redirect(payload: memoryview) -> tuple[int, int, int]:
    return _REDIRECT.unpack_from(payload, 0)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class TimerFacts:
    position: int
    size: int
    deliver_at_ms: int
    accepted_ms: int
    tag_hash: int
    queue_id: int | None
    group_hash: int | None
    rolled_from: int | None
    topic: str
    message_id: str
    keys: tuple[str, ...]


class FactsDamaged(Exception):
    """A facts record fails its length or CRC check at `offset`."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"facts journal record at offset {offset}: {reason}")
        self.offset = offset


def _read_text(buf: bytes | memoryview, at: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(buf, at)
    return bytes(buf[at + 2:at + 2 + n]).decode(), at + 2 + n


def decode_timer(payload: memoryview) -> TimerFacts:
    position, size, due, accepted, tag, qid, ghash, rolled = _TIMER.unpack_from(payload, 0)
    at = _TIMER.size
    topic, at = _read_text(payload, at)
    message_id, at = _read_text(payload, at)
    (count,) = _U16.unpack_from(payload, at)
    at += 2
    keys = []
    for _ in range(count):
        key, at = _read_text(payload, at)
        keys.append(key)
    return TimerFacts(position, size, due, accepted, tag, None if qid < 0 else qid, None if ghash < 0 else ghash,
                      None if rolled < 0 else rolled, topic, message_id, tuple(keys))


def iter_records(buf: bytes | memoryview, start: int, end: int):  # type: ignore[no-untyped-def]
    """(offset, kind, payload) of each facts record in [start, end); raises `FactsDamaged`."""
    view = memoryview(buf)
    at = start
    while at < end:
        if at + _HEAD.size > end:
            raise FactsDamaged(at, "a record header runs past the journal's end")
        length, crc = _HEAD.unpack_from(view, at)
        if length < 1 or at + _HEAD.size + length > end:
            raise FactsDamaged(at, f"length {length} runs past the journal's end {end}")
        body = view[at + _HEAD.size:at + _HEAD.size + length]
        if crc32c(body) != crc:
            raise FactsDamaged(at, "CRC32C mismatch")
        yield at, body[0], body[1:]
        at += _HEAD.size + length


def decode_level(payload: memoryview) -> tuple[int, int]:
    return _LEVEL.unpack_from(payload, 0)  # type: ignore[return-value]


def decode_floor(payload: memoryview) -> tuple[int, int]:
    return _FLOOR.unpack_from(payload, 0)  # type: ignore[return-value]


def decode_link_copy(payload: memoryview) -> tuple[int, int, bytes]:
    position, linked_ms = _LINK_COPY.unpack_from(payload, 0)
    return position, linked_ms, bytes(payload[_LINK_COPY.size:])


def decode_forget(payload: memoryview) -> tuple[int, int | None]:
    below, live_from = _FORGET.unpack_from(payload, 0)
    return below, None if live_from < 0 else live_from


def decode_prune(payload: memoryview) -> int:
    return _PRUNE.unpack_from(payload, 0)[0]  # type: ignore[no-any-return]


# -- checkpoint --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Checkpoint:
    generation: int
    indexed_position: int
    timerlog_end: int
    facts_end: int
    read_slot_ms: int
    slot_ms: int
    slots: int

    def encode(self) -> bytes:
        rest = _CHECK.pack(FORMAT_VERSION, self.generation, self.indexed_position, self.timerlog_end,
                           self.facts_end, 0, self.read_slot_ms, self.slot_ms, self.slots)
        return CHECK_MAGIC + struct.pack(">I", crc32c(rest)) + rest

    @staticmethod
    def decode(raw: bytes) -> Checkpoint:
        """Raises ValueError naming what is wrong."""
        if len(raw) != 12 + _CHECK.size or raw[:8] != CHECK_MAGIC:
            raise ValueError(f"checkpoint is {len(raw)} bytes or lacks its magic {CHECK_MAGIC!r}")
        (crc,) = struct.unpack_from(">I", raw, 8)
        rest = raw[12:]
        if crc32c(rest) != crc:
            raise ValueError("checkpoint CRC32C mismatch")
        version, gen, indexed, log_end, facts_end, _zero, read_slot, slot_ms, slots = _CHECK.unpack(rest)
        if version != FORMAT_VERSION:
            raise ValueError(f"format version {version}, this chronoq reads {FORMAT_VERSION}")
        return Checkpoint(gen, indexed, log_end, facts_end, read_slot, slot_ms, slots)


def write_checkpoint(directory: Path, checkpoint: Checkpoint) -> None:
    path = directory / "timercheck"
    tmp = directory / "timercheck.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, checkpoint.encode())
        fsync(fd, tmp)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


# -- the append-only files and the slot table --------------------------------------------------


class AppendFile:
    """An append-only file read through a growing memory map (units are read by position, often
    backwards along a slot's chain). Writes go through `os.write`; `end` is the logical end."""

    def __init__(self, path: Path, end: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size != end:
            os.ftruncate(self.fd, end)
        self.end = end
        self._map: mmap.mmap | None = None
        self._mapped = 0

    def append(self, data: bytes) -> int:
        """Write `data` at the end; return where it starts. On an error nothing stays written."""
        at = self.end
        try:
            written = os.pwrite(self.fd, data, at)
            if written != len(data):
                raise OSError(28, "short write")
        except OSError:
            os.ftruncate(self.fd, at)
            raise
        self.end = at + len(data)
        return at

    def view(self) -> memoryview | bytes:
        """The file's bytes up to `end` (a map, remapped as the file grows)."""
        if self.end == 0:
            return b""
        if self._mapped < self.end:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self.fd, self.end, prot=mmap.PROT_READ)
            self._mapped = self.end
        return memoryview(self._map)[:self.end]  # type: ignore[arg-type]

    def sync(self) -> None:
        fdatasync(self.fd, self.path)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported: the map goes with the last one
                pass
            self._map = None
        os.close(self.fd)


class WheelFile:
    """The slot table, memory-mapped read-write as RocketMQ's TimerWheel is."""

    def __init__(self, path: Path, slots: int) -> None:
        self.path = path
        self.slots = slots
        size = slots * SLOT_SIZE
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            st = os.fstat(self.fd)
            if st.st_size != size:
                os.ftruncate(self.fd, size)
            if st.st_blocks * 512 < size:
                # Every block allocated now: a write through the map into a hole of a sparse file
                # on a full disk is a SIGBUS, not an error a caller could handle.
                os.posix_fallocate(self.fd, 0, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.map = mmap.mmap(self.fd, size)

    def get(self, index: int) -> tuple[int, int, int, int, int]:
        """(slot time, first_pos, last_pos, count, magic) of slot `index`."""
        return SLOT.unpack_from(self.map, index * SLOT_SIZE)  # type: ignore[return-value]

    def put(self, index: int, slot_ms: int, first_pos: int, last_pos: int, count: int) -> None:
        SLOT.pack_into(self.map, index * SLOT_SIZE, slot_ms, first_pos, last_pos, count, 0)

    def clear(self) -> None:
        self.map[:] = bytes(len(self.map))

    def sync(self) -> None:
        self.map.flush()

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
