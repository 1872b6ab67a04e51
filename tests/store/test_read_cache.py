"""The read cache: records just dispatched, kept decoded for the reads that follow.

What it must keep true: a hit is the record (equal to a read from the log, and a fresh object a
caller may change without changing the cache); the budget (`read_cache_bytes`) bounds it, oldest
out first; once full it leaves out what it would evict before it is read (a timer due later than
the span it holds, a tombstone); and its entries are ones the garbage collector stops tracking
(most in a young collection, the rest in the first full one that sees them), so a full
collection on the broker's event loop does not walk every cached record (a pause that grew with
the cache).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import fields

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.model import LINKS_TOPIC, SYS_TIMER_OUT_MS, TIMER_TOPIC, MessageType, OutgoingMessage, StoredMessage
from chronoq.store.messagestore import PreparedMessage
from chronoq.timer.reads import FiredReads


async def _send(broker: Broker, n: int) -> None:
    await broker.create_topic("orders", 2)
    for first in range(0, n, 50):
        await broker.send_batch([
            OutgoingMessage("orders", f"body-{i}".encode(), message_id=f"m{i:04d}", tag="t" if i % 2 else "",
                            keys=(f"k{i}",), properties={"a": str(i), "b": "x"} if i % 3 else {},
                            message_type=MessageType.FIFO if i % 5 == 0 else MessageType.NORMAL,
                            message_group="g" if i % 5 == 0 else None)
            for i in range(first, min(n, first + 50))])


def test_a_hit_is_the_record_as_the_log_holds_it(run_broker: Callable[..., None]) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        await _send(broker, 40)
        store = broker.store
        for rec in store.scan(0):
            hits = store.read_cache_hits
            cached = store.read_at(rec.position, rec.size)
            assert store.read_cache_hits == hits + 1
            assert cached == store.log.read(rec.position, rec.size)
            assert type(cached.message_type) is MessageType
            cached.system_properties["changed"] = "by a caller"  # type: ignore[index]
            assert "changed" not in store.read_at(rec.position, rec.size).system_properties

    run_broker(body)


def test_the_budget_evicts_oldest_first(run_broker: Callable[..., None]) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        await _send(broker, 200)
        store = broker.store
        records = list(store.scan(0))
        hits = store.read_cache_hits
        assert store.read_at(records[-1].position, records[-1].size) == records[-1]
        assert store.read_cache_hits == hits + 1, "the newest record is cached"
        assert store.read_at(records[0].position, records[0].size) == records[0]
        assert store.read_cache_hits == hits + 1, "the oldest was evicted: read from the log"

    run_broker(body, read_cache_bytes=8 * 1024)


def test_cached_records_leave_the_collectors_view(run_broker: Callable[..., None]) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        await _send(broker, 300)
        cached = list(broker.store.read_cache.records.values())
        assert len(cached) == 300
        for _ in range(3):  # in a full suite run one gc.collect() was seen to leave them for the next
            gc.collect()
            tracked = [c for c in cached if gc.is_tracked(c)]
            if not tracked:
                break
        # A StoredMessage, or a dict inside an entry, would keep all 300 tracked for as long as
        # they are cached, walked by every full collection.
        assert not tracked, f"{len(tracked)} of {len(cached)} cached records still tracked, e.g. {tracked[0]!r}"

    run_broker(body)


def _cached(broker: Broker, message_id: str) -> bool:
    store = broker.store
    return any(c[0] == message_id for c in store.read_cache.records.values())


def test_a_full_cache_leaves_out_what_it_would_evict_before_it_is_read(run_broker: Callable[..., None]) -> None:
    """Once full, the cache spans the records dispatched over its last `span` ms: a timer due
    later than that (or a tombstone, never read by position) is left out; a message read at once
    and a timer due within the span are kept. Before it is full, everything is kept."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        now = clock.now_ms()
        await broker.create_topic("orders", 2)
        await broker.send(OutgoingMessage("orders", b"x", message_id="early-far", deliver_at_ms=now + 3_600_000))
        assert _cached(broker, "early-far"), "a cache with room keeps everything"
        for second in range(20):  # fill it, a batch a second: it then spans about 20 s
            await broker.send_batch([OutgoingMessage("orders", b"f" * 200, message_id=f"fill-{second}-{i}")
                                     for i in range(20)])
            clock.advance(1000)
        store = broker.store
        assert store.read_cache.held_bytes + 1000 > broker.config.read_cache_bytes, "the cache is full"
        now = clock.now_ms()
        await broker.send_batch([
            OutgoingMessage("orders", b"x", message_id="plain"),
            OutgoingMessage("orders", b"x", message_id="soon", deliver_at_ms=now + 5_000),
            OutgoingMessage("orders", b"x", message_id="far", deliver_at_ms=now + 3_600_000),
        ])
        assert _cached(broker, "plain") and _cached(broker, "soon")
        assert not _cached(broker, "far"), "a timer due an hour on would be evicted long before it fires"
        # A tombstone is never read by position: left out too.
        await broker.cancel(topic="orders", message_id="soon")
        tombstones = [c for c in store.read_cache.records.values()
                      if c[0] == "soon" and c[1] == TIMER_TOPIC and not c[9]]
        assert not tombstones
        # Left out is only not cached: it fires and is read from the log as ever.
        clock.advance(3_600_000)
        assert await broker.run_due() == 2  # "early-far" and "far"
        got = []
        while batch := await broker.receive("g", "orders", batch_size=64, invisible_duration_ms=60_000):
            got += batch
        far = [r.message for r in got if r.message.message_id == "far"]
        assert len(far) == 1 and far[0].body == b"x"

    run_broker(body, read_cache_bytes=64 * 1024)


