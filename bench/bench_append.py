"""Acknowledged appends per second with `sync` flush, 1 KiB messages, 1 and 16 concurrent producers.

Each producer awaits `Broker.send` (returns after the group-commit fsync) before sending its next
message, so the rate is of *acknowledged, durable* messages. Also measured: the same with batches
of 64 (`send_batch`), and fsyncs per second (how much group commit shares). Writes
`append.json` under `bench.results_dir()` (or `--out`) and prints a table.

    .venv/bin/python bench/bench_append.py [--messages 20000] [--size 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: `bench` and its chronoq

from bench import results_dir
from chronoq.broker import Broker
from chronoq.config import Config
from chronoq.model import OutgoingMessage


async def run_case(producers: int, total: int, size: int, batch: int) -> dict[str, float]:
    d = Path(tempfile.mkdtemp(prefix="chronoq-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        broker = await Broker.open(Config(data_dir=d, flush="sync"), background=False)
        body = os.urandom(size)
        per = total // producers

        async def producer() -> None:
            for _ in range(0, per, batch):
                if batch == 1:
                    await broker.send(OutgoingMessage("bench", body))
                else:
                    await broker.send_batch([OutgoingMessage("bench", body) for _ in range(batch)])

        fsyncs0 = broker.store.log.fsync_count
        t0 = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(producers)))
        elapsed = time.perf_counter() - t0
        fsyncs = broker.store.log.fsync_count - fsyncs0
        await broker.close()
        n = per * producers
        return {"producers": producers, "batch": batch, "messages": n, "seconds": round(elapsed, 3),
                "msgs_per_s": round(n / elapsed), "fsyncs": fsyncs, "msgs_per_fsync": round(n / max(fsyncs, 1), 1)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--out", default=str(results_dir() / "append.json"))
    args = ap.parse_args()
    cases = []
    for producers, batch in ((1, 1), (16, 1), (1, 64), (16, 64)):
        n = args.messages if batch > 1 or producers > 1 else max(args.messages // 4, 1000)
        cases.append(await run_case(producers, n, args.size, batch))
        c = cases[-1]
        print(f"producers={c['producers']:>2} batch={c['batch']:>3}: {c['msgs_per_s']:>8,} acknowledged msgs/s "
              f"({c['messages']} in {c['seconds']} s, {c['msgs_per_fsync']} msgs per fsync)", flush=True)
    result = {"benchmark": "sync appends", "message_size_bytes": args.size, "python": sys.version.split()[0],
              "machine": platform.machine(), "cpus": os.cpu_count(), "cases": cases,
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
