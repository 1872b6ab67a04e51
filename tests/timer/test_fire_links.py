"""Firing by link records (`timer/service.py` step 3, `store/links.py`): what a fired timer is to
its consumers, what a fire step writes, and how long retention keeps a fired timer's record.

A fire step writes one link record for all the timers it fires, instead of a full copy of
each; consumers must see exactly what a fired copy showed them (real topic and queue, original
id, the timer's bookkeeping cleared, stored when it fired), and the record must stay readable as
long as a fired copy would have (as long as the record that fired it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, MINUTE_MS, Config
from chronoq.model import (
    LINKS_TOPIC,
    SYS_FIRED_FROM,
    SYS_TIMER_OUT_MS,
    TIMER_TOPIC,
    OutgoingMessage,
    topic_name_problem,
)
from chronoq.store import files
from chronoq.store.check import check_data_dir
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, drain, fired_messages, run

pytestmark = pytest.mark.usefixtures("each_timer_engine")


def test_a_fired_timer_reads_as_its_fired_copy_did(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path / "data", clock)
        try:
            await b.create_topic("orders", 4)
            sent = await b.send(OutgoingMessage("orders", b"pay now", message_id="order-9", tag="unpaid",
                                                keys=("k9",), properties={"shop": "3"}, queue_id=2,
                                                delay_ms=1_500))
            clock.advance(1_600)  # fired 100 ms late: stored in its topic then
            assert await b.run_due() == 1
            [m] = await drain(b, "orders")
            assert (m.topic, m.queue_id, m.queue_offset, m.message_id) == ("orders", 2, 0, "order-9")
            assert (m.body, m.tag, m.keys, dict(m.properties)) == (b"pay now", "unpaid", ("k9",), {"shop": "3"})
            assert dict(m.system_properties) == {SYS_TIMER_OUT_MS: str(START_MS + 1_500),
                                                 SYS_FIRED_FROM: str(sent.position)}
            assert (m.store_ms, m.born_ms, m.position) == (START_MS + 1_600, START_MS, sent.position)
            assert m.deliver_at_ms == START_MS + 1_500
        finally:
            await b.close()

    run(body())


def test_a_message_group_fires_into_one_queue_and_a_named_queue_is_kept(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path / "data", clock)
        try:
            await b.create_topic("orders", 8)
            for i in range(12):
                await b.send(OutgoingMessage("orders", b"g", message_id=f"g{i}", message_group="cart-1",
                                             delay_ms=1_000))
            await b.send(OutgoingMessage("orders", b"q", message_id="q5", queue_id=5, delay_ms=1_000))
            clock.advance(1_000)
            assert await b.run_due() == 13
            got = await drain(b, "orders")
            group_queues = {m.queue_id for m in got if m.message_id.startswith("g")}
            assert len(group_queues) == 1
            assert [m.queue_id for m in got if m.message_id == "q5"] == [5]
            # In acceptance order within the group's queue.
            assert [m.message_id for m in got if m.message_id.startswith("g")] == [f"g{i}" for i in range(12)]
        finally:
            await b.close()

    run(body())


def test_a_fire_step_writes_link_records_of_bounded_size_and_no_copy(tmp_path: Path) -> None:
    """500 timers fired in one step: four link records of at most `timer_links_per_record` (128)
    links each, ~30 bytes a timer, not a copy of each message."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path / "data", clock)
        try:
            await b.send_batch([OutgoingMessage("orders", b"x" * 200, message_id=f"m{i}", delay_ms=1_000)
                                for i in range(500)])
            end = b.store.log.end_position
            clock.advance(1_000)
            assert await b.run_due() == 500
            written = list(b.store.scan(end))
            assert [m.topic for m in written] == [LINKS_TOPIC] * 4
            assert [len(b.store.links_in(m)) for m in written] == [128, 128, 128, 116]
            assert all(m.size < 128 * 32 + 100 for m in written)  # one 4 KiB page each
            assert sorted(m.message_id for m in await drain(b, "orders")) == sorted(f"m{i}" for i in range(500))
        finally:
            await b.close()

    run(body())


def test_retention_keeps_a_fired_timer_as_long_as_the_link_record_that_fired_it(tmp_path: Path) -> None:
    """A timer accepted 50 minutes before it fires, an hour's retention: its segment expires 10
    minutes after the fire, by its own records; a fired copy would have lived an hour more. The
    link record that fired it keeps it for that hour, and lets it go with itself."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(tmp_path / "data", clock, retention_ms=HOUR_MS, segment_size_bytes=64 * 1024,
                              max_message_size_bytes=4096)
        try:
            sent = await b.send(OutgoingMessage("orders", b"late", message_id="t1", delay_ms=50 * MINUTE_MS))

            async def traffic(n: int) -> None:
                for i in range(n):
                    await b.send(OutgoingMessage("filler", b"f" * 900, message_id=f"f{clock.now_ms()}-{i}"))

            await traffic(100)
            clock.advance(50 * MINUTE_MS)
            assert await b.run_due() == 1
            await traffic(100)  # the link record's segment fills and rolls
            clock.advance(20 * MINUTE_MS)  # the timer's segment is past retention; the link's is not
            await traffic(100)
            await b.enforce_retention()
            assert b.store.log.start_position <= sent.position, "the fired timer's record went before its link"
            [m] = await drain(b, "orders")
            assert (m.message_id, m.body) == ("t1", b"late")
            clock.advance(2 * HOUR_MS)  # the link record's segment expires too
            await traffic(200)
            await b.enforce_retention()
            assert b.store.log.start_position > sent.position
            assert b.timer.engine.linked_floor(b.store.log.start_position) is None
            assert not [m for m in b.store.scan(b.store.log.start_position) if m.topic == TIMER_TOPIC]
        finally:
            await b.close()

    run(body())


def test_no_topic_a_producer_can_name_is_read_as_link_records() -> None:
    """Link records are known by their topic's name alone, so it is one no door accepts: a
    user's topic of any valid name, made before this format or since, is never taken for one."""
    assert topic_name_problem(LINKS_TOPIC, Config().max_topic_name_length) is not None


