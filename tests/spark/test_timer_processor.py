"""The Spark timer engine's processor under TwsTester (no JVM): never early, cancel, order, restart."""

from __future__ import annotations

import random

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark; the imports below need it too

import pandas as pd  # noqa: E402
from pyspark.sql.streaming.tws_tester import TwsTester  # noqa: E402

from chronoq.spark.timer_processor import (  # noqa: E402
    BucketTimerProcessor,
    pack_entries,
    split_due,
    unpack_entries,
)

pytestmark = pytest.mark.spark

KEY = (0, 0)


def _frame(*entries: tuple) -> pd.DataFrame:
    return pd.DataFrame({
        "message_id": [e[0] for e in entries],
        "due_ms": pd.Series([e[1] for e in entries], dtype="int64"),
        "position": pd.Series([e[2] for e in entries], dtype="int64"),
        "tombstone": pd.Series([e[3] if len(e) > 3 else False for e in entries], dtype=bool),
    })


def _held(t: TwsTester, key: tuple = KEY) -> list[tuple]:
    """The entries a key's state holds, unpacked from its chunks."""
    return [e for (chunk,) in t.peekListState("chunks", key) for e in unpack_entries(chunk)]


def _tester(grace_ms: int = 10_000) -> TwsTester:
    return TwsTester(BucketTimerProcessor(tombstone_grace_ms=grace_ms), timeMode="ProcessingTime")


def _fired(out: pd.DataFrame) -> list[tuple[str, int]]:
    if out.empty:
        return []
    for due, fired in zip(out["due_ms"], out["fired_ms"], strict=True):
        assert fired >= due, "fired early"
    return list(zip(out["message_id"], out["fired_ms"], strict=True))


def test_never_early_and_one_timer_per_key():
    t = _tester()
    assert _fired(t.testInPandas(KEY, _frame(("a", 1000, 10), ("b", 1500, 20), ("c", 2500, 30)))) == []
    assert list(t.handle.listTimers()) == [1000]
    assert _fired(t.setProcessingTime(999)) == []
    assert _fired(t.setProcessingTime(1000)) == [("a", 1000)]
    assert list(t.handle.listTimers()) == [1500]
    assert _fired(t.setProcessingTime(2499)) == [("b", 2499)]
    assert _fired(t.setProcessingTime(2500)) == [("c", 2500)]
    assert _held(t) == []
    assert list(t.handle.listTimers()) == []


def test_earlier_arrival_wakes_the_key_earlier_and_due_input_fires_at_once():
    t = _tester()
    t.testInPandas(KEY, _frame(("late", 5000, 1)))
    t.testInPandas(KEY, _frame(("early", 3000, 2)))
    # Registered without reading the key's timers: the later one stays until the key runs.
    assert sorted(t.handle.listTimers()) == [3000, 5000]
    assert _fired(t.setProcessingTime(3000)) == [("early", 3000)]
    assert list(t.handle.listTimers()) == [5000]
    t.setProcessingTime(4000)
    # Already due when it arrives: emitted by this very batch, stamped with the batch time.
    assert _fired(t.testInPandas(KEY, _frame(("past", 3500, 3)))) == [("past", 4000)]
    assert _fired(t.setProcessingTime(5000)) == [("late", 5000)]


def test_cancel_before_and_after_the_timer_arrives():
    t = _tester(grace_ms=10_000)
    t.testInPandas(KEY, _frame(("a", 1000, 1), ("b", 1000, 2)))
    assert _fired(t.testInPandas(KEY, _frame(("a", 1000, 3, True)))) == []
    # The tombstone for "x" arrives before its timer (another queue, a later batch).
    t.testInPandas(KEY, _frame(("x", 2000, 9, True)))
    t.testInPandas(KEY, _frame(("x", 2000, 4)))
    assert _fired(t.setProcessingTime(5000)) == [("b", 5000)]
    assert _held(t) == []


class _CountingReads:
    """The processor's real ListState, counting whole-list reads (`get`)."""

    def __init__(self, state):
        self.state, self.reads = state, 0

    def get(self):
        self.reads += 1
        return self.state.get()

    def __getattr__(self, name):
        return getattr(self.state, name)


