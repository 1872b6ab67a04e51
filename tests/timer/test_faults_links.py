"""A damaged link record: the timers it fired are read, or fired again, never lost.

A fire step enters its timers into their topics' queues by link records (`store/links.py`); a
consumer reads a fired timer through its link. A byte flipped in a link record on disk used to
cost every message that record fired, though their own records were intact: the queue entries
named a record that failed its checks, and the index said the timers were delivered. Now the
timer index keeps a copy of each link record while the record is retained, and a reader falls
back on it; with the copy lost too (the index rebuilt from a log whose link record is damaged)
the timers are pending again in the rebuilt index and fire again: at least once, never lost.
Link records hold at most `timer_links_per_record` links, so one damaged sector reaches few.

Faults are real bytes on disk, flipped in a closed copy of the data directory.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import LINKS_TOPIC, OutgoingMessage, StoredMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir, format_report

START_MS = 1_800_000_000_000
TIMERS = 200


def _config(data: Path) -> Config:
    return Config(data_dir=data, segment_size_bytes=64 * 1024, max_message_size_bytes=8192, default_queue_count=2)


async def _open(data: Path, clock: FakeClock) -> Broker:
    return await Broker.open(_config(data), clock=clock, background=False)


async def _drain(broker: Broker, topic: str, group: str) -> list[StoredMessage]:
    out: list[StoredMessage] = []
    while True:
        got = await broker.receive(group, topic, batch_size=64)
        if not got:
            return out
        for r in got:
            await broker.ack(group, topic, r.receipt_handle)
            out.append(r.message)


def _flip(data: Path, position: int) -> None:
    """Flip a byte of the record at log `position`, inside its body."""
    segments = sorted((data / files.COMMITLOG_DIR).glob("*" + files.SEGMENT_SUFFIX))
    path = max((p for p in segments if int(p.name[:20]) <= position), key=lambda p: int(p.name[:20]))
    raw = bytearray(path.read_bytes())
    raw[position - int(path.name[:20]) + 24 + 300] ^= 0x5A
    path.write_bytes(bytes(raw))


async def _fired_then_pushed_out(data: Path, clock: FakeClock) -> tuple[list[int], set[str]]:
    """200 timers fired in one step (two link records: 128 and 72 links), then enough fillers
    that the link records' segment is no longer the last one. Returns the link records'
    positions and the timers' ids."""
    b = await _open(data, clock)
    try:
        await b.create_topic("orders", 2)
        ids = {f"order-{i}" for i in range(TIMERS)}
        await b.send_batch([OutgoingMessage("orders", b"pay or cancel", message_id=i, delay_ms=1_000)
                            for i in sorted(ids)])
        clock.advance(1_000)
        assert await b.run_due() == TIMERS
        links = [m.position for m in b.store.scan(b.store.log.start_position) if m.topic == LINKS_TOPIC]
        for i in range(120):
            await b.send(OutgoingMessage("filler", b"f" * 1000, message_id=f"f{i}"))
        assert b.store.log.segment_base(links[0]) != b.store.log.segment_base(b.store.log.end_position)
    finally:
        await b.close()
    return links, ids


def test_a_damaged_link_record_costs_no_message_its_links_are_read_from_the_index_copy(tmp_path: Path) -> None:
    """Before: the range was quarantined and a group received 0 of the 200 timers (`chronoq
    check` also said every queue held "entries past the last record")."""
    data = tmp_path / "data"
    clock = FakeClock(START_MS)

    async def body() -> None:
        links, ids = await _fired_then_pushed_out(data, clock)
        assert len(links) == 2  # bounded: 128 + 72, not one record of 200
        _flip(data, links[0])
        report = check_data_dir(data)
        text = format_report(report, data)
        assert report.damaged, text
        assert not any("past the last record" in p for p in report.problems), text
        # Exact about the cost: the link record, its 128 timers, read from the index's copy.
        assert f"link record at position {links[0]} (128 links)" in text, text
        assert "nothing is lost" in text and "order-" in text, text

        b = await _open(data, clock)
        try:
            got = await _drain(b, "orders", "g")
            assert sorted(m.message_id for m in got) == sorted(ids)
            assert all(m.topic == "orders" and m.body == b"pay or cancel" for m in got)
            assert all(m.store_ms == START_MS + 1_000 for m in got)  # when it fired: the copy's store time
            assert b.store.damaged_links_read == {links[0]}
            assert b.stats()["commitlog"]["damaged_ranges"] == 1
        finally:
            await b.close()

    asyncio.run(body())


def test_a_damaged_link_record_with_its_copy_lost_too_fires_its_timers_again(tmp_path: Path) -> None:
    """The second fault: the timer index rebuilt from a log whose link record is damaged has no
    copy of it. The timers that record fired are pending in the rebuilt index (their records
    are intact and nothing marks them fired), so they fire again: a new group receives every
    timer, and one that had read them all gets the 128 again (at least once, never lost)."""
    data = tmp_path / "data"
    clock = FakeClock(START_MS)

    async def body() -> None:
        links, ids = await _fired_then_pushed_out(data, clock)
        b = await _open(data, clock)
        try:
            assert len(await _drain(b, "orders", "early")) == TIMERS
        finally:
            await b.close()
        _flip(data, links[0])
        shutil.rmtree(data / files.TIMER_DIR)  # the index's copy is gone with it
        report = check_data_dir(data)
        text = format_report(report, data)
        assert f"link record at position {links[0]}" in text and "fire again" in text, text

        b = await _open(data, clock)
        try:
            assert b.timer.engine.link_copy(links[0]) is None
            clock.advance(1)
            assert await b.run_due() == 128
            again = await _drain(b, "orders", "early")
            assert len(again) == 128 and set(m.message_id for m in again) < ids
            assert sorted(m.message_id for m in await _drain(b, "orders", "late")) == sorted(ids)
            for mid in ids:
                assert {s.state for s in b.query(mid)} == {TimerState.DELIVERED}
        finally:
            await b.close()

    asyncio.run(body())
