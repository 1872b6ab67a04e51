"""Simple-consumer semantics (RocketMQ 5 pop) through the Broker, in simulated time.

receive/ack; change_invisible_duration returns a new handle and the old one dies; an unacked
message comes back after its invisible duration with attempt + 1 (not a millisecond earlier);
after max_delivery_attempts it moves to %DLQ%<group>; tag filters; group progress across a
restart; retention with a clock far ahead; consume queues deleted or corrupted on disk are
rebuilt from the log. Everything runs on a FakeClock with background=False: no sleeps.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronoq import errors
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, Config
from chronoq.model import (
    SCHEDULE_TOPIC,
    SYS_DLQ_ORIGIN_OFFSET,
    SYS_DLQ_ORIGIN_QUEUE_ID,
    SYS_DLQ_ORIGIN_TOPIC,
    TIMER_TOPIC,
    OutgoingMessage,
    ReceivedMessage,
)
from chronoq.store import files
from chronoq.store.check import check_data_dir
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY_SIZE
from tests.support.brokers import open_broker

INVISIBLE_MS = 10_000


class Env:
    """A broker on a FakeClock that a test can restart."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.clock = FakeClock()
        self.broker: Broker

    async def open(self) -> Broker:
        self.broker = await open_broker(self.config, clock=self.clock, background=False)
        return self.broker

    async def restart(self) -> Broker:
        await self.broker.close()
        return await self.open()

    async def send(self, topic: str, n: int, **fields: Any) -> list[str]:
        ids = []
        for i in range(n):
            r = await self.broker.send(OutgoingMessage(topic, f"{topic}-{i}".encode(), **fields))
            ids.append(r.message_id)
        return ids

    async def receive(self, topic: str = "orders", group: str = "g", **kw: Any) -> list[ReceivedMessage]:
        kw.setdefault("invisible_duration_ms", INVISIBLE_MS)
        kw.setdefault("batch_size", 64)
        return await self.broker.receive(group, topic, **kw)


@pytest.fixture
def env(make_config: Callable[..., Config], arun: Callable) -> Any:
    """`env(body, **config)`: run `body(env)` against an open broker, closing it after."""

    def run(body: Callable[[Env], Any], **overrides: Any) -> None:
        async def main() -> None:
            e = Env(make_config(**overrides))
            await e.open()
            try:
                await body(e)
            finally:
                await e.broker.close()

        arun(main())

    return run


def ids(got: list[ReceivedMessage]) -> list[str]:
    return sorted(m.message.message_id for m in got)


def test_receive_ack(env: Callable) -> None:
    async def body(e: Env) -> None:
        sent = await e.send("orders", 5)
        got = await e.receive(batch_size=3)
        assert len(got) == 3 and all(m.delivery_attempt == 1 for m in got)
        assert all(m.invisible_until_ms == e.clock.now_ms() + INVISIBLE_MS for m in got)
        got += await e.receive()
        assert ids(got) == sorted(sent)
        assert await e.receive() == []
        for m in got:
            await e.broker.ack("g", "orders", m.receipt_handle)
        with pytest.raises(errors.InvalidReceiptHandle):
            await e.broker.ack("g", "orders", got[0].receipt_handle)  # acked twice
        e.clock.advance(INVISIBLE_MS * 10)
        assert await e.receive() == []  # acked messages never come back
        # Another group sees everything independently; a handle is bound to its group.
        other = await e.receive(group="other")
        assert ids(other) == sorted(sent)
        with pytest.raises(errors.InvalidReceiptHandle):
            await e.broker.ack("g", "orders", other[0].receipt_handle)
        await e.broker.ack("other", "orders", other[0].receipt_handle)

    env(body)


def test_unacked_message_comes_back_after_its_invisible_duration(env: Callable) -> None:
    async def body(e: Env) -> None:
        await e.send("orders", 2)
        first = await e.receive()
        await e.broker.ack("g", "orders", first[0].receipt_handle)
        e.clock.advance(INVISIBLE_MS - 1)
        assert await e.receive() == []  # one millisecond early: still invisible
        e.clock.advance(1)
        again = await e.receive()
        assert ids(again) == [first[1].message.message_id]
        assert again[0].delivery_attempt == 2
        with pytest.raises(errors.InvalidReceiptHandle):
            await e.broker.ack("g", "orders", first[1].receipt_handle)  # superseded by the redelivery
        await e.broker.ack("g", "orders", again[0].receipt_handle)
        e.clock.advance(INVISIBLE_MS)
        assert await e.receive() == []

    env(body)