def test_a_cancel_appends_its_tombstone_and_never_reads_the_buckets_list():
    lead, step = 300_000, 60_000
    t = TwsTester(BucketTimerProcessor(tombstone_grace_ms=600_000, lead_ms=lead, step_ms=step),
                  timeMode="ProcessingTime")
    t.processor.chunks = reads = _CountingReads(t.processor.chunks)
    timers = [(f"m{i}", 4_000_000 + i, 10 + i) for i in range(2_000)]
    t.testInPandas(KEY, _frame(*timers))
    # Cancels of stored timers, and one of a timer sent in the same batch (met at once).
    out = t.testInPandas(KEY, _frame(("m5", 4_000_005, 5_000, True), ("m7", 4_000_007, 5_001, True),
                                     ("new", 4_100_000, 5_002), ("new", 4_100_000, 5_003, True)))
    assert out.empty and reads.reads == 0
    stored = _held(t)
    assert len(stored) == 2_000 + 2  # the two tombstones appended; "new" and its tombstone never stored
    assert len(t.peekListState("chunks", KEY)) == 2  # a chunk a batch, not a value a timer
    first_wake = -(-(4_000_000 - lead) // step) * step
    # The earliest timer is the timers' release; the later one the unmatched tombstones' expiry.
    assert sorted(t.handle.listTimers()) == [first_wake, -(-(4_000_007 + 600_000 - lead) // step) * step]
    released = t.setProcessingTime(4_000_000 - lead + step)
    assert reads.reads == 1
    assert sorted(released["message_id"]) == sorted(m for m, _, _ in timers if m not in ("m5", "m7"))
    assert _held(t) == [] and list(t.handle.listTimers()) == []


def test_entries_pack_and_unpack_exactly():
    entries = [("orders\x00o-1", 1_800_000_000_123, 4_096, False), ("orders\x00o-1", 1_800_000_000_123, 9_999, True),
               ("t\x00é-ü", 0, 0, False), ("k" * 300, (1 << 63) - 1, (1 << 62), True)]
    assert unpack_entries(pack_entries(entries)) == entries
    assert unpack_entries(pack_entries([])) == []


def test_state_of_the_one_entry_layout_is_read_and_emptied_on_expiry():
    t = _tester()
    t.testInPandas(KEY, _frame(("new", 3000, 5)))
    # What an earlier version stored: one entry a value, in the `entries` ListState.
    t.handle.setGroupingKey(KEY)
    t.processor.entries.put([("old", 2000, 1, False), ("gone", 2500, 2, False), ("gone", 2500, 3, True)])
    assert _fired(t.setProcessingTime(3000)) == [("old", 3000), ("new", 3000)]
    assert t.peekListState("entries", KEY) == [] and _held(t) == []


def test_orphan_tombstone_expires_after_grace():
    t = _tester(grace_ms=10_000)
    t.testInPandas(KEY, _frame(("ghost", 1000, 1, True)))
    assert _held(t) == [("ghost", 1000, 1, True)]
    assert list(t.handle.listTimers()) == [11_000]
    t.setProcessingTime(10_999)
    assert len(_held(t)) == 1
    t.setProcessingTime(11_000)
    assert _held(t) == []
    assert list(t.handle.listTimers()) == []


def test_same_millisecond_fires_in_position_order():
    t = _tester()
    positions = list(range(100, 600, 10))
    random.Random(3).shuffle(positions)
    t.testInPandas(KEY, _frame(*[(f"m{p}", 7000, p) for p in positions]))
    t.testInPandas(KEY, _frame(("first", 6999, 999)))
    out = t.setProcessingTime(7000)
    assert list(out["message_id"]) == ["first"] + [f"m{p}" for p in sorted(positions)]


def test_restart_keeps_pending_timers():
    t = _tester()
    t.testInPandas(KEY, _frame(("a", 1000, 1), ("b", 3000, 2)))
    assert _fired(t.setProcessingTime(1000)) == [("a", 1000)]
    # A restarted job: a new processor object over the same (checkpointed) state and timers.
    t.processor.close()
    t.processor = BucketTimerProcessor()
    t.processor.init(t.handle)
    assert _fired(t.setProcessingTime(2999)) == []
    assert _fired(t.setProcessingTime(3000)) == [("b", 3000)]


def test_random_schedule_fires_each_live_timer_once_never_early():
    rng = random.Random(42)
    t = _tester(grace_ms=1_000_000)
    live: dict[str, int] = {}
    cancelled: set[str] = set()
    fired: dict[str, int] = {}
    now = 0
    position = 0
    for _ in range(200):
        batch = []
        for _ in range(rng.randint(0, 5)):
            position += 1
            mid = f"m{position}"
            due = now + rng.randint(-50, 3000)
            live[mid] = due
            batch.append((mid, due, position))
        # Cancel some pending timer (the broker only cancels before due).
        candidates = [m for m, d in live.items() if d > now and m not in cancelled and m not in fired]
        if candidates and rng.random() < 0.3:
            victim = rng.choice(candidates)
            position += 1
            cancelled.add(victim)
            batch.append((victim, live[victim], position, True))
        # A few keys, chosen by message id as the (shard, bucket) grouping does: a tombstone meets its timer.
        for shard in range(3):
            rows = [e for e in batch if int(e[0][1:]) % 3 == shard]
            if rows:
                for mid, when in _fired(t.testInPandas((shard, 0), _frame(*rows))):
                    assert mid not in fired
                    fired[mid] = when
        now += rng.randint(1, 100)
        for mid, when in _fired(t.setProcessingTime(now)):
            assert mid not in fired
            fired[mid] = when
    now += 10_000
    for mid, when in _fired(t.setProcessingTime(now)):
        fired[mid] = when
    assert len(cancelled) > 20 and len(fired) > 300
    assert set(fired) == set(live) - cancelled
    for mid, when in fired.items():
        assert when >= live[mid]


def test_split_due_is_pure():
    entries = [("a", 5, 1, False), ("b", 10, 2, False), ("a", 5, 3, True), ("z", 1, 4, True)]
    due, pending = split_due(entries, now_ms=10, grace_ms=5)
    assert due == [("b", 10, 2, False)]
    assert pending == []  # "a" cancelled, the orphan "z" past its grace


def test_a_tombstone_cancels_only_the_timers_recorded_before_it():
    """Cancel, then send again under the same id and due time: the three records share a key and
    often a micro-batch. The tombstone used to cancel the new timer too; the broker's backstop
    then fired it a minute late."""
    entries = [("x", 5, 1, False), ("x", 5, 2, True), ("x", 5, 3, False)]
    due, pending = split_due(entries, now_ms=10, grace_ms=5)
    assert due == [("x", 5, 3, False)] and pending == []


def test_a_tombstone_cancels_only_the_timer_of_its_id_due_at_its_due_time():
    """An id reused after the dedupe window names two timers, due at 5 and 7 ms: both fall in one
    bucket (one state key). The tombstone of the one due at 7 used to drop both, and the other
    fired only by the broker's backstop, a minute late."""
    entries = [("x", 5, 1, False), ("x", 7, 2, False), ("x", 7, 3, True)]
    due, pending = split_due(entries, now_ms=10, grace_ms=5)
    assert due == [("x", 5, 1, False)] and pending == []
    due, pending = split_due(entries, now_ms=6, grace_ms=5)
    assert due == [("x", 5, 1, False)] and pending == []


def test_heartbeat_rows_are_ignored():
    t = _tester()
    out = t.testInPandas((-1, -1), _frame(("__chronoq_heartbeat", -1, -1)))
    assert out.empty and _held(t, (-1, -1)) == [] and list(t.handle.listTimers()) == []


def test_with_a_lead_each_timer_is_released_that_long_before_it_is_due_never_earlier():
    """The hand-off: with `lead_ms` the broker's horizon, a timer is released (handed to ArmTimers)
    as it enters the horizon, not at its due time, and leaves the job's state; a cancel before
    that keeps it from being handed over at all."""
    t = TwsTester(BucketTimerProcessor(tombstone_grace_ms=10_000, lead_ms=60_000), timeMode="ProcessingTime")
    t.testInPandas(KEY, _frame(("orders\x00a", 100_000, 1), ("orders\x00b", 130_000, 2),
                               ("orders\x00c", 130_000, 3)))
    assert list(t.handle.listTimers()) == [40_000]  # a's due time less the lead
    assert t.setProcessingTime(39_999).empty
    out = t.setProcessingTime(40_000)
    assert list(zip(out["message_id"], out["topic"], out["due_ms"], out["fired_ms"], strict=True)) == [
        ("a", "orders", 100_000, 40_000)]
    assert list(t.handle.listTimers()) == [70_000]
    t.testInPandas(KEY, _frame(("orders\x00c", 130_000, 4, True)))  # c cancelled while in the job's state
    # Already inside the horizon when it arrives: handed over by this very batch.
    out = t.testInPandas(KEY, _frame(("orders\x00d", 95_000, 5)))
    assert list(out["message_id"]) == ["d"] and list(out["fired_ms"]) == [40_000]
    out = t.setProcessingTime(70_000)
    assert list(out["message_id"]) == ["b"]
    assert _held(t) == [] and list(t.handle.listTimers()) == []


def test_with_a_release_step_a_key_wakes_once_a_step_and_hands_over_what_entered_the_horizon():
    """`step_ms`: the key's timer is rounded up to a multiple of the step, so a bucket holding
    many timers is read and rewritten once a step, not once a micro-batch. Each timer is still
    released at or after `due - lead` (never before it enters the horizon) and at most a step later."""
    t = TwsTester(BucketTimerProcessor(tombstone_grace_ms=10_000, lead_ms=60_000, step_ms=10_000),
                  timeMode="ProcessingTime")
    t.testInPandas(KEY, _frame(("q\x00a", 100_000, 1), ("q\x00b", 105_000, 2), ("q\x00c", 112_000, 3)))
    assert list(t.handle.listTimers()) == [40_000]  # a enters the horizon on a step
    assert list(t.setProcessingTime(40_000)["message_id"]) == ["a"]
    assert list(t.handle.listTimers()) == [50_000]  # b enters at 45,000: handed over at the next step
    assert t.setProcessingTime(49_999).empty
    out = t.setProcessingTime(50_000)
    assert list(out["message_id"]) == ["b"] and list(out["fired_ms"]) == [50_000]  # c enters at 52,000: not yet
    assert list(t.handle.listTimers()) == [60_000]
    out = t.setProcessingTime(60_000)
    assert list(out["message_id"]) == ["c"]
    for due, fired in zip(out["due_ms"], out["fired_ms"], strict=True):
        assert due - 60_000 <= fired <= due - 60_000 + 10_000
    assert _held(t) == [] and list(t.handle.listTimers()) == []


@pytest.mark.parametrize(("lead_ms", "step_ms"), [(60_000, 30_001), (0, 1), (60_000, -1)])
def test_a_release_step_past_half_the_lead_is_refused(lead_ms: int, step_ms: int):
    with pytest.raises(ValueError, match="release step"):
        BucketTimerProcessor(lead_ms=lead_ms, step_ms=step_ms)


def test_the_engine_buckets_and_steps_by_its_mode():
    from chronoq.spark.engine import ARM_BUCKET_MS, FIRE_BUCKET_MS, EngineOptions, bucket_ms_of, release_step_ms

    arm, fire = EngineOptions(server="", checkpoint="c"), EngineOptions(server="", checkpoint="c", mode="fire")
    assert (bucket_ms_of(arm), bucket_ms_of(fire)) == (ARM_BUCKET_MS, FIRE_BUCKET_MS)
    assert bucket_ms_of(EngineOptions(server="", checkpoint="c", bucket_ms=1_000)) == 1_000
    assert release_step_ms(arm, 300_000) == 60_000 and release_step_ms(arm, 60_000) == 12_000
    assert release_step_ms(fire, 0) == 0
    with pytest.raises(ValueError, match="release_step_ms 200000 must be from 0 to half"):
        release_step_ms(EngineOptions(server="", checkpoint="c", release_step_ms=200_000), 300_000)
    with pytest.raises(ValueError, match="bucket_ms 0 must be at least 1"):
        bucket_ms_of(EngineOptions(server="", checkpoint="c", bucket_ms=0))


def test_the_engine_triggers_by_its_mode_and_never_too_late_to_arm():
    from chronoq.spark.engine import ARM_TRIGGER_MS, FIRE_TRIGGER_MS, EngineOptions, release_step_ms, trigger_ms_of

    arm, fire = EngineOptions(server="", checkpoint="c"), EngineOptions(server="", checkpoint="c", mode="fire")
    assert trigger_ms_of(arm, 300_000) == ARM_TRIGGER_MS == 5_000
    assert trigger_ms_of(fire, 0) == FIRE_TRIGGER_MS == 200
    assert trigger_ms_of(arm, 0) == FIRE_TRIGGER_MS  # nothing to hand over ahead (no broker to ask)
    # A short horizon: a quarter of what the step leaves of it, so a timer is armed well before due.
    assert release_step_ms(arm, 10_000) == 2_000 and trigger_ms_of(arm, 10_000) == 2_000
    assert trigger_ms_of(arm, 1_000) == FIRE_TRIGGER_MS  # never below the firing interval
    given = EngineOptions(server="", checkpoint="c", trigger_ms=1_000)
    assert trigger_ms_of(given, 300_000) == 1_000
    with pytest.raises(ValueError, match=r"trigger_ms 120001 must be at most half .* \(60000 ms\) .* \(300000 ms\)"):
        trigger_ms_of(EngineOptions(server="", checkpoint="c", trigger_ms=120_001), 300_000)
    assert trigger_ms_of(EngineOptions(server="", checkpoint="c", trigger_ms=120_000), 300_000) == 120_000
    with pytest.raises(ValueError, match="trigger_ms 0 must be at least 1"):
        trigger_ms_of(EngineOptions(server="", checkpoint="c", trigger_ms=0, mode="fire"), 0)
