"""Benchmark the RocksDB timer index: adds/s, due+fire/s, and memory with N pending.

What it does: opens a fresh `RocksTimerIndex` in a temporary directory, applies N timer records
in batches (the way the broker does after appending them to the commit log), reopens the index
(to time an open with N pending), asks for metrics, then fires everything: `due(now, batch)`
followed by `apply(fired=...)` until nothing is due. Only the index calls are timed; generating
the synthetic entries is not. Rates are given per wall-clock second and per CPU-second of the
calling thread: on a shared machine the second shows what the code costs, the first what it got.
Results go to `timer_index.json` under `bench.results_dir()` (or `--out`) and a table.

Workload: message ids shaped like RocketMQ 5's (34 hex characters), 16 topics, due times
uniform over [1 s, 2 h] after a fixed start, one message key per message unless `--keys 0`.

    .venv/bin/python bench/bench_timer_index.py               # N = 1,000,000
    .venv/bin/python bench/bench_timer_index.py --n 200000 --keys 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import results_dir
from chronoq.timer.engine import IndexBatch, TimerEntry
from chronoq.timer.index import RocksTimerIndex

T0_MS = 1_700_000_000_000
RECORD_BYTES = 300  # a plausible timer record size: positions advance by this much


def make_batch(rng: random.Random, first: int, count: int, with_keys: bool) -> list[TimerEntry]:
    out = []
    for i in range(first, first + count):
        out.append(TimerEntry(
            deliver_at_ms=T0_MS + rng.randrange(1_000, 7_200_000),
            position=i * RECORD_BYTES,
            size=RECORD_BYTES,
            message_id=f"01{0x5EED:04X}{rng.getrandbits(48):012X}{i:016X}",
            topic=f"topic-{i % 16}",
            accepted_ms=T0_MS,
            keys=(f"order-{i}",) if with_keys else (),
        ))
    return out


def reference_us() -> float:
    """CPU-microseconds per `TimerEntry(...)`: a fixed pure-Python yardstick, so runs made while
    other work shares the machine can be compared with each other."""
    started = time.thread_time()
    for i in range(100_000):
        TimerEntry(i, i, 1, "id", "topic", i, ())
    return (time.thread_time() - started) * 10


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def run(n: int, batch: int, with_keys: bool, workdir: Path) -> dict:
    proc = psutil.Process()
    rng = random.Random(42)
    path = workdir / "timer-index"
    result: dict = {
        "n": n, "batch": batch, "keys_per_message": int(with_keys),
        "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
        "rss_start_mb": proc.memory_info().rss / 2**20, "reference_us_start": reference_us(),
    }
    index = RocksTimerIndex.open(path)

    # -- adds -------------------------------------------------------------------------------
    apply_s: list[float] = []
    cpu_s = 0.0
    for first in range(0, n, batch):
        entries = make_batch(rng, first, min(batch, n - first), with_keys)
        end = (first + len(entries)) * RECORD_BYTES
        started, started_cpu = time.perf_counter(), time.thread_time()
        index.apply(IndexBatch(adds=entries, indexed_position=end))
        apply_s.append(time.perf_counter() - started)
        cpu_s += time.thread_time() - started_cpu
    result["adds_per_s"] = n / sum(apply_s)
    result["adds_per_cpu_s"] = n / cpu_s
    result["add_batch_ms_p50"] = statistics.median(apply_s) * 1000
    result["add_batch_ms_p99"] = percentile(apply_s, 99) * 1000
    result["rss_after_adds_mb"] = proc.memory_info().rss / 2**20

    # -- reopen and metrics with N pending --------------------------------------------------
    started = time.perf_counter()
    index.close()  # flushes the memtables
    result["close_s"] = time.perf_counter() - started
    started = time.perf_counter()
    index = RocksTimerIndex.open(path)
    result["open_s"] = time.perf_counter() - started
    started = time.perf_counter()
    snapshot = index.metrics(T0_MS + 3_600_000)
    result["metrics_ms"] = (time.perf_counter() - started) * 1000
    assert snapshot.pending_total == n, snapshot.pending_total
    result["pending_by_due_at_1h"] = dict(snapshot.pending_by_due)
    result["disk_mb"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20

    # -- fire everything ---------------------------------------------------------------------
    now_ms = T0_MS + 7_200_000
    position = n * RECORD_BYTES
    due_s = fire_s = cpu_s = 0.0
    fired = 0
    while True:
        started, started_cpu = time.perf_counter(), time.thread_time()
        due = index.due(now_ms, batch)
        middle = time.perf_counter()
        if not due:
            break
        position += len(due) * RECORD_BYTES  # each fired copy is a record in the log
        index.apply(IndexBatch(fired=[(e.position, now_ms) for e in due], indexed_position=position))
        fire_s += time.perf_counter() - middle
        cpu_s += time.thread_time() - started_cpu
        due_s += middle - started
        fired += len(due)
    assert fired == n and index.metrics(now_ms).pending_total == 0
    result["fires_per_s"] = fired / (due_s + fire_s)
    result["fires_per_cpu_s"] = fired / cpu_s
    result["due_share"] = due_s / (due_s + fire_s)
    result["rss_end_mb"] = proc.memory_info().rss / 2**20
    result["loadavg_end"] = os.getloadavg()
    result["reference_us_end"] = reference_us()
    index.close()
    return result


def print_table(result: dict) -> None:
    rows = [
        ("pending timers (N)", f"{result['n']:,}"),
        ("batch size", f"{result['batch']}"),
        ("message keys per timer", f"{result['keys_per_message']}"),
        ("adds/s (wall)", f"{result['adds_per_s']:,.0f}"),
        ("adds per CPU-second (main thread)", f"{result['adds_per_cpu_s']:,.0f}"),
        ("add batch p50 / p99", f"{result['add_batch_ms_p50']:.1f} / {result['add_batch_ms_p99']:.1f} ms"),
        ("due+fire/s (wall)", f"{result['fires_per_s']:,.0f} (due() {result['due_share']:.0%} of it)"),
        ("due+fire per CPU-second (main thread)", f"{result['fires_per_cpu_s']:,.0f}"),
        ("close (flush) / open with N pending", f"{result['close_s'] * 1000:.0f} / {result['open_s'] * 1000:.0f} ms"),
        ("metrics() with N pending", f"{result['metrics_ms']:.1f} ms"),
        ("RSS start / after adds / end", f"{result['rss_start_mb']:.0f} / {result['rss_after_adds_mb']:.0f} / "
                                         f"{result['rss_end_mb']:.0f} MB"),
        ("index on disk after adds", f"{result['disk_mb']:.0f} MB"),
        ("load average start / end", f"{result['loadavg_start'][0]:.1f} / {result['loadavg_end'][0]:.1f} "
                                     f"on {result['cpus']} CPUs"),
        ("yardstick TimerEntry() start / end", f"{result['reference_us_start']:.2f} / "
                                               f"{result['reference_us_end']:.2f} CPU-us"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="timers to add and fire (default 1,000,000)")
    parser.add_argument("--batch", type=int, default=500, help="timers per apply (default 500)")
    parser.add_argument("--keys", type=int, choices=(0, 1), default=1, help="message keys per timer (default 1)")
    parser.add_argument("--out", type=Path, default=results_dir() / "timer_index.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="chronoq-bench-timer-"))
    try:
        result = run(args.n, args.batch, bool(args.keys), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
