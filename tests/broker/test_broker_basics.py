"""The Broker's produce/read/topic API in simulated time: what a send returns and stores, batches,
idempotent retries, topics, queue selection, restarts, the directory lock, closing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest

from chronoq import errors
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.model import SCHEDULE_TOPIC, SYS_MESSAGE_GROUP, TIMER_TOPIC, MessageType, OutgoingMessage, StoredMessage
from chronoq.store import files
from chronoq.store.meta import read_checkpoint
from tests.support.brokers import SimulatedBrokers, open_broker


def test_send_then_read_returns_every_field(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        r = await broker.send(OutgoingMessage("orders", b"\x00payload\xff", message_id="id-1", tag="paid",
                                              keys=("k1", "k 2"), properties={"a": "1", "ü": "ß"}, queue_id=1,
                                              born_ms=123))
        assert (r.message_id, r.topic, r.queue_id, r.queue_offset, r.duplicate) == ("id-1", "orders", 1, 0, False)
        assert r.deliver_at_ms is None and r.recall_handle is None
        (m,) = await broker.read("orders", 1, 0, 10)
        assert (m.message_id, m.topic, m.queue_id, m.queue_offset, m.position) == ("id-1", "orders", 1, 0, r.position)
        assert (m.body, m.tag, m.keys, dict(m.properties)) == (b"\x00payload\xff", "paid", ("k1", "k 2"),
                                                               {"a": "1", "ü": "ß"})
        assert (m.born_ms, m.store_ms, m.message_type) == (123, clock.now_ms(), MessageType.NORMAL)
        assert broker.queue_offsets("orders", 1) == (0, 1)
        assert broker.stats()["commitlog"]["end_position"] == m.position + m.size

    run_broker(body)


def test_batches_round_robin_and_fifo_groups(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        await broker.create_topic("rr", 3)
        results = await broker.send_batch([OutgoingMessage("rr", f"{i}".encode()) for i in range(9)])
        assert sorted(r.queue_id for r in results) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert all(b.position > a.position for a, b in itertools.pairwise(results))
        for qid in range(3):
            assert [m.queue_offset for m in await broker.read("rr", qid, 0, 10)] == [0, 1, 2]
        fifo = await broker.send_batch([OutgoingMessage("rr", b"f", message_group="order-7") for _ in range(4)])
        assert len({r.queue_id for r in fifo}) == 1
        (m, *_) = await broker.read("rr", fifo[0].queue_id, fifo[0].queue_offset, 1)
        assert m.message_type is MessageType.FIFO and m.system_properties[SYS_MESSAGE_GROUP] == "order-7"

    run_broker(body)


def test_a_retried_message_id_is_stored_once_within_the_window(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        first = await broker.send(OutgoingMessage("orders", b"one", message_id="same"))
        end = broker.store.log.end_position
        again = await broker.send(OutgoingMessage("orders", b"one", message_id="same"))
        assert again.duplicate and (again.queue_id, again.queue_offset) == (first.queue_id, first.queue_offset)
        twice = await broker.send_batch([OutgoingMessage("orders", b"x", message_id="dup")] * 2)
        assert [r.duplicate for r in twice] == [False, True]
        assert broker.store.log.end_position > end
        end = broker.store.log.end_position
        await broker.send(OutgoingMessage("orders", b"one", message_id="same"))
        assert broker.store.log.end_position == end
        other = await broker.send(OutgoingMessage("audit", b"one", message_id="same"))
        assert not other.duplicate  # the window is per topic
        clock.advance(broker.config.dedupe_window_ms + 1)
        late = await broker.send(OutgoingMessage("orders", b"one", message_id="same"))
        assert not late.duplicate and late.position > first.position

    run_broker(body)


def test_concurrent_sends_of_one_id_store_it_once_and_share_its_result(run_broker: Callable) -> None:
    """A retry that arrives while the first send is still waiting for its fsync waits for that
    send and gets its result (marked duplicate), whatever its position in either batch."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        first = [OutgoingMessage("orders", b"a", message_id=f"id-{i}") for i in range(5)]
        retry = [OutgoingMessage("orders", b"b", message_id="new"), OutgoingMessage("orders", b"a", message_id="id-3"),
                 OutgoingMessage("orders", b"a", message_id="id-0")]
        a, b = await asyncio.gather(broker.send_batch(first), broker.send_batch(retry))
        assert [r.duplicate for r in a] == [False] * 5
        assert [r.duplicate for r in b] == [False, True, True]
        assert (b[1].message_id, b[1].queue_id, b[1].queue_offset, b[1].position) == (
            "id-3", a[3].queue_id, a[3].queue_offset, a[3].position)
        assert (b[2].message_id, b[2].position) == ("id-0", a[0].position)
        stored = [m for q in range(broker.get_topic("orders").queue_count)
                  for m in await broker.read("orders", q, 0, 100)]
        assert sorted(m.message_id for m in stored) == sorted(["new", *(f"id-{i}" for i in range(5))])

    run_broker(body)


