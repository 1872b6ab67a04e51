"""Timer metrics: latency histograms and the snapshot an engine reports.

Theory of operation: `LatencyHistogram` is a log-linear histogram (HDR-style) over whole
milliseconds. Magnitudes below 256 ms get a bucket each; above that every power of two is split
into 128 equal sub-buckets, so a bucket is never wider than 1/128 of its lower edge and the
value reported for a percentile (the bucket's midpoint, clamped to the observed min and max) is
within 0.4% of the true one. Negative values (a timer delivered *early*, which must never
happen and so must be visible if it does) mirror the positive buckets. Memory is a dict of
non-empty buckets: a few thousand at most for values up to years.

`TimerMetricsSnapshot` is what `TimerEngine.metrics(now_ms)` returns. Its pending-by-due-time
buckets come from per-second slot counters through `pending_by_due`, which asks its caller only
for "how many pending are due before second s"; an engine answers that from counters it keeps
durable, never by scanning its (possibly millions of) pending entries.

Nothing here reads the clock or does I/O; histograms live in memory and restart empty.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_SUB_BUCKET_BITS = 7
_SUB_BUCKETS = 1 << _SUB_BUCKET_BITS  # 128 sub-buckets per power of two: width <= 1/128 of value


def _bucket_of(magnitude: int) -> int:
    """Bucket index of a non-negative integer; monotone in `magnitude`."""
    if magnitude < 2 * _SUB_BUCKETS:
        return magnitude
    shift = magnitude.bit_length() - 1 - _SUB_BUCKET_BITS
    return _SUB_BUCKETS * shift + (magnitude >> shift)


def _bucket_bounds(index: int) -> tuple[int, int]:
    """Inclusive [low, high] magnitudes of a bucket index."""
    if index < 2 * _SUB_BUCKETS:
        return index, index
    shift = index // _SUB_BUCKETS - 1
    sub = index - _SUB_BUCKETS * shift
    return sub << shift, ((sub + 1) << shift) - 1


class LatencyHistogram:
    """Counts of millisecond values (negative allowed) in log-linear buckets."""

    __slots__ = ("_buckets", "_count", "_max", "_min", "_sum")

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}
        self._count = 0
        self._sum = 0
        self._min = 0
        self._max = 0

    def record(self, value_ms: int | float, count: int = 1) -> None:
        """Add `count` observations of `value_ms` (floats are rounded to whole ms)."""
        if count <= 0:
            return
        value = value_ms if isinstance(value_ms, int) else round(value_ms)
        # Signed key: positives keep their bucket index; negatives map below zero so that
        # sorting keys sorts values (bigger magnitude -> more negative key).
        key = _bucket_of(value) if value >= 0 else -_bucket_of(-value) - 1
        self._buckets[key] = self._buckets.get(key, 0) + count
        if self._count == 0:
            self._min = self._max = value
        else:
            self._min = min(self._min, value)
            self._max = max(self._max, value)
        self._count += count
        self._sum += value * count

    def record_many(self, values_ms: Sequence[int]) -> None:
        """Add whole-millisecond observations in one pass (the engines record a batch at a
        time; this is several times cheaper than `record` per value). Equal values are counted
        first, in C: a batch's values are mostly a few (a fire step's timers fell due together
        and fire together), so the bucket is found per distinct value, not per observation."""
        if not values_ms:
            return
        buckets = self._buckets
        small = 2 * _SUB_BUCKETS
        for value, n in Counter(values_ms).items():
            if 0 <= value < small:
                key = value
            elif value >= 0:
                shift = value.bit_length() - 1 - _SUB_BUCKET_BITS
                key = _SUB_BUCKETS * shift + (value >> shift)
            else:
                key = -_bucket_of(-value) - 1
            buckets[key] = buckets.get(key, 0) + n
        low, high = min(values_ms), max(values_ms)
        if self._count == 0:
            self._min, self._max = low, high
        else:
            self._min = min(self._min, low)
            self._max = max(self._max, high)
        self._count += len(values_ms)
        self._sum += sum(values_ms)

    def merge(self, other: LatencyHistogram) -> None:
        if other._count == 0:
            return
        for key, n in other._buckets.items():
            self._buckets[key] = self._buckets.get(key, 0) + n
        if self._count == 0:
            self._min, self._max = other._min, other._max
        else:
            self._min = min(self._min, other._min)
            self._max = max(self._max, other._max)
        self._count += other._count
        self._sum += other._sum

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> int:
        return self._sum

    def buckets(self) -> list[tuple[int, int]]:
        """(bucket key, count) of the non-empty buckets, for exporters (`bucket_high`)."""
        return list(self._buckets.items())

    @staticmethod
    def bucket_high(key: int) -> int:
        """The largest value a bucket key holds (for negative keys, the one nearest zero)."""
        if key >= 0:
            return _bucket_bounds(key)[1]
        return -_bucket_bounds(-key - 1)[0]

    @property
    def min(self) -> int | None:
        return self._min if self._count else None

    @property
    def max(self) -> int | None:
        return self._max if self._count else None

    @property
    def mean(self) -> float | None:
        return self._sum / self._count if self._count else None

    def percentile(self, p: float) -> int | None:
        """The nearest-rank p-th percentile (0 < p <= 100), to within 0.4% (or 1 ms); None if
        empty. Nearest rank: the smallest recorded value with at least p% of values <= it."""
        if not 0 < p <= 100:
            raise ValueError(f"percentile must be in (0, 100], not {p}")
        if self._count == 0:
            return None
        rank = max(1, math.ceil(p / 100 * self._count))
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen >= rank:
                return self._representative(key)
        return self._max  # unreachable: the counts add up to _count

    def _representative(self, key: int) -> int:
        if key >= 0:
            low, high = _bucket_bounds(key)
        else:
            neg_low, neg_high = _bucket_bounds(-key - 1)
            low, high = -neg_high, -neg_low
        # Midpoint keeps the error symmetric; clamping makes p100 exactly the max and keeps a
        # single-valued histogram exact.
        return min(max((low + high) // 2, self._min), self._max)

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self._count,
            "min": self.min,
            "max": self.max,
            "mean": round(self.mean, 3) if self.mean is not None else None,
            "p50": self.percentile(50) if self._count else None,
            "p90": self.percentile(90) if self._count else None,
            "p99": self.percentile(99) if self._count else None,
            "p999": self.percentile(99.9) if self._count else None,
        }


# Pending-by-due-time buckets: (name, upper edge in seconds from now). "overdue" holds timers
# whose second has already begun before now's second; "more" everything beyond 24 h. Edges are
# whole seconds because the counters behind them are per-second slots.
DUE_BUCKETS: tuple[tuple[str, int], ...] = (
    ("5s", 5), ("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600),
    ("4h", 4 * 3600), ("8h", 8 * 3600), ("24h", 24 * 3600),
)
OVERDUE_BUCKET = "overdue"
MORE_BUCKET = "more"


class DelayHistogram:
    """Counts of timer delays (ms) under fixed upper edges, exact at the edges: a delay of exactly
    one hour, a common request, counts under the one-hour edge (`LatencyHistogram`'s 1/128-wide
    buckets would put it under the next). One bisect per accepted timer."""

    __slots__ = ("counts", "edges_ms", "sum_ms")

    def __init__(self, edges_ms: Sequence[int]) -> None:
        self.edges_ms = tuple(edges_ms)
        self.counts = [0] * (len(self.edges_ms) + 1)
        """counts[i]: delays in (edges_ms[i-1], edges_ms[i]]; the last: above every edge."""
        self.sum_ms = 0

    def record(self, delay_ms: int) -> None:
        self.counts[bisect.bisect_left(self.edges_ms, delay_ms)] += 1
        self.sum_ms += delay_ms


DELAY_EDGES_MS: tuple[int, ...] = tuple(s * 1000 for s in (
    1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200, 21_600, 43_200, 86_400, 259_200, 604_800, 2_592_000))
"""Edges of the timer delay histogram (RocketMQ's `rocketmq_delay_message_latency`): 1 s to 30 days."""


def pending_by_due(now_ms: int, total: int, count_before_s: Callable[[int], int]) -> dict[str, int]:
    """Split `total` pending timers by due time relative to `now_ms`.

    `count_before_s(s)` must return how many pending timers are due in seconds < s. Bucket
    "5s" holds slots now_s .. now_s+4, "1m" slots now_s+5 .. now_s+59, and so on; the counts
    always add up to `total`.
    """
    now_s = now_ms // 1000
    out: dict[str, int] = {}
    previous = count_before_s(now_s)
    out[OVERDUE_BUCKET] = previous
    for name, edge_s in DUE_BUCKETS:
        upto = count_before_s(now_s + edge_s)
        out[name] = upto - previous
        previous = upto
    out[MORE_BUCKET] = total - previous
    return out


@dataclass
class TimerLatencies:
    """The three histograms every engine keeps (in memory; they restart empty)."""

    delivery_error_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    """fired_ms - max(deliver_at_ms, accepted_ms) per fired timer: lateness as consumers see it
    (< 0 = early). A timer whose due time had passed when it was accepted (RocketMQ delivers it
    at once) counts from its acceptance: it cannot be late by more than the time since then."""
    enqueue_lag_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    """applied_ms - accepted_ms per live add: from durable in the log to visible in the index."""
    fire_lag_ms: LatencyHistogram = field(default_factory=LatencyHistogram)
    """now_ms - max(deliver_at_ms, accepted_ms) when `due()` first hands a timer to the broker:
    the engine's own share of the delivery error, before the link record that fires it is written."""

    def summaries(self) -> dict[str, dict[str, Any]]:
        return {
            "delivery_error_ms": self.delivery_error_ms.to_dict(),
            "enqueue_lag_ms": self.enqueue_lag_ms.to_dict(),
            "fire_lag_ms": self.fire_lag_ms.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class TimerMetricsSnapshot:
    now_ms: int
    pending_total: int
    pending_by_topic: Mapping[str, int]
    pending_by_due: Mapping[str, int]
    """Keys: "overdue", then each of `DUE_BUCKETS`, then "more"; values add up to pending_total."""
    next_deadline_ms: int | None
    oldest_overdue_ms: int
    """now_ms - the earliest pending due time when that is in the past, else 0: how far the
    firing loop is behind right now."""
    indexed_position: int
    latencies: Mapping[str, Mapping[str, Any]]
    """`TimerLatencies.summaries()`: delivery_error_ms, enqueue_lag_ms, fire_lag_ms."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "now_ms": self.now_ms,
            "pending_total": self.pending_total,
            "pending_by_topic": dict(self.pending_by_topic),
            "pending_by_due": dict(self.pending_by_due),
            "next_deadline_ms": self.next_deadline_ms,
            "oldest_overdue_ms": self.oldest_overdue_ms,
            "indexed_position": self.indexed_position,
            "latencies": {name: dict(summary) for name, summary in self.latencies.items()},
        }
