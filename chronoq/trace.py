"""The delivery trace journal: when each timer message was accepted, fired, first received or cancelled.

Theory of operation: with `trace_enable`, the broker appends one binary event per milestone to
the journal's active segment, `DATA_DIR/trace/<20-digit number>.trace` (buffered, flushed at
checkpoints and on close; the trace is a measurement, not a durable record, so it does not ride
the commit log's fsync). `read_trace()` folds the events into one row per (topic, message id,
due time), the shape of `chronoq.spark.trace.TRACE_COLUMNS`; `chronoq trace export` writes them
as Parquet for `chronoq spark report`.

Bounded, because it shares its disk with the commit log and a full disk stops sends: a segment
is closed once the next event would take it past `trace_segment_size_bytes`, a new one is
started, and the oldest closed segments are deleted while they and a full active segment would
exceed `trace_retention_bytes`. The cap is in bytes, not age: bytes are what fill the disk, and
an age bound (the commit log's `retention_ms`) bounds nothing at a high timer rate; events need
no log record, so nothing ties their lifetime to the log's. Segments are numbered from 0 without
gaps (1 when a version-1 `events.bin` is there: it is number 0), so the lowest number left says
how many were rotated away, and `read_trace` says so: "no events" and "events rotated away" read
differently. A timer whose acceptance was rotated away is left out of the rows and counted.
An export may read a running broker's directory, whose rotation can delete a segment it listed:
`read_trace` then reads again from the start, so its rows and notes agree.

Crash safety: every step leaves a readable journal. A new segment is written with its header
under a temporary name and renamed into place (a crash leaves a `.tmp`, removed at open); one
whose header a power loss cut is, as the last segment, made again at open; a crash before the
oldest were deleted leaves too many, deleted at open. A cut last event (a crash mid-write) is
ignored by the reader and cut off when the journal is opened again, before anything follows it.
On a full disk the journal stops for the rest of the run (one warning): it is a measurement,
and a broker must not stall on it; what it wrote stays readable. A stopped journal says so where
an operator looks, not only in the log: `chronoq stats` ("trace" line; `trace` in
`Broker.stats()`) and /metrics (`chronoq_trace_active`, `chronoq_trace_stopped{reason}`).

Each segment is a 24-byte header (magic, version, number, CRC32C) and events, each a 21-byte
head (kind, times, name lengths) and the names; `docs/disk-format.md` ("Delivery trace") gives
the layout, once. Older versions are read and never appended to: version 1, one unbounded
`trace/events.bin` with no header (segment 0, the first rotated away), and version 2 segments,
which cannot hold a cancel (kind 4, new in version 3: a version-2 reader would take it for the
end of the readable part and cut the segment there at its next open), so a new segment follows
them. A version this chronoq does not know is refused (`TraceFormatError`, naming the file and
the versions); by the broker too, which then runs without the trace rather than mix versions.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c

from chronoq.model import (
    LINKS_TOPIC,
    SYS_DLQ_ORIGIN_TOPIC,
    SYS_FIRED_FROM,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    StoredMessage,
)
from chronoq.store import files
from chronoq.store.diskspace import is_disk_full
from chronoq.timefmt import instant

ACCEPTED, FIRED, RECEIVED, CANCELLED = 1, 2, 3, 4
EVENT_HEAD = struct.Struct(">BQQHH")
_EVENT = EVENT_HEAD
SEGMENT_MAGIC = b"CHRONOQT"
SEGMENT_HEADER = struct.Struct(">8sIQI")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size  # 24
TRACE_VERSION = 3
"""The version this chronoq writes (3: cancels journaled; 2: segments, without cancels)."""
LEGACY_VERSION = 1
"""`trace/events.bin`: one file, no header; read, never written."""
KINDS_BY_VERSION: dict[int, tuple[int, ...]] = {
    1: (ACCEPTED, FIRED, RECEIVED), 2: (ACCEPTED, FIRED, RECEIVED), 3: (ACCEPTED, FIRED, RECEIVED, CANCELLED)}
"""The event kinds each readable version holds (an unknown kind is where the readable part ends)."""
log = logging.getLogger("chronoq.trace")
RECEIVED_REMEMBERED = 100_000


class TraceFormatError(ValueError):
    """A trace segment of a version this chronoq cannot read (written by a newer one)."""

    def __init__(self, path: Path, version: int) -> None:
        readable = ", ".join(str(v) for v in sorted(KINDS_BY_VERSION))
        super().__init__(f"{path}: delivery-trace format version {version}; this chronoq reads versions "
                         f"{readable} (written by a newer chronoq? export it with that one, or move the "
                         "trace directory aside)")
        self.path = path
        self.version = version


def encode_segment_header(number: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, TRACE_VERSION, number, 0)[:20]
    return head + struct.pack(">I", crc32c.crc32c(head))


@dataclass(slots=True)
class Segment:
    number: int
    path: Path
    version: int
    """LEGACY_VERSION, a readable version, or 0: the header is cut or damaged (no event read)."""
    size: int
    damage: str | None = None
    """Why its header could not be read; None when it could."""

    @property
    def data_start(self) -> int:
        return 0 if self.version == LEGACY_VERSION else SEGMENT_HEADER_SIZE


def list_segments(data_dir: Path) -> list[Segment]:
    """The journal's segments, oldest first: version 1's `events.bin` (number 0), then the
    numbered ones. A segment whose header is cut or damaged is listed with its `damage` (it holds
    no event to read); one of a version this chronoq does not know raises TraceFormatError."""
    trace_dir = data_dir / files.TRACE_DIR
    out: list[Segment] = []
    if not trace_dir.is_dir():
        return out
    legacy = trace_dir / files.TRACE_EVENTS
    numbered = sorted((n, p) for p in trace_dir.iterdir()
                      if (n := files.parse_numbered(p.name, files.TRACE_SEGMENT_SUFFIX)) is not None)
    for number, path in [(0, legacy), *numbered]:
        try:
            with open(path, "rb") as f:
                head = b"" if path is legacy else f.read(SEGMENT_HEADER_SIZE)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            continue  # never there (legacy), or rotated away by a running broker since the listing
        out.append(Segment(0, legacy, LEGACY_VERSION, size) if path is legacy else _segment(number, path, head, size))
    return out


def _segment(number: int, path: Path, head: bytes, size: int) -> Segment:
    if len(head) < SEGMENT_HEADER_SIZE:
        return Segment(number, path, 0, size, f"header cut at {len(head)} of {SEGMENT_HEADER_SIZE} bytes")
    magic, version, in_header, crc = SEGMENT_HEADER.unpack(head)
    if magic != SEGMENT_MAGIC or crc32c.crc32c(head[:20]) != crc:
        return Segment(number, path, 0, size, "header damaged (magic or CRC32C)")
    if version not in KINDS_BY_VERSION or version == LEGACY_VERSION:
        raise TraceFormatError(path, version)
    if in_header != number:
        return Segment(number, path, 0, size, f"header says segment {in_header}")
    return Segment(number, path, version, size)


class TraceJournal:
    def __init__(self, data_dir: Path, *, segment_size_bytes: int, retention_bytes: int,
                 fired_in: Callable[[StoredMessage], Iterable[tuple[str, str, int]]] | None = None) -> None:
        self.dir = data_dir / files.TRACE_DIR
        self.fired_in = fired_in
        """For a link record: (topic, message id, due time) of each timer it fired (the timer
        room reads them from their records; the fire itself never does)."""
        self.segment_size_bytes = segment_size_bytes
        self.retention_bytes = retention_bytes
        self._f: Any = None
        self._size = 0
        """Bytes of the active segment, written or buffered."""
        self._segments: list[Segment] = []
        self._received: OrderedDict[tuple[str, str], None] = OrderedDict()
        """The last `RECEIVED_REMEMBERED` first receives, so a second group's is not journaled
        too. Bounded: a set of every id received grew for good (157 MiB per million); past it a
        later group's first receive is journaled again, and the export keeps the first."""
        self.stopped: str | None = None
        """Why the journal stopped recording (its disk was full, a newer version's file), or None."""
        self.stopped_reason: str | None = None
        """`stopped` in one word, for `stats` and /metrics: "disk_full", "unknown_version" or
        "error" (any other OSError)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for tmp in self.dir.glob(f"*{files.TRACE_SEGMENT_SUFFIX}.tmp"):
                tmp.unlink()  # a rotation the last run did not finish: no event in it
            self._segments = list_segments(data_dir)
            self._open_last()
            self._drop_oldest()
        except (OSError, TraceFormatError) as e:
            self._stop(e)

    def _open_last(self) -> None:
        last = self._segments[-1] if self._segments else None
        if last is None or last.version == LEGACY_VERSION:
            # Version 1 is never appended to: its events follow in segment 1.
            self._start_segment(0 if last is None else 1)
            return
        if last.damage is None and last.version != TRACE_VERSION:
            self._start_segment(last.number + 1)  # an older version's: this one's events go in a new one
            return
        if last.damage is not None:
            if last.size >= SEGMENT_HEADER_SIZE:
                self._start_segment(last.number + 1)  # left as it is, for a person to look at
                return
            # A power loss cut the header of the segment a rotation had just made: it held nothing.
            log.warning("delivery trace: %s: %s; made again", last.path, last.damage)
            self._segments.pop()
            self._start_segment(last.number)
            return
        data = last.path.read_bytes()
        whole = _whole_length(data, last.version)
        if whole < len(data):
            # A run that ended mid-event (a full disk, a power loss) left a cut event at the end:
            # appended after, this run's events would be misread from it. Cut it off first.
            log.warning("delivery trace: %d bytes of a cut last event dropped from %s", len(data) - whole, last.path)
            os.truncate(last.path, whole)
            last.size = whole
        self._f = open(last.path, "ab", buffering=1 << 20)  # noqa: SIM115 (owned, closed in close())
        self._size = whole

    def _start_segment(self, number: int) -> None:
        path = self.dir / files.trace_segment_name(number)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(encode_segment_header(number))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._f = open(path, "ab", buffering=1 << 20)  # noqa: SIM115 (owned, closed in close())
        self._size = SEGMENT_HEADER_SIZE
        self._segments.append(Segment(number, path, TRACE_VERSION, SEGMENT_HEADER_SIZE))

    def _drop_oldest(self) -> None:
        """Delete the oldest closed segments while they and a full active one exceed the cap."""
        closed = self._segments[:-1]
        total = sum(s.size for s in closed)
        while closed and total + self.segment_size_bytes > self.retention_bytes:
            oldest = closed.pop(0)
            oldest.path.unlink(missing_ok=True)
            self._segments.remove(oldest)
            total -= oldest.size
            log.info("delivery trace: %s rotated away (trace_retention_bytes = %d)", oldest.path.name,
                     self.retention_bytes)

    def _rotate(self) -> None:
        self._f.close()  # flushes: the closed segment is whole on disk before the next starts
        active = self._segments[-1]
        active.size = self._size
        self._start_segment(active.number + 1)
        self._drop_oldest()

    def record(self, kind: int, topic: str, message_id: str, ts_ms: int, due_ms: int) -> None:
        if self.stopped is not None:
            return
        t = topic.encode()
        m = message_id.encode()
        event = _EVENT.pack(kind, ts_ms, due_ms, len(t), len(m)) + t + m
        try:
            if self._size + len(event) > self.segment_size_bytes and self._size > SEGMENT_HEADER_SIZE:
                self._rotate()
            self._f.write(event)
            self._size += len(event)
        except OSError as e:
            self._stop(e)

    def dispatched(self, msgs: list[StoredMessage]) -> None:
        """The trace's step of dispatch (`chronoq/dispatch.py`): journal timers accepted (their
        timer records), fired (the link records that fired them, and the fired copies of delay
        levels and of older brokers) and cancelled (their tombstones: dispatched once durable, before the cancel is
        acknowledged); rolled copies are none of these."""
        for m in msgs:
            if m.topic == LINKS_TOPIC:
                for topic, message_id, due in self.fired_in(m) if self.fired_in is not None else ():
                    self.record(FIRED, topic, message_id, m.store_ms, due)
                continue
            due = m.deliver_at_ms
            if due is None:
                continue
            sp = m.system_properties
            if m.topic == TIMER_TOPIC:
                if SYS_TIMER_DEL_UNIQKEY in sp:  # its due time is the cancelled timer's
                    self.record(CANCELLED, sp[SYS_REAL_TOPIC], sp[SYS_TIMER_DEL_UNIQKEY], m.store_ms, due)
                elif SYS_TIMER_ROLLED_FROM not in sp:
                    self.record(ACCEPTED, sp[SYS_REAL_TOPIC], m.message_id, m.store_ms, due)
            elif SYS_FIRED_FROM in sp and SYS_DLQ_ORIGIN_TOPIC not in sp:
                # (A dead letter copies a fired message's properties: it did not fire again.)
                self.record(FIRED, m.topic, m.message_id, m.store_ms, due)

    def received(self, topic: str, message_id: str, ts_ms: int, due_ms: int) -> None:
        """A first delivery to any group (later ones are not the 'first received')."""
        key = (topic, message_id)
        if key not in self._received:
            self._received[key] = None
            if len(self._received) > RECEIVED_REMEMBERED:
                self._received.popitem(last=False)
            self.record(RECEIVED, topic, message_id, ts_ms, due_ms)

    def flush(self) -> None:
        if self.stopped is None:
            try:
                self._f.flush()
            except OSError as e:
                self._stop(e)

    def _stop(self, err: Exception) -> None:
        self.stopped = str(err)
        if isinstance(err, TraceFormatError):
            self.stopped_reason = "unknown_version"
        else:
            self.stopped_reason = "disk_full" if is_disk_full(err) else "error"
        log.warning("delivery trace stopped for the rest of this run: %s", err)
        try:
            if self._f is not None:
                self._f.close()  # closes the file even when its last flush fails
        except OSError:
            pass

    def close(self) -> None:
        if self.stopped is None:
            try:
                self._f.close()
            except OSError as e:
                log.warning("delivery trace: last events lost at close: %s", e)


# -- reading ----------------------------------------------------------------------------------


@dataclass(slots=True)
class TraceRead:
    """What `read_trace` found: the rows, and what a reader must know about what is missing."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    rotated_segments: int = 0
    """Older segments `trace_retention_bytes` deleted (0: the trace is whole from its start)."""
    first_event_ms: int | None = None
    """The earliest event time retained: with segments rotated away, the trace covers from here."""
    without_acceptance: int = 0
    """Timers with events retained whose acceptance was rotated away: left out of `rows`."""
    damaged: list[str] = field(default_factory=list)
    """Segments skipped because their header is cut or damaged, each with why."""

    def notes(self) -> list[str]:
        """One line per thing a reader of the rows must know, for people (CLI, report)."""
        out = []
        if self.rotated_segments:
            since = ("" if self.first_event_ms is None
                     else f"; the trace holds events from {instant(self.first_event_ms)} on")
            out.append(f"{self.rotated_segments} older trace segment(s) were rotated away "
                       f"(trace_retention_bytes){since}")
        if self.without_acceptance:
            out.append(f"{self.without_acceptance} timer message(s) left out: their acceptance was rotated away")
        out += [f"trace segment skipped: {d}" for d in self.damaged]
        return out


