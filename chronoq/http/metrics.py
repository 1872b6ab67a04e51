"""Prometheus metrics: a collector that reads the broker when scraped.

Theory of operation: nothing here runs on the hot path. `BrokerCollector.collect()` is called by
`prometheus_client` when `GET /metrics` is served (on the broker's own event loop, so it reads a
consistent state without locks) and turns what the broker already keeps into metric families:

- `broker.stats()`, the dict the admin service's Stats method returns: pending timers by topic
  and by due time, the timer latencies, the commit log, the disk (and what a full disk or a lack
  of file descriptors holds back now), the delivery trace (recording, or stopped and why),
  consumer groups, the clock (how far broker time is from the wall clock, its re-bases), the
  recurring schedules (by state; their occurrences issued, late, skipped, withdrawn, refused);
- the per-topic counts the broker's doors keep in plain dicts (`Broker.accepted_by_topic`,
  `timers_by_topic`, `delivered_by_topic`), the delays timers asked for
  (`timer_delays_by_topic`), and the timer side's `fired_by_topic`;
- the timer records written and not yet indexed (`MessageStore.undispatched`), counted when scraped;
- the timer engine's in-memory latency histograms (`timer/metrics.py`), re-bucketed here into
  Prometheus's cumulative `le` buckets; the commit log's fsync durations (`FsyncTimes`); the
  schedules' issue lag (`Schedules.lateness`). A schedule's occurrence is an ordinary timer, so
  how late it was delivered is in `chronoq_timer_delivery_error_ms` with every other timer.

So a scrape costs the hot path nothing: the per-message work is the dict updates at the doors
(measured in docs/design.md, "Metrics and the web console"), and the collector's own work
(O(topics + groups x queues + histogram buckets)) runs only when Prometheus asks.

Names follow RocketMQ 5's exporter where it has one (`rocketmq_timer_*`, `rocketmq_timing_messages`,
with its labels `topic` and `timer_bound_s`); chronoq's own are `chronoq_*`, units last.
The registry is private to the server (`make_registry`), not prometheus_client's global one,
so two brokers in one process (tests) never share metrics.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from chronoq.store.commitlog import FSYNC_BUCKETS_S
from chronoq.timer.metrics import DUE_BUCKETS, MORE_BUCKET, OVERDUE_BUCKET, LatencyHistogram

if TYPE_CHECKING:
    from chronoq.broker import Broker  # the type only: the broker imports the store, the servers stay light

LATENCY_BUCKETS_MS: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000,
                                       60_000, 300_000, 3_600_000)
"""Upper edges (ms) of the `le` buckets the timer latency histograms are exported with."""


def make_registry(broker: Broker) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(broker))
    return registry


def held_back(disk: Mapping[str, Any]) -> Metric:
    """`chronoq_held_back{what,reason}` from the store's `disk_stats()`: one sample per piece of
    work a full disk (`held_back`) or a lack of file descriptors (`dispatch_out_of_fds`) holds
    back now, none while nothing is."""
    held = GaugeMetricFamily("chronoq_held_back",
                             "1 for each piece of work held back and retried, labelled with what "
                             "(dispatch, checkpoint, timer firing, ...) and why (disk_full, out_of_fds); "
                             "no sample while nothing is held back",
                             labels=["what", "reason"])
    for what in sorted(disk["held_back"]):
        held.add_metric([what, "disk_full"], 1)
    if disk["dispatch_out_of_fds"] is not None:
        held.add_metric(["dispatch", "out_of_fds"], 1)
    return held


def histogram_buckets(hist: LatencyHistogram, edges: Iterable[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs of `hist` at `edges` plus +Inf. Each of the histogram's own
    buckets is counted under the first edge >= its upper bound: exact below 256 ms (one bucket
    per ms), and above that a bucket is at most 1/128 of its value wide, so a value just under
    an edge may be counted under the next one."""
    edge_list = list(edges)
    counts = [0] * (len(edge_list) + 1)
    for key, n in hist.buckets():
        high = hist.bucket_high(key)
        index = next((i for i, edge in enumerate(edge_list) if high <= edge), len(edge_list))
        counts[index] += n
    out = []
    for edge, total in zip(edge_list, itertools.accumulate(counts), strict=False):
        out.append((str(edge), float(total)))
    out.append(("+Inf", float(sum(counts))))
    return out