def test_change_invisible_duration(env: Callable) -> None:
    async def body(e: Env) -> None:
        await e.send("orders", 1)
        (m,) = await e.receive()
        e.clock.advance(5_000)
        new = await e.broker.change_invisible_duration("g", "orders", m.receipt_handle, 30_000)
        assert new != m.receipt_handle
        for call in (e.broker.ack("g", "orders", m.receipt_handle),
                     e.broker.change_invisible_duration("g", "orders", m.receipt_handle, 30_000)):
            with pytest.raises(errors.InvalidReceiptHandle):
                await call
        e.clock.advance(30_000 - 1)  # the old deadline (10 s) passed long ago; the new one not yet
        assert await e.receive() == []
        e.clock.advance(1)
        (again,) = await e.receive()
        assert again.delivery_attempt == 2  # a renewal is not a delivery
        with pytest.raises(errors.InvalidReceiptHandle):
            await e.broker.ack("g", "orders", new)
        await e.broker.ack("g", "orders", again.receipt_handle)
        with pytest.raises(errors.InvalidInvisibleDuration):
            await e.broker.change_invisible_duration("g", "orders", again.receipt_handle, 10)

    env(body)


def test_dead_letter_after_max_delivery_attempts(env: Callable) -> None:
    async def body(e: Env) -> None:
        (sent,) = await e.send("orders", 1, tag="x", keys=("k",), properties={"p": "v"})
        for attempt in (1, 2, 3):
            (m,) = await e.receive()
            assert (m.message.message_id, m.delivery_attempt) == (sent, attempt)
            e.clock.advance(INVISIBLE_MS)
        assert await e.receive() == []  # the fourth would exceed max_delivery_attempts=3
        e.clock.advance(INVISIBLE_MS * 10)
        assert await e.receive() == []
        (dead,) = await e.receive(topic="%DLQ%g", group="dlq-reader")
        msg = dead.message
        assert (msg.message_id, msg.body, msg.tag, msg.keys, dict(msg.properties)) == (
            sent, b"orders-0", "x", ("k",), {"p": "v"})
        assert msg.system_properties[SYS_DLQ_ORIGIN_TOPIC] == "orders"
        assert msg.system_properties[SYS_DLQ_ORIGIN_OFFSET] == "0"
        assert SYS_DLQ_ORIGIN_QUEUE_ID in msg.system_properties
        assert e.broker.groups.inflight_count("g", "orders") == 0
        await e.restart()
        e.clock.advance(INVISIBLE_MS * 10)
        assert await e.receive() == []  # still dead after a restart, not back in the group

    env(body, max_delivery_attempts=3)


def test_receives_at_once_write_one_dead_letter_copy(env: Callable) -> None:
    """An exhausted entry stays in flight until its DLQ copy is durable; two receives at once
    (two consumers of the group, or a poll while the other waits) each found it and each wrote
    a copy, so the DLQ held the message twice."""
    async def body(e: Env) -> None:
        (sent,) = await e.send("orders", 1)
        (received,) = await e.receive()
        assert received.message.message_id == sent
        e.clock.advance(INVISIBLE_MS)
        first, second = await asyncio.gather(e.receive(), e.receive())
        assert first == second == []
        dead = await e.receive(topic="%DLQ%g", group="dlq-reader")
        assert [d.message.message_id for d in dead] == [sent]
        assert e.broker.groups.inflight_count("g", "orders") == 0

    env(body, max_delivery_attempts=1)


