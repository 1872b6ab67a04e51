"""Benchmark: the Spark timer engine holding N far timers, and what that costs each side.

Theory of operation: with `timer_firer = "spark"` the broker keeps every timer in its durable
index (on disk) and fires only the armed ones, those inside its hand-off horizon; the job keeps
the far ones in Spark's state store and arms each as it enters the horizon (`chronoq/spark/engine.py`).
The claim is that the broker's memory follows the horizon's timers and the job's state the count
of far timers, not their spread. This run puts it to the test:

1. a `chronoq serve` child (timer_firer=spark, the default horizon unless `--set`) and the engine
   (`run_engine` on its defaults: hour buckets, 2 shards, a micro-batch every 5 s) in this process's Spark;
2. N timers sent through the SDK's bulk send (`AsyncProducer.send_columns`), due at random over
   `--from-s`..`--days` ahead (none inside the horizon, so none is armed);
3. wait until the engine has read every one: the chronoq source's input rows, summed over the
   query's progress reports by batch id, reach N, and a batch has run since;
4. report the broker's RSS (VmRSS now, VmHWM the peak, from /proc), its data directory, the
   engine's state (rows and memory the state operator reports, the files its last version names,
   the checkpoint's `state/` on disk with the older versions Spark keeps), the driver JVM's RSS,
   the broker's hand-off counters (armed: 0 expected), the send rate and how long the engine took
   to take it all in.

Results go to `spark-hold.json` under `bench.results_dir()` (or `--out`).

    python -m bench spark-hold --timers 10000000 --days 30
    python -m bench spark-hold --timers 20000 --days 1        # in miniature
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import results_dir
from bench.bench_backlog_memory import _children, _rss_bytes, tree_rss_bytes
from bench.harness.procs import dir_size_bytes

TOPIC = "hold"
CHUNK = 100_000
"""Rows given to one send_columns call (the SDK splits them into requests of its own size)."""


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def last_version_mb(state_dir: Path) -> float | None:
    """The state's live size: the SST files named by the newest version of each state partition
    (the RocksDB state store's checkpoint: `<operator>/<partition>/<version>.zip`, whose `metadata`
    is a version line and JSON listing `sstFiles` with their sizes). The rest of `state/` is older
    versions' files, kept for `spark.sql.streaming.minBatchesToRetain` batches. None when the
    checkpoint is not laid out so (another Spark, another state store)."""
    total = 0
    found = False
    try:
        for partition in state_dir.glob("*/*"):
            versions = sorted((p for p in partition.glob("*.zip") if p.stem.isdigit()), key=lambda p: int(p.stem))
            if not versions:
                continue
            with zipfile.ZipFile(versions[-1]) as archive:
                text = archive.read("metadata").decode()
            total += sum(int(f["sizeBytes"]) for f in json.loads(text.split("\n", 1)[1])["sstFiles"])
            found = True
    except (OSError, KeyError, ValueError, IndexError, zipfile.BadZipFile):
        return None
    return round(total / 2**20, 1) if found else None


def _jvm_pid() -> int | None:
    """The Spark driver's JVM: the descendant of this process whose command is java."""
    for pid in _children(os.getpid()):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "java":
                return pid
        except OSError:
            continue
    return None


