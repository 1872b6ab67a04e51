"""The commit log on its own: positions, segments and rolling, group commit, reopening, damage.

Torn tails are in test_recovery.py; here the log is driven directly with encoded records.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from chronoq.errors import BrokerClosed, CorruptRecord, LogDamaged
from chronoq.model import MessageType
from chronoq.store import files
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE, CommitLog
from chronoq.store.record import encode_record

SEGMENT = 1024


def blob(position: int, body: bytes = b"x" * 100, message_id: str = "m") -> bytes:
    return encode_record(position=position, message_id=message_id, topic="t", queue_id=0, queue_offset=0,
                         message_type=MessageType.NORMAL, tag="", keys=(), properties={}, system_properties={},
                         body=body, born_ms=1, store_ms=2)


def append(log: CommitLog, body: bytes = b"x" * 100, message_id: str = "m") -> tuple[int, int]:
    """Append one record the way the store does; return (position, end)."""
    size = len(blob(0, body, message_id))
    log.roll_if_needed(size)
    position = log.end_position
    return position, log.write(blob(position, body, message_id), store_ms=2)


def open_log(directory: Path, **kw: object) -> CommitLog:
    log, _report = CommitLog.open(directory, segment_size_bytes=SEGMENT, **kw)  # type: ignore[arg-type]
    return log


def test_append_read_scan(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    try:
        assert (log.start_position, log.end_position) == (0, 0)
        spots = [append(log, bytes([65 + i]) * (10 + i), f"m{i}") for i in range(5)]
        assert [p for p, _ in spots] == [0, *[e for _, e in spots[:-1]]]  # contiguous
        for i, (position, end) in enumerate(spots):
            msg = log.read(position, end - position)
            assert (msg.message_id, msg.position, msg.body) == (f"m{i}", position, bytes([65 + i]) * (10 + i))
        assert [m.message_id for m in log.scan(spots[2][0])] == ["m2", "m3", "m4"]
        assert [m.message_id for m in log.scan(0, spots[2][0])] == ["m0", "m1"]
        with pytest.raises(CorruptRecord):
            log.read_bytes(log.end_position, 10)
        with pytest.raises(CorruptRecord):
            log.read(spots[0][0], spots[0][1] - spots[0][0] + 1)  # runs past into the next record
    finally:
        log.close()


def test_rolls_without_splitting_records(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    try:
        spots = [append(log, b"y" * 150, f"m{i}") for i in range(20)]
        segments = log.segments()
        assert len(segments) > 3
        for seg in segments:
            assert seg.path.name == files.segment_name(seg.base)
            assert seg.path.stat().st_size <= SEGMENT
            assert seg.path.stat().st_size == SEGMENT_HEADER_SIZE + seg.data_size
        for a, b in itertools.pairwise(segments):
            assert a.end == b.base  # one contiguous position space, no padding
        bases = {s.base for s in segments}
        for position, end in spots:  # every record lies inside one segment
            seg = max((s for s in segments if s.base <= position), key=lambda s: s.base)
            assert end <= seg.end
        assert {p for p, _ in spots} >= bases - {0} and 0 in bases
        assert [m.message_id for m in log.scan(0)] == [f"m{i}" for i in range(20)]
    finally:
        log.close()


def test_reopen_continues_at_the_end(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    spots = [append(log, b"z" * 120, f"a{i}") for i in range(10)]
    log.close()
    log = open_log(tmp_path)
    try:
        assert log.end_position == spots[-1][1]
        assert log.flushed_position == log.end_position
        # The first write after a reopen lands at the end, not at the reopened file's offset 0.
        more = [append(log, b"w" * 30, f"b{i}") for i in range(3)]
        assert more[0][0] == spots[-1][1]
        assert [m.message_id for m in log.scan(0)] == [f"a{i}" for i in range(10)] + ["b0", "b1", "b2"]
    finally:
        log.close()
    log = open_log(tmp_path)
    try:
        assert [m.message_id for m in log.scan(0)][-3:] == ["b0", "b1", "b2"]
    finally:
        log.close()


def test_group_commit_shares_fsyncs(tmp_path: Path, arun: Callable) -> None:
    async def body() -> None:
        log = open_log(tmp_path, flush="sync")
        durable: list[int] = []
        log.on_durable = durable.append
        flusher = asyncio.create_task(log.flush_loop())
        try:
            async def producer(i: int) -> int:
                _, end = append(log, b"p" * 50, f"p{i}")
                await log.wait_durable(end)
                assert log.flushed_position >= end
                return end

            ends = await asyncio.gather(*(producer(i) for i in range(16)))
            assert log.fsync_count < len(ends)  # sixteen producers, fewer fsyncs
            assert durable and durable[-1] == max(ends) == log.flushed_position
            await log.wait_durable(ends[0])  # already durable: returns at once
        finally:
            flusher.cancel()
            log.close()

    arun(body())


def test_async_flush_waits_for_the_flusher(tmp_path: Path, arun: Callable) -> None:
    async def body() -> None:
        log = open_log(tmp_path, flush="async", flush_interval_ms=3_600_000)
        flusher = asyncio.create_task(log.flush_loop())
        try:
            _, end = append(log)
            waiter = asyncio.create_task(log.wait_durable(end))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert not waiter.done() and log.flushed_position < end
            log.request_flush()
            await asyncio.wait_for(waiter, 10)
            assert log.flushed_position == end
        finally:
            flusher.cancel()
            log.close()

    arun(body())


def test_write_after_close_is_refused(tmp_path: Path, arun: Callable) -> None:
    log = open_log(tmp_path)
    append(log)
    log.close()
    with pytest.raises(BrokerClosed):
        log.write(blob(log.end_position), 0)


def test_a_damaged_segment_header_is_reported_and_a_missing_segment_stops_the_open(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    for i in range(20):
        append(log, b"d" * 150, f"m{i}")
    names = [s.path.name for s in log.segments()]
    log.close()
    first = tmp_path / names[0]
    good = first.read_bytes()
    first.write_bytes(good[:3] + b"\x00" + good[4:])  # header magic
    # Records carry their own positions: the header is only a label. Read by the name's base.
    log, report = CommitLog.open(tmp_path, segment_size_bytes=SEGMENT)
    try:
        assert len(report.damaged_headers) == 1 and "magic" in report.damaged_headers[0]
        assert [m.message_id for m in log.scan(0)] == [f"m{i}" for i in range(20)]
    finally:
        log.close()
    first.write_bytes(good)
    middle = tmp_path / names[1]
    middle.rename(tmp_path / "aside")
    with pytest.raises(LogDamaged, match="does not follow"):
        open_log(tmp_path)
    (tmp_path / "aside").rename(middle)
    log = open_log(tmp_path)
    log.close()


def test_interrupted_roll_leaves_a_removable_header(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    for i in range(3):
        append(log, message_id=f"m{i}")
    end = log.end_position
    log.close()
    partial = tmp_path / files.segment_name(end)
    partial.write_bytes(b"CHRONO")  # a roll cut before its header was whole
    log, report = CommitLog.open(tmp_path, segment_size_bytes=SEGMENT)
    try:
        assert report.removed_files == [partial.name] and not partial.exists()
        assert log.end_position == end
        assert append(log)[0] == end
    finally:
        log.close()


def test_delete_segments_before_keeps_the_active_one(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    try:
        for i in range(20):
            append(log, b"r" * 150, f"m{i}")
        segments = log.segments()
        removed = log.delete_segments_before(segments[2].base)
        assert [p.name for p in removed] == [s.path.name for s in segments[:2]]
        assert log.start_position == segments[2].base
        assert not any(p.exists() for p in removed)
        assert next(log.scan(0)).position == segments[2].base  # scanning from 0 starts at the new start
        log.delete_segments_before(log.end_position + 1)
        assert len(log.segments()) == 1 and log.segments()[0].path.exists()
        end = log.end_position
        assert append(log)[0] == end
        assert sorted(os.listdir(tmp_path)) == [s.path.name for s in log.segments()]
    finally:
        log.close()
