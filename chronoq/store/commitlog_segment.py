"""A commit-log segment: its file's header, its records' frames, and reading records off it.

Theory of operation:
- Positions form one contiguous byte space. A segment file holds the records of
  [base, base + data_size) behind a 24-byte header; it is named by its base. A record never spans
  two segments: when it would not fit, the log rolls to a new segment whose base is the current
  end, so no padding records exist and the position a record was encoded with stays valid.
- A record's frame (its size, magic, version, position and CRC32C) is checked by `check_frame`
  without decoding its fields: recovery, retention's store-time walk, `check_records` and
  `chronoq check` all judge records by it, so they agree on what is damaged.
- `record_buffers` walks a segment's records reading `SCAN_CHUNK_BYTES` at a time, so a scan
  costs few system calls; it only reads, its consumer validates each record.

Why apart from `store/commitlog.py`: these are the facts of one file (the format and how to
read it), which recovery (`store/commitlog_recovery.py`) and `chronoq check` (`store/check.py`)
use without a log; the log itself (`CommitLog`) chains segments and appends to them.

The segment header (24 bytes) and the records are laid out in `docs/disk-format.md`
("Commit-log segment", "Commit-log record"), their one description.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c

from chronoq.errors import CorruptRecord
from chronoq.store.record import HEADER, HEADER_SIZE, RECORD_MAGIC, RECORD_VERSION

SEGMENT_MAGIC = b"CHRONOQL"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct(">8sIQI")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size  # 24
SCAN_CHUNK_BYTES = 4 * 1024 * 1024


def encode_segment_header(base_position: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, base_position, 0)[:20]
    return head + struct.pack(">I", crc32c.crc32c(head))


def decode_segment_header(buf: bytes) -> int:
    """The base position, or CorruptRecord naming what is wrong."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise CorruptRecord(f"segment header is {len(buf)} bytes, needs {SEGMENT_HEADER_SIZE}")
    magic, version, base, crc = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC:
        raise CorruptRecord(f"bad segment magic {magic!r}")
    if version != SEGMENT_VERSION:
        raise CorruptRecord(f"unknown segment version {version}")
    if crc32c.crc32c(buf[:20]) != crc:
        raise CorruptRecord("segment header CRC32C mismatch")
    return int(base)


def check_frame(buf: bytes | memoryview, offset: int, position: int) -> int:
    """Validate the record at `buf[offset]` cheaply (length, magic, version, position, CRC)
    without decoding its fields; return its size. Raises CorruptRecord."""
    avail = len(buf) - offset
    if avail < HEADER_SIZE:
        raise CorruptRecord(f"{avail} bytes left, a record header needs {HEADER_SIZE}", position)
    total, crc, magic, version, _kind, _mt, pos = HEADER.unpack_from(buf, offset)[:7]
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        raise CorruptRecord(f"bad magic/version 0x{magic:04X}/{version}", position)
    if total < HEADER_SIZE or total > avail:
        raise CorruptRecord(f"record size {total} does not fit the {avail} bytes available", position)
    if pos != position:
        raise CorruptRecord(f"record says position {pos}", position)
    if crc32c.crc32c(memoryview(buf)[offset + 8:offset + total]) != crc:
        raise CorruptRecord("CRC32C mismatch", position)
    return int(total)


@dataclass
class Segment:
    base: int
    path: Path
    fd: int
    data_size: int
    last_store_ms: int = 0
    """The youngest store time among the records written to it in this run (0: none): `write`
    keeps the max, whatever order callers pass them in."""
    opened_size: int = 0
    """Bytes of records it held when the log was opened: written by an earlier run, immutable."""
    opened_youngest_ms: int | None = None
    """The youngest store time among those, once `opened_youngest_store_ms` has read them."""
    opened_read: bool = False

    @property
    def end(self) -> int:
        return self.base + self.data_size

    def pread(self, position: int, size: int) -> bytes:
        """Up to `size` bytes of the segment from log position `position`."""
        return os.pread(self.fd, size, position - self.base + SEGMENT_HEADER_SIZE)


def record_buffers(seg: Segment, start: int, stop: int) -> Iterator[tuple[int, bytes, int]]:
    """Walk records of `seg` in [start, stop): yield (position, buffer, offset in buffer) with at
    least one whole record (as its size field claims, capped at `stop`) in the buffer. The consumer
    must validate the record; this only reads. Reads in chunks so a scan costs few syscalls."""
    position = start
    buf = b""
    buf_pos = start
    while position < stop:
        off = position - buf_pos
        need = HEADER_SIZE
        if len(buf) - off >= 4:
            need = max(need, int.from_bytes(buf[off:off + 4], "big"))
        if len(buf) - off < need:
            buf = os.pread(seg.fd, min(max(SCAN_CHUNK_BYTES, need), stop - position),
                           position - seg.base + SEGMENT_HEADER_SIZE)
            buf_pos = position
            off = 0
        yield position, buf, off
        size = int.from_bytes(buf[off:off + 4], "big") if len(buf) - off >= 4 else 0
        if size < HEADER_SIZE:
            return  # the consumer raised or stopped on a bad record; nothing sane follows
        position += size


def sound_frame_size(pread: Callable[[int, int], bytes], position: int, end: int) -> int | None:
    """The size of the record at `position` if its frame passes `check_frame` (read by the size
    it states), else None."""
    head = pread(position, HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        return None
    total = int.from_bytes(head[:4], "big")
    if total < HEADER_SIZE or position + total > end:
        return None
    try:
        return check_frame(pread(position, total), 0, position)
    except CorruptRecord:
        return None
