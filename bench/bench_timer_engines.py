"""The two durable timer engines side by side: the RocksDB index and the file wheel (RIP-43).

What it does: runs the same workloads on `RocksTimerIndex` (`timer/index.py`, the default) and on
`WheelTimerEngine` (`timer/wheel.py`, RocketMQ 5's TimerLog + TimerWheel), each engine and each
workload in a fresh child process (this file run with `--child`), so one engine's memory never
counts against the other's, and reports them side by side with the wheel / RocksDB ratio. Only
engine calls are timed (building the synthetic entries is not). Each engine is opened with the
broker's settings (`Config()`'s block cache and write buffer; the wheel's slot width and slot
count) and the broker's collector settings (`server/serve.settle_heap`), and fires as the
broker's fire step does: `due_timers(now, timer_fire_batch)`, then one `apply` with the fired
marks, one link-record copy and link floor per `timer_links_per_record` timers.

The workloads (`--scenarios`, all by default):
- `pending`: N timers (`--n`, 1,000,000) added in batches of `--batch` (500), due uniform over
  [1 s, 2 h] with one key each: the generator of `bench_timer_index.py`, so the RocksDB figures
  stay comparable with it. Adds/s and CPU µs an add; RSS growth a pending timer (RSS after the
  adds less RSS of the open empty engine); bytes on disk a pending timer after close; close and
  reopen with N pending (until `open` returns and metrics count all N); then every timer fired.
  Also the objects Python's cyclic collector tracks with N pending, and what one full collection
  of them costs (a pause of the broker's one event loop).
- `burst`: 100,000 timers (`--burst-n`) due in the same millisecond. From that millisecond on,
  fire steps run back to back; each timer's lateness is when the `apply` that marked it fired
  returned, less its due time. All fired after how long, and how many within 1 s.
- `second`: 500,000 (`--second-n`) due uniformly over one second. The clock is honest: every
  `due` is asked at start + wall time elapsed, so an engine slower than the arrival rate falls
  behind and its lateness shows it; while nothing is due the loop sleeps until
  `next_deadline_ms()`, as the broker's does. How many fired within 1 s and 2 s of their due
  time, and the lateness percentiles.
- `spread`: N timers (`--spread-n`, default `--n`) due uniform over [1 s, 30 days] (the broker's
  `timer_max_delay_ms`). Adds/s; then the clock jumps through the 30 days in steps of
  `--spread-step-s` (600 s), each step firing what is due: CPU per step (mean, max: the wheel
  links again, at the end of its 7-day window, the timers it chained there with ROLL), and the
  cost of a `due` that finds nothing.
- `steady`: `--steady-rate` (5,000) timers a second for 10 s, due 5-30 s later (the shape of
  `python -m bench`'s precision phase), added and fired as the clock runs, a step every 5 ms:
  the engine's fire lag (its own histogram), its slowest add, due and fire calls in CPU ms, and
  the longest collector pauses (each holds the broker's one event loop).

Rates are per wall second and per CPU second of the calling thread (RocksDB's background
flushes and compactions run on threads of their own and are not in the CPU figures): on a shared
host the CPU figures are the ones to compare. Results go to `timer_engines.json` under
`bench.results_dir()` (or `--out`), and a table.

    python -m bench timer-engines                       # both engines, every workload, N = 1,000,000
    python -m bench timer-engines --n 200000 --scenarios pending,burst
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import results_dir
from bench.bench_timer_index import RECORD_BYTES, T0_MS, make_batch, percentile, reference_us
from chronoq.config import Config
from chronoq.timer.engine import IndexBatch, TimerEngine, TimerEntry

ENGINES = ("rocksdb", "wheel")
SCENARIOS = ("pending", "burst", "second", "spread", "steady")
DAY_MS = 86_400_000
LINK_BYTES = 30
"""About what one link costs in a link record's body (128 links: ~3.9 KB)."""


# -- the engines, as the broker opens them -----------------------------------------------------

