"""What a damaged stretch of the log costs, for `chronoq check` (`store/check.py`).

Theory of operation: check finds damaged bytes in the log (records that fail their checks with
valid records after them) while it walks it; this module says, for each damaged range, exactly
what it costs, from what names records inside it, since the damaged records themselves cannot be
read:
- consume-queue entries whose record lies in the range: those messages are lost (counted per
  queue, with their offsets);
- entries that name a *link record* in the range (how timers fire, `store/links.py`): the timer
  index keeps a copy of each link record while it is retained, and readers fall back on it, so
  those messages are not lost; the copy's links name the timer records (intact, elsewhere), whose
  message ids are listed. With no copy (the index rebuilt since, or missing), the index rebuilt
  from the log finds those timers pending (nothing in the log marks them fired), so they fire
  again: at least once, never lost;
- pending timers whose own record lies in the range: lost (marked damaged when due), by id.
It reads the timer index read-only (`IndexView`, also how check learns where retention's live
link records begin) and the consume queues in chunks, as the rest of check does: its memory
grows with the damage it reports, not with the store.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rocksdict import AccessType, Options, Rdict

from chronoq.errors import CorruptRecord
from chronoq.model import LINKS_TOPIC, TIMER_TOPIC
from chronoq.store import files
from chronoq.store.commitlog_segment import SEGMENT_HEADER_SIZE
from chronoq.store.consumequeue import LINKED
from chronoq.store.links import decode_links
from chronoq.store.record import decode_record
from chronoq.timefmt import instant

if TYPE_CHECKING:
    from chronoq.timer.engine import TimerEngine
from chronoq.timer.index_codec import (
    CF_LINKS,
    CF_META,
    CF_POS,
    META_FORMAT_VERSION,
    META_LIVE_LINKS_FROM,
    POS_PENDING,
    U32,
    U64,
    MalformedValue,
    decode_link_copy,
    decode_pos_pending,
    split_id_key,
)

_ENTRY_WHOLE = struct.Struct(">QIII")  # a consume-queue entry with its CRC32C


class IndexView:
    """The timer index opened read-only (nothing written, a running broker's lock ignored): the
    copies of link records, the pending timers by position, where live link records begin.
    `open` returns None when there is no index of this chronoq's format to read (a restart
    rebuilds it from the log; check reports that apart)."""

    def __init__(self, db: Rdict) -> None:
        self._db = db
        self._links = db.get_column_family(CF_LINKS)
        self._pos = db.get_column_family(CF_POS)
        raw = db.get_column_family(CF_META).get(META_LIVE_LINKS_FROM)
        self.live_links_from: int | None = U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else None

    @classmethod
    def open(cls, path: Path, format_version: int) -> IndexView | None:
        try:
            cfs = Rdict.list_cf(str(path))
            opts = Options(raw_mode=True)
            db = Rdict(str(path), opts, column_families={name: opts for name in cfs if name != "default"},
                       access_type=AccessType.read_only())
        except Exception:
            return None
        try:
            raw = db.get_column_family(CF_META).get(META_FORMAT_VERSION) if CF_META in cfs else None
            if CF_LINKS in cfs and raw is not None and len(raw) == 4 and U32.unpack(raw)[0] == format_version:
                return cls(db)
        except Exception:
            pass
        db.close()
        return None

    def close(self) -> None:
        for handle in (self._links, self._pos, self._db):
            handle.close()

    def link_copies(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """(position, body) of the link records in [start, end) the index keeps copies of."""
        out = []
        for key, value in self._links.items(from_key=U64.pack(start)):
            position = U64.unpack(key)[0]
            if position >= end:
                break
            try:
                out.append((position, decode_link_copy(value)[0]))
            except MalformedValue:
                continue
        return out

    def pending_timers(self, start: int, end: int) -> list[tuple[str, str, int]]:
        """(message id, topic, due time) of the pending timers recorded in [start, end)."""
        out = []
        for key, value in self._pos.items(from_key=U64.pack(start)):
            if U64.unpack(key)[0] >= end:
                break
            if value[:1] != bytes([POS_PENDING]):
                continue
            try:
                due, ik = decode_pos_pending(value)
                message_id, topic, _ = split_id_key(ik)
            except MalformedValue:
                continue
            out.append((message_id, topic, due))
        return out


class EngineView:
    """A timer engine read as `IndexView` is (the file wheel, opened from a copy by
    `WheelTimerEngine.open_copy`): the same three answers, from the engine's own calls."""

    def __init__(self, engine: TimerEngine) -> None:
        self._engine = engine
        self.live_links_from = engine.live_links_from()

    def close(self) -> None:
        self._engine.close()

    def link_copies(self, start: int, end: int) -> list[tuple[int, bytes]]:
        out = []
        for position in self._engine.link_copies_in(start, end):
            copy = self._engine.link_copy(position)
            if copy is not None:
                out.append((position, copy[0]))
        return out

    def pending_timers(self, start: int, end: int) -> list[tuple[str, str, int]]:
        return [(e.message_id, e.topic, e.deliver_at_ms) for e in self._engine.pending_in(start, end)]


class _Records:
    """Reads single records of the log by position (the intact timer records a link names)."""

    def __init__(self, data_dir: Path) -> None:
        log_dir = data_dir / files.COMMITLOG_DIR
        self._paths = sorted(log_dir.glob("*" + files.SEGMENT_SUFFIX)) if log_dir.is_dir() else []
        self._bases = [files.parse_numbered(p.name, files.SEGMENT_SUFFIX) or 0 for p in self._paths]
        self._fds: dict[int, int] = {}

    def message_id(self, position: int, size: int) -> str | None:
        i = bisect.bisect_right(self._bases, position) - 1
        if i < 0:
            return None
        try:
            if i not in self._fds:
                self._fds[i] = os.open(self._paths[i], os.O_RDONLY)
            buf = os.pread(self._fds[i], size, position - self._bases[i] + SEGMENT_HEADER_SIZE)
            return decode_record(buf, expected_position=position).message_id
        except (OSError, CorruptRecord):
            return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


