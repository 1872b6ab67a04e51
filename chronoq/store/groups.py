"""Consumer-group progress: per-queue offsets and in-flight (received, unacked) messages.

Theory of operation: RocketMQ 5 simple consumers "pop" messages: a receive hands out messages,
advances the group's offset past them, and remembers each as in flight until it is acked or its
invisible duration ends, when it becomes receivable again with attempt + 1. This module keeps
that state in RocksDB (`DATA_DIR/groups/`), one atomic WriteBatch per receive/ack/change, with
the WAL on. A process crash loses nothing written; a power loss can lose the last writes, which
means a message is delivered again (at least once), never lost, because the offset advance and
the in-flight entry that covers it are in the same batch.

Keys (one column family, big-endian integers, `G` = group, `T` = topic, names contain no 0x00):
    b"o" G 0x00 T 0x00 qid:u32                 -> next offset u64
    b"i" G 0x00 T 0x00 qid:u32 offset:u64      -> in-flight value (below)
    b"v" G 0x00 T 0x00 visible_ms:u64 qid:u32 offset:u64 -> b"" (in-flight ordered by due time)
    b"meta:version"                            -> u32 = 1
In-flight value, version 1: version u8 | attempt u16 | visible_ms u64 | nonce u32 | position u64 |
size u32 | first_delivery_ms u64.
"""

from __future__ import annotations

import base64
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from chronoq.errors import CorruptRecord, InvalidReceiptHandle

