"""The delivery trace of a real broker in simulated time: bounded by `trace_retention_bytes`,
readable after a crash at any step of a rotation, an export that tells "no events" from
"events rotated away", cancels journaled, older versions read (chronoq/trace.py). Real files
throughout: cut segments are written, not simulated."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest

from chronoq import trace
from chronoq.broker import Broker
from chronoq.cli import main as cli_main
from chronoq.clock import FakeClock
from chronoq.model import OutgoingMessage
from chronoq.store import files
from tests.support.extras import need_module

SEGMENT_BYTES = 4096
RETENTION_BYTES = 4 * SEGMENT_BYTES
TRACED = {"trace_enable": True, "trace_segment_size_bytes": SEGMENT_BYTES, "trace_retention_bytes": RETENTION_BYTES}


def _trace_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in (data_dir / files.TRACE_DIR).iterdir())


def _journal(data_dir: Path) -> trace.TraceJournal:
    return trace.TraceJournal(data_dir, segment_size_bytes=SEGMENT_BYTES, retention_bytes=RETENTION_BYTES)


def _segments(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / files.TRACE_DIR).iterdir())


async def _timers(broker: Broker, clock: FakeClock, first: int, count: int) -> None:
    """`count` timers due 1 s after now, fired, and received by one group."""
    await broker.send_batch([OutgoingMessage("tp", b"x", message_id=f"M{i:05d}", deliver_at_ms=clock.now_ms() + 1000)
                             for i in range(first, first + count)])
    clock.advance(1000)
    assert await broker.run_due() == count
    got = 0
    while batch := await broker.receive("g", "tp", batch_size=64):
        got += len(batch)
        for rm in batch:
            await broker.ack("g", "tp", rm.receipt_handle)
    assert got == count


def test_the_trace_stays_within_its_byte_cap_and_says_what_went(run_broker: Callable, data_dir: Path) -> None:
    """Without a cap `events.bin` grew for as long as the broker ran, on the disk of the commit
    log. With one, the oldest segments go, the newest events stay whole, and the export says
    how many segments were rotated away and from when it holds events."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        start = clock.now_ms()
        for n in range(12):  # about 3 x 40 bytes per timer: ~15 segments of 4 KiB
            await _timers(broker, clock, n * 50, 50)
            assert _trace_bytes(data_dir) <= RETENTION_BYTES
        broker.trace.flush()
        assert _trace_bytes(data_dir) <= RETENTION_BYTES
        read = trace.read_trace(data_dir)
        assert read.rotated_segments > 0 and read.first_event_ms is not None and read.first_event_ms > start
        ids = sorted(r["message_id"] for r in read.rows)
        assert ids[-1] == "M00599" and len(ids) < 600  # the newest kept, the oldest gone
        assert ids == [f"M{i:05d}" for i in range(int(ids[0][1:]), 600)]  # no hole in what is kept
        for r in read.rows:  # each row whole and right: fired when due, received at once
            assert r["fired_ms"] == r["due_ms"] == r["accepted_ms"] + 1000 == r["first_received_ms"]
        assert any("rotated away" in note for note in read.notes())

    run_broker(body, **TRACED)


def test_a_crash_at_any_step_of_a_rotation_leaves_a_readable_journal(data_dir: Path) -> None:
    """The states a crash can leave, written as real files: a `.tmp` of the next segment (crash
    before its rename), a next segment with its header cut at every length (a power loss after
    the rename), too many old segments (crash before the oldest were deleted), and a cut last
    event. Each opens, keeps every whole event, and goes on appending where it should."""
    journal = _journal(data_dir)
    for i in range(300):
        journal.record(trace.ACCEPTED, "tp", f"M{i:04d}", i, 10_000 + i)
    journal.close()
    names = _segments(data_dir)
    assert len(names) > 2 and _trace_bytes(data_dir) <= RETENTION_BYTES
    before = list(trace.read_events(data_dir))
    last = data_dir / files.TRACE_DIR / names[-1]
    number = files.parse_numbered(last.name, files.TRACE_SEGMENT_SUFFIX)
    assert number is not None
    header = trace.encode_segment_header(number + 1)
    nxt = data_dir / files.TRACE_DIR / files.trace_segment_name(number + 1)
    blob = last.read_bytes()
    for cut in range(len(header) + 1):
        (data_dir / files.TRACE_DIR / (nxt.name + ".tmp")).write_bytes(header[:cut])
        if cut < len(header):
            nxt.write_bytes(header[:cut])
        last.write_bytes(blob + blob[trace.SEGMENT_HEADER_SIZE:trace.SEGMENT_HEADER_SIZE + 20])  # a cut event
        journal = _journal(data_dir)
        assert journal.stopped is None
        journal.record(trace.FIRED, "tp", "after", 1, 2)
        journal.close()
        assert not [n for n in _segments(data_dir) if n.endswith(".tmp")]
        assert list(trace.read_events(data_dir)) == [*before, (trace.FIRED, 1, 2, "tp", "after")], cut
        nxt.unlink(missing_ok=True)
        last.write_bytes(blob)
    # A crash between making the next segment and deleting the oldest: too many segments.
    full = (data_dir / files.TRACE_DIR / names[0]).read_bytes()
    for extra in range(number + 1, number + 4):
        (data_dir / files.TRACE_DIR / files.trace_segment_name(extra)).write_bytes(
            trace.encode_segment_header(extra) + full[trace.SEGMENT_HEADER_SIZE:])
    journal = _journal(data_dir)
    journal.close()
    assert _trace_bytes(data_dir) <= RETENTION_BYTES
    assert trace.read_trace(data_dir).rotated_segments > 0


