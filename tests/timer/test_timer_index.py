"""The RocksDB timer index: semantics of the `TimerEngine` contract, durability, corruption.

Engine-contract tests take the `engine` fixture (parametrised by engine kind: the file wheel and
the Spark engine join the list when they exist); RocksDB-specific tests open `RocksTimerIndex`
directly. Time is always an argument: nothing here sleeps.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chronoq
from chronoq.errors import DataDirLocked, IndexPositionWentBack, TimerIndexClosed, TimerIndexCorrupt
from chronoq.model import TimerState
from chronoq.timer import index_retention as index_retention_module
from chronoq.timer import index_txn as index_txn_module
from chronoq.timer.engine import IndexBatch, TimerEngine, TimerEntry
from chronoq.timer.index import RocksTimerIndex
from chronoq.timer.index_codec import (
    CF_COUNTERS,
    CF_HISTORY,
    CF_ID,
    CF_KEY,
    CF_LINKS,
    CF_META,
    CF_POS,
    CF_TIME,
    META_FORMAT_VERSION,
    decode_fired_history,
)
from chronoq.timer.memory import MemoryTimerEngine, MemoryTimerState
from chronoq.timer.wheel import WheelTimerEngine

T0 = 1_700_000_000_000
STRIDE = 100  # bytes between timer records in these synthetic logs


def entry(position: int, deliver_at_ms: int, message_id: str | None = None, topic: str = "orders",
          keys: tuple[str, ...] = (), accepted_ms: int = T0) -> TimerEntry:
    return TimerEntry(deliver_at_ms=deliver_at_ms, position=position, size=STRIDE,
                      message_id=message_id or f"id-{position}", topic=topic, accepted_ms=accepted_ms, keys=keys)


class Log:
    """Hands out increasing log positions, so batches obey the engine's contract."""

    def __init__(self, engine: TimerEngine) -> None:
        self.engine = engine
        self.next = max(engine.indexed_position, STRIDE)
        self.applied = engine.indexed_position

    def position(self) -> int:
        position = self.next
        self.next += STRIDE
        return position

    def add(self, *due_ms: int, topic: str = "orders", keys: tuple[str, ...] = (),
            message_id: str | None = None) -> list[TimerEntry]:
        entries = [entry(self.position(), d, message_id=message_id, topic=topic, keys=keys) for d in due_ms]
        self.apply(adds=entries)
        return entries

    def apply(self, **parts: object) -> None:
        # A fired copy, tombstone or rolled copy is itself a record: it takes a log position. A
        # cancel given as (topic, id, ms) gets its tombstone's position here, after every timer
        # the test made before it, and no due time (it reaches the id's every due time); as
        # (topic, id, ms, due) it gets a position too; a 5-tuple is taken as it is.
        parts["cancels"] = [c if len(c) == 5 else (*c, self.position(), None) if len(c) == 3  # type: ignore[arg-type]
                            else (*c[:3], self.position(), c[3])  # type: ignore[index]
                            for c in parts.get("cancels", ())]  # type: ignore[union-attr]
        for _ in range(len(parts.get("fired", ())) + len(parts.get("rolled", ()))):  # type: ignore[arg-type]
            self.position()
        self.engine.apply(IndexBatch(indexed_position=self.next, **parts))  # type: ignore[arg-type]
        self.applied = self.next

    def fire(self, now_ms: int, limit: int = 1_000_000, fired_ms: int | None = None) -> list[TimerEntry]:
        due = self.engine.due(now_ms, limit)
        if due:
            self.apply(fired=[(e.position, now_ms if fired_ms is None else fired_ms) for e in due])
        return due


EngineFactory = Callable[[Path], TimerEngine]
_MEMORY_STATES: dict[Path, MemoryTimerState] = {}
"""The in-memory engine's "disk": a reopen on the same path finds the state a close left."""
ENGINES: dict[str, EngineFactory] = {
    "rocksdb": lambda path: RocksTimerIndex.open(path / "timer-index"),
    "memory": lambda path: MemoryTimerEngine(_MEMORY_STATES.setdefault(path, MemoryTimerState())),
    "wheel": lambda path: WheelTimerEngine.open(path / "timer-wheel", slots=4 * 24 * 3600),
    # A wheel of 256 slots of 50 ms (a 12.8 s window): many timers here lie beyond it (ROLL,
    # linked again when their slot comes up).
    "wheel-small": lambda path: WheelTimerEngine.open(path / "timer-wheel-small", slot_ms=50, slots=256),
    # The same, rewriting its files into a new generation every 2 KiB they grow.
    "wheel-rewriting": lambda path: WheelTimerEngine.open(path / "timer-wheel-rw", slot_ms=50, slots=256,
                                                          checkpoint_bytes=2048, rewrite_ratio=0),
}
"""Every `TimerEngine`: each semantic test below runs against each (add an engine here)."""


@pytest.fixture(params=sorted(ENGINES))
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[TimerEngine | None], TimerEngine]]:
    """`reopen(None)` opens the engine; `reopen(engine)` closes it and opens it again."""
    factory = ENGINES[request.param]
    opened: list[TimerEngine] = []

    def _reopen(engine: TimerEngine | None) -> TimerEngine:
        if engine is not None:
            engine.close()
        fresh = factory(tmp_path)
        opened.append(fresh)
        return fresh

    yield _reopen
    for engine in opened:
        engine.close()


@pytest.fixture
def engine(reopen: Callable[[TimerEngine | None], TimerEngine]) -> TimerEngine:
    return reopen(None)


# --- ordering and due ---------------------------------------------------------------------------


def test_due_returns_only_pending_at_or_before_now_in_time_then_position_order(engine: TimerEngine) -> None:
    log = Log(engine)
    a, b, c = log.add(T0 + 30, T0 + 10, T0 + 20)
    d = log.add(T0 + 10)[0]
    assert engine.next_deadline_ms() == T0 + 10
    assert engine.due(T0 + 9, 100) == []
    assert engine.due(T0 + 10, 100) == [b, d]
    assert engine.due(T0 + 25, 100) == [b, d, c]
    assert engine.due(T0 + 25, 2) == [b, d]
    assert engine.due(T0 + 10_000, 100) == [b, d, c, a]
    assert engine.due(T0 + 10_000, 0) == []
    # due() does not consume: only fired copies do.
    assert engine.due(T0 + 10, 100) == [b, d]