def open_engine(name: str, path: Path) -> TimerEngine:
    config = Config()
    if name == "rocksdb":
        from chronoq.timer.index import RocksTimerIndex

        return RocksTimerIndex.open(path, block_cache_bytes=config.timer_index_block_cache_bytes,
                                    write_buffer_bytes=config.timer_index_write_buffer_bytes)
    from chronoq.timer.wheel import WheelTimerEngine

    return WheelTimerEngine.open(path, slot_ms=config.timer_wheel_slot_ms, slots=config.timer_wheel_slots)


class Log:
    """The log positions a run hands out: timer records, then link records, in order."""

    def __init__(self) -> None:
        self.end = 0

    def take(self, count: int) -> int:
        first = self.end
        self.end += count * RECORD_BYTES
        return first


def fire_batch(log: Log, positions: tuple[int, ...] | list[int], now_ms: int) -> IndexBatch:
    """The batch a broker fire step applies: a link record per `timer_links_per_record` timers,
    each firing its timers, with its floor and a copy of its body."""
    per_record = Config().timer_links_per_record
    fired: list[tuple[int, int]] = []
    floors: list[tuple[int, int]] = []
    copies: list[tuple[int, int, bytes]] = []
    for i in range(0, len(positions), per_record):
        chunk = positions[i:i + per_record]
        record = log.take(1)
        fired.extend((p, now_ms) for p in chunk)
        floors.append((0, min(chunk)))
        copies.append((record, now_ms, bytes(LINK_BYTES * len(chunk))))
    return IndexBatch(fired=fired, link_floors=floors, link_copies=copies, indexed_position=log.end)