def test_a_version_1_events_bin_is_read_then_rotated_away_first(data_dir: Path) -> None:
    """A data directory from before segments: its `events.bin` is read as the oldest segment,
    never appended to, and once the cap needs its room it goes first, and the export says so."""
    (data_dir / files.TRACE_DIR).mkdir(parents=True)
    legacy = data_dir / files.TRACE_DIR / files.TRACE_EVENTS
    legacy.write_bytes(bytes([1]) + struct.pack(">QQHH", 5, 9, 2, 3) + b"tpold")
    journal = _journal(data_dir)
    journal.record(trace.FIRED, "tp", "old", 9, 9)
    journal.close()
    assert trace.export_rows(data_dir) == [{"message_id": "old", "topic": "tp", "accepted_ms": 5, "due_ms": 9,
                                            "fired_ms": 9, "first_received_ms": None, "cancelled_ms": None}]
    assert trace.read_trace(data_dir).rotated_segments == 0
    assert legacy.stat().st_size == 26  # never appended to
    legacy.write_bytes(legacy.read_bytes() * 1000)  # a version-1 file from months of tracing
    journal = _journal(data_dir)
    journal.close()
    assert not legacy.exists()
    read = trace.read_trace(data_dir)
    assert read.rows == [] and read.rotated_segments == 1 and read.without_acceptance == 1


def test_a_segment_of_a_newer_version_is_refused_naming_file_and_versions(data_dir: Path) -> None:
    journal = _journal(data_dir)
    journal.record(trace.ACCEPTED, "tp", "M1", 1, 5)
    journal.close()
    path = data_dir / files.TRACE_DIR / files.trace_segment_name(1)
    head = b"CHRONOQT" + struct.pack(">IQ", 99, 1)
    path.write_bytes(head + struct.pack(">I", crc32c.crc32c(head)))
    with pytest.raises(trace.TraceFormatError, match=r"00000000000000000001\.trace: delivery-trace format "
                                                     r"version 99; this chronoq reads versions 1, 2, 3"):
        trace.read_trace(data_dir)
    journal = _journal(data_dir)  # the broker runs on without the trace, and says why
    assert journal.stopped is not None and "version 99" in journal.stopped
    assert journal.stopped_reason == "unknown_version"  # what stats and /metrics show
    journal.record(trace.ACCEPTED, "tp", "M2", 1, 5)
    journal.close()
    assert path.read_bytes()[:24] == head + struct.pack(">I", crc32c.crc32c(head))