def test_a_receive_cancelled_while_its_dead_letter_is_made_durable_writes_one_copy(
        env: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receive's caller goes away (a client's deadline cancels the handler) while the DLQ
    copy waits for its group commit. The copy becomes durable all the same; the entry used to
    stay in the group (exhausted, and no longer marked as being dead-lettered), so the next
    receive wrote a second copy: the DLQ held the message twice."""
    held, release, armed = threading.Event(), threading.Event(), threading.Event()
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if armed.is_set() and os.readlink(f"/proc/self/fd/{fd}").endswith(files.SEGMENT_SUFFIX):
            armed.clear()
            held.set()
            assert release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)

    async def body(e: Env) -> None:
        (poison,) = await e.send("orders", 1)
        assert ids(await e.receive()) == [poison]
        e.clock.advance(INVISIBLE_MS)  # exhausted: max_delivery_attempts = 1
        armed.set()
        receiver = asyncio.create_task(e.receive())
        while not held.is_set():  # the DLQ copy is written; its group commit is held
            await asyncio.sleep(0.001)
        receiver.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receiver
        release.set()
        for _ in range(100):  # the held group commit ends; its copy is durable
            if e.broker.store.log.flushed_position == e.broker.store.log.end_position:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        assert await e.receive() == []
        assert ids(await e.receive(topic="%DLQ%g", group="r")) == [poison]
        assert e.broker.groups.inflight_count("g", "orders") == 0

    env(body, max_delivery_attempts=1)


def test_a_dead_letter_that_cannot_be_written_does_not_hide_the_rest_of_the_receive(env: Callable) -> None:
    """The receive that finds an exhausted entry has already put its other messages in flight.
    When the DLQ copy could not be written (a full disk, raised here at the broker's appender),
    the receive used to fail: its messages stayed hidden for their invisible duration, and each
    retry hid a new batch and spent another attempt, until they reached the DLQ undelivered."""
    async def body(e: Env) -> None:
        (poison,) = await e.send("orders", 1)
        assert [m.message.message_id for m in await e.receive(batch_size=1)] == [poison]
        e.clock.advance(INVISIBLE_MS)  # exhausted: max_delivery_attempts = 1
        fresh = await e.send("orders", 3)
        real_append = e.broker.deliver._append
        failures = []

        async def dlq_out_of_space(msgs: list[Any]) -> Any:
            if msgs and msgs[0].topic == "%DLQ%g":
                failures.append(len(msgs))
                raise errors.DiskFull(str(e.config.data_dir), 0, 0, during="a commit-log write")
            return await real_append(msgs)

        e.broker.deliver._append = dlq_out_of_space
        got = await e.receive()
        assert ids(got) == sorted(fresh) and failures == [1]
        e.broker.deliver._append = real_append
        assert await e.receive() == []  # the others are in flight; the poison is written now
        assert ids(await e.receive(topic="%DLQ%g", group="r")) == [poison]

    env(body, max_delivery_attempts=1)


def test_the_timer_and_schedule_topics_cannot_be_received_from(env: Callable) -> None:
    """Their messages are not due yet: a consumer of them got a timer an hour early (and again
    when it fired), and its in-flight entry held retention back."""
    async def body(e: Env) -> None:
        await e.broker.send(OutgoingMessage("orders", b"later", delay_ms=3_600_000))
        await e.broker.send(OutgoingMessage("orders", b"level", delay_level=18))
        for topic in (TIMER_TOPIC, SCHEDULE_TOPIC):
            with pytest.raises(errors.SystemTopicForbidden, match="consumers may not receive"):
                await e.receive(topic=topic)
        assert e.broker.groups.min_inflight_position() is None

    env(body)


@pytest.mark.parametrize("group", ["%SCHEDULE%", "g" * 123])
def test_group_names_the_broker_cannot_serve_are_refused(env: Callable, group: str) -> None:
    """`%SCHEDULE%` is the broker's own (its offsets are cleared at every open, so such a group
    got everything again after a restart); a name whose dead-letter topic `%DLQ%<group>` would be
    longer than a topic may be left its dead letters unreadable."""
    async def body(e: Env) -> None:
        await e.send("orders", 1)
        with pytest.raises(errors.InvalidGroupName):
            await e.receive(group=group)
        assert len(await e.receive(group="g" * 122)) == 1  # the longest name that fits

    env(body)


def test_a_receive_for_one_queue_gets_its_redeliveries_whatever_other_queues_hold(env: Callable) -> None:
    """The overdue entries were taken earliest first, `batch_size * 4` of them, and then filtered
    by queue: a queue whose consumer went away, with that many overdue entries earlier, kept
    another queue's redelivery from ever coming back to a receive for that queue."""
    async def body(e: Env) -> None:
        for i in range(8):
            await e.broker.send(OutgoingMessage("orders", b"q0", message_id=f"q0-{i}", queue_id=0))
        assert len(await e.receive(batch_size=8, queue_id=0)) == 8  # and that consumer goes away
        e.clock.advance(10)
        await e.broker.send(OutgoingMessage("orders", b"q1", message_id="q1", queue_id=1))
        assert ids(await e.receive(batch_size=1, queue_id=1)) == ["q1"]
        e.clock.advance(INVISIBLE_MS)  # everything is visible again
        again = await e.receive(batch_size=1, queue_id=1)
        assert [(m.message.message_id, m.delivery_attempt) for m in again] == [("q1", 2)]

    env(body)