# --- a fire racing the roll ------------------------------------------------------------------------

_SMALL = {"segment_size_bytes": 64 * 1024, "max_message_size_bytes": 4096, "retention_ms": HOUR_MS}


def _hold_two_segment_syncs(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, object], list[threading.Event],
                                                                        list[threading.Event]]:
    """(state, held, release): once `state["armed"]`, the next two group commits of a segment each
    wait for their own release (a real fdatasync then runs)."""
    held = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    state: dict[str, object] = {"armed": False, "n": 0}
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        n = state["n"]
        assert isinstance(n, int)
        if state["armed"] and n < 2 and os.readlink(f"/proc/self/fd/{fd}").endswith(files.SEGMENT_SUFFIX):
            state["n"] = n + 1
            held[n].set()
            assert release[n].wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return state, held, release


async def _until(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("fire_by", ["loop", "spark"])
def test_a_fire_racing_the_roll_keeps_the_record_it_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          fire_by: str) -> None:
    """Retention rolls a due timer forward, and its roll copy waits for its group commit; the
    timer fires meanwhile from its old record (still the indexed one), so the link record follows
    the roll copy and names the old position. The roll copy is made durable first: the timer is
    pending at the copy, nothing is pending below the limit, and the link record, not yet
    dispatched, has no floor in the index. Retention must not delete the old segment under the
    fire in flight (which holds retention back), or the fired message is lost."""
    state, held, release = _hold_two_segment_syncs(monkeypatch)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await simulated_broker(tmp_path / "data", clock, **_SMALL)
        fire_now: dict[str, Callable[[], Awaitable[object]]] = {
            "loop": broker.run_due, "spark": lambda: broker.fire_timers([sent.position])}
        try:
            sent = await broker.send(OutgoingMessage("orders", b"t", message_id="t1",
                                                     deliver_at_ms=START_MS + HOUR_MS))
            for i in range(150):  # the timer's segment is sealed
                await broker.send(OutgoingMessage("filler", b"f" * 600, message_id=f"f{i}"))
            clock.advance(2 * HOUR_MS)  # due, and its segment past retention
            for i in range(150):
                await broker.send(OutgoingMessage("filler", b"f" * 600, message_id=f"g{i}"))
            assert await broker.store.expired_before(clock.now_ms()) > sent.position
            state["armed"] = True
            retention = asyncio.ensure_future(broker.enforce_retention())
            await asyncio.wait_for(_until(held[0]), 5)  # the roll copy's group commit waits
            fire = asyncio.ensure_future(fire_now[fire_by]())
            await asyncio.sleep(0.05)  # the link record is written after the roll copy
            release[0].set()
            await asyncio.wait_for(_until(held[1]), 5)  # the link record's group commit waits
            await asyncio.wait_for(asyncio.shield(retention), 5)
            assert broker.store.log.start_position <= sent.position, "the linked record was deleted"
            release[1].set()
            await fire
            assert [m.message_id for m in await drain(broker, "orders")] == ["t1"]
            assert [m.message_id for m in fired_messages(broker.store, "orders")] == ["t1"]
            await broker.enforce_retention()  # and retention goes on working
        finally:
            release[0].set()
            release[1].set()
            await broker.close()
        assert check_data_dir(tmp_path / "data").ok

    run(body())


def test_check_reports_a_link_whose_record_is_gone(tmp_path: Path) -> None:
    """A link record naming a record below the log's start (what the race above left) is a
    problem `chronoq check` names: the message it fired is gone."""
    data = tmp_path / "data"

    async def body() -> None:
        clock = FakeClock(START_MS)
        b: Broker = await simulated_broker(data, clock, segment_size_bytes=64 * 1024, max_message_size_bytes=4096)
        try:
            await b.send(OutgoingMessage("orders", b"t", message_id="t1", delay_ms=1_000))
            for i in range(150):
                await b.send(OutgoingMessage("filler", b"f" * 600, message_id=f"f{i}"))
            clock.advance(1_000)
            assert await b.run_due() == 1
        finally:
            await b.close()

    run(body())
    assert check_data_dir(data).ok
    first = sorted((data / files.COMMITLOG_DIR).iterdir())[0]
    first.unlink()  # the timer's segment, as a retention that ignored the link would have
    report = check_data_dir(data)
    assert any("names a record at 0, below the log's start" in p for p in report.problems), report.problems
