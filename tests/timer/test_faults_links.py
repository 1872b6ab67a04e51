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

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, MINUTE_MS, Config
from chronoq.model import (
    LINKS_TOPIC,
    SYS_DLQ_ORIGIN_OFFSET,
    SYS_DLQ_ORIGIN_QUEUE_ID,
    SYS_DLQ_ORIGIN_TOPIC,
    SYS_FIRED_FROM,
    SYS_REAL_TOPIC,
    SYS_TIMER_ENQUEUE_MS,
    SYS_TIMER_OUT_MS,
    OutgoingMessage,
    StoredMessage,
    TimerState,
    dlq_topic,
)
from chronoq.store import files
from chronoq.store.check import check_data_dir, format_report
from chronoq.store.consumequeue import LINKED
from tests.support.brokers import open_broker

pytestmark = pytest.mark.usefixtures("each_timer_engine")

START_MS = 1_800_000_000_000
TIMERS = 200


def _config(data: Path, **overrides: int) -> Config:
    return Config(data_dir=data, segment_size_bytes=64 * 1024, max_message_size_bytes=8192, default_queue_count=2,
                  **overrides)


async def _open(data: Path, clock: FakeClock) -> Broker:
    return await open_broker(_config(data), clock=clock, background=False)


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


@pytest.mark.durable_index("`chronoq check` reads the link copies from the index on disk")
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


@pytest.mark.rocksdb_index("removes the index on disk with its link copies")
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


# --- dead letters of fired timers -----------------------------------------------------------------

ATTEMPTS = 2
INVISIBLE_MS = 10_000


async def _exhaust(b: Broker, clock: FakeClock, ids: set[str]) -> None:
    """Receive `ids` from "orders" for group "g" `ATTEMPTS` times, never acking: each is in flight,
    exhausted; the next receive writes its dead letter."""
    for attempt in range(1, ATTEMPTS + 1):
        got = await b.receive("g", "orders", batch_size=64, invisible_duration_ms=INVISIBLE_MS)
        assert sorted(r.message.message_id for r in got) == sorted(ids)
        assert {r.delivery_attempt for r in got} == {attempt}
        clock.advance(INVISIBLE_MS)


def _dead_letters(b: Broker) -> dict[str, StoredMessage]:
    """The group's dead-letter queue as stored, by message id, each checked to be a record of
    its own (not a link: a queue entry with a real size)."""
    cq = b.store.queue(dlq_topic("g"), 0)
    out = {}
    for offset in range(cq.min_offset, cq.next_offset):
        entry = cq.get(offset)
        assert entry is not None
        position, size, _ = entry
        assert not size & LINKED, "a dead letter is a link, not a copy"
        record = b.store.read_at(position, size)
        assert record is not None and record.topic == dlq_topic("g") and record.queue_offset == offset
        out[record.message_id] = record
    return out


def _as_dead(m: StoredMessage) -> tuple[object, ...]:
    """What a dead letter must carry of its message, whatever it was."""
    sp = m.system_properties
    return (m.message_id, m.body, m.tag, m.keys, dict(m.properties), m.born_ms,
            sp[SYS_DLQ_ORIGIN_TOPIC], sp[SYS_DLQ_ORIGIN_QUEUE_ID], sp[SYS_DLQ_ORIGIN_OFFSET])


