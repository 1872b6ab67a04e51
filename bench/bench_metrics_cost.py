"""Benchmark: what the metrics cost the hot path, and what one scrape costs the event loop.

Theory of operation: the metrics add work in four places on the message path, all plain Python
on values already at hand (`Broker.send_batch` counts each accepted message per topic, `receive`
counts once per call, the timer side counts each fired copy per topic, the commit log times each
group-commit fsync). Everything else is read when Prometheus scrapes. Three measurements:

1. **Per message, in isolation** (timeit): the exact counting code of `send_batch` over a batch
   of 256 `SendResult`s, the fired-copy count, a receive's count, one `FsyncTimes.record`.
2. **Per message, in the real path, with and without** (`bench_path`-style, in process, FakeClock,
   real fsync): N timers accepted in batches with the broker's counting `send_batch`, and with
   `accept.send_batch` called directly (no counting), alternated `--rounds` times on fresh
   directories; reported as CPU µs per message (`time.process_time`). On a shared machine the
   noise between rounds is larger than the difference: read (1) for the cost, (2) for "not
   measurable".
3. **One scrape**: `generate_latest` over a broker with `--topics` topics holding pending timers
   and `--groups` consumer groups, in ms of CPU: the time the event loop is away from brokering.

    .venv/bin/python bench/bench_metrics_cost.py --messages 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client import generate_latest  # noqa: E402

from chronoq.broker import Broker  # noqa: E402
from chronoq.clock import FakeClock  # noqa: E402
from chronoq.config import Config  # noqa: E402
from chronoq.http.metrics import make_registry  # noqa: E402
from chronoq.model import OutgoingMessage, SendResult  # noqa: E402
from chronoq.store.commitlog import FsyncTimes  # noqa: E402

START_MS = 1_800_000_000_000


def isolated_ns() -> dict[str, float]:
    """ns per message (per call for receive and fsync) of the counting code alone."""
    results = [SendResult(f"id{i}", "orders", 0, i, i, START_MS + i) for i in range(256)]
    accepted: dict[str, int] = {}
    timers: dict[str, int] = {}

    def count_sends() -> None:  # the loop in Broker.send_batch
        for outcome in results:
            if type(outcome) is SendResult and not outcome.duplicate:
                topic = outcome.topic
                accepted[topic] = accepted.get(topic, 0) + 1
                if outcome.deliver_at_ms is not None:
                    timers[topic] = timers.get(topic, 0) + 1

    fired: dict[str, int] = {}

    def count_fired() -> None:  # the loop in TimerService._append_fired
        for copy in results:
            fired[copy.topic] = fired.get(copy.topic, 0) + 1

    delivered: dict[str, int] = {}
    received = [1] * 32

    def count_receive() -> None:  # Broker.receive
        if received:
            delivered["orders"] = delivered.get("orders", 0) + len(received)

    times = FsyncTimes()
    n = 2000
    best = {name: min(timeit.repeat(fn, number=n, repeat=5)) / n
            for name, fn in (("send", count_sends), ("fired", count_fired), ("receive", count_receive),
                             ("fsync", lambda: times.record(0.00025)))}
    return {"send_count_ns_per_message": best["send"] / 256 * 1e9,
            "fired_count_ns_per_timer": best["fired"] / 256 * 1e9,
            "receive_count_ns_per_call": best["receive"] * 1e9,
            "fsync_record_ns_per_fsync": best["fsync"] * 1e9}


async def accept_cpu_us(n: int, batch: int, data: Path, counting: bool) -> float:
    clock = FakeClock(START_MS)
    broker = await Broker.open(Config(data_dir=data), clock=clock, background=False)
    try:
        await broker.create_topic("orders")
        send = broker.send_batch if counting else broker.accept.send_batch
        msgs = [OutgoingMessage(topic="orders", body=b"x" * 100, deliver_at_ms=START_MS + 3_600_000 + i)
                for i in range(n)]
        started = time.process_time()
        for i in range(0, n, batch):
            await send(msgs[i:i + batch])
        return (time.process_time() - started) / n * 1e6
    finally:
        await broker.close()


async def scrape_ms(topics: int, groups: int, data: Path) -> dict[str, Any]:
    clock = FakeClock(START_MS)
    broker = await Broker.open(Config(data_dir=data), clock=clock, background=False)
    try:
        for t in range(topics):
            await broker.create_topic(f"topic-{t}")
            await broker.send_batch([OutgoingMessage(topic=f"topic-{t}", body=b"x", deliver_at_ms=START_MS + 60_000 * i)
                                     for i in range(1, 11)])
            await broker.send_batch([OutgoingMessage(topic=f"topic-{t}", body=b"x") for _ in range(4)])
        for g in range(groups):
            await broker.receive(f"group-{g}", f"topic-{g % topics}", batch_size=1)
        registry = make_registry(broker)
        generate_latest(registry)
        runs = []
        for _ in range(20):
            started = time.process_time()
            body = generate_latest(registry)
            runs.append((time.process_time() - started) * 1000)
        return {"topics": topics, "groups": groups, "scrape_ms_median": statistics.median(runs),
                "scrape_bytes": len(body)}
    finally:
        await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--groups", type=int, default=100)
    args = parser.parse_args()
    out: dict[str, Any] = {"isolated": isolated_ns()}
    with_us, without_us = [], []
    for _ in range(args.rounds):
        for counting, sink in ((False, without_us), (True, with_us)):
            with tempfile.TemporaryDirectory(prefix="chronoq-metrics-cost-") as tmp:
                sink.append(asyncio.run(accept_cpu_us(args.messages, args.batch, Path(tmp), counting)))
    out["accept_cpu_us_per_message"] = {"with_counters": with_us, "without": without_us,
                                        "median_with": statistics.median(with_us),
                                        "median_without": statistics.median(without_us)}
    with tempfile.TemporaryDirectory(prefix="chronoq-metrics-cost-") as tmp:
        out["scrape"] = asyncio.run(scrape_ms(args.topics, args.groups, Path(tmp)))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