def test_due_timers_are_dues_entries_as_rows_and_columns(engine: TimerEngine) -> None:
    """The fire path takes `due_timers` (columns, no entry per timer); every other caller
    `due`: the same timers, every field, in the same order."""
    log = Log(engine)
    a, b = log.add(T0 + 30, T0 + 10)
    routed = dataclasses.replace(entry(log.position(), T0 + 10, keys=("k1", "k2"), accepted_ms=T0 + 20),
                                 tag_hash=7, queue_id=3, group_hash=11)
    log.apply(adds=[routed])
    assert engine.due_timers(T0 + 9, 100).rows == []
    assert len(engine.due_timers(T0 + 9, 100).positions) == 0
    for now, limit in ((T0 + 10, 100), (T0 + 30, 100), (T0 + 30, 2), (T0 + 30, 0)):
        entries = engine.due(now, limit)
        timers = engine.due_timers(now, limit)
        assert timers.entries() == entries
        assert len(timers) == len(entries)
        assert list(timers.positions) == [e.position for e in entries]
        assert list(zip(timers.topics, timers.message_ids, timers.deliver_at_ms, timers.keys, strict=True)) == [
            (e.topic, e.message_id, e.deliver_at_ms, e.keys) for e in entries]
        routes = zip(timers.sizes, timers.accepted_ms, timers.tag_hashes, timers.queue_ids, timers.group_hashes,
                     strict=True)
        assert list(routes) == [(e.size, e.accepted_ms, e.tag_hash, e.queue_id, e.group_hash) for e in entries]
    assert engine.due_timers(T0 + 30, 100).entries() == [b, routed, a]
    assert engine.due_timers(T0 + 30, 100).without({routed.position}).entries() == [b, a]


def test_ten_thousand_due_in_the_same_millisecond_come_back_in_acceptance_order(engine: TimerEngine) -> None:
    n = 10_000
    positions = [STRIDE * (i + 1) for i in range(n)]
    shuffled = positions[:]
    random.Random(7).shuffle(shuffled)
    end = STRIDE * (n + 1)
    # Apply them out of order (several batches) so only the index can restore acceptance order.
    for start in range(0, n, 1000):
        engine.apply(IndexBatch(adds=[entry(p, T0 + 500) for p in shuffled[start:start + 1000]],
                                indexed_position=end))
    assert engine.due(T0 + 499, n) == []
    got = [e.position for e in engine.due(T0 + 500, n + 1)]
    assert got == positions
    fired_order: list[int] = []
    while True:
        chunk = engine.due(T0 + 500, 2048)
        if not chunk:
            break
        fired_order += [e.position for e in chunk]
        end += STRIDE
        engine.apply(IndexBatch(fired=[(e.position, T0 + 501) for e in chunk], indexed_position=end))
    assert fired_order == positions
    assert engine.next_deadline_ms() is None
    assert engine.metrics(T0 + 501).pending_total == 0


def test_next_deadline_follows_adds_fires_and_cancels(reopen: Callable[[TimerEngine | None], TimerEngine]) -> None:
    engine = reopen(None)
    log = Log(engine)
    assert engine.next_deadline_ms() is None
    first = log.add(T0 + 5_000)[0]
    assert engine.next_deadline_ms() == T0 + 5_000
    log.add(T0 + 1_000)
    assert engine.next_deadline_ms() == T0 + 1_000
    log.add(T0 + 9_000)
    log.fire(T0 + 1_000)
    assert engine.next_deadline_ms() == T0 + 5_000
    log.apply(cancels=[("orders", first.message_id, T0 + 1_500)])
    assert engine.next_deadline_ms() == T0 + 9_000
    engine = reopen(engine)
    assert engine.next_deadline_ms() == T0 + 9_000
    # An add below the head and its fired copy in the same batch leave the head where it was.
    log = Log(engine)
    position = log.position()
    log.apply(adds=[entry(position, T0 + 2_000)], fired=[(position, T0 + 2_000)])
    assert engine.next_deadline_ms() == T0 + 9_000


# --- idempotent replay ----------------------------------------------------------------------------