def test_export_tells_no_events_from_events_rotated_away(data_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    need_module("pyarrow", "spark")
    from chronoq.spark.trace import read_trace_notes

    out = str(tmp_path / "t.parquet")
    (data_dir / files.TRACE_DIR).mkdir(parents=True)
    assert cli_main(["trace", "export", str(data_dir), out]) == 1
    assert "no trace events in" in capsys.readouterr().out
    journal = _journal(data_dir)
    for i in range(300):  # every acceptance rotated away but the last segment's
        journal.record(trace.ACCEPTED, "tp", f"M{i:04d}", 1_000 + i, 10_000 + i)
    for i in range(1500):  # and then only fires: every acceptance is gone
        journal.record(trace.FIRED, "tp", f"M{i % 300:04d}", 10_000 + i, 10_000 + i % 300)
    journal.close()
    assert cli_main(["trace", "export", str(data_dir), out]) == 1
    said = capsys.readouterr().out
    assert "no trace events retained in" in said and "rotated away" in said and "(trace_retention_bytes)" in said
    journal = _journal(data_dir)
    journal.record(trace.ACCEPTED, "tp", "N1", 20_000, 30_000)
    journal.close()
    assert cli_main(["trace", "export", str(data_dir), out]) == 0
    said = capsys.readouterr().out
    assert "wrote 1 timer messages" in said and "note: " in said and "rotated away" in said
    notes = read_trace_notes(out)
    assert any("rotated away" in n for n in notes) and any("left out" in n for n in notes)
    assert json.loads(json.dumps(notes)) == notes


def test_a_cancel_is_journaled_once_durable_and_the_row_says_cancelled(run_broker: Callable,
                                                                       data_dir: Path) -> None:
    """A cancelled timer used to stay a row without fired_ms: pending, in the report, for good.
    Its tombstone is journaled when dispatched (durable, before the cancel returns)."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        due = clock.now_ms() + 60_000
        by_handle = await broker.send(OutgoingMessage("tp", b"x", message_id="H", deliver_at_ms=due))
        await broker.send(OutgoingMessage("tp", b"x", message_id="K", deliver_at_ms=due))
        await broker.send(OutgoingMessage("tp", b"x", message_id="F", deliver_at_ms=due))
        clock.advance(1_000)
        await broker.cancel(recall_handle=by_handle.recall_handle)
        clock.advance(1_000)
        await broker.cancel(topic="tp", message_id="K")
        broker.trace.flush()
        rows = {r["message_id"]: r for r in trace.export_rows(data_dir)}
        assert (rows["H"]["cancelled_ms"], rows["K"]["cancelled_ms"], rows["F"]["cancelled_ms"]) == (
            due - 59_000, due - 58_000, None)
        clock.set(due)
        assert await broker.run_due() == 1
        await broker.send(OutgoingMessage("tp", b"x", message_id="K", deliver_at_ms=due + 5_000))  # sent again
        clock.set(due + 5_000)
        assert await broker.run_due() == 1

    run_broker(body, **TRACED)
    rows = {(r["message_id"], r["due_ms"]): r for r in trace.export_rows(data_dir)}
    assert len(rows) == 4
    (fired,) = [r for (m, _), r in rows.items() if m == "F"]
    assert fired["fired_ms"] == fired["due_ms"] and fired["cancelled_ms"] is None
    cancelled = [r for r in rows.values() if r["cancelled_ms"] is not None]
    assert sorted(r["message_id"] for r in cancelled) == ["H", "K"]
    assert all(r["fired_ms"] is None for r in cancelled)
    (again,) = [r for (m, _), r in rows.items() if m == "K" and r["cancelled_ms"] is None]
    assert again["fired_ms"] == again["due_ms"]


def test_a_fired_timer_dead_lettered_is_journaled_fired_once(run_broker: Callable, data_dir: Path) -> None:
    """A dead letter copies the fired message's properties (TIMER_FIRED_FROM among them), and
    its copy must not be journaled as a second fire, of the DLQ topic."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        await broker.send(OutgoingMessage("tp", b"x", message_id="D", deliver_at_ms=clock.now_ms() + 1_000))
        clock.advance(1_000)
        assert await broker.run_due() == 1
        [rm] = await broker.receive("g", "tp", batch_size=1)
        await broker.forward_to_dlq("g", "tp", rm.receipt_handle)
        broker.trace.flush()

    run_broker(body, **TRACED)
    fired = [(e[3], e[4]) for e in trace.read_events(data_dir) if e[0] == trace.FIRED]
    assert fired == [("tp", "D")]


def test_a_version_2_segment_is_read_and_not_appended_to(data_dir: Path) -> None:
    """Version 2 had no cancel kind: its reader takes a 4 for the end of what it can read (and
    cut the segment there at its next open). This version reads a version-2 segment whole and
    starts a version-3 one after it rather than append cancels to it."""
    seg = data_dir / files.TRACE_DIR / files.trace_segment_name(0)
    seg.parent.mkdir(parents=True)
    head = b"CHRONOQT" + struct.pack(">IQ", 2, 0)
    event = bytes([1]) + struct.pack(">QQHH", 5, 9, 2, 2) + b"tpM1"
    seg.write_bytes(head + struct.pack(">I", crc32c.crc32c(head)) + event)
    before = seg.read_bytes()
    journal = _journal(data_dir)
    journal.record(trace.CANCELLED, "tp", "M1", 7, 9)
    journal.close()
    assert seg.read_bytes() == before
    assert _segments(data_dir) == [files.trace_segment_name(0), files.trace_segment_name(1)]
    (row,) = trace.export_rows(data_dir)
    assert (row["accepted_ms"], row["cancelled_ms"], row["fired_ms"]) == (5, 7, None)
    seg.write_bytes(before + bytes([4]) + event[1:])  # a 4 in a version-2 segment is not an event
    assert [e[0] for e in trace.read_events(data_dir)] == [trace.ACCEPTED, trace.CANCELLED]


def test_a_segment_rotated_away_while_it_is_read_is_passed_over(data_dir: Path) -> None:
    """`chronoq trace export` reads the data directory of a running broker, whose rotation can
    delete a listed segment before the reader gets to it: that was a FileNotFoundError."""
    journal = _journal(data_dir)
    for i in range(300):
        journal.record(trace.ACCEPTED, "tp", f"M{i:04d}", i, 10_000 + i)
    journal.close()
    names = _segments(data_dir)
    assert len(names) >= 3 and len(list(trace.read_events(data_dir))) == 300
    events = trace.read_events(data_dir)
    first = next(events)  # the segments are listed, the first read
    (data_dir / files.TRACE_DIR / names[1]).unlink()  # the broker rotates it away now
    rest = list(events)
    kept = list(trace.read_events(data_dir))
    assert [first, *rest] == kept and 0 < len(kept) < 300