def test_topics(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        t = await broker.create_topic("plain", 3, [MessageType.NORMAL])
        assert (t.name, t.queue_count, t.message_types, t.created_ms) == (
            "plain", 3, frozenset({MessageType.NORMAL}), clock.now_ms())
        assert broker.get_topic("plain") == t
        await broker.send(OutgoingMessage("auto", b"x"))
        assert broker.get_topic("auto").queue_count == broker.config.default_queue_count
        assert [x.name for x in broker.list_topics()] == ["auto", "plain"]  # system topics hidden
        cases = [(("plain",), errors.TopicExists), (("", 1), errors.InvalidTopicName),
                 ((TIMER_TOPIC, 1), errors.SystemTopicForbidden), ((SCHEDULE_TOPIC, 1), errors.SystemTopicForbidden),
                 (("q0", 0), errors.InvalidQueueCount),
                 (("q9", broker.config.max_queue_count + 1), errors.InvalidQueueCount)]
        for args, error in cases:
            with pytest.raises(error):
                await broker.create_topic(*args)
        with pytest.raises(errors.MessageTypeNotAccepted):
            await broker.create_topic("none", 1, [])
        with pytest.raises(errors.TopicNotFound):
            broker.get_topic("q0")
        await broker.close()
        broker2 = await open_broker(broker.config, clock=clock, background=False)
        try:
            assert broker2.get_topic("plain") == t
            assert [x.name for x in broker2.list_topics()] == ["auto", "plain"]
        finally:
            await broker2.close()

    run_broker(body)


def test_restart_keeps_messages_and_continues_offsets(make_config: Callable, arun: Callable,
                                                      assert_queues_match_log: Callable) -> None:
    async def main() -> None:
        config = make_config()
        clock = FakeClock()
        broker = await open_broker(config, clock=clock, background=False)
        sent = [await broker.send(OutgoingMessage("orders", f"{i}".encode() * 50, queue_id=0)) for i in range(30)]
        await broker.close()
        for round_no in range(3):
            broker = await open_broker(config, clock=clock, background=False)
            try:
                assert broker.open_report.log.truncated_bytes == 0 and broker.open_report.rebuilt_queues == []
                end_before = broker.store.log.end_position
                r = await broker.send(OutgoingMessage("orders", b"more", queue_id=0))
                assert (r.queue_offset, r.position) == (len(sent), end_before)
                sent.append(r)
                got = await broker.read("orders", 0, 0, 1000)
                assert [m.message_id for m in got] == [s.message_id for s in sent], round_no
                assert_queues_match_log(broker.store)
            finally:
                await broker.close()

    arun(main())


def test_one_broker_per_directory(brokers: SimulatedBrokers, make_config: Callable, arun: Callable) -> None:
    async def main() -> None:
        config = make_config()
        broker = await brokers.open(config)
        try:
            with pytest.raises(errors.DataDirLocked):
                await brokers.open(config)
            await broker.send(OutgoingMessage("orders", b"still works"))
        finally:
            await broker.close()
        again = await brokers.open(config)  # the lock went with it
        await again.close()

    arun(main())


def test_closed_broker_refuses_calls(brokers: SimulatedBrokers, make_config: Callable, arun: Callable) -> None:
    async def main() -> None:
        broker = await brokers.open(make_config())
        await broker.close()
        await broker.close()  # idempotent
        for call in (broker.send(OutgoingMessage("orders", b"x")), broker.receive("g", "orders"),
                     broker.read("orders", 0, 0, 1), broker.create_topic("t2")):
            with pytest.raises(errors.BrokerClosed):
                await call

    arun(main())


def test_long_poll_wakes_on_arrival(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        await broker.create_topic("orders", 1)
        poll = asyncio.create_task(broker.receive("g", "orders", wait_ms=20_000))
        await asyncio.sleep(0)
        assert not poll.done()
        r = await broker.send(OutgoingMessage("orders", b"wake up"))
        got = await asyncio.wait_for(poll, 10)  # woken by the arrival, not by the 20 s timeout
        assert [m.message.message_id for m in got] == [r.message_id]

    run_broker(body)


def test_the_periodic_ticks_wait_on_the_injected_clock(make_config: Callable, arun: Callable) -> None:
    """The checkpoint tick sleeps on the broker's clock (`Clock.sleep_ms`): on a FakeClock, real
    time passing runs no tick, and moving the clock by the interval runs one."""

    async def main() -> None:
        clock = FakeClock()
        config = make_config(checkpoint_interval_ms=1_000, retention_check_interval_ms=3_600_000)
        broker = await open_broker(config, clock=clock)
        try:
            await broker.send(OutgoingMessage("t", b"x"))
            written = read_checkpoint(config.data_dir / files.CHECKPOINT)
            assert written is not None and written < broker.store.dispatched_position
            await asyncio.sleep(0.3)
            assert read_checkpoint(config.data_dir / files.CHECKPOINT) == written, "a tick ran on real time"
            clock.advance(1_000)
            for _ in range(500):
                if read_checkpoint(config.data_dir / files.CHECKPOINT) == broker.store.dispatched_position:
                    break
                await asyncio.sleep(0.01)
            assert read_checkpoint(config.data_dir / files.CHECKPOINT) == broker.store.dispatched_position
        finally:
            await broker.close()

    arun(main())


def test_the_fake_clock_wakes_an_interval_sleeper_when_moved_that_far(arun: Callable) -> None:
    async def main() -> None:
        clock = FakeClock()
        sleeper = asyncio.ensure_future(clock.sleep_ms(500))
        await asyncio.sleep(0.01)
        clock.advance(499)
        await asyncio.sleep(0.01)
        assert not sleeper.done()
        clock.advance(1)
        await asyncio.wait_for(sleeper, 1)

    arun(main())


def test_dispatch_takes_each_durable_run_through_its_rooms_in_order(run_broker: Callable) -> None:
    """The path of a durable record is the broker's one `Dispatch` (`chronoq/dispatch.py`): the
    store's queues, the timer index, the trace, the long polls, in that order, each once a run."""
    calls: list[tuple[str, list[str]]] = []

    class Room:
        def __init__(self, name: str, inner: object) -> None:
            self.name, self.inner = name, inner

        def record(self, method: str, records: list[StoredMessage]) -> None:
            calls.append((self.name, [m.message_id for m in records]))
            getattr(self.inner, method)(records)

        def enter(self, records: list[StoredMessage]) -> None:
            self.record("enter", records)

        def index(self, records: list[StoredMessage]) -> None:
            self.record("index", records)

        def dispatched(self, records: list[StoredMessage]) -> None:
            self.record("dispatched", records)

        def arrived(self, records: list[StoredMessage]) -> None:
            self.record("arrived", records)

    async def body(broker: Broker, clock: FakeClock) -> None:
        dispatch = broker.dispatch
        assert (dispatch.queues, dispatch.timer_index, dispatch.trace, dispatch.long_polls) == (
            broker.store, broker.timer_loop, broker.trace, broker.deliver)
        dispatch.queues = Room("queues", broker.store)
        dispatch.timer_index = Room("timer index", broker.timer_loop)
        dispatch.trace = Room("trace", broker.trace)
        dispatch.long_polls = Room("long polls", broker.deliver)
        sent = await broker.send(OutgoingMessage("t", b"x", message_id="m1", delay_ms=1_000))
        assert calls == [(room, ["m1"]) for room in ("queues", "timer index", "trace", "long polls")]
        assert broker.query(sent.message_id)[0].deliver_at_ms == clock.now_ms() + 1_000

    run_broker(body, trace_enable=True)
