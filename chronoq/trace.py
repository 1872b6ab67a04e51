"""The delivery trace journal: when each timer message was accepted, fired and first received.

Theory of operation: with `trace_enable`, the broker appends one fixed-size binary event per
milestone to `DATA_DIR/trace/events.bin` (buffered, flushed at checkpoints and on close; the
trace is a measurement, not a durable record, so it does not ride the commit log's fsync).
`export_rows()` folds the events into one row per (topic, message id, due time), the shape of
`chronoq.spark.trace.TRACE_COLUMNS`; `chronoq trace export` writes them as Parquet for
`chronoq spark report`.

Each event is a 21-byte head (kind, times, name lengths) and the names; `docs/disk-format.md`
("Delivery trace") gives the layout, once. A truncated last event (crash) is ignored, and cut
off when the journal is opened again.
On a full disk the journal stops for the rest of the run (one warning): it is a measurement,
and a broker must not stall on it; what it wrote stays readable (a cut last event is ignored).
"""

from __future__ import annotations

import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chronoq.model import (
    SYS_FIRED_FROM,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    StoredMessage,
)
from chronoq.store import files

ACCEPTED, FIRED, RECEIVED = 1, 2, 3
EVENT_HEAD = struct.Struct(">BQQHH")
_EVENT = EVENT_HEAD
TRACE_FILE = files.TRACE_EVENTS
log = logging.getLogger("chronoq.trace")
RECEIVED_REMEMBERED = 100_000


class TraceJournal:
    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir / files.TRACE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / TRACE_FILE
        if path.exists():
            # A run that ended mid-event (a full disk, a power loss) left a cut event at the end:
            # appended after, this run's events would be misread from it. Cut it off first.
            whole = _whole_length(path.read_bytes())
            if whole < path.stat().st_size:
                log.warning("delivery trace: %d bytes of a cut last event dropped from %s",
                            path.stat().st_size - whole, path)
                os.truncate(path, whole)
        self._f = open(path, "ab", buffering=1 << 20)  # noqa: SIM115 (owned, closed in close())
        self._received: OrderedDict[tuple[str, str], None] = OrderedDict()
        """The last `RECEIVED_REMEMBERED` first receives, so a second group's is not journaled
        too. Bounded: a set of every id received grew for good (157 MiB per million); past it a
        later group's first receive is journaled again, and the export keeps the first."""
        self.stopped: str | None = None
        """Why the journal stopped recording (its disk was full), or None."""

    def record(self, kind: int, topic: str, message_id: str, ts_ms: int, due_ms: int) -> None:
        if self.stopped is not None:
            return
        t = topic.encode()
        m = message_id.encode()
        try:
            self._f.write(_EVENT.pack(kind, ts_ms, due_ms, len(t), len(m)) + t + m)
        except OSError as e:
            self._stop(e)

    def dispatched(self, msgs: list[StoredMessage]) -> None:
        """A store dispatch listener: journal timers accepted (their timer records) and fired
        (their fired copies); rolled copies and tombstones are neither."""
        for m in msgs:
            due = m.deliver_at_ms
            if due is None:
                continue
            sp = m.system_properties
            if m.topic == TIMER_TOPIC:
                if SYS_TIMER_ROLLED_FROM not in sp and SYS_TIMER_DEL_UNIQKEY not in sp:
                    self.record(ACCEPTED, sp[SYS_REAL_TOPIC], m.message_id, m.store_ms, due)
            elif SYS_FIRED_FROM in sp:
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

    def _stop(self, err: OSError) -> None:
        self.stopped = str(err)
        log.warning("delivery trace stopped for the rest of this run: %s", err)
        try:
            self._f.close()  # closes the file even when its last flush fails
        except OSError:
            pass

    def close(self) -> None:
        if self.stopped is None:
            try:
                self._f.close()
            except OSError as e:
                log.warning("delivery trace: last events lost at close: %s", e)


def read_events(data_dir: Path) -> Iterator[tuple[int, int, int, str, str]]:
    """(kind, ts_ms, due_ms, topic, message_id) for every whole event in the journal."""
    path = data_dir / files.TRACE_DIR / TRACE_FILE
    if not path.exists():
        return
    data = path.read_bytes()
    for i, end in _events(data):
        kind, ts, due, tlen, _ = _EVENT.unpack_from(data, i)
        j = i + _EVENT.size
        yield kind, ts, due, data[j:j + tlen].decode(), data[j + tlen:end].decode()


def _events(data: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each whole event, in order, up to the first that is cut or not an event."""
    i = 0
    while i + _EVENT.size <= len(data):
        kind, _, _, tlen, mlen = _EVENT.unpack_from(data, i)
        end = i + _EVENT.size + tlen + mlen
        if kind not in (ACCEPTED, FIRED, RECEIVED) or end > len(data):
            return
        try:
            data[i + _EVENT.size:end].decode()
        except UnicodeDecodeError:
            return
        yield i, end
        i = end


def _whole_length(data: bytes) -> int:
    """Bytes of `data` up to the end of its last whole event."""
    return max((end for _, end in _events(data)), default=0)


def export_rows(data_dir: Path) -> list[dict[str, Any]]:
    """One row per timer message: accepted_ms, due_ms, fired_ms, first_received_ms. A row is a
    (topic, message id, due time): a timer cancelled and sent again under its id for another
    time is two rows (one key per id measured the new one against the cancelled one's due time:
    an hour early). A cancelled one stays a row without fired_ms (cancels are not journaled)."""
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for kind, ts, due, topic, mid in read_events(data_dir):
        row = rows.setdefault((topic, mid, due), {"message_id": mid, "topic": topic, "accepted_ms": None,
                                                  "due_ms": due, "fired_ms": None, "first_received_ms": None})
        if kind == ACCEPTED and row["accepted_ms"] is None:
            row["accepted_ms"] = ts
        elif kind == FIRED and row["fired_ms"] is None:
            row["fired_ms"] = ts
        elif kind == RECEIVED and row["first_received_ms"] is None:
            row["first_received_ms"] = ts
    return [r for r in rows.values() if r["accepted_ms"] is not None]