READ_ATTEMPTS = 3
"""`read_trace` reads again from the start when a running broker rotated a segment away under it."""


def read_events(data_dir: Path) -> Iterator[tuple[int, int, int, str, str]]:
    """(kind, ts_ms, due_ms, topic, message_id) for every whole event in the journal, oldest
    segment first; a segment a running broker rotated away meanwhile is passed over.
    TraceFormatError for a segment of a version this chronoq does not read."""
    for seg in list_segments(data_dir):
        try:
            yield from _segment_events(seg)
        except FileNotFoundError:
            continue


def _segment_events(seg: Segment) -> Iterator[tuple[int, int, int, str, str]]:
    if seg.damage is not None:
        return
    data = seg.path.read_bytes()  # FileNotFoundError: rotated away since it was listed
    for i, end in _events(data, seg.version, seg.data_start):
        kind, ts, due, tlen, _ = _EVENT.unpack_from(data, i)
        j = i + _EVENT.size
        yield kind, ts, due, data[j:j + tlen].decode(), data[j + tlen:end].decode()


def _events(data: bytes, version: int, start: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each whole event, in order, up to the first that is cut or not an event."""
    kinds = KINDS_BY_VERSION[version]
    i = start
    while i + _EVENT.size <= len(data):
        kind, _, _, tlen, mlen = _EVENT.unpack_from(data, i)
        end = i + _EVENT.size + tlen + mlen
        if kind not in kinds or end > len(data):
            return
        try:
            data[i + _EVENT.size:end].decode()
        except UnicodeDecodeError:
            return
        yield i, end
        i = end


def _whole_length(data: bytes, version: int) -> int:
    """Bytes of `data` up to the end of its last whole event."""
    start = 0 if version == LEGACY_VERSION else SEGMENT_HEADER_SIZE
    return max((end for _, end in _events(data, version, start)), default=start)


def read_trace(data_dir: Path) -> TraceRead:
    """`_read_trace`, again from the start (`READ_ATTEMPTS` in all) when a running broker
    rotated a segment away while it was read: rows and notes then agree on what was retained."""
    for _ in range(READ_ATTEMPTS - 1):
        try:
            return _read_trace(data_dir)
        except FileNotFoundError:
            continue
    return _read_trace(data_dir)


def _read_trace(data_dir: Path) -> TraceRead:
    """One row per timer message: accepted_ms, due_ms, fired_ms, first_received_ms, cancelled_ms.
    A row is a (topic, message id, due time): a timer cancelled and sent again under its id for
    another time is two rows (one key per id measured the new one against the cancelled one's due
    time: an hour early), the first with its cancelled_ms. A trace written before version 3 has no
    cancels: a timer cancelled then stays a row with neither fired_ms nor cancelled_ms.
    With segments rotated away, the rows are those of the events retained, and the result
    says how many segments went and how many timers were left out for it."""
    out = TraceRead()
    segments = list_segments(data_dir)
    if segments:
        out.rotated_segments = segments[0].number
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for seg in segments:
        if seg.damage is not None:
            out.damaged.append(f"{seg.path}: {seg.damage}")
        for kind, ts, due, topic, mid in _segment_events(seg):
            if out.first_event_ms is None or ts < out.first_event_ms:
                out.first_event_ms = ts
            row = rows.setdefault((topic, mid, due), {"message_id": mid, "topic": topic, "accepted_ms": None,
                                                      "due_ms": due, "fired_ms": None, "first_received_ms": None,
                                                      "cancelled_ms": None})
            if kind == ACCEPTED and row["accepted_ms"] is None:
                row["accepted_ms"] = ts
            elif kind == FIRED and row["fired_ms"] is None:
                row["fired_ms"] = ts
            elif kind == RECEIVED and row["first_received_ms"] is None:
                row["first_received_ms"] = ts
            elif kind == CANCELLED and row["cancelled_ms"] is None:
                row["cancelled_ms"] = ts
    out.rows = [r for r in rows.values() if r["accepted_ms"] is not None]
    if out.rotated_segments:
        out.without_acceptance = len(rows) - len(out.rows)
    return out


def export_rows(data_dir: Path) -> list[dict[str, Any]]:
    """`read_trace(data_dir).rows`."""
    return read_trace(data_dir).rows