def _record(topic: str, position: int, size: int, store_ms: int) -> StoredMessage:
    return StoredMessage(f"m{position}", topic, 0, 0, MessageType.NORMAL, "", (), {}, {}, b"", store_ms, store_ms,
                         position, size)


def test_the_cache_is_full_at_the_record_that_fills_it_and_links_never_count(run_broker: Callable[..., None]) -> None:
    """"Full" is decided record by record: a batch that fills the cache leaves out its far timers
    from the record that would overflow it on (and evicts nothing read sooner for them); a link
    record, never cached, never makes a roomy cache count as full."""
    async def body(broker: Broker, clock: FakeClock) -> None:
        store, now = broker.store, clock.now_ms()
        cache = store.read_cache

        def next_read_ms(m: StoredMessage) -> int | None:
            return now + 10**9 if m.topic == "far" else None

        budget = broker.config.read_cache_bytes
        plain = [_record("orders", 10**12 + i * 10_000, 1_000, now) for i in range(budget // 1_400)]
        cache.put(plain, next_read_ms)
        assert len(cache.records) == len(plain)
        cache.put([_record("far", 2 * 10**12 + i * 10_000, 100, now) for i in range(20)], next_read_ms)
        assert all(m.position in cache.records for m in plain), "nothing read sooner was evicted"
        cache.records.clear()
        cache.held_bytes = 0
        cache.put([_record("orders", 10**12, 100, now)], next_read_ms)
        timer = _record("far", 3 * 10**12, 100, now)
        cache.put([timer, _record(LINKS_TOPIC, 3 * 10**12 + 10_000, 100_000, now)], next_read_ms)
        assert timer.position in cache.records, "a cache with room keeps everything"

    run_broker(body, read_cache_bytes=64 * 1024)


def test_next_read_ms_never_raises_on_an_odd_due_time() -> None:
    for due in ("9" * 5_000, "1_000", " 5", "٣", "-1", ""):
        rec = StoredMessage("m", TIMER_TOPIC, 0, 0, MessageType.DELAY, "", (), {}, {SYS_TIMER_OUT_MS: due}, b"x",
                            0, 0, 0, 100)
        assert FiredReads.next_read_ms(rec) is None


def test_append_returns_each_record_as_the_log_holds_it(run_broker: Callable[..., None]) -> None:
    """`MessageStore.append` builds its `StoredMessage`s positionally (the cheaper call): each
    must equal the record decoded from the log, field by field. The five records' values differ
    between fields of a type (offsets 0-4 against queue 2, born against store time), so two
    swapped fields would show."""

    async def body(broker: Broker, clock: FakeClock) -> None:
        await broker.create_topic("orders", 3)
        store = broker.store
        clock.advance(5_000)
        msgs = [PreparedMessage("orders", f"m{i}", MessageType.FIFO, f"body-{i}".encode(), 1_000 + i, f"tag{i}",
                                (f"k{i}", "k"), {"a": str(i)}, {"S": str(i)}, queue_id=2) for i in range(5)]
        stored = store.append(msgs, clock.now_ms())
        await store.wait_durable(stored[-1].position + stored[-1].size)
        for i, rec in enumerate(stored):
            on_disk = store.log.read(rec.position, rec.size)
            for f in fields(StoredMessage):
                assert getattr(rec, f.name) == getattr(on_disk, f.name), f.name
            assert (rec.message_id, rec.tag, rec.keys, rec.born_ms, rec.queue_id, rec.queue_offset) == (
                f"m{i}", f"tag{i}", (f"k{i}", "k"), 1_000 + i, 2, i)

    run_broker(body)