def test_a_tag_filter_that_matches_little_walks_the_backlog_in_bounded_steps(env: Callable) -> None:
    """A receive whose filter matches little used to look at the whole backlog in one step of the
    event loop (1.6 us an entry: 16 s for 10 M). It looks at `max_receive_scan_entries` per step,
    gives the loop back, and goes on, so it still finds the match, with no wait too."""
    async def body(e: Env) -> None:
        for i in range(50):
            await e.broker.send(OutgoingMessage("orders", b"a", message_id=f"a{i}", tag="a", queue_id=0))
        await e.broker.send(OutgoingMessage("orders", b"b", message_id="b", tag="b", queue_id=0))
        steps = []
        real_receive = e.broker.deliver.consumers.receive

        def counted(*args: Any, **kwargs: Any) -> Any:
            outcome = real_receive(*args, **kwargs)
            steps.append(len(outcome.delivered))
            return outcome

        e.broker.deliver.consumers.receive = counted  # type: ignore[method-assign]
        got = await e.receive(filter_expression="b", wait_ms=0)
        assert ids(got) == ["b"]
        assert len(steps) >= 51 // 8 and steps[-1] == 1  # bounded steps; the match in the last

    env(body, max_receive_scan_entries=8)


def test_forward_to_dlq_and_nack(env: Callable) -> None:
    async def body(e: Env) -> None:
        await e.send("orders", 2)
        a, b = await e.receive()
        await e.broker.forward_to_dlq("g", "orders", a.receipt_handle)
        assert ids(await e.receive(topic="%DLQ%g", group="r")) == [a.message.message_id]
        new = await e.broker.nack("g", "orders", b.receipt_handle)
        retry_ms = e.broker.timer.levels.retry_delay_ms(1)
        e.clock.advance(retry_ms - 1)
        assert await e.receive() == []
        e.clock.advance(1)
        (again,) = await e.receive()
        assert (again.message.message_id, again.delivery_attempt) == (b.message.message_id, 2)
        with pytest.raises(errors.InvalidReceiptHandle):
            await e.broker.ack("g", "orders", new)

    env(body)


def test_tag_filters(env: Callable) -> None:
    async def body(e: Env) -> None:
        by_tag = {tag: await e.send("orders", 3, tag=tag) for tag in ("a", "b", "c")}
        untagged = await e.send("orders", 2)
        got = await e.receive(group="ab", filter_expression="a || b")
        assert ids(got) == sorted(by_tag["a"] + by_tag["b"])
        assert ids(await e.receive(group="c", filter_expression=" c ")) == sorted(by_tag["c"])
        everything = await e.receive(group="all", filter_expression="*")
        assert ids(everything) == sorted(by_tag["a"] + by_tag["b"] + by_tag["c"] + untagged)
        # Filtered-out messages are passed over for good, as RocketMQ does: later ones still come.
        late = await e.send("orders", 1, tag="b")
        await e.send("orders", 1, tag="c")
        assert ids(await e.receive(group="ab", filter_expression="a || b")) == late
        for bad in ("a ||", "|| b", "a | b", "a || *", "a||||b"):
            with pytest.raises(errors.InvalidFilterExpression):
                await e.receive(group="ab", filter_expression=bad)

    env(body)