def add_all(engine: TimerEngine, log: Log, entries_of: Callable[[int, int], list[TimerEntry]], n: int,
            batch: int) -> dict[str, float]:
    """Apply n timers in batches; time only the applies."""
    apply_s: list[float] = []
    cpu_s = 0.0
    for first in range(0, n, batch):
        count = min(batch, n - first)
        entries = entries_of(log.take(count) // RECORD_BYTES, count)
        started, started_cpu = time.perf_counter(), time.thread_time()
        engine.apply(IndexBatch(adds=entries, indexed_position=log.end))
        apply_s.append(time.perf_counter() - started)
        cpu_s += time.thread_time() - started_cpu
    return {"adds_per_s": n / sum(apply_s), "add_cpu_us": cpu_s / n * 1e6,
            "add_batch_ms_p50": statistics.median(apply_s) * 1000, "add_batch_ms_p99": percentile(apply_s, 99) * 1000}


def entries_at(rng: random.Random, due_of: Callable[[], int],
               accepted_ms: int) -> Callable[[int, int], list[TimerEntry]]:
    def make(first: int, count: int) -> list[TimerEntry]:
        return [TimerEntry(deliver_at_ms=due_of(), position=i * RECORD_BYTES, size=RECORD_BYTES,
                           message_id=f"01{0x5EED:04X}{rng.getrandbits(48):012X}{i:016X}", topic=f"topic-{i % 16}",
                           accepted_ms=accepted_ms, keys=(f"order-{i}",)) for i in range(first, first + count)]
    return make


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fire_step(engine: TimerEngine, log: Log, now_ms: int, limit: int) -> tuple[int, float, float]:
    """One broker fire step at `now_ms`: (fired, seconds in due_timers, seconds in apply)."""
    started = time.perf_counter()
    due = engine.due_timers(now_ms, limit)
    middle = time.perf_counter()
    if due.rows:
        engine.apply(fire_batch(log, due.positions, now_ms))
    return len(due), middle - started, time.perf_counter() - middle


# -- the workloads (each in a child process of its own) ----------------------------------------

def scenario_pending(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    proc = psutil.Process()
    fire_limit = Config().timer_fire_batch
    engine = open_engine(name, path)
    out: dict[str, Any] = {"n": args.n, "rss_empty_mb": proc.memory_info().rss / 2**20}
    log = Log()
    rng = random.Random(42)

    def generator(first: int, count: int) -> list[TimerEntry]:
        return make_batch(rng, first, count, True)

    out.update(add_all(engine, log, generator, args.n, args.batch))
    out["rss_after_adds_mb"] = proc.memory_info().rss / 2**20
    out["rss_per_timer_b"] = (out["rss_after_adds_mb"] - out["rss_empty_mb"]) * 2**20 / args.n
    out["gc_tracked_objects"] = len(gc.get_objects())
    started = time.perf_counter()
    gc.collect()  # what a full collection of the broker's collector costs with N pending
    out["full_gc_ms"] = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    engine.close()
    out["close_s"] = time.perf_counter() - started
    out["disk_mb"] = disk_bytes(path) / 2**20
    out["disk_per_timer_b"] = disk_bytes(path) / args.n
    started, started_cpu = time.perf_counter(), time.thread_time()
    engine = open_engine(name, path)
    assert engine.metrics(T0_MS).pending_total == args.n
    out["open_s"] = time.perf_counter() - started
    out["open_cpu_s"] = time.thread_time() - started_cpu
    out["rss_after_reopen_mb"] = proc.memory_info().rss / 2**20
    now_ms = T0_MS + 7_200_000
    fired = 0
    due_s = apply_s = 0.0
    started_cpu = time.thread_time()
    while True:
        count, d, a = fire_step(engine, log, now_ms, fire_limit)
        due_s += d
        apply_s += a
        if not count:
            break
        fired += count
    assert fired == args.n and engine.metrics(now_ms).pending_total == 0, fired
    out["fires_per_s"] = fired / (due_s + apply_s)
    out["fire_cpu_us"] = (time.thread_time() - started_cpu) / fired * 1e6
    out["fire_due_share"] = due_s / (due_s + apply_s)
    engine.close()
    return out


def fire_in_real_time(engine: TimerEngine, log: Log, start_ms: int, n: int) -> dict[str, Any]:
    """Fire from `start_ms` with the clock running: now = start_ms + wall time elapsed. Returns
    each timer's lateness (ms from its due time to the end of the apply that fired it)."""
    limit = Config().timer_fire_batch
    lateness: list[float] = []
    steps = 0
    cpu0 = time.thread_time()
    t0 = time.perf_counter()

    def now() -> float:
        return start_ms + (time.perf_counter() - t0) * 1000

    first_due_cpu_ms = None
    while len(lateness) < n:
        now_ms = int(now())
        started_cpu = time.thread_time()
        due = engine.due_timers(now_ms, limit)
        if first_due_cpu_ms is None:  # the first due() at the due time: a slot read, for the wheel
            first_due_cpu_ms = (time.thread_time() - started_cpu) * 1000
        if not due.rows:
            deadline = engine.next_deadline_ms()
            assert deadline is not None, len(lateness)
            time.sleep(max(0.0, (deadline - now()) / 1000))
            continue
        engine.apply(fire_batch(log, due.positions, now_ms))
        done = now()
        lateness.extend(done - d for d in due.deliver_at_ms)
        steps += 1
    return {"first_due_cpu_ms": first_due_cpu_ms, "all_fired_ms": max(lateness),
            "fire_cpu_us": (time.thread_time() - cpu0) / n * 1e6, "steps": steps,
            "within_1s": sum(x <= 1000 for x in lateness), "within_2s": sum(x <= 2000 for x in lateness),
            "late_p50_ms": percentile(lateness, 50), "late_p99_ms": percentile(lateness, 99)}


def scenario_burst(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = open_engine(name, path)
    log = Log()
    due_ms = T0_MS + 60_000
    out: dict[str, Any] = {"n": args.burst_n}
    out.update(add_all(engine, log, entries_at(random.Random(7), lambda: due_ms, T0_MS), args.burst_n, args.batch))
    out.update(fire_in_real_time(engine, log, due_ms, args.burst_n))
    engine.close()
    return out


def scenario_second(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = open_engine(name, path)
    log = Log()
    rng = random.Random(11)
    first_due = T0_MS + 60_000
    out: dict[str, Any] = {"n": args.second_n}
    out.update(add_all(engine, log, entries_at(rng, lambda: first_due + rng.randrange(1000), T0_MS),
                       args.second_n, args.batch))
    out.update(fire_in_real_time(engine, log, first_due, args.second_n))
    engine.close()
    return out


def scenario_spread(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    engine = open_engine(name, path)
    log = Log()
    rng = random.Random(13)
    n = args.spread_n or args.n
    out: dict[str, Any] = {"n": n, "step_s": args.spread_step_s}
    out.update(add_all(engine, log, entries_at(rng, lambda: T0_MS + rng.randrange(1000, 30 * DAY_MS), T0_MS),
                       n, args.batch))
    limit = Config().timer_fire_batch
    step_cpu: list[float] = []
    fired = 0
    now_ms = T0_MS
    while now_ms <= T0_MS + 30 * DAY_MS + args.spread_step_s * 1000:
        now_ms += args.spread_step_s * 1000
        started_cpu = time.thread_time()
        while True:
            count, _d, _a = fire_step(engine, log, now_ms, limit)
            fired += count
            if count < limit:
                break
        step_cpu.append(time.thread_time() - started_cpu)
        if "empty_due_us" not in out and now_ms >= T0_MS + 3600_000:  # a due finding nothing: the next is later
            idle_at = engine.next_deadline_ms()
            assert idle_at is not None
            started_cpu = time.thread_time()
            for _ in range(1000):
                engine.due_timers(idle_at - 1, limit)
            out["empty_due_us"] = (time.thread_time() - started_cpu) * 1000
    assert fired == n and engine.metrics(now_ms).pending_total == 0, fired
    out["steps"] = len(step_cpu)
    out["fire_cpu_us"] = sum(step_cpu) / n * 1e6
    out["step_cpu_ms_mean"] = statistics.fmean(step_cpu) * 1000
    out["step_cpu_ms_p99"] = percentile(step_cpu, 99) * 1000
    out["step_cpu_ms_max"] = max(step_cpu) * 1000
    out["step_max_at_day"] = (step_cpu.index(max(step_cpu)) + 1) * args.spread_step_s / 86400
    engine.close()
    return out


def scenario_steady(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`--steady-rate` timers a second for 10 s, due 5-30 s after they are added (the broker-level
    precision phase's shape), added and fired as the clock runs, a step every 5 ms: the engine's
    own fire lag, and its slowest calls (what holds the broker's loop)."""
    engine = open_engine(name, path)
    log = Log()
    rng = random.Random(5)
    n = int(args.steady_rate * 10)
    limit = Config().timer_fire_batch
    slowest = {"add": 0.0, "due": 0.0, "fire": 0.0}
    collections: list[tuple[int, float]] = []
    started_at = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started_at[0] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - started_at[0]) * 1000))

    def timed(kind: str, call: Callable[..., Any], *call_args: Any) -> Any:
        started_cpu = time.thread_time()
        result = call(*call_args)
        slowest[kind] = max(slowest[kind], (time.thread_time() - started_cpu) * 1000)
        return result

    gc.callbacks.append(on_gc)
    sent = fired = 0
    t0 = time.perf_counter()
    while fired < n:
        now_ms = T0_MS + int((time.perf_counter() - t0) * 1000)
        want = min(n, int((now_ms - T0_MS) * args.steady_rate / 1000))
        if want > sent:
            count = want - sent
            first = log.take(count) // RECORD_BYTES
            entries = [TimerEntry(now_ms + rng.randrange(5000, 30000), i * RECORD_BYTES, RECORD_BYTES,
                                  f"01{0x5EED:04X}{rng.getrandbits(48):012X}{i:016X}", f"topic-{i % 16}", now_ms,
                                  (f"order-{i}",)) for i in range(first, first + count)]
            timed("add", engine.apply, IndexBatch(adds=entries, indexed_position=log.end, applied_ms=now_ms))
            sent = want
        due = timed("due", engine.due_timers, now_ms, limit)
        if due.rows:
            timed("fire", engine.apply, fire_batch(log, due.positions, now_ms))
            fired += len(due)
        time.sleep(0.005)
    gc.callbacks.remove(on_gc)
    lag = engine.metrics(now_ms).latencies["fire_lag_ms"]
    engine.close()
    return {"n": n, "rate": args.steady_rate, "lag_p50_ms": lag["p50"], "lag_p99_ms": lag["p99"],
            "lag_p999_ms": lag["p999"], "lag_max_ms": lag["max"], "slowest_add_ms": slowest["add"],
            "slowest_due_ms": slowest["due"], "slowest_fire_ms": slowest["fire"],
            "gc_young_max_ms": max([t for g, t in collections if g == 0] or [0.0]),
            "gc_middle_max_ms": max([t for g, t in collections if g == 1] or [0.0]),
            "gc_full_count": sum(g == 2 for g, _ in collections)}


RUNNERS: dict[str, Callable[[str, Path, argparse.Namespace], dict[str, Any]]] = {
    "pending": scenario_pending, "burst": scenario_burst, "second": scenario_second, "spread": scenario_spread,
    "steady": scenario_steady}


def child(args: argparse.Namespace) -> int:
    from chronoq.server.serve import settle_heap

    settle_heap(Config())
    workdir = Path(tempfile.mkdtemp(prefix=f"chronoq-bench-{args.child}-"))
    try:
        result = RUNNERS[args.scenario](args.child, workdir / "timer", args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["rss_peak_mb"] = _peak_rss_mb()
    print(json.dumps(result))
    return 0


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the parent: run every pair, print them side by side ---------------------------------------

ROWS: dict[str, list[tuple[str, str, str]]] = {
    # (label, key, format)
    "pending": [("adds/s (wall)", "adds_per_s", ",.0f"), ("CPU µs an add", "add_cpu_us", ".1f"),
                ("add batch p50 ms", "add_batch_ms_p50", ".1f"), ("add batch p99 ms", "add_batch_ms_p99", ".1f"),
                ("RSS empty MB", "rss_empty_mb", ".0f"), ("RSS with N pending MB", "rss_after_adds_mb", ".0f"),
                ("RSS growth B a pending timer", "rss_per_timer_b", ".0f"),
                ("objects the collector tracks", "gc_tracked_objects", ",d"),
                ("a full gc.collect() with N pending, ms", "full_gc_ms", ",.0f"),
                ("disk MB with N pending (after close)", "disk_mb", ".0f"),
                ("disk B a pending timer", "disk_per_timer_b", ".0f"), ("close s", "close_s", ".2f"),
                ("reopen s (until ready)", "open_s", ".2f"), ("reopen CPU s", "open_cpu_s", ".2f"),
                ("RSS after reopen MB", "rss_after_reopen_mb", ".0f"),
                ("due+fire/s (wall)", "fires_per_s", ",.0f"), ("CPU µs a fire", "fire_cpu_us", ".1f"),
                ("share of fire time in due()", "fire_due_share", ".0%"), ("RSS peak MB", "rss_peak_mb", ".0f")],
    "burst": [("CPU µs an add", "add_cpu_us", ".1f"),
              ("first due() at the due time, CPU ms", "first_due_cpu_ms", ".1f"),
              ("all fired, ms after due", "all_fired_ms", ",.0f"),
              ("fired within 1 s", "within_1s", ","), ("lateness P50 ms", "late_p50_ms", ",.0f"),
              ("lateness P99 ms", "late_p99_ms", ",.0f"), ("CPU µs a fire", "fire_cpu_us", ".1f"),
              ("fire steps", "steps", ",")],
    "second": [("CPU µs an add", "add_cpu_us", ".1f"),
               ("first due() at the second's start, CPU ms", "first_due_cpu_ms", ".1f"),
               ("fired within 1 s of due", "within_1s", ","),
               ("fired within 2 s of due", "within_2s", ","), ("lateness P50 ms", "late_p50_ms", ",.0f"),
               ("lateness P99 ms", "late_p99_ms", ",.0f"), ("last fired, ms after its due", "all_fired_ms", ",.0f"),
               ("CPU µs a fire", "fire_cpu_us", ".1f"), ("fire steps", "steps", ",")],
    "spread": [("adds/s (wall)", "adds_per_s", ",.0f"), ("CPU µs an add", "add_cpu_us", ".1f"),
               ("CPU µs a fire (30 days in steps)", "fire_cpu_us", ".1f"),
               ("CPU ms a step, mean", "step_cpu_ms_mean", ".2f"), ("CPU ms a step, P99", "step_cpu_ms_p99", ".2f"),
               ("CPU ms a step, max", "step_cpu_ms_max", ",.1f"), ("slowest step, day", "step_max_at_day", ".1f"),
               ("CPU µs a due() finding nothing", "empty_due_us", ".1f"), ("RSS peak MB", "rss_peak_mb", ".0f")],
    "steady": [("fire lag P50 ms", "lag_p50_ms", ",.0f"), ("fire lag P99 ms", "lag_p99_ms", ",.0f"),
               ("fire lag P999 ms", "lag_p999_ms", ",.0f"), ("fire lag max ms", "lag_max_ms", ",.0f"),
               ("slowest add apply, CPU ms", "slowest_add_ms", ".1f"),
               ("slowest due(), CPU ms", "slowest_due_ms", ".1f"),
               ("slowest fire apply, CPU ms", "slowest_fire_ms", ".1f"),
               ("longest young collection ms", "gc_young_max_ms", ".1f"),
               ("longest middle collection ms", "gc_middle_max_ms", ".1f"),
               ("full collections", "gc_full_count", ",d")],
}


def print_tables(results: dict[str, Any]) -> None:
    for scenario, pair in results["scenarios"].items():
        print(f"\n{scenario} (n = {pair['rocksdb'].get('n', '?'):,})")
        rows = [("figure", "rocksdb", "wheel", "wheel / rocksdb")]
        for label, key, fmt in ROWS[scenario]:
            a, b = pair["rocksdb"].get(key), pair["wheel"].get(key)
            ratio = f"{b / a:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-"
            rows.append((label, "-" if a is None else format(a, fmt), "-" if b is None else format(b, fmt), ratio))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            cells = zip(r, widths, strict=True)
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench timer-engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="pending timers in `pending` (default 1,000,000)")
    p.add_argument("--batch", type=int, default=500, help="timers per add batch (default 500)")
    p.add_argument("--burst-n", type=int, default=100_000, help="timers due in one ms in `burst`")
    p.add_argument("--second-n", type=int, default=500_000, help="timers due within one second in `second`")
    p.add_argument("--spread-n", type=int, default=0, help="timers in `spread` (default: --n)")
    p.add_argument("--spread-step-s", type=int, default=600, help="clock step in `spread`, seconds")
    p.add_argument("--steady-rate", type=float, default=5000.0, help="timers a second in `steady` (for 10 s)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list from {','.join(SCENARIOS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list from {','.join(ENGINES)}")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default: timer_engines.json under "
                                                          "$BENCH_RESULTS_DIR or bench/results/)")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return child(args)
    scenarios = [s for s in args.scenarios.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    passed = _without_values(argv if argv is not None else sys.argv[1:], ("--scenarios", "--engines", "--out"))
    results: dict[str, Any] = {
        "command": "python -m bench timer-engines " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
        "reference_us_start": reference_us(), "scenarios": {}}
    for scenario in scenarios:
        results["scenarios"][scenario] = {}
        for engine in engines:
            print(f"[{time.strftime('%H:%M:%S')}] {scenario} on {engine} ...", flush=True)
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *passed, "--child", engine,
                                   "--scenario", scenario], capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{scenario} on {engine} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            results["scenarios"][scenario][engine] = json.loads(done.stdout.strip().splitlines()[-1])
            results["scenarios"][scenario].setdefault("rocksdb", {})
            results["scenarios"][scenario].setdefault("wheel", {})
    results["loadavg_end"] = os.getloadavg()
    results["reference_us_end"] = reference_us()
    out = args.out or results_dir() / "timer_engines.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)
    print(f"\nload average {results['loadavg_start'][0]:.1f} -> {results['loadavg_end'][0]:.1f} on "
          f"{results['cpus']} CPUs; yardstick TimerEntry() {results['reference_us_start']:.2f} -> "
          f"{results['reference_us_end']:.2f} CPU-µs\nwritten to {out}")
    return 0


def _without_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` less the options in `names` and their values (the parent's own options)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.startswith(tuple(f"{n}=" for n in names)):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