class BrokerCollector(Collector):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        broker = self.broker
        stats = broker.stats()
        timer: Mapping[str, Any] = stats["timer"]
        yield from self._timer_gauges(timer)
        yield from self._counters()
        latencies = broker.timer_latencies()
        for name, hist, doc in (
            ("chronoq_timer_delivery_error_ms", latencies.delivery_error_ms,
             "Fired minus due per fired timer, ms (from max(due, accepted); < 0 would be early)"),
            ("chronoq_timer_enqueue_lag_ms", latencies.enqueue_lag_ms,
             "From accepted to indexed per timer, ms"),
            ("chronoq_timer_fire_lag_ms", latencies.fire_lag_ms,
             "From due to handed to the firing loop per timer, ms"),
        ):
            family = HistogramMetricFamily(name, doc)
            family.add_metric([], histogram_buckets(hist, LATENCY_BUCKETS_MS), sum_value=float(hist.sum))
            yield family
        yield from self._commitlog(stats)
        yield from self._schedules(stats["schedules"])
        yield from self._groups(stats["groups"])
        yield from self._clock(stats["clock"])

    def _timer_gauges(self, timer: Mapping[str, Any]) -> Iterator[Metric]:
        # Every topic the broker knows reads its count, 0 included: a series that vanished at 0
        # would leave a graph at its last value and `sum()` with nothing to add up.
        by_topic: dict[str, int] = {t.name: 0 for t in self.broker.list_topics()}
        by_topic.update(timer["pending_by_topic"])
        for name, doc in (("rocketmq_timing_messages", "Timer messages pending, per topic (RocketMQ's name)"),
                          ("chronoq_timer_pending", "Timer messages pending, per topic")):
            gauge = GaugeMetricFamily(name, doc, labels=["topic"])
            for topic, n in sorted(by_topic.items()):
                gauge.add_metric([topic], n)
            yield gauge
        snapshot = GaugeMetricFamily(
            "rocketmq_timer_message_snapshot",
            "Pending timers by due time: the bucket up to timer_bound_s seconds from now (overdue ones in 5; "
            "beyond 24 h under +Inf)", labels=["timer_bound_s"])
        due: Mapping[str, int] = timer["pending_by_due"]
        for i, (bucket, bound_s) in enumerate(DUE_BUCKETS):
            snapshot.add_metric([str(bound_s)], due.get(bucket, 0) + (due.get(OVERDUE_BUCKET, 0) if i == 0 else 0))
        snapshot.add_metric(["+Inf"], due.get(MORE_BUCKET, 0))
        yield snapshot
        yield GaugeMetricFamily("rocketmq_timer_dequeue_latency",
                                "How far the firing loop is behind now: now minus the earliest pending due time "
                                "when that has passed, else 0 (ms)", value=timer["oldest_overdue_ms"])
        yield GaugeMetricFamily("rocketmq_timer_dequeue_lag", "Timers due before this second, not yet fired",
                                value=due.get(OVERDUE_BUCKET, 0))
        enqueue = timer["latencies"]["enqueue_lag_ms"]
        yield GaugeMetricFamily("rocketmq_timer_enqueue_latency",
                                "P99 of accepted-to-indexed per timer since start (ms; chronoq indexes a timer "
                                "before acknowledging it)", value=enqueue.get("p99") or 0)
        yield GaugeMetricFamily("chronoq_timer_pending_all_topics", "Timer messages pending, all topics",
                                value=timer["pending_total"])
        # The same gauge under its former name, which a Prometheus reader takes for a counter
        # (`_total`); kept one more release so dashboards and alerts can move.
        yield GaugeMetricFamily("chronoq_timer_pending_total",
                                "Deprecated: chronoq_timer_pending_all_topics (a gauge, not a counter)",
                                value=timer["pending_total"])
        yield GaugeMetricFamily("rocketmq_timer_enqueue_lag",
                                "Timer messages written to the log and not yet in the time index (waiting for "
                                "their group commit; chronoq acknowledges a timer only once indexed)",
                                value=self.broker.timers_undispatched())
        delays = HistogramMetricFamily("rocketmq_delay_message_latency",
                                       "Delay asked for by each accepted timer message, per topic: due minus "
                                       "accepted, seconds (0 when already due)", labels=["topic"])
        for topic, hist in sorted(self.broker.timer_delays_by_topic.items()):
            cumulative = list(itertools.accumulate(hist.counts))
            buckets = [(f"{edge_ms // 1000}", float(n)) for edge_ms, n in zip(hist.edges_ms, cumulative, strict=False)]
            delays.add_metric([topic], [*buckets, ("+Inf", float(cumulative[-1]))], sum_value=hist.sum_ms / 1000)
        yield delays

    def _counters(self) -> Iterator[Metric]:
        broker = self.broker
        for name, doc, counts in (
            ("chronoq_messages_accepted", "Messages acknowledged to producers (duplicates not counted), per topic",
             broker.accepted_by_topic),
            ("chronoq_messages_delivered", "Messages handed to consumers (redeliveries counted), per topic",
             broker.delivered_by_topic),
            ("rocketmq_timer_enqueue", "Timer messages accepted into the time index, per topic",
             broker.timers_by_topic),
            ("rocketmq_timer_dequeue", "Timer messages fired (copied to their topic), per topic",
             broker.fired_by_topic),
        ):
            counter = CounterMetricFamily(name, doc, labels=["topic"])
            for topic, n in sorted(counts.items()):
                counter.add_metric([topic], n)
            yield counter

    def _commitlog(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        log = stats["commitlog"]
        yield GaugeMetricFamily("chronoq_commitlog_bytes", "Bytes of commit log kept (end minus start position)",
                                value=log["end_position"] - log["start_position"])
        yield GaugeMetricFamily("chronoq_commitlog_segments", "Commit-log segment files", value=log["segments"])
        yield GaugeMetricFamily("chronoq_commitlog_damaged_ranges", "Quarantined stretches of the commit log",
                                value=log["damaged_ranges"])
        times = self.broker.fsync_seconds()
        fsync = HistogramMetricFamily("chronoq_commitlog_fsync_latency_seconds",
                                      "Group-commit fsync durations (one per group commit)")
        cumulative = list(itertools.accumulate(times.counts))
        buckets = [(str(edge), float(n)) for edge, n in zip(FSYNC_BUCKETS_S, cumulative, strict=False)]
        fsync.add_metric([], [*buckets, ("+Inf", float(cumulative[-1]))], sum_value=times.sum_s)
        yield fsync
        disk = stats["disk"]
        yield GaugeMetricFamily("chronoq_disk_free_bytes", "Free space on the data directory's file system",
                                value=disk["free_bytes"])
        yield held_back(disk)
        yield GaugeMetricFamily("chronoq_ready", "1 while the broker accepts work (see /healthz), else 0",
                                value=0 if self.broker.fatal is not None or self.broker.closed else 1)
        yield from self._trace(stats["trace"])

    @staticmethod
    def _trace(trace: Mapping[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("chronoq_trace_enabled", "1 when the delivery trace is configured (trace_enable)",
                                value=1 if trace["enabled"] else 0)
        yield GaugeMetricFamily("chronoq_trace_active", "1 while the delivery trace is recording, else 0",
                                value=1 if trace["active"] else 0)
        stopped = GaugeMetricFamily("chronoq_trace_stopped",
                                    "1 once the delivery trace stopped for this run, labelled with why "
                                    "(disk_full, unknown_version, error); no sample while it records",
                                    labels=["reason"])
        if trace["stopped_reason"] is not None:
            stopped.add_metric([trace["stopped_reason"]], 1)
        yield stopped

    def _schedules(self, schedules: Mapping[str, Any]) -> Iterator[Metric]:
        """Recurring schedules (`chronoq/recurring/`): how many in each state, what became of
        their occurrences since start, and how long after an occurrence's due time the next one
        was issued. An occurrence is a timer: how late it was delivered is counted in
        `chronoq_timer_delivery_error_ms` with every other timer."""
        states = GaugeMetricFamily("chronoq_schedules",
                                   "Recurring schedules by state: active (occurrences to come), paused, finished "
                                   "(end passed or limit reached; kept until deleted); sum() is every schedule",
                                   labels=["state"])
        for state in ("active", "paused", "finished"):
            states.add_metric([state], schedules[state])
        yield states
        for key, name, doc in (
            ("issued", "chronoq_schedule_occurrences_issued",
             "Schedule occurrences issued as timer messages since start (a repeat after a crash not counted)"),
            ("late", "chronoq_schedule_occurrences_late",
             "Occurrences issued after their due time, so delivered at once: catch-up after an outage or a pause"),
            ("skipped", "chronoq_schedule_occurrences_skipped",
             "Occurrences missed (the broker down, the schedule paused) that the catch-up policy did not deliver"),
            ("withdrawn", "chronoq_schedule_occurrences_withdrawn",
             "Issued occurrences cancelled before they fired: by an update, pause or delete, or at start-up"),
            ("failed", "chronoq_schedule_issue_failures",
             "Occurrence sends the broker refused (topic gone, disk full); each is retried"),
        ):
            yield CounterMetricFamily(name, doc, value=schedules[key])
        lag = self.broker.schedules.lateness
        family = HistogramMetricFamily("chronoq_schedule_issue_lag_ms",
                                       "Per issue of a schedule's next occurrence, ms from when it was planned (in "
                                       "the first half of the gap after the last one's due time) to the step that "
                                       "made it")
        cumulative = list(itertools.accumulate(lag.counts))
        buckets = [(str(edge), float(n)) for edge, n in zip(lag.edges_ms, cumulative, strict=False)]
        family.add_metric([], [*buckets, ("+Inf", float(cumulative[-1]))], sum_value=float(lag.sum_ms))
        yield family

    @staticmethod
    def _clock(clock: Mapping[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("chronoq_clock_behind_wall_ms",
                                "Wall clock minus broker time, ms: > 0 behind after a step forward, < 0 ahead "
                                "(paused) after a step back", value=clock["behind_wall_ms"])
        yield CounterMetricFamily("chronoq_clock_rebases",
                                  "Re-bases of broker time to the wall clock (a step back of more than "
                                  "clock_max_backward_step_ms) since start", value=clock["rebases"])
        yield GaugeMetricFamily("chronoq_clock_last_rebase_ms",
                                "How far the last re-base moved broker time back, ms (0: none since start)",
                                value=clock["last_rebase_ms"] or 0)

    def _groups(self, groups: list[Mapping[str, Any]]) -> Iterator[Metric]:
        lag = GaugeMetricFamily("chronoq_consumer_lag", "Messages not yet handed out to the consumer group",
                                labels=["group", "topic"])
        inflight = GaugeMetricFamily("chronoq_consumer_inflight", "Messages handed out and not yet acked",
                                     labels=["group", "topic"])
        for g in groups:
            lag.add_metric([g["group"], g["topic"]], g["lag"])
            inflight.add_metric([g["group"], g["topic"]], g["inflight"])
        yield lag
        yield inflight