def test_bad_receive_requests(env: Callable) -> None:
    async def body(e: Env) -> None:
        await e.send("orders", 1)
        before = e.broker.store.log.end_position
        cases = [
            ({"group": ""}, errors.InvalidGroupName),
            ({"group": "a b"}, errors.InvalidGroupName),
            ({"topic": ""}, errors.InvalidTopicName),
            ({"batch_size": 0}, errors.InvalidBatchSize),
            ({"batch_size": e.config.max_receive_batch + 1}, errors.InvalidBatchSize),
            ({"invisible_duration_ms": e.config.min_invisible_duration_ms - 1}, errors.InvalidInvisibleDuration),
            ({"invisible_duration_ms": e.config.max_invisible_duration_ms + 1}, errors.InvalidInvisibleDuration),
            ({"queue_id": 2}, errors.InvalidQueueId),
        ]
        for kw, error in cases:
            with pytest.raises(error):
                await e.receive(**kw)
        for handle in ("", "garbage", "A" * 28):
            with pytest.raises(errors.InvalidReceiptHandle):
                await e.broker.ack("g", "orders", handle)
        assert e.broker.store.log.end_position == before
        assert e.broker.groups.offset("g", "orders", 0) is None  # nothing was handed out
        assert len(await e.receive()) == 1

    env(body)


def test_receive_by_queue(env: Callable) -> None:
    async def body(e: Env) -> None:
        q0 = await e.send("orders", 3, queue_id=0)
        q1 = await e.send("orders", 2, queue_id=1)
        assert ids(await e.receive(queue_id=1)) == sorted(q1)
        assert ids(await e.receive(queue_id=0)) == sorted(q0)

    env(body)


def test_group_progress_survives_restart(env: Callable) -> None:
    async def body(e: Env) -> None:
        sent = await e.send("orders", 6)
        got = await e.receive(batch_size=4)
        await e.broker.ack("g", "orders", got[0].receipt_handle)
        await e.broker.ack("g", "orders", got[1].receipt_handle)
        renewed = await e.broker.change_invisible_duration("g", "orders", got[2].receipt_handle, 3 * INVISIBLE_MS)
        await e.restart()
        rest = await e.receive()  # offsets held: only the two never handed out
        assert ids(rest) == sorted(set(sent) - {m.message.message_id for m in got})
        await e.broker.ack("g", "orders", renewed)  # handles survive the restart too
        e.clock.advance(INVISIBLE_MS)
        back = await e.receive()
        assert ids(back) == sorted(m.message.message_id for m in (got[3], *rest))
        assert all(m.delivery_attempt == 2 for m in back)
        for m in back:
            await e.broker.ack("g", "orders", m.receipt_handle)
        await e.restart()
        e.clock.advance(10 * INVISIBLE_MS)
        assert await e.receive() == []
        new = await e.send("orders", 1)
        assert ids(await e.receive()) == new

    env(body)


