"""Benchmark: `chronoq serve` memory while a backlog of far-future timer messages grows.

Theory of operation: one `chronoq serve` child process on loopback (fresh temp data dir, default
configuration unless `--set name=value` overrides it, passed as `CHRONOQ_<NAME>` environment
variables). `--senders` concurrent SDK producers send `--messages` timer messages in batches
(admin SendBatch), each due 2 h ahead spread over `--spread-s` seconds, so nothing fires while
sending and the whole load stays pending. A sampler reads the server's RSS (VmRSS of the server
and its children, from /proc) every `--sample-s` seconds and prints one line per sample:
pending (acknowledged sends), RSS, bytes of RSS growth per pending message (over the RSS after
start-up), and the accept rate. RSS is the figure this script exists for: rates on a shared
2-core machine are noisy. Results go to `backlog_memory.json` under `bench.results_dir()` (or `--out`).

    .venv/bin/python bench/bench_backlog_memory.py --messages 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import results_dir  # noqa: E402

HOUR_MS = 3_600_000
BODY = b"x" * 100


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def _rss_bytes(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int, field: str = "VmRSS:") -> int:
    """RSS of `pid` and its descendants (the server runs no helpers today; counted if it does).
    `field` "RssAnon:" is the heap part, "RssFile:" mapped files (page cache, shared libraries)."""
    return sum(_rss_bytes(p, field) for p in [pid, *_children(pid)])


async def sender(address: str, topic: str, ids: range, batch: int, base_due_ms: int, spread_s: int,
                 progress: list[int], slot: int) -> None:
    from chronoq.client import AsyncProducer, outgoing

    async with AsyncProducer(address, max_batch=batch, timeout_ms=120_000) as p:
        for start in range(ids.start, ids.stop, batch):
            msgs = [outgoing(topic, BODY, deliver_at=base_due_ms + (i % spread_s) * 1000, message_id=f"bl-{i:012d}")
                    for i in range(start, min(start + batch, ids.stop))]
            await p.send_batch(msgs)
            progress[slot] += len(msgs)


async def sample(pid: int, progress: list[int], rss_idle: int, every_s: float, samples: list[dict[str, Any]],
                 started: float, stop: asyncio.Event) -> None:
    last_t, last_n = started, 0
    while not stop.is_set():
        with _suppress_timeout():
            await asyncio.wait_for(stop.wait(), every_s)
        t, n = time.monotonic(), sum(progress)
        rss = tree_rss_bytes(pid)
        row = {"t_s": round(t - started, 1), "pending": n, "rss_mb": round(rss / 2**20, 1),
               "rss_anon_mb": round(tree_rss_bytes(pid, "RssAnon:") / 2**20, 1),
               "rss_file_mb": round(tree_rss_bytes(pid, "RssFile:") / 2**20, 1),
               "bytes_per_pending": round((rss - rss_idle) / n, 1) if n else None,
               "accept_per_s": round((n - last_n) / (t - last_t), 0) if t > last_t else None}
        samples.append(row)
        print(json.dumps(row), flush=True)
        last_t, last_n = t, n


class _suppress_timeout:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, *rest: object) -> bool:
        return kind is TimeoutError


async def run(address: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    from chronoq.client import AsyncAdmin

    topic = "backlog"
    async with AsyncAdmin(address) as admin:
        await admin.create_topic(topic)
    await asyncio.sleep(1.0)
    rss_idle = tree_rss_bytes(pid)
    print(json.dumps({"rss_idle_mb": round(rss_idle / 2**20, 1)}), flush=True)
    base_due_ms = now_ms() + 2 * HOUR_MS
    per = -(-args.messages // args.senders)
    progress = [0] * args.senders
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    started = time.monotonic()
    sampler = asyncio.create_task(sample(pid, progress, rss_idle, args.sample_s, samples, started, stop))
    await asyncio.gather(*(sender(address, topic, range(k * per, min((k + 1) * per, args.messages)), args.batch,
                                  base_due_ms, args.spread_s, progress, k) for k in range(args.senders)))
    elapsed_s = time.monotonic() - started
    await asyncio.sleep(args.settle_s)  # let background work (checkpoints, compactions) show in RSS
    stop.set()
    await sampler
    async with AsyncAdmin(address) as admin:
        stats = await admin.stats()
    pending = sum(progress)
    rss_end = tree_rss_bytes(pid)
    peak = max([rss_end, *(int(s["rss_mb"] * 2**20) for s in samples)])
    return {"messages": args.messages, "senders": args.senders, "batch": args.batch, "settings": args.set,
            "pending": pending, "server_timer_stats": stats.get("timer"),
            "rss_idle_mb": round(rss_idle / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
            "rss_peak_mb": round(peak / 2**20, 1),
            "bytes_per_pending_end": round((rss_end - rss_idle) / pending, 1) if pending else None,
            "accept_per_s": round(pending / elapsed_s, 0), "send_seconds": round(elapsed_s, 1), "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--spread-s", type=int, default=3600, help="due times spread over this many seconds")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="server config override")
    ap.add_argument("--out", type=Path, default=results_dir() / "backlog_memory.json")
    args = ap.parse_args()
    from chronoq.client.testing import ServerProcess

    settings = dict(kv.split("=", 1) for kv in args.set)
    with tempfile.TemporaryDirectory(prefix="chronoq-backlog-") as tmp:
        server = ServerProcess(Path(tmp) / "data", settings=settings).start()
        try:
            assert server.pid is not None
            result = asyncio.run(run(server.address, server.pid, args))
            result["disk_mb"] = round(sum(f.stat().st_size for f in (Path(tmp) / "data").rglob("*")
                                          if f.is_file()) / 2**20, 1)
        finally:
            server.stop()
    result["environ"] = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "CHRONOQ_"))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
