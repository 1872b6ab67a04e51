"""Latency histograms and pending-by-due buckets, checked against exact computations."""

from __future__ import annotations

import math
import random

import pytest

from chronoq.timer.metrics import (
    DUE_BUCKETS,
    MORE_BUCKET,
    OVERDUE_BUCKET,
    LatencyHistogram,
    TimerLatencies,
    TimerMetricsSnapshot,
    pending_by_due,
)


def exact_percentile(values: list[int], p: float) -> int:
    """Nearest rank: the smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def close_enough(got: int, want: int) -> bool:
    return abs(got - want) <= max(1, abs(want) // 200)  # 0.5%, or 1 ms near zero


def test_small_values_are_exact() -> None:
    hist = LatencyHistogram()
    for v in [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233]:
        hist.record(v)
    assert (hist.count, hist.min, hist.max) == (14, 0, 233)
    assert hist.percentile(50) == 8
    assert hist.percentile(100) == 233
    assert hist.percentile(0.1) == 0
    assert hist.mean == pytest.approx(sum([0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233]) / 14)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_percentiles_on_random_data_are_within_half_a_percent(seed: int) -> None:
    rng = random.Random(seed)
    values = [int(rng.lognormvariate(3, 2.5)) - (rng.randrange(0, 50) if rng.random() < 0.05 else 0)
              for _ in range(20_000)]
    values += [rng.randrange(-10**9, 10**9) for _ in range(200)]
    hist = LatencyHistogram()
    for v in values:
        hist.record(v)
    for p in (0.1, 1, 10, 25, 50, 75, 90, 99, 99.9, 99.99, 100):
        got, want = hist.percentile(p), exact_percentile(values, p)
        assert close_enough(got, want), (p, got, want)
    assert (hist.min, hist.max, hist.count) == (min(values), max(values), len(values))
    assert hist.mean == pytest.approx(sum(values) / len(values))


def test_record_many_matches_record() -> None:
    rng = random.Random(5)
    values = [rng.randrange(-100_000, 10_000_000) for _ in range(5_000)]
    # and runs of equal values, as a fire step's lags come (counted once per distinct value)
    values += [rng.choice((0, 7, 7, 300, 300, 300, -2, 5_000_000)) for _ in range(3_000)]
    rng.shuffle(values)
    one, many = LatencyHistogram(), LatencyHistogram()
    for v in values:
        one.record(v)
    many.record_many(values[:2_500])
    many.record_many(values[2_500:])
    many.record_many([])
    assert one.to_dict() == many.to_dict()
    assert one._buckets == many._buckets


def test_merge_adds_counts_and_keeps_extremes() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.record_many([5, 10, 15])
    b.record_many([-3, 400_000])
    a.merge(b)
    a.merge(LatencyHistogram())
    assert (a.count, a.min, a.max) == (5, -3, 400_000)
    assert a.percentile(100) == 400_000
    assert a.percentile(1) == -3


def test_negative_values_report_early_deliveries() -> None:
    hist = LatencyHistogram()
    hist.record_many([-1_000_000, -5, 0, 5])
    assert hist.percentile(25) == -1_000_000
    assert hist.percentile(50) == -5
    assert hist.min == -1_000_000


def test_floats_round_to_whole_milliseconds_and_counts_weight() -> None:
    hist = LatencyHistogram()
    hist.record(2.6)
    hist.record(7, count=3)
    hist.record(9, count=0)
    assert (hist.count, hist.min, hist.max) == (4, 3, 7)


def test_empty_histogram_and_bad_percentile() -> None:
    hist = LatencyHistogram()
    assert hist.percentile(50) is None
    assert hist.to_dict() == {"count": 0, "min": None, "max": None, "mean": None,
                              "p50": None, "p90": None, "p99": None, "p999": None}
    for p in (0, -1, 100.5):
        with pytest.raises(ValueError):
            hist.percentile(p)


def test_bucket_count_stays_small_for_huge_ranges() -> None:
    hist = LatencyHistogram()
    hist.record_many(list(range(0, 10**12, 10**7)))
    assert len(hist._buckets) < 128 * 40


def test_pending_by_due_against_a_brute_force_split() -> None:
    rng = random.Random(9)
    now_ms = 1_700_000_000_123
    due_ms = [now_ms + rng.randrange(-3_600_000, 3 * 86_400_000) for _ in range(5_000)]
    slots = [d // 1000 for d in due_ms]

    def count_before_s(s: int) -> int:
        return sum(1 for slot in slots if slot < s)

    got = pending_by_due(now_ms, len(due_ms), count_before_s)
    now_s = now_ms // 1000
    want = {OVERDUE_BUCKET: 0, **{name: 0 for name, _ in DUE_BUCKETS}, MORE_BUCKET: 0}
    for slot in slots:
        if slot < now_s:
            want[OVERDUE_BUCKET] += 1
        else:
            want[next((name for name, edge in DUE_BUCKETS if slot - now_s < edge), MORE_BUCKET)] += 1
    assert got == want
    assert list(got) == [OVERDUE_BUCKET, "5s", "1m", "5m", "15m", "1h", "4h", "8h", "24h", MORE_BUCKET]
    assert sum(got.values()) == len(due_ms)


def test_snapshot_to_dict_is_plain_data() -> None:
    latencies = TimerLatencies()
    latencies.delivery_error_ms.record(4)
    snapshot = TimerMetricsSnapshot(
        now_ms=1, pending_total=2, pending_by_topic={"a": 2}, pending_by_due={"overdue": 2},
        next_deadline_ms=0, oldest_overdue_ms=1, indexed_position=9, latencies=latencies.summaries())
    data = snapshot.to_dict()
    assert data["latencies"]["delivery_error_ms"]["p50"] == 4
    assert data["latencies"]["fire_lag_ms"]["count"] == 0
    assert data["pending_by_topic"] == {"a": 2}