def test_retention_removes_old_segments_and_reading_still_works(env: Callable,
                                                               assert_queues_match_log: Callable) -> None:
    async def body(e: Env) -> None:
        old = await e.send("orders", 80, queue_id=0)  # many 4 KiB segments
        held = await e.receive(group="slow", batch_size=1)  # in flight: pins its segment
        assert held[0].message.message_id == old[0]
        while got := await e.receive(group="done"):
            for m in got:
                await e.broker.ack("done", "orders", m.receipt_handle)
        e.clock.advance(e.config.retention_ms + HOUR_MS)
        recent = await e.send("orders", 5, queue_id=0)
        segments = len(e.broker.store.log.segments())
        await e.broker.enforce_retention()
        assert len(e.broker.store.log.segments()) == segments  # the in-flight message pins the start
        await e.broker.ack("slow", "orders", held[0].receipt_handle)
        await e.broker.enforce_retention()
        log = e.broker.store.log
        assert len(log.segments()) < segments and log.start_position > 0
        assert not (e.config.data_dir / files.COMMITLOG_DIR / files.segment_name(0)).exists()
        remaining = [m.message_id for m in await e.broker.read("orders", 0, 0, 1000)]
        assert remaining[-5:] == recent and set(remaining) < set(old) | set(recent)
        assert len(remaining) < len(old)
        lo, hi = e.broker.queue_offsets("orders", 0)
        assert hi == len(old) + len(recent)
        assert [m.message_id for m in await e.broker.read("orders", 0, hi - 5, 100)] == recent
        assert ids(await e.receive(group="done")) == sorted(recent)
        assert ids(await e.receive(group="new")) == sorted(remaining)
        assert_queues_match_log(e.broker.store)
        await e.restart()
        assert [m.message_id for m in await e.broker.read("orders", 0, lo, 1000)] == remaining
        assert_queues_match_log(e.broker.store)
        await e.broker.close()
        assert check_data_dir(e.config.data_dir).ok
        # A queue lost after retention is rebuilt from what the log still holds, offsets kept.
        for f in _queue_files(e.config.data_dir, "orders", 0):
            f.unlink()
        await e.open()
        assert "orders/0" in e.broker.open_report.rebuilt_queues
        assert [m.message_id for m in await e.broker.read("orders", 0, 0, 1000)] == remaining
        assert e.broker.queue_offsets("orders", 0)[1] == hi
        r = await e.broker.send(OutgoingMessage("orders", b"after", queue_id=0))
        assert r.queue_offset == hi
        assert ids(await e.receive(group="done")) == [r.message_id]
        assert_queues_match_log(e.broker.store)

    env(body, segment_size_bytes=4096)


def _queue_files(data_dir: Path, topic: str, qid: int) -> list[Path]:
    return sorted(files.queue_dir(data_dir, topic, qid).glob("*.cq"))


@pytest.mark.parametrize("damage", ["delete queue dir", "delete cq files", "delete one cq file", "flip header byte",
                                    "flip entry byte in first file", "flip entry byte in last file",
                                    "truncate mid entry", "delete checkpoint too"])
def test_damaged_consume_queue_is_rebuilt_from_the_log(damage: str, env: Callable,
                                                       assert_queues_match_log: Callable) -> None:
    async def body(e: Env) -> None:
        sent = await e.send("orders", 20, queue_id=0)  # 8 entries per file: 3 files
        other = await e.send("orders", 3, queue_id=1)
        got = await e.receive(batch_size=5, queue_id=0)
        for m in got:
            await e.broker.ack("g", "orders", m.receipt_handle)
        await e.broker.close()
        data = e.config.data_dir
        cq_files = _queue_files(data, "orders", 0)
        assert len(cq_files) == 3
        if damage == "delete queue dir":
            for f in cq_files:
                f.unlink()
            files.queue_dir(data, "orders", 0).rmdir()
        elif damage == "delete cq files":
            for f in cq_files:
                f.unlink()
        elif damage == "delete one cq file":
            cq_files[1].unlink()
        elif damage == "flip header byte":
            _flip(cq_files[0], 12)
        elif damage == "flip entry byte in first file":
            _flip(cq_files[0], CQ_HEADER_SIZE + 3 * ENTRY_SIZE + 5)
        elif damage == "flip entry byte in last file":
            _flip(cq_files[-1], CQ_HEADER_SIZE + 1 * ENTRY_SIZE + 2)
        elif damage == "truncate mid entry":
            os.truncate(cq_files[-1], CQ_HEADER_SIZE + 2 * ENTRY_SIZE + 7)
        elif damage == "delete checkpoint too":
            for f in cq_files:
                f.unlink()
            (data / files.CHECKPOINT).unlink()
        assert not check_data_dir(data).ok
        await e.open()
        assert [m.message_id for m in await e.broker.read("orders", 0, 0, 100)] == sent
        assert [m.message_id for m in await e.broker.read("orders", 1, 0, 100)] == other
        assert_queues_match_log(e.broker.store)
        # The group goes on where it was, and new messages take the next offsets.
        rest = await e.receive(queue_id=0)
        assert ids(rest) == sorted(sent[5:])
        (r,) = await e.broker.send_batch([OutgoingMessage("orders", b"new", queue_id=0)])
        assert r.queue_offset == 20
        assert ids(await e.receive(queue_id=0)) == [r.message_id]
        await e.broker.close()
        assert check_data_dir(data).ok, check_data_dir(data).problems
        await e.open()

    env(body)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