def test_an_add_of_a_known_position_is_a_no_op(engine: TimerEngine) -> None:
    log = Log(engine)
    pending, fired, cancelled = (entry(log.position(), T0 + 1_000 * i, keys=("k",)) for i in (5, 1, 2))
    batch = IndexBatch(adds=[pending, fired, cancelled], indexed_position=log.position())
    engine.apply(batch)
    log.apply(fired=[(fired.position, T0 + 1_000)], cancels=[("orders", cancelled.message_id, T0 + 10)])
    before = engine.metrics(T0)
    # Replay the same records (a restart that replays from before them): nothing changes.
    engine.apply(IndexBatch(adds=batch.adds, indexed_position=engine.indexed_position))
    engine.apply(IndexBatch(adds=[pending, pending], indexed_position=engine.indexed_position))
    after = engine.metrics(T0)
    assert after.pending_total == before.pending_total == 1
    assert after.pending_by_due == before.pending_by_due
    assert engine.slot_count((T0 + 5_000) // 1000) == 1
    assert engine.lookup("orders", fired.message_id).state is TimerState.DELIVERED
    assert engine.lookup("orders", cancelled.message_id).state is TimerState.CANCELLED
    assert engine.due(T0 + 10_000, 10) == [pending]


def test_indexed_position_persists_and_never_goes_back(reopen: Callable[[TimerEngine | None], TimerEngine]) -> None:
    engine = reopen(None)
    assert engine.indexed_position == 0
    engine.apply(IndexBatch(adds=[entry(100, T0)], indexed_position=200))
    engine.apply(IndexBatch(indexed_position=200))  # equal is fine: an empty stretch
    with pytest.raises(IndexPositionWentBack) as info:
        engine.apply(IndexBatch(adds=[entry(150, T0)], indexed_position=199))
    assert info.value.details == {"indexed_position": 200, "batch_position": 199}
    assert engine.indexed_position == 200
    assert engine.metrics(T0).pending_total == 1  # the refused batch changed nothing
    engine = reopen(engine)
    assert engine.indexed_position == 200
    assert [e.position for e in engine.due(T0, 10)] == [100]


def test_a_bad_record_refuses_the_whole_batch(engine: TimerEngine) -> None:
    engine.apply(IndexBatch(adds=[entry(100, T0)], indexed_position=200))
    bad_batches = [
        IndexBatch(adds=[entry(300, T0), entry(400, -5)], indexed_position=500),
        IndexBatch(adds=[entry(300, T0), entry(600, T0)], indexed_position=500),  # past the batch's end
        IndexBatch(adds=[entry(300, T0)], fired=[(100, -1)], indexed_position=500),
        IndexBatch(adds=[entry(300, T0, message_id="x" * 70_000)], indexed_position=500),
    ]
    for bad in bad_batches:
        with pytest.raises(ValueError):
            engine.apply(bad)
    assert engine.indexed_position == 200
    assert [e.position for e in engine.due(T0, 10)] == [100]
    assert engine.metrics(T0).pending_total == 1


# --- cancel ------------------------------------------------------------------------------------------


def test_cancel_removes_from_time_order_and_keeps_a_cancelled_status(engine: TimerEngine) -> None:
    log = Log(engine)
    entries = log.add(*(T0 + 1_000 * i for i in range(1, 6)))
    victim = entries[2]
    log.apply(cancels=[("orders", victim.message_id, T0 + 42)])
    assert [e.position for e in engine.due(T0 + 10_000, 10)] == [e.position for e in entries if e is not victim]
    status = engine.lookup("orders", victim.message_id)
    assert status is not None
    assert (status.state, status.cancelled_ms, status.fired_ms) == (TimerState.CANCELLED, T0 + 42, None)
    assert (status.deliver_at_ms, status.position, status.accepted_ms) == (victim.deliver_at_ms, victim.position, T0)
    assert engine.metrics(T0).pending_total == 4
    assert engine.slot_count(victim.deliver_at_ms // 1000) == 0
    # A fired copy for the cancelled timer (a lost race) does not revive or redeliver it.
    log.apply(fired=[(victim.position, T0 + 3_000)])
    assert engine.lookup("orders", victim.message_id).state is TimerState.CANCELLED


def test_cancel_of_an_unknown_id_changes_nothing(engine: TimerEngine) -> None:
    log = Log(engine)
    log.add(T0 + 1_000, T0 + 2_000)
    before = engine.metrics(T0)
    log.apply(cancels=[("orders", "no-such-id", T0), ("no-such-topic", "id-100", T0)])
    after = engine.metrics(T0)
    assert (after.pending_total, after.pending_by_due, after.pending_by_topic) == (
        before.pending_total, before.pending_by_due, before.pending_by_topic)
    assert engine.lookup("orders", "no-such-id") is None
    assert len(engine.due(T0 + 5_000, 10)) == 2


def test_the_same_message_id_on_another_topic_is_not_cancelled(engine: TimerEngine) -> None:
    log = Log(engine)
    on_a = log.add(T0 + 1_000, topic="topic-a", message_id="shared")[0]
    on_b = log.add(T0 + 1_000, topic="topic-b", message_id="shared")[0]
    log.apply(cancels=[("topic-a", "shared", T0 + 1)])
    assert engine.due(T0 + 1_000, 10) == [on_b]
    assert engine.lookup("topic-a", "shared").state is TimerState.CANCELLED
    assert engine.lookup("topic-b", "shared").state is TimerState.PENDING
    by_id = engine.lookup_id("shared")
    assert [(s.topic, s.state, s.position) for s in by_id] == [
        ("topic-a", TimerState.CANCELLED, on_a.position), ("topic-b", TimerState.PENDING, on_b.position)]
    assert engine.metrics(T0).pending_by_topic == {"topic-b": 1}


def test_fired_wins_over_a_cancel_in_the_same_batch(engine: TimerEngine) -> None:
    log = Log(engine)
    position = log.position()
    # Timer record, its fired copy and a late tombstone all in one batch (a replay after a race).
    log.apply(adds=[entry(position, T0 + 10)], cancels=[("orders", f"id-{position}", T0 + 12)],
              fired=[(position, T0 + 11)])
    status = engine.lookup("orders", f"id-{position}")
    assert (status.state, status.fired_ms) == (TimerState.DELIVERED, T0 + 11)
    assert engine.due(T0 + 100, 10) == []


def test_cancel_in_the_same_batch_as_the_add(engine: TimerEngine) -> None:
    log = Log(engine)
    position = log.position()
    log.apply(adds=[entry(position, T0 + 10)], cancels=[("orders", f"id-{position}", T0 + 1)])
    assert engine.lookup("orders", f"id-{position}").state is TimerState.CANCELLED
    assert engine.due(T0 + 100, 10) == []
    assert engine.next_deadline_ms() is None
    assert engine.metrics(T0).pending_total == 0


# --- fired ---------------------------------------------------------------------------------------------


def test_fired_marks_delivered_and_unknown_positions_are_ignored(engine: TimerEngine) -> None:
    log = Log(engine)
    a, b = log.add(T0 + 1_000, T0 + 2_000, keys=("order-7",))
    log.apply(fired=[(a.position, T0 + 1_003), (999_999_999, T0), (a.position, T0 + 1_500)])
    status = engine.lookup("orders", a.message_id)
    assert (status.state, status.fired_ms, status.cancelled_ms) == (TimerState.DELIVERED, T0 + 1_003, None)
    assert engine.due(T0 + 5_000, 10) == [b]
    assert [(s.message_id, s.state) for s in engine.lookup_key("order-7")] == [
        (a.message_id, TimerState.DELIVERED), (b.message_id, TimerState.PENDING)]
    assert engine.lookup_key("no-such-key") == []
    hist = engine.metrics(T0).latencies["delivery_error_ms"]
    assert (hist["count"], hist["min"], hist["max"]) == (1, 3, 3)


def test_a_timer_handed_out_by_due_then_cancelled_or_rolled_is_not_fired_as_it_was(engine: TimerEngine) -> None:
    log = Log(engine)
    cancelled, rolled, same_batch = log.add(T0 + 1, T0 + 2, T0 + 3)
    assert engine.due(T0 + 10, 10) == [cancelled, rolled, same_batch]  # handed to the broker
    log.apply(cancels=[("orders", cancelled.message_id, T0 + 5)])
    rolled_copy = entry(log.next, rolled.deliver_at_ms, message_id=rolled.message_id)
    log.apply(rolled=[(rolled.position, rolled_copy)])
    # The broker's fired copies, made from what due() handed out, arrive after those.
    log.apply(fired=[(cancelled.position, T0 + 11), (rolled.position, T0 + 11)])
    assert engine.lookup("orders", cancelled.message_id).state is TimerState.CANCELLED
    status = engine.lookup("orders", rolled.message_id)
    assert (status.state, status.position, status.fired_ms) == (TimerState.DELIVERED, rolled_copy.position, T0 + 11)
    # A roll and the fired copy of the original in one batch.
    copy = entry(log.position(), same_batch.deliver_at_ms, message_id=same_batch.message_id)
    log.apply(rolled=[(same_batch.position, copy)], fired=[(same_batch.position, T0 + 12)])
    status = engine.lookup("orders", same_batch.message_id)
    assert (status.state, status.position) == (TimerState.DELIVERED, copy.position)
    snapshot = engine.metrics(T0 + 20)
    assert (snapshot.pending_total, engine.next_deadline_ms(), engine.due(T0 + 100, 10)) == (0, None, [])
    assert snapshot.latencies["delivery_error_ms"]["count"] == 2


def test_lookup_returns_the_newest_timer_and_lookup_id_every_timer_of_a_reused_id(engine: TimerEngine) -> None:
    log = Log(engine)
    old = log.add(T0 + 10, message_id="again")[0]
    log.fire(T0 + 10)
    new = log.add(T0 + 50, message_id="again")[0]
    status = engine.lookup("orders", "again")
    assert (status.position, status.state) == (new.position, TimerState.PENDING)
    # A tombstone without a due time cancels what is pending, and leaves the delivered one alone.
    log.apply(cancels=[("orders", "again", T0 + 20)])
    assert engine.lookup("orders", "again").state is TimerState.CANCELLED
    assert [(s.position, s.state) for s in engine.lookup_id("again")] == [
        (old.position, TimerState.DELIVERED), (new.position, TimerState.CANCELLED)]
    assert engine.lookup_id("again", "orders") == engine.lookup_id("again")
    assert engine.lookup_id("again", "elsewhere") == []


def test_a_cancel_with_a_due_time_reaches_only_the_timers_of_the_id_due_then(
        reopen: Callable[[TimerEngine | None], TimerEngine]) -> None:
    """An id reused on a topic after the dedupe window names two pending timers; a tombstone
    carries the due time of the one it cancels (its TIMER_OUT_MS) and must leave the other
    pending. It used to cancel both."""
    engine = reopen(None)
    log = Log(engine)
    first = log.add(T0 + 1_000, message_id="X", keys=("k",))[0]
    second = log.add(T0 + 2_000, message_id="X", keys=("k",))[0]
    other_topic = log.add(T0 + 2_000, message_id="X", topic="audit")[0]
    log.apply(cancels=[("orders", "X", T0 + 5, second.deliver_at_ms)])
    assert engine.due(T0 + 10_000, 10) == [first, other_topic]
    assert [(s.topic, s.position, s.state) for s in engine.lookup_id("X")] == [
        ("audit", other_topic.position, TimerState.PENDING), ("orders", first.position, TimerState.PENDING),
        ("orders", second.position, TimerState.CANCELLED)]
    assert [(s.position, s.state) for s in engine.lookup_key("k")] == [
        (first.position, TimerState.PENDING), (second.position, TimerState.CANCELLED)]
    # A due time no timer of the id has cancels nothing; the right one cancels the first.
    log.apply(cancels=[("orders", "X", T0 + 6, T0 + 1_500)])
    assert engine.metrics(T0).pending_total == 2
    engine = reopen(engine)
    log.engine = engine
    log.apply(cancels=[("orders", "X", T0 + 7, first.deliver_at_ms)])
    assert engine.due(T0 + 10_000, 10) == [other_topic]
    assert engine.slot_count(first.deliver_at_ms // 1000) == 0


# --- counters ----------------------------------------------------------------------------------------


def test_slot_and_topic_counts_match_a_brute_force_count_and_survive_reopen(
        reopen: Callable[[TimerEngine | None], TimerEngine]) -> None:
    engine = reopen(None)
    log = Log(engine)
    rng = random.Random(3)
    live: dict[int, TimerEntry] = {}
    for _ in range(20):
        batch = [entry(log.position(), T0 + rng.randrange(0, 7_200_000), topic=rng.choice("abc"))
                 for _ in range(rng.randrange(1, 60))]
        engine.apply(IndexBatch(adds=batch, indexed_position=log.next))
        live.update((e.position, e) for e in batch)
    for e in log.fire(T0 + 1_800_000):
        del live[e.position]
    for e in rng.sample(sorted(live.values(), key=lambda x: x.position), 15):
        log.apply(cancels=[(e.topic, e.message_id, T0)])
        del live[e.position]

    def check(engine: TimerEngine) -> None:
        slots: dict[int, int] = {}
        topics: dict[str, int] = {}
        for e in live.values():
            slots[e.deliver_at_ms // 1000] = slots.get(e.deliver_at_ms // 1000, 0) + 1
            topics[e.topic] = topics.get(e.topic, 0) + 1
        for slot_s in set(slots) | {(T0 + 100_000) // 1000}:
            assert engine.slot_count(slot_s) == slots.get(slot_s, 0)
        snapshot = engine.metrics(T0)
        assert snapshot.pending_total == len(live)
        assert dict(snapshot.pending_by_topic) == topics
        assert engine.next_deadline_ms() == min(e.deliver_at_ms for e in live.values())

    check(engine)
    check(reopen(engine))


def test_pending_by_due_buckets_match_a_brute_force_split(engine: TimerEngine) -> None:
    log = Log(engine)
    rng = random.Random(11)
    now_ms = T0 + 123_456
    offsets_ms = [rng.randrange(-120_000, 3 * 86_400_000) for _ in range(3_000)]
    offsets_ms += [0, 999, -1, 4_999, 5_000, 59_999, 60_000, 86_399_999, 86_400_000]
    for start in range(0, len(offsets_ms), 500):
        log.add(*(now_ms + o for o in offsets_ms[start:start + 500]))
    edges_s = [("5s", 5), ("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600), ("4h", 14_400),
               ("8h", 28_800), ("24h", 86_400)]
    now_s = now_ms // 1000
    expected = {"overdue": 0, **{name: 0 for name, _ in edges_s}, "more": 0}
    for o in offsets_ms:
        ahead_s = (now_ms + o) // 1000 - now_s
        if ahead_s < 0:
            expected["overdue"] += 1
            continue
        expected[next((name for name, edge in edges_s if ahead_s < edge), "more")] += 1
    snapshot = engine.metrics(now_ms)
    assert dict(snapshot.pending_by_due) == expected
    assert sum(snapshot.pending_by_due.values()) == snapshot.pending_total == len(offsets_ms)
    assert snapshot.oldest_overdue_ms == now_ms - min(now_ms + o for o in offsets_ms)


def test_latency_histograms(engine: TimerEngine) -> None:
    log = Log(engine)
    position = log.position()
    engine.apply(IndexBatch(adds=[entry(position, T0 + 100, accepted_ms=T0)], indexed_position=log.next,
                            applied_ms=T0 + 7))
    engine.apply(IndexBatch(adds=[entry(log.position(), T0 + 200)], indexed_position=log.next))  # replay: no lag
    assert engine.due(T0 + 150, 10)[0].position == position
    assert len(engine.due(T0 + 160, 10)) == 1  # asked again before it fired: counted once
    log.apply(fired=[(position, T0 + 152)])
    lat = engine.metrics(T0 + 200).latencies
    assert (lat["enqueue_lag_ms"]["count"], lat["enqueue_lag_ms"]["max"]) == (1, 7)
    assert (lat["fire_lag_ms"]["count"], lat["fire_lag_ms"]["max"]) == (1, 50)
    assert (lat["delivery_error_ms"]["count"], lat["delivery_error_ms"]["max"]) == (1, 52)


def test_a_deliver_at_already_past_when_accepted_is_late_only_from_its_acceptance(engine: TimerEngine) -> None:
    """RocketMQ delivers a deliver-at in the past at once; the delivery error then counts from the
    acceptance, not from a due time an hour before it existed (`stats` showed P90 11h32m)."""
    log = Log(engine)
    accepted = T0 + 3_600_000
    handed, unhanded = log.position(), log.position()
    adds = [entry(handed, T0, accepted_ms=accepted), entry(unhanded, T0 + 1, accepted_ms=accepted)]
    engine.apply(IndexBatch(adds=adds, indexed_position=log.next))
    # One fired through what due() handed out (the fast path), one by position alone (replay's path).
    assert [e.position for e in engine.due(accepted + 1, 1)] == [handed]
    log.apply(fired=[(handed, accepted + 5), (unhanded, accepted + 9)])
    latencies = engine.metrics(accepted + 10).latencies
    hist = latencies["delivery_error_ms"]
    assert (hist["count"], hist["min"], hist["max"]) == (2, 5, 9)
    assert (latencies["fire_lag_ms"]["count"], latencies["fire_lag_ms"]["max"]) == (1, 1)  # due() at accepted + 1


# --- roll and pending_in -------------------------------------------------------------------------------


def test_pending_in_and_roll_move_a_timer_to_its_new_copy(engine: TimerEngine) -> None:
    log = Log(engine)
    a, b, c = log.add(T0 + 86_400_000, T0 + 10, T0 + 172_800_000, keys=("k",))
    log.fire(T0 + 10)
    assert engine.pending_in(a.position, c.position + 1) == [a, c]
    assert engine.pending_in(a.position, c.position) == [a]
    assert engine.pending_in(c.position + 1, c.position + 1_000) == []
    # Roll a and c (their segment is about to be deleted).
    a2 = entry(log.position(), a.deliver_at_ms, message_id=a.message_id, keys=("k",))
    c2 = entry(log.position(), c.deliver_at_ms, message_id=c.message_id, keys=("k",))
    engine.apply(IndexBatch(rolled=[(a.position, a2), (c.position, c2)], indexed_position=log.next))
    assert engine.pending_in(a.position, c.position + 1) == []
    assert engine.pending_in(a2.position, c2.position + 1) == [a2, c2]
    assert engine.due(T0 + 200_000_000, 10) == [a2, c2]
    assert engine.metrics(T0).pending_total == 2
    assert engine.lookup("orders", a.message_id).position == a2.position
    assert [s.position for s in engine.lookup_key("k")] == [b.position, a2.position, c2.position]
    # Replaying the roll changes nothing; a fired copy made from the OLD record (a race with
    # the roll) marks the new copy delivered instead of leaving it to fire twice.
    engine.apply(IndexBatch(rolled=[(a.position, a2)], indexed_position=log.next))
    log.apply(fired=[(a.position, a.deliver_at_ms + 1)])
    assert engine.due(T0 + 200_000_000, 10) == [c2]
    assert engine.lookup("orders", a.message_id).state is TimerState.DELIVERED


def test_roll_of_an_unknown_original_adds_and_of_a_finished_one_is_ignored(engine: TimerEngine) -> None:
    log = Log(engine)
    gone_position = 1  # a record in a segment deleted before this index was rebuilt
    copy = entry(log.position(), T0 + 5_000, message_id="m1")
    log.apply(rolled=[(gone_position, copy)])
    assert engine.due(T0 + 5_000, 10) == [copy]
    fired = log.add(T0 + 1_000, message_id="m2")[0]
    log.fire(T0 + 1_000)
    late_copy = entry(log.position(), T0 + 1_000, message_id="m2")
    log.apply(rolled=[(fired.position, late_copy)])
    assert engine.due(T0 + 10_000, 10) == [copy]
    assert engine.lookup("orders", "m2").state is TimerState.DELIVERED


# --- history ---------------------------------------------------------------------------------------


def test_prune_history_forgets_old_finished_statuses_only(engine: TimerEngine) -> None:
    log = Log(engine)
    early, late, pending, cancelled = log.add(T0 + 1_000, T0 + 9_000, T0 + 99_000, T0 + 50_000, keys=("kk",))
    log.fire(T0 + 1_000)
    log.apply(cancels=[("orders", cancelled.message_id, T0 + 2_000)])
    log.fire(T0 + 9_000)
    assert engine.prune_history(T0 + 1_000) == 0
    assert engine.prune_history(T0 + 5_000) == 2  # early (fired 1_000) and cancelled (2_000)
    assert engine.lookup("orders", early.message_id) is None
    assert engine.lookup("orders", cancelled.message_id) is None
    assert engine.lookup("orders", late.message_id).state is TimerState.DELIVERED
    assert [s.message_id for s in engine.lookup_key("kk")] == [late.message_id, pending.message_id]
    assert engine.prune_history(T0 + 10**9) == 1
    assert engine.lookup("orders", pending.message_id).state is TimerState.PENDING
    assert engine.due(T0 + 99_000, 10) == [pending]


def test_fired_history_rows_hold_a_bounded_number_and_prune_forgets_about_a_chunk_a_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fire step writes a `history` row per HISTORY_FIRED_MAX timers it fired, and a prune
    write forgets about `_PRUNE_CHUNK` timers (whole rows), however big the step was."""
    monkeypatch.setattr(index_txn_module, "HISTORY_FIRED_MAX", 4)
    monkeypatch.setattr(index_retention_module, "_PRUNE_CHUNK", 3)
    with RocksTimerIndex.open(tmp_path / "idx") as index:
        log = Log(index)
        fired = log.add(*(T0 + i for i in range(10)))
        assert len(log.fire(T0 + 100)) == 10  # one step, through due()
        rows = list(index._cf[CF_HISTORY].values())
        assert [len(decode_fired_history(v)) for v in rows] == [4, 4, 2]
        per_write: list[int] = []
        prune_rows = index._prune_rows
        monkeypatch.setattr(index, "_prune_rows", lambda rows: per_write.append(prune_rows(rows)) or per_write[-1])
        assert index.prune_history(T0 + 1_000) == len(fired)
        assert per_write == [4, 4, 2]
        assert all(index.lookup("orders", e.message_id) is None for e in fired)
        assert list(index._cf[CF_HISTORY].keys()) == [] and list(index._cf[CF_POS].keys()) == []


def test_prune_history_in_chunks_and_roll_redirects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_retention_module, "_PRUNE_CHUNK", 3)
    with RocksTimerIndex.open(tmp_path / "idx") as index:
        log = Log(index)
        fired = log.add(*(T0 + i for i in range(10)))
        log.fire(T0 + 100)
        rolled = log.add(T0 + 50_000)[0]
        copy = entry(log.next, rolled.deliver_at_ms, message_id=rolled.message_id)
        log.apply(rolled=[(rolled.position, copy)])
        redirect_key = struct.pack(">Q", rolled.position)
        assert index.prune_history(T0 + 1_000) == len(fired)
        assert all(index.lookup("orders", e.message_id) is None for e in fired)
        assert index._cf[CF_POS].get(redirect_key) is not None  # not yet due: keep the redirect
        assert index.prune_history(T0 + 60_000) == 0
        assert index._cf[CF_POS].get(redirect_key) is None
        assert list(index._cf[CF_HISTORY].keys()) == []
        assert index.due(T0 + 60_000, 10) == [copy]


# --- model-based: random schedules, cancels, rolls, replays and restarts ---------------------------


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.tuples(st.integers(0, 50_000), st.sampled_from("ab"),
                                                 st.integers(0, 15)), min_size=1, max_size=20)),
    st.tuples(st.just("cancel"), st.sampled_from("ab"), st.integers(0, 15), st.integers(0, 3)),
    st.tuples(st.just("fire"), st.integers(0, 60_000), st.integers(1, 10)),
    st.tuples(st.just("roll"), st.integers(0, 1_000)),
    st.tuples(st.just("replay"), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0)),
), min_size=1, max_size=40)


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", sorted(ENGINES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ops)
def test_engine_matches_the_in_memory_model_through_random_histories(
        tmp_path_factory: pytest.TempPathFactory, engine_name: str, script: list[tuple]) -> None:
    """The model is `MemoryTimerEngine` (plain dicts, nothing clever): each batch goes to both, and
    after every step the engine under test answers as the model does."""
    path = tmp_path_factory.mktemp("model")
    engine: TimerEngine = ENGINES[engine_name](path)
    model = MemoryTimerEngine()
    log = Log(engine)
    now_ms = T0
    last_adds: list[TimerEntry] = []
    seen: set[tuple[str, str]] = set()

    def both(**parts: object) -> None:
        log.apply(**parts)
        model.apply(IndexBatch(indexed_position=log.applied, **parts))  # type: ignore[arg-type]

    try:
        for op in script:
            if op[0] == "add":
                last_adds = [entry(log.position(), T0 + d, message_id=f"m{i}", topic=t) for d, t, i in op[1]]
                both(adds=last_adds)
                seen.update((t, f"m{i}") for _, t, i in op[1])
            elif op[0] == "cancel":
                # 0: a tombstone without a due time (every due time of the id); else one of the
                # due times of the id's timers (a reused id names several).
                _, topic, i, pick = op
                dues = sorted({s.deliver_at_ms for s in model.lookup_id(f"m{i}", topic)})
                due = dues[(pick - 1) % len(dues)] if pick and dues else None
                both(cancels=[(topic, f"m{i}", now_ms, log.position(), due)])
            elif op[0] == "fire":
                now_ms = max(now_ms, T0 + op[1])
                got = engine.due(now_ms, op[2])
                assert got == model.due(now_ms, op[2])
                assert all(e.deliver_at_ms <= now_ms for e in got)  # never early
                if got:
                    both(fired=[(e.position, now_ms) for e in got])
            elif op[0] == "roll":
                pending = model.pending_in(0, log.next)
                if pending:
                    e = pending[op[1] % len(pending)]
                    new = entry(log.next, e.deliver_at_ms, message_id=e.message_id, topic=e.topic)
                    both(rolled=[(e.position, new)])
            elif op[0] == "replay" and last_adds:
                engine.apply(IndexBatch(adds=last_adds, indexed_position=engine.indexed_position))
            elif op[0] == "reopen":
                engine = log.engine = reopen_engine(engine, engine_name, path)
            # Invariants after every step.
            assert engine.next_deadline_ms() == model.next_deadline_ms()
            assert engine.metrics(now_ms).pending_total == model.metrics(now_ms).pending_total
        assert engine.due(T0 + 10**9, 10**6) == model.due(T0 + 10**9, 10**6)
        for topic, message_id in sorted(seen):
            assert engine.lookup(topic, message_id) == model.lookup(topic, message_id)
            assert engine.lookup_id(message_id, topic) == model.lookup_id(message_id, topic)
            assert engine.lookup_id(message_id) == model.lookup_id(message_id)
        assert engine.indexed_position == log.applied == model.indexed_position
    finally:
        engine.close()


def reopen_engine(engine: TimerEngine, engine_name: str, path: Path) -> TimerEngine:
    engine.close()
    return ENGINES[engine_name](path)


# --- RocksDB specifics: open, corruption, locking, crash -------------------------------------------


def test_byte_layouts_match_docs_disk_format(tmp_path: Path) -> None:
    """The layouts docs/disk-format.md ("Timer index") states, byte for byte."""
    with RocksTimerIndex.open(tmp_path / "idx") as index:
        e = dataclasses.replace(entry(300, T0 + 61_500, message_id="M1", topic="tp", keys=("k1",), accepted_ms=T0 - 7),
                                tag_hash=0xABCD1234, queue_id=3)
        index.apply(IndexBatch(adds=[e], indexed_position=400))
        cf = index._cf
        ik = b"\x00\x02M1" + b"\x00\x02tp" + struct.pack(">Q", 300)
        keys = b"\x00\x01" + b"\x00\x02k1"
        tk = struct.pack(">QQ", T0 + 61_500, 300)
        assert list(cf[CF_TIME].items()) == [
            (tk, b"\x02" + struct.pack(">QIqIiq", 300, STRIDE, T0 - 7, 0xABCD1234, 3, -1)
             + b"\x00\x02M1\x00\x02tp" + keys)]
        facts = b"\x01" + struct.pack(">qIq", T0 + 61_500, STRIDE, T0 - 7) + keys
        assert list(cf[CF_ID].items()) == [(ik, facts)]
        position_key = struct.pack(">Q", 300)
        assert list(cf[CF_POS].items()) == [(position_key, b"\x01" + struct.pack(">q", T0 + 61_500) + ik)]
        assert list(cf[CF_KEY].items()) == [(b"\x00\x02k1" + struct.pack(">Q", 300), ik)]
        second = (T0 + 61_500) // 1000
        minute_slots = [0] * 60
        minute_slots[second % 60] = 1
        assert dict(cf[CF_COUNTERS].items()) == {
            b"m" + struct.pack(">Q", second // 60): struct.pack(">60I", *minute_slots),
            b"h" + struct.pack(">Q", second // 3600): struct.pack(">q", 1),
            b"ttp": struct.pack(">q", 1),
        }
        assert dict(cf[CF_META].items()) == {META_FORMAT_VERSION: struct.pack(">I", 6),
                                              b"indexed_position": struct.pack(">Q", 400), b"head_floor": tk}
        # Fired by a link record at 450 in the segment based at 0 (its links name 300 at the
        # lowest), whose body the index keeps a copy of in `links`.
        index.apply(IndexBatch(fired=[(300, T0 + 61_502)], link_floors=[(0, 300)],
                               link_copies=[(450, T0 + 61_502, b"links body")], indexed_position=500))
        assert list(cf[CF_LINKS].items()) == [(struct.pack(">Q", 450),
                                               b"\x01" + struct.pack(">q", T0 + 61_502) + b"links body")]
        assert index.link_copy(450) == (b"links body", T0 + 61_502) and index.link_copy(300) is None
        assert index.link_copies_in(0, 451) == [450] and index.link_copies_in(451, 1000) == []
        assert list(cf[CF_ID].items()) == [(ik, facts)]  # facts stay; the state moved to `pos`
        assert list(cf[CF_POS].items()) == [(position_key, b"\x03\x02" + struct.pack(">q", T0 + 61_502))]
        assert list(cf[CF_HISTORY].items()) == [(struct.pack(">QQ", T0 + 61_502, 300), b"\x01" + ik)]
        assert list(cf[CF_TIME].items()) == []
        assert dict(cf[CF_COUNTERS].items()) == {b"f" + struct.pack(">Q", 0): struct.pack(">Q", 300)}
        assert index.linked_floor(0) == 300
        index.forget_links_below(451, live_from=451)  # the segment based at 0 is gone
        assert dict(cf[CF_COUNTERS].items()) == {} and index.linked_floor(0) is None
        assert list(cf[CF_LINKS].items()) == [] and index.link_copy(450) is None
        assert cf[CF_META][b"live_links_from"] == struct.pack(">Q", 451) and index.live_links_from() == 451
        assert cf[CF_META][b"head_floor"] == tk  # the old head: at or below anything pending
        index.apply(IndexBatch(indexed_position=600))
        assert cf[CF_META][b"head_floor"] == b""  # nothing pending
        # Timers a fire step took from `due()` and fired together: one `history` row of kind 3,
        # keyed by the first of them, their `id` keys end to end.
        index.apply(IndexBatch(adds=[entry(700, T0 + 1, message_id="M7", topic="tp"),
                                      entry(800, T0 + 2, message_id="M22", topic="tp")], indexed_position=900))
        assert [e.position for e in index.due(T0 + 2, 10)] == [700, 800]
        index.apply(IndexBatch(fired=[(700, T0 + 5), (800, T0 + 5)], indexed_position=1000))
        ik7 = b"\x00\x02M7" + b"\x00\x02tp" + struct.pack(">Q", 700)
        ik8 = b"\x00\x03M22" + b"\x00\x02tp" + struct.pack(">Q", 800)
        history = dict(cf[CF_HISTORY].items())
        fired_row = b"\x03" + struct.pack(">I", 2) + ik7 + ik8
        assert len(history) == 2 and history[struct.pack(">QQ", T0 + 5, 700)] == fired_row
        assert decode_fired_history(fired_row) == [ik7, ik8]


def test_open_creates_a_fresh_index_and_refuses_a_missing_one_when_asked(tmp_path: Path) -> None:
    with pytest.raises(TimerIndexCorrupt) as info:
        RocksTimerIndex.open(tmp_path / "absent", create_if_missing=False)
    assert "missing" in info.value.details["reason"]
    with RocksTimerIndex.open(tmp_path / "fresh") as index:
        assert (index.indexed_position, index.next_deadline_ms(), index.pending_total) == (0, None, 0)


def test_a_wrong_format_version_is_reported_then_destroy_allows_a_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    with RocksTimerIndex.open(path) as index:
        index.apply(IndexBatch(adds=[entry(100, T0)], indexed_position=200))
        index._cf[CF_META][META_FORMAT_VERSION] = (99).to_bytes(4, "big")
    with pytest.raises(TimerIndexCorrupt) as info:
        RocksTimerIndex.open(path)
    assert "format version 99" in str(info.value)
    RocksTimerIndex.destroy(path)
    with RocksTimerIndex.open(path) as index:
        assert index.indexed_position == 0 and index.pending_total == 0


def test_garbage_in_the_directory_is_reported_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    with RocksTimerIndex.open(path) as index:
        index.apply(IndexBatch(adds=[entry(100, T0)], indexed_position=200))
    (path / "CURRENT").write_text("garbage\n")
    with pytest.raises(TimerIndexCorrupt):
        RocksTimerIndex.open(path)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not an index")
    with pytest.raises(TimerIndexCorrupt):
        RocksTimerIndex.open(stray)


def test_an_undecodable_value_is_reported_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    with RocksTimerIndex.open(path) as index:
        index.apply(IndexBatch(adds=[entry(100, T0)], indexed_position=200))
        head = index._head
        index._cf[CF_TIME][head] = b"\x07garbage"
    with pytest.raises(TimerIndexCorrupt):
        RocksTimerIndex.open(path)


def test_a_second_open_of_the_same_index_is_refused_as_locked(tmp_path: Path) -> None:
    with RocksTimerIndex.open(tmp_path / "idx"), pytest.raises(DataDirLocked):
        RocksTimerIndex.open(tmp_path / "idx")


@pytest.mark.slow
def test_an_index_held_by_another_process_is_refused_as_locked(tmp_path: Path) -> None:
    holder = ("import sys\nfrom chronoq.timer.index import RocksTimerIndex\n"
              "index = RocksTimerIndex.open(sys.argv[1])\nprint('ready', flush=True)\nsys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(chronoq.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / "idx")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(DataDirLocked):
            RocksTimerIndex.open(tmp_path / "idx")
    finally:
        child.communicate(timeout=30)  # closes its stdin: it exits and lets go of the lock
    with RocksTimerIndex.open(tmp_path / "idx") as index:
        assert index.indexed_position == 0


def test_a_closed_index_refuses_work(tmp_path: Path) -> None:
    index = RocksTimerIndex.open(tmp_path / "idx")
    index.close()
    index.close()  # idempotent
    with pytest.raises(TimerIndexClosed):
        index.apply(IndexBatch(indexed_position=1))
    with pytest.raises(TimerIndexClosed):
        index.due(T0, 1)


_CHILD = textwrap.dedent("""
    import sys
    from chronoq.timer.engine import IndexBatch, TimerEntry
    from chronoq.timer.index import RocksTimerIndex
    index = RocksTimerIndex.open(sys.argv[1])
    T0 = 1_700_000_000_000
    while True:
        start = index.indexed_position
        adds = [TimerEntry(T0 + (p * 7919) % 100_000, p, 10, f"id{p}", "t", T0) for p in range(start, start + 500)]
        fired = [(p, T0) for p in range(max(0, start - 2_000), start - 1_500)]  # batch - 4's adds
        index.apply(IndexBatch(adds=adds, fired=fired, indexed_position=start + 500))
        print(index.indexed_position, flush=True)
""")


@pytest.mark.slow
def test_sigkill_mid_apply_leaves_a_consistent_index_at_a_batch_boundary(tmp_path: Path) -> None:
    path = tmp_path / "idx"
    env = {**os.environ, "PYTHONPATH": str(Path(chronoq.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    acknowledged = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            acknowledged = int(line)
            if acknowledged >= 40_000:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    with RocksTimerIndex.open(path) as index:
        end = index.indexed_position
        assert end >= acknowledged  # every apply that returned survived the kill
        assert end % 500 == 0
        # Exactly the state the workload has at that boundary: positions [0, end) added, and
        # [0, end - 2_000) fired: each batch fires what the batch four before it added.
        fired_end = max(0, end - 2_000)
        assert index.pending_total == end - fired_end
        assert sorted(e.position for e in index.pending_in(0, end)) == list(range(fired_end, end))
        assert index.metrics(T0).pending_by_topic == {"t": end - fired_end}
