"""Damage in the commit log: telling it from a torn tail, stepping over it, remembering it.

Theory of operation: a record that fails its checks is either a *torn tail* (a write that a crash
cut short: nothing valid, so nothing acknowledged, follows it) or *damage* (a flipped bit, a bad
sector, a file restored from a bad copy: valid records, possibly acknowledged ones, may follow).
At the bad record the two look alike; they differ in what comes after. `next_valid_record`
searches the bytes after a bad record for the next one that passes every check *at its own
position* (magic, version, size, the position it names, CRC32C): a false match needs a 4-byte
tag, an 8-byte position and a CRC32C to agree by chance.

The rules (`classify`):
- a valid record follows: damage. The bad bytes up to it are quarantined, nothing is cut.
- nothing valid follows, and the bad record is *complete* (its header is sound and its length
  fits the file; only the CRC32C disagrees): damage too, of that one record, which may have been
  acknowledged. It is quarantined and reported, not silently cut; any bytes after it are a torn
  tail.
- nothing valid follows and the record is incomplete (runs past the end of the file, or its
  header is not a header): a torn tail. Recovery truncates it; with `flush = "sync"` that loses
  nothing acknowledged, because a send is acknowledged only after an fsync that covered the
  whole record (with "async", what a power loss took before its fsync: the option's price). A
  torn tail below the checkpoint held acknowledged records: `commitlog_recovery._lost_below_checkpoint`.

A quarantined range costs the records inside it and nothing else: every reader steps over it,
`stats` and `chronoq check` report it, consume queues get a hole entry (size 0) at each queue
offset it swallowed, and a pending timer whose record lies in it is marked damaged instead of
firing. The registry lives in memory: ranges found at open (the last segment's tail) and on the
way (scans, reads); `chronoq check` finds them all by reading everything.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from chronoq.errors import CorruptRecord
from chronoq.store.record import HEADER, HEADER_SIZE, KIND_MESSAGE, RECORD_MAGIC, RECORD_VERSION

RECORD_TAG = struct.pack(">HBB", RECORD_MAGIC, RECORD_VERSION, KIND_MESSAGE)
"""Bytes 8..12 of every record: magic, version, kind. What the search for the next record looks for."""
_TAG_OFFSET = 8
_SEARCH_CHUNK = 4 * 1024 * 1024

Pread = Callable[[int, int], bytes]
"""`pread(position, size)`: up to `size` bytes of the log from `position` (fewer at the end)."""
CheckFrame = Callable[[bytes, int, int], int]


@dataclass(frozen=True, slots=True)
class Damage:
    """Quarantined log bytes [start, end): records there are lost; everything else is intact."""

    start: int
    end: int
    reason: str
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, object]:
        return {"start": self.start, "end": self.end, "bytes": self.size, "reason": self.reason, "file": self.path}


TORN_TAIL = "torn tail"
DAMAGED = "damaged"


def classify(pread: Pread, check_frame: CheckFrame, position: int, end: int) -> tuple[str, int]:
    """What the bad record at `position` of a segment that ends at `end` is:
    (TORN_TAIL, position) - truncate here; or (DAMAGED, resume) - quarantine [position, resume)
    and read on from `resume` (`end` when nothing valid follows)."""
    nxt = next_valid_record(pread, check_frame, position + 1, end)
    if nxt is not None:
        return DAMAGED, nxt
    size = complete_record_size(pread, position, end)
    if size is not None:
        return DAMAGED, position + size
    return TORN_TAIL, position


def complete_record_size(pread: Pread, position: int, end: int) -> int | None:
    """The size of the record at `position` if its header is sound (tag, position, a size that
    fits before `end`) though the record failed its CRC32C; None if it is not a whole record."""
    head = pread(position, HEADER_SIZE)
    if len(head) < HEADER_SIZE or head[_TAG_OFFSET:_TAG_OFFSET + 4] != RECORD_TAG:
        return None
    total, _crc, _magic, _version, _kind, _mt, pos = HEADER.unpack_from(head)[:7]
    if pos != position or total < HEADER_SIZE or position + total > end:
        return None
    return int(total)


def next_valid_record(pread: Pread, check_frame: CheckFrame, start: int, end: int) -> int | None:
    """The position of the first record in [start, end) that passes `check_frame` at its own
    position, or None. Reads in chunks; a candidate is any place the record tag appears."""
    chunk_start = start
    while chunk_start < end:
        # Overlap chunks by a header so a record that starts in this chunk is seen whole enough
        # here to check its tag and position.
        buf = pread(chunk_start, min(_SEARCH_CHUNK + HEADER_SIZE, end - chunk_start))
        if not buf:
            return None
        i = buf.find(RECORD_TAG, _TAG_OFFSET)
        while i != -1 and i - _TAG_OFFSET < _SEARCH_CHUNK:
            candidate = chunk_start + i - _TAG_OFFSET
            if _is_record_at(pread, check_frame, buf, i - _TAG_OFFSET, candidate, end):
                return candidate
            i = buf.find(RECORD_TAG, i + 1)
        chunk_start += _SEARCH_CHUNK
    return None


def _is_record_at(pread: Pread, check_frame: CheckFrame, buf: bytes, offset: int, position: int,
                  end: int) -> bool:
    if offset + HEADER_SIZE > len(buf):
        head = pread(position, HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            return False
        buf, offset = head, 0
    total, _crc, _magic, _version, _kind, _mt, pos = HEADER.unpack_from(buf, offset)[:7]
    if pos != position or total < HEADER_SIZE or position + total > end:
        return False
    record = buf[offset:offset + total] if offset + total <= len(buf) else pread(position, total)
    try:
        check_frame(record, 0, position)
    except CorruptRecord:
        return False
    return True


class DamageRegistry:
    """The quarantined ranges found so far, by start position. Readers ask `resume_after` to
    step over a range already known, so each is searched for (and logged) once."""

    def __init__(self) -> None:
        self._by_start: dict[int, Damage] = {}

    def add(self, damage: Damage) -> bool:
        """Remember `damage`; False if a range starting there was already known."""
        if damage.start in self._by_start:
            return False
        self._by_start[damage.start] = damage
        return True

    def known(self, position: int) -> Damage | None:
        """The range that holds `position`, if one is known. Not only one that starts there: a
        queue entry can point inside a range (a zeroed run of several records), and a search
        from there found a second, overlapping range for each record, each logged as new."""
        found = self._by_start.get(position)
        if found is not None:
            return found
        return next((d for d in self._by_start.values() if d.start <= position < d.end), None)

    def ranges(self) -> list[Damage]:
        return sorted(self._by_start.values(), key=lambda d: d.start)

    def drop_before(self, position: int) -> None:
        """Forget ranges retention removed with their segments."""
        for start in [s for s, d in self._by_start.items() if d.end <= position]:
            del self._by_start[start]

    def __len__(self) -> int:
        return len(self._by_start)
