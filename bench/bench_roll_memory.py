"""Benchmark: memory held while retention rolls long timers forward.

Theory of operation: an in-process broker (FakeClock, no background tasks) on a fresh temporary
directory takes `--timers` timer messages with `--body-bytes` bodies, due 30 days ahead, then
enough other traffic that the timers' segments pass `retention_ms`. One retention step then
rolls every one of those timers forward (re-appends it) before it may delete their segments.
The figure is the peak of Python allocations during that step (tracemalloc, so it counts the
bodies and per-timer objects the roll holds, not RocksDB's or the page cache's memory), next to
the timers rolled and the time it took. Before the roll went in chunks it held every timer being
rolled, with its body, at once.

    .venv/bin/python bench/bench_roll_memory.py --timers 100000 --body-bytes 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import results_dir  # noqa: E402
from chronoq.broker import Broker  # noqa: E402
from chronoq.clock import FakeClock  # noqa: E402
from chronoq.config import DAY_MS, HOUR_MS, Config  # noqa: E402
from chronoq.model import OutgoingMessage  # noqa: E402

START_MS = 1_800_000_000_000


async def measure(timers: int, body_bytes: int, data: Path, roll_batch: int | None) -> dict[str, float]:
    clock = FakeClock(START_MS)
    settings: dict[str, object] = {"segment_size_bytes": 16 << 20, "retention_ms": HOUR_MS}
    if roll_batch is not None:
        settings["timer_roll_batch"] = roll_batch
    broker = await Broker.open(Config(data_dir=data, **settings), clock=clock, background=False)  # type: ignore[arg-type]
    try:
        body = b"b" * body_bytes
        for start in range(0, timers, 1000):
            await broker.send_batch([OutgoingMessage("orders", body, message_id=f"t{i}",
                                                     deliver_at_ms=START_MS + 30 * DAY_MS)
                                     for i in range(start, min(timers, start + 1000))])
        clock.advance(2 * HOUR_MS)
        filler = b"f" * 4000
        for start in range(0, 5000, 1000):  # past the timers' last segment
            await broker.send_batch([OutgoingMessage("filler", filler, message_id=f"f{i}")
                                     for i in range(start, start + 1000)])
        before = broker.store.log.start_position
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        started = time.perf_counter()
        await broker.enforce_retention()
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rolled = broker.stats()["timer"]["pending_total"]
        return {"timers": timers, "body_bytes": body_bytes, "peak_python_mb": (peak - base) / 1e6,
                "roll_s": elapsed, "deleted_bytes": broker.store.log.start_position - before, "pending": rolled}
    finally:
        await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timers", type=int, default=100_000)
    parser.add_argument("--body-bytes", type=int, default=1000)
    parser.add_argument("--roll-batch", type=int, default=None, help="timer_roll_batch (default: the config's)")
    parser.add_argument("--out", type=Path, default=results_dir() / "roll_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(measure(args.timers, args.body_bytes, Path(tmp) / "data", args.roll_batch))
    result["command"] = " ".join(sys.argv)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