def test_a_fired_timers_dead_letter_is_a_whole_message_that_outlives_its_timer_and_link_records(
        tmp_path: Path) -> None:
    """The fault: a consumer never acks a fired timer (read through its link record), so it
    reaches `max_delivery_attempts` and is copied to `%DLQ%g`; later retention deletes the
    segments of its timer record and of its link record. What must hold: the dead letter is a
    record of its own in the DLQ (not a link), with the original id, body, tag, keys,
    properties, born time and the origin (the real topic, the queue and offset the consumer read
    it at) exactly as a plain message's dead letter has them, the timer's bookkeeping cleared as
    its consumers saw it (the due time and TIMER_FIRED_FROM kept); it survives a restart, and
    retention deleting both segments changes nothing in it."""
    data = tmp_path / "data"
    clock = FakeClock(START_MS)
    settings = {"max_delivery_attempts": ATTEMPTS, "retention_ms": HOUR_MS, "retention_inflight_hold_ms": 0}

    async def body() -> None:
        b = await open_broker(_config(data, **settings), clock=clock, background=False)
        timer_queue = timer_offset = -1
        try:
            await b.create_topic("orders", 2)
            same = {"body": b"pay or cancel", "tag": "pay", "keys": ("order-7",), "properties": {"shop": "s1"},
                    "born_ms": START_MS - 5}
            timer = await b.send(OutgoingMessage("orders", message_id="timer", delay_ms=1_000, **same))
            await b.send(OutgoingMessage("orders", message_id="plain", queue_id=1, **same))
            await _fillers(b, "a")
            clock.advance(1_000)
            assert await b.run_due() == 1
            [link] = [m for m in b.store.scan(b.store.log.start_position) if m.topic == LINKS_TOPIC]
            await _fillers(b, "b")
            await _exhaust(b, clock, {"timer", "plain"})
            clock.set(START_MS + 90 * MINUTE_MS)
            assert await b.receive("g", "orders", batch_size=64) == []  # exhausted: dead-lettered
            dead = _dead_letters(b)
            assert set(dead) == {"timer", "plain"}
            assert b.groups.inflight_count("g", "orders") == 0
            fired, plain = dead["timer"], dead["plain"]
            assert _as_dead(fired)[1:6] == _as_dead(plain)[1:6] == (
                b"pay or cancel", "pay", ("order-7",), {"shop": "s1"}, START_MS - 5)
            assert fired.system_properties[SYS_DLQ_ORIGIN_TOPIC] == plain.system_properties[SYS_DLQ_ORIGIN_TOPIC] \
                == "orders"
            timer_queue, timer_offset = _origins(b)["timer"]  # where its consumer read it
            assert (fired.system_properties[SYS_DLQ_ORIGIN_QUEUE_ID], fired.system_properties[SYS_DLQ_ORIGIN_OFFSET]) \
                == (str(timer_queue), str(timer_offset))
            assert (plain.system_properties[SYS_DLQ_ORIGIN_QUEUE_ID], plain.system_properties[SYS_DLQ_ORIGIN_OFFSET]) \
                == ("1", "0")
            extra = set(fired.system_properties) - set(plain.system_properties)
            assert extra == {SYS_TIMER_OUT_MS, SYS_FIRED_FROM}, extra  # as its consumers saw it
            assert fired.system_properties[SYS_TIMER_OUT_MS] == str(START_MS + 1_000)
            assert fired.system_properties[SYS_FIRED_FROM] == str(timer.position)
            assert not set(fired.system_properties) & {SYS_REAL_TOPIC, SYS_TIMER_ENQUEUE_MS}
            await _fillers(b, "c")
        finally:
            await b.close()

        b = await open_broker(_config(data, **settings), clock=clock, background=False)
        try:
            assert {m: _as_dead(r) for m, r in _dead_letters(b).items()} == {m: _as_dead(r) for m, r in dead.items()}
            clock.set(START_MS + 2 * HOUR_MS)
            await b.enforce_retention()
            assert b.store.log.start_position > link.position > timer.position, "retention deleted nothing"
            assert b.store.readable_entry("orders", timer_queue, timer_offset, link.position, LINKED) is None
            after = _dead_letters(b)
            assert {m: _as_dead(r) for m, r in after.items()} == {m: _as_dead(r) for m, r in dead.items()}
            got = await b.receive("dlq-reader", dlq_topic("g"), batch_size=8)
            assert sorted(r.message.message_id for r in got) == ["plain", "timer"]
            assert all(r.message.body == b"pay or cancel" for r in got)
        finally:
            await b.close()
        assert check_data_dir(data).ok

    asyncio.run(body())


