"""Firing by link records (`timer/service.py` step 3, `store/links.py`): what a fired timer is to
its consumers, what a fire step writes, and how long retention keeps a fired timer's record.

A fire step writes one link record for all the timers it fires, instead of a full copy of
each; consumers must see exactly what a fired copy showed them (real topic and queue, original
id, the timer's bookkeeping cleared, stored when it fired), and the record must stay readable as
long as a fired copy would have (as long as the record that fired it).
"""

from __future__ import annotations

from pathlib import Path

from timer_helpers import START_MS, drain, open_broker, run

from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, MINUTE_MS
from chronoq.model import LINKS_TOPIC, SYS_FIRED_FROM, SYS_TIMER_OUT_MS, TIMER_TOPIC, OutgoingMessage


def test_a_fired_timer_reads_as_its_fired_copy_did(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(tmp_path / "data", clock)
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
        b = await open_broker(tmp_path / "data", clock)
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


def test_a_fire_step_writes_one_link_record_and_no_copy(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(tmp_path / "data", clock)
        try:
            await b.send_batch([OutgoingMessage("orders", b"x" * 200, message_id=f"m{i}", delay_ms=1_000)
                                for i in range(500)])
            end = b.store.log.end_position
            clock.advance(1_000)
            assert await b.run_due() == 500
            written = list(b.store.scan(end))
            assert [m.topic for m in written] == [LINKS_TOPIC]
            assert written[0].size < 500 * 40  # ~30 bytes a timer, not a copy of each message
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
        b = await open_broker(tmp_path / "data", clock, retention_ms=HOUR_MS, segment_size_bytes=64 * 1024,
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