@dataclass
class DamageCosts:
    """The damaged ranges check found, and what names records inside them."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    problem_index: list[int] = field(default_factory=list)
    """Per range, the index of its finding in `CheckReport.problems` (its cost is added there)."""
    _starts: list[int] = field(default_factory=list)
    _lost: list[dict[tuple[str, int], list[int]]] = field(default_factory=list)
    """Per range: queue -> [entries, first offset, last offset] of records lost in it."""
    _linked: list[dict[int, int]] = field(default_factory=list)
    """Per range: link record position -> queue entries naming it."""
    _fired: list[dict[tuple[str, int], list[int]]] = field(default_factory=list)
    """Per range: queue -> [links, first offset, last offset] of fired timers whose record is in
    it, entered by intact link records."""

    def add(self, start: int, end: int, problem_index: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self.ranges.insert(i, (start, end))
        self.problem_index.insert(i, problem_index)
        self._lost.insert(i, {})
        self._linked.insert(i, {})
        self._fired.insert(i, {})

    def holds(self, position: int) -> bool:
        return self._find(position) is not None

    def _find(self, position: int) -> int | None:
        i = bisect.bisect_right(self._starts, position) - 1
        return i if i >= 0 and position < self.ranges[i][1] else None

    def count_entries(self, topic: str, queue_id: int, first_offset: int, raw: bytes) -> None:
        """Note each of these raw entries of queue (`topic`, `queue_id`), the first at
        `first_offset`, that names a record in a damaged range. The timer and link topics' own
        entries are not messages anyone receives: a timer record's cost is its timer's (pending,
        `IndexView.pending_timers`, or fired, `count_link`), a link record's its links'."""
        if topic in (TIMER_TOPIC, LINKS_TOPIC):
            return
        low, high = self.ranges[0][0], self.ranges[-1][1]
        for j, (position, size, _, _) in enumerate(_ENTRY_WHOLE.iter_unpack(raw), first_offset):
            if size == 0 or not low <= position < high or (i := self._find(position)) is None:
                continue
            if size & LINKED:
                self._linked[i][position] = self._linked[i].get(position, 0) + 1
            else:
                seen = self._lost[i].setdefault((topic, queue_id), [0, j, j])
                seen[0] += 1
                seen[2] = j

    def count_link(self, target: int, topic: str, queue_id: int, queue_offset: int) -> None:
        """An intact link record enters the record at `target` at `queue_offset` of queue
        (`topic`, `queue_id`): a fired timer, lost if its record lies in a damaged range."""
        if (i := self._find(target)) is not None:
            seen = self._fired[i].setdefault((topic, queue_id), [0, queue_offset, queue_offset])
            seen[0] += 1
            seen[1] = min(seen[1], queue_offset)
            seen[2] = max(seen[2], queue_offset)

    def costs(self, data_dir: Path, index: IndexView | EngineView | None) -> list[str]:
        """Per range, what it costs, in words."""
        records = _Records(data_dir)
        try:
            return [self._cost(i, records, index) for i in range(len(self.ranges))]
        finally:
            records.close()

    def _cost(self, i: int, records: _Records, index: IndexView | EngineView | None) -> str:
        start, end = self.ranges[i]
        parts: list[str] = []
        copies = dict(index.link_copies(start, end)) if index is not None else {}
        for position, body in sorted(copies.items()):
            try:
                links = decode_links(body, position)
            except CorruptRecord:
                continue
            ids = [records.message_id(p, s) or f"<record at {p}>" for p, s in zip(links.positions, links.sizes,
                                                                                  strict=True)]
            parts.append(f"link record at position {position} ({len(links)} links): read from the timer index's "
                         f"copy of it, nothing is lost (the timers it fired: {', '.join(ids)})")
        for position, entries in sorted(self._linked[i].items()):
            if position in copies:
                continue
            why = ("the timer index has no copy of it (rebuilt since the damage): the timers it fired were "
                   "pending again there, and fire again" if index is not None else
                   "the timer index, which keeps a copy of each link record, is missing or of another format: "
                   "a restart rebuilds it from the log, where this record is damaged, so the timers it fired are "
                   "pending again and fire again")
            parts.append(f"link record at position {position}: {entries} queue entries name it; {why} (at least "
                         "once, never lost)")
        for (topic, queue_id), (count, first, last) in sorted(self._lost[i].items()):
            parts.append(f"{_messages(count)} of {topic}/{queue_id} ({_offsets(count, first, last)}) lost: "
                         "their records are damaged")
        for (topic, queue_id), (count, first, last) in sorted(self._fired[i].items()):
            parts.append(f"{_messages(count, 'fired timer')} of {topic}/{queue_id} ({_offsets(count, first, last)}) "
                         "lost: their timer records are damaged")
        if index is not None:
            for message_id, topic, due in index.pending_timers(start, end):
                parts.append(f"pending timer {message_id!r} on {topic!r} due {instant(due)} lost: its record is "
                             "damaged (marked damaged when due)")
        if not parts:
            return "It costs nothing a consume queue or the timer index names."
        return "It costs: " + "; ".join(parts) + "."


def _messages(count: int, what: str = "message") -> str:
    return f"{count:,} {what}" + ("" if count == 1 else "s")


def _offsets(count: int, first: int, last: int) -> str:
    return f"offset {first}" if count == 1 else f"offsets {first} to {last}"