GROUPS_FORMAT_VERSION = 1
_INFLIGHT = struct.Struct(">BHQIQIQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_QO = struct.Struct(">IQ")
_VQO = struct.Struct(">QIQ")
_HANDLE = struct.Struct(">BIQI")  # version, queue id, offset, nonce
HANDLE_VERSION = 1


@dataclass(frozen=True, slots=True)
class InFlight:
    group: str
    topic: str
    queue_id: int
    offset: int
    attempt: int
    visible_ms: int
    nonce: int
    position: int
    size: int
    first_delivery_ms: int

    @property
    def receipt_handle(self) -> str:
        return encode_handle(self.queue_id, self.offset, self.nonce)


def encode_handle(queue_id: int, offset: int, nonce: int) -> str:
    raw = _HANDLE.pack(HANDLE_VERSION, queue_id, offset, nonce)
    return base64.urlsafe_b64encode(raw + _U32.pack(crc32c.crc32c(raw))).decode().rstrip("=")


def decode_handle(handle: str) -> tuple[int, int, int]:
    """(queue_id, offset, nonce), or InvalidReceiptHandle saying why."""
    if not isinstance(handle, str) or not handle or len(handle) > 64:
        raise InvalidReceiptHandle("not a chronoq receipt handle")
    try:
        raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    except (ValueError, TypeError):
        raise InvalidReceiptHandle("not base64") from None
    if len(raw) != _HANDLE.size + 4:
        raise InvalidReceiptHandle("wrong length")
    if crc32c.crc32c(raw[:-4]) != _U32.unpack(raw[-4:])[0]:
        raise InvalidReceiptHandle("checksum mismatch")
    version, qid, offset, nonce = _HANDLE.unpack(raw[:-4])
    if version != HANDLE_VERSION:
        raise InvalidReceiptHandle(f"unknown handle version {version}")
    # The lenient base64 decoder skips stray characters and padding; one entry, one spelling.
    if encode_handle(qid, offset, nonce) != handle:
        raise InvalidReceiptHandle("not in canonical form (extra or substituted characters)")
    return qid, offset, nonce


def _gt(group: str, topic: str) -> bytes:
    return group.encode() + b"\x00" + topic.encode() + b"\x00"


class GroupStore:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self.directory = directory
        self._db = Rdict(str(directory), opts)
        self._wo = WriteOptions()
        self._wo.sync = False
        version = self._db.get(b"meta:version")
        if version is None:
            self._db.put(b"meta:version", _U32.pack(GROUPS_FORMAT_VERSION), self._wo)
        elif _U32.unpack(version)[0] != GROUPS_FORMAT_VERSION:
            from chronoq.errors import UnsupportedVersion
            raise UnsupportedVersion("groups store", _U32.unpack(version)[0], GROUPS_FORMAT_VERSION)

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def destroy(directory: Path) -> None:
        if directory.exists():
            shutil.rmtree(directory)

    # -- offsets ----------------------------------------------------------------------------

    def offset(self, group: str, topic: str, queue_id: int) -> int | None:
        raw = self._db.get(b"o" + _gt(group, topic) + _U32.pack(queue_id))
        return None if raw is None else _U64.unpack(raw)[0]

    def groups(self) -> Iterator[tuple[str, str]]:
        """(group, topic) pairs with stored offsets."""
        seen: set[tuple[str, str]] = set()
        for key in self._db.keys(from_key=b"o"):
            if not key.startswith(b"o"):
                break
            group, topic, _ = key[1:].split(b"\x00", 2)
            pair = (group.decode(), topic.decode())
            if pair not in seen:
                seen.add(pair)
                yield pair

    # -- in flight --------------------------------------------------------------------------

    def get(self, group: str, topic: str, queue_id: int, offset: int) -> InFlight | None:
        raw = self._db.get(b"i" + _gt(group, topic) + _QO.pack(queue_id, offset))
        return None if raw is None else _decode_inflight(group, topic, queue_id, offset, raw)

    def due(self, group: str, topic: str, now_ms: int, limit: int) -> list[InFlight]:
        """In-flight entries whose invisible duration has ended, earliest first."""
        prefix = b"v" + _gt(group, topic)
        out: list[InFlight] = []
        for key in self._db.keys(from_key=prefix):
            if not key.startswith(prefix) or len(out) >= limit:
                break
            visible_ms, qid, offset = _VQO.unpack(key[len(prefix):])
            if visible_ms > now_ms:
                break
            entry = self.get(group, topic, qid, offset)
            if entry is not None:
                out.append(entry)
        return out

    def next_visible_ms(self, group: str, topic: str) -> int | None:
        prefix = b"v" + _gt(group, topic)
        for key in self._db.keys(from_key=prefix):
            if key.startswith(prefix):
                return _VQO.unpack(key[len(prefix):])[0]
            break
        return None

    def inflight_count(self, group: str, topic: str) -> int:
        prefix = b"i" + _gt(group, topic)
        n = 0
        for key in self._db.keys(from_key=prefix):
            if not key.startswith(prefix):
                break
            n += 1
        return n

    def min_inflight_position(self) -> int | None:
        """The lowest commit-log position any group still holds in flight (retention keeps it)."""
        low: int | None = None
        for key, raw in self._db.items(from_key=b"i"):
            if not key.startswith(b"i"):
                break
            position = _INFLIGHT.unpack(raw)[4]
            low = position if low is None else min(low, position)
        return low

    # -- the one write path -----------------------------------------------------------------

    def commit(self, *, offsets: Iterable[tuple[str, str, int, int]] = (),
               put: Iterable[InFlight] = (), remove: Iterable[InFlight] = ()) -> None:
        """Atomically: set next offsets, add/replace in-flight entries, remove in-flight entries.
        `remove` entries must be the stored ones (their visible_ms locates the index key)."""
        wb = WriteBatch(raw_mode=True)
        for group, topic, qid, offset in offsets:
            wb.put(b"o" + _gt(group, topic) + _U32.pack(qid), _U64.pack(offset))
        for e in remove:
            gt = _gt(e.group, e.topic)
            wb.delete(b"i" + gt + _QO.pack(e.queue_id, e.offset))
            wb.delete(b"v" + gt + _VQO.pack(e.visible_ms, e.queue_id, e.offset))
        for e in put:
            gt = _gt(e.group, e.topic)
            wb.put(b"i" + gt + _QO.pack(e.queue_id, e.offset), _encode_inflight(e))
            wb.put(b"v" + gt + _VQO.pack(e.visible_ms, e.queue_id, e.offset), b"")
        self._db.write(wb, self._wo)

    def lookup_handle(self, group: str, topic: str, handle: str) -> InFlight:
        qid, offset, nonce = decode_handle(handle)
        entry = self.get(group, topic, qid, offset)
        if entry is None:
            raise InvalidReceiptHandle("no such in-flight message for this group and topic (acked or expired)")
        if entry.nonce != nonce:
            raise InvalidReceiptHandle("superseded: the message was renewed or redelivered since")
        return entry


def new_nonce() -> int:
    return int.from_bytes(os.urandom(4), "big")


def _encode_inflight(e: InFlight) -> bytes:
    return _INFLIGHT.pack(1, e.attempt, e.visible_ms, e.nonce, e.position, e.size, e.first_delivery_ms)


def _decode_inflight(group: str, topic: str, qid: int, offset: int, raw: bytes) -> InFlight:
    # Checked here, not trusted: a value of another length or version must fail as CorruptRecord
    # (naming the entry), not as struct.error from deep inside a receive.
    if len(raw) != _INFLIGHT.size:
        raise CorruptRecord(f"in-flight value for {group}/{topic}/{qid}@{offset} is {len(raw)} bytes, "
                            f"expected {_INFLIGHT.size}")
    version, attempt, visible_ms, nonce, position, size, first_ms = _INFLIGHT.unpack(raw)
    if version != 1:
        raise CorruptRecord(f"unknown in-flight value version {version} for {group}/{topic}/{qid}@{offset}")
    return InFlight(group, topic, qid, offset, attempt, visible_ms, nonce, position, size, first_ms)