@pytest.mark.rocksdb_index("removes the index on disk, or has `chronoq check` read it")
@pytest.mark.parametrize("index_copy", ["kept", "lost too"])
def test_a_timer_whose_link_record_is_damaged_still_reaches_the_dead_letter_queue_whole(
        tmp_path: Path, index_copy: str) -> None:
    """The fault: 10 timers fired by one link record are received and never acked until they are
    exhausted; then, in a closed copy, a byte of that link record is flipped (it lies in an older
    segment), before the receive that dead-letters them. What must hold, with the timer index's
    copy of the link record kept: every one is dead-lettered, read through the copy, as a whole
    record with its id, body and origin (the queue and offset the consumer saw), and the copies
    survive a restart; `chronoq check` reports the damage and says nothing is lost. With the copy
    lost too (the index rebuilt from the damaged log): the in-flight entries name a link no one
    can read, so they leave the group, and the timers, pending in the rebuilt index, fire again:
    delivered anew (attempts start over, at least once), then dead-lettered once those run out:
    nothing lost, each dead-lettered once."""
    data = tmp_path / "data"
    clock = FakeClock(START_MS)
    settings = {"max_delivery_attempts": ATTEMPTS}
    ids = {f"order-{i}" for i in range(10)}

    async def body() -> None:
        b = await open_broker(_config(data, **settings), clock=clock, background=False)
        try:
            await b.create_topic("orders", 2)
            await b.send_batch([OutgoingMessage("orders", f"pay {m}".encode(), message_id=m, delay_ms=1_000)
                                for m in sorted(ids)])
            clock.advance(1_000)
            assert await b.run_due() == len(ids)
            [link] = [m for m in b.store.scan(b.store.log.start_position) if m.topic == LINKS_TOPIC]
            assert link.size > 24 + 300 + 1  # `_flip` lands inside it
            await _fillers(b, "a")  # the link record's segment is not the last one
            await _exhaust(b, clock, ids)
            seen = _origins(b)
        finally:
            await b.close()
        _flip(data, link.position)
        if index_copy == "lost too":
            shutil.rmtree(data / files.TIMER_DIR)

        b = await open_broker(_config(data, **settings), clock=clock, background=False)
        try:
            if index_copy == "kept":
                assert await b.receive("g", "orders", batch_size=64) == []  # exhausted: dead-lettered
            else:
                assert await b.receive("g", "orders", batch_size=64) == []  # their entries left the group
                assert dlq_topic("g") not in b.store.topics
                assert await b.run_due() == len(ids)  # pending in the rebuilt index: fired again
                await _exhaust(b, clock, ids)
                seen = _origins(b)  # where they were fired again
                assert await b.receive("g", "orders", batch_size=64) == []
            dead = _dead_letters(b)
            assert sorted(dead) == sorted(ids), "a timer never reached the dead-letter queue"
            assert b.groups.inflight_count("g", "orders") == 0
            assert b.store.damaged_links_read == ({link.position} if index_copy == "kept" else set())
            for m, r in dead.items():
                assert r.body == f"pay {m}".encode()
                assert (r.system_properties[SYS_DLQ_ORIGIN_TOPIC], int(r.system_properties[SYS_DLQ_ORIGIN_QUEUE_ID]),
                        int(r.system_properties[SYS_DLQ_ORIGIN_OFFSET])) == ("orders", *seen[m])
        finally:
            await b.close()
        b = await open_broker(_config(data, **settings), clock=clock, background=False)
        try:
            assert {m: r.body for m, r in _dead_letters(b).items()} == {m: r.body for m, r in dead.items()}
            clock.advance(10 * INVISIBLE_MS)
            assert await b.receive("g", "orders", batch_size=64) == [] and await b.run_due() == 0
        finally:
            await b.close()
        text = format_report(check_data_dir(data), data)
        assert f"link record at position {link.position}" in text, text
        if index_copy == "kept":
            assert "nothing is lost" in text, text

    asyncio.run(body())


def _origins(b: Broker) -> dict[str, tuple[int, int]]:
    """(queue id, queue offset) of each fired timer "orders" holds readable now, by id."""
    out = {}
    for qid in range(2):
        cq = b.store.queue("orders", qid)
        offset = cq.min_offset
        while entries := cq.read_range(offset, cq.next_offset - offset):  # (one file at a time)
            for off, position, size, _ in entries:
                m = b.store.readable_entry("orders", qid, off, position, size)
                if m is not None:
                    out[m.message_id] = (qid, off)
            offset = entries[-1][0] + 1
    return out


async def _fillers(b: Broker, tag: str) -> None:
    """Enough 1 KB fillers to close the active 64 KiB segment."""
    for i in range(0, 80, 20):
        await b.send_batch([OutgoingMessage("filler", b"f" * 1000, message_id=f"{tag}{j}") for j in range(i, i + 20)])