async def _send(address: str, n: int, from_ms: int, to_ms: int, seed: int) -> tuple[int, float]:
    from chronoq.client import AsyncProducer

    rng = random.Random(seed)
    stored = 0
    started = time.monotonic()
    async with AsyncProducer(address, timeout_ms=300_000) as producer:
        for base in range(0, n, CHUNK):
            rows = range(base, min(n, base + CHUNK))
            now = int(time.time() * 1000)
            outcome = await producer.send_columns(
                TOPIC, [b"x" * 64] * len(rows), message_ids=[f"h{i:09d}" for i in rows],
                deliver_at_ms=[now + rng.randrange(from_ms, to_ms) for _ in rows])
            if outcome.refused:
                raise SystemExit(f"{outcome.refused} rows refused, e.g. {next(iter(outcome.errors.values()))}")
            stored += outcome.stored
            if (base // CHUNK) % 10 == 9:
                _log(f"sent {stored:,} ({stored / (time.monotonic() - started):,.0f}/s)")
    return stored, time.monotonic() - started


def _source_rows(progress: dict[str, Any]) -> int:
    """Rows a batch read from the timer topic (every source but the heartbeat's rate source)."""
    return sum(int(s.get("numInputRows", 0)) for s in progress.get("sources", [])
               if not str(s.get("description", "")).startswith("Rate"))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from chronoq.client import Admin
    from chronoq.client.testing import ServerProcess
    from chronoq.spark.engine import EngineOptions, bucket_ms_of, release_lead_ms, run_engine, trigger_ms_of
    from chronoq.spark.session import build_session

    settings: dict[str, Any] = {"timer_firer": "spark", **dict(kv.split("=", 1) for kv in args.set)}
    server = ServerProcess(work / "data", settings=settings, args=["--log-level", "WARNING"]).start()
    assert server.process is not None
    pid = server.process.pid
    spark = build_session("chronoq-bench-spark-hold", master=args.master)
    query = None
    try:
        with Admin(server.address) as admin:
            admin.create_topic(TOPIC, queue_count=4)
        rss_idle = tree_rss_bytes(pid)
        engine = EngineOptions(server=server.address, checkpoint=str(work / "ckpt"))
        if args.bucket_ms is not None:
            engine = replace(engine, bucket_ms=args.bucket_ms)
        query = run_engine(spark, engine)
        _log(f"engine started; sending {args.timers:,} timers due {args.from_s} s to {args.days} days ahead")
        stored, send_s = asyncio.run(_send(server.address, args.timers, args.from_s * 1000,
                                           args.days * 86_400_000, args.seed))
        _log(f"sent {stored:,} in {send_s:.1f} s ({stored / send_s:,.0f}/s); waiting for the engine to read them")
        read: dict[int, int] = {}
        last: dict[str, Any] = {}
        deadline = time.monotonic() + args.wait_s
        after_send = time.monotonic()
        while True:
            for p in query.recentProgress:
                read[int(p["batchId"])] = _source_rows(p)
                last = p
            total = sum(read.values())
            if total >= stored and last and int(last["batchId"]) > max(b for b, r in read.items() if r):
                break
            if not query.isActive:
                raise SystemExit(f"the engine stopped: {query.exception()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the engine read {total:,} of {stored:,} in {args.wait_s} s")
            _log(f"engine has read {total:,} of {stored:,}")
            time.sleep(5)
        ingest_s = time.monotonic() - after_send
        time.sleep(2)
        state = (query.lastProgress or last).get("stateOperators", [{}])[0]
        with Admin(server.address) as admin:
            timer_stats = admin.stats()["timer"]
        jvm = _jvm_pid()
        result = {
            "timers": stored, "from_s": args.from_s, "days": args.days, "settings": settings,
            "bucket_ms": bucket_ms_of(engine), "shards": engine.shards,
            "trigger_ms": trigger_ms_of(engine, release_lead_ms(engine)),
            "send_s": round(send_s, 1), "send_per_s": round(stored / send_s),
            "engine_read_after_send_s": round(ingest_s, 1),
            "broker_rss_idle_mb": round(rss_idle / 2**20, 1),
            "broker_rss_mb": round(tree_rss_bytes(pid) / 2**20, 1),
            "broker_rss_peak_mb": round(_rss_bytes(pid, "VmHWM:") / 2**20, 1),
            "broker_data_mb": round(dir_size_bytes(work / "data") / 2**20, 1),
            "broker_pending": timer_stats.get("pending_total"),
            "broker_handoff": timer_stats.get("handoff"),
            "state_rows": state.get("numRowsTotal"),
            "state_memory_mb": round(int(state.get("memoryUsedBytes", 0)) / 2**20, 1),
            "state_last_version_mb": last_version_mb(work / "ckpt" / "state"),
            "state_on_disk_mb": round(dir_size_bytes(work / "ckpt" / "state") / 2**20, 1),
            "checkpoint_mb": round(dir_size_bytes(work / "ckpt") / 2**20, 1),
            "driver_jvm_rss_mb": round(_rss_bytes(jvm, "VmRSS:") / 2**20, 1) if jvm else None,
            "batches": len(read),
        }
    finally:
        if query is not None:
            query.stop()
        spark.stop()
        server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench spark-hold", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timers", type=int, default=10_000_000)
    ap.add_argument("--days", type=int, default=30, help="the latest due time, days ahead")
    ap.add_argument("--from-s", type=int, default=3600, help="the earliest due time, s ahead (past the horizon)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--wait-s", type=int, default=7200, help="give up if the engine has not read all by then")
    ap.add_argument("--bucket-ms", type=int, default=None, help="the engine's bucket (default: its own)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="server config override")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    ap.add_argument("--out", type=Path, default=results_dir() / "spark-hold.json")
    args = ap.parse_args(argv)
    if args.timers < 1 or args.days < 1 or not 0 < args.from_s < args.days * 86_400:
        ap.error("--timers and --days must be at least 1, and --from-s between 0 and --days")
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        result = run(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="chronoq-bench-spark-hold-") as tmp:
            result = run(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
