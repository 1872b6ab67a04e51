"""Timer messages through the in-process broker: accepted per second, and delivery error.

Two phases, as the TDMQ article's table is built:
- accept: N timer messages due an hour ahead (nothing fires), sent in batches (`send_batch`,
  durable when it returns, sync flush) and one at a time by 16 concurrent producers;
  timer messages accepted per second.
- precision: N timer messages with due times spread uniformly over a window that starts after
  sending ends, one consumer group long-polling and acking in the same process. Delivery error =
  the consumer's receive time minus the due time; also the broker's own fire error (fired minus
  due, from its histogram). P50/P90/P99/P999/max, early count, lost, duplicates.

    .venv/bin/python bench/bench_timers.py [--n 100000] [--window-s 20]

Writes `bench/results/timers.json` and prints a table. The consumer shares the broker's event
loop and core, so its numbers include its own cost; the broker's fire error does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chronoq.broker import Broker
from chronoq.config import Config
from chronoq.model import OutgoingMessage

BATCH = 256


def _percentiles(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    s = sorted(values)

    def p(q: float) -> int:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"count": len(s), "p50": p(0.50), "p90": p(0.90), "p99": p(0.99), "p999": p(0.999), "max": s[-1],
            "min": s[0]}


async def accept_phase(data_dir: Path, n: int) -> dict[str, Any]:
    broker = await Broker.open(Config(data_dir=data_dir))
    body = b"x" * 100
    due = broker.clock.now_ms() + 3_600_000
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        await broker.send_batch([OutgoingMessage("accept", body, deliver_at_ms=due + j)
                                 for j in range(i, min(n, i + BATCH))])
    batched_s = time.perf_counter() - t0
    single_n = max(n // 10, 1000)
    per = single_n // 16

    async def producer(k: int) -> None:
        for j in range(per):
            await broker.send(OutgoingMessage("accept", body, deliver_at_ms=due + k * per + j))

    t0 = time.perf_counter()
    await asyncio.gather(*(producer(k) for k in range(16)))
    single_s = time.perf_counter() - t0
    pending = broker.stats()["timer"]["pending_total"]
    await broker.close()
    return {"batched": {"messages": n, "batch": BATCH, "seconds": round(batched_s, 2),
                        "msgs_per_s": round(n / batched_s)},
            "one_at_a_time_16_producers": {"messages": per * 16, "seconds": round(single_s, 2),
                                           "msgs_per_s": round(per * 16 / single_s)},
            "pending_after": pending}


async def precision_phase(data_dir: Path, n: int, window_s: float, lead_s: float,
                          trace_out: str | None = None) -> dict[str, Any]:
    broker = await Broker.open(Config(data_dir=data_dir, trace_enable=trace_out is not None))
    rng = random.Random(7)
    start_ms = broker.clock.now_ms() + int(lead_s * 1000)
    dues = sorted(start_ms + int(rng.random() * window_s * 1000) for _ in range(n))
    rng.shuffle(dues)
    due_of: dict[str, int] = {}
    received: dict[str, int] = {}
    duplicates = 0
    t0 = time.perf_counter()
    for i in range(0, n, BATCH):
        msgs = [OutgoingMessage("precision", b"y" * 100, deliver_at_ms=d) for d in dues[i:i + BATCH]]
        for msg, r in zip(msgs, await broker.send_batch(msgs), strict=True):
            due_of[r.message_id] = msg.deliver_at_ms  # type: ignore[assignment]
    send_s = time.perf_counter() - t0
    late_start_ms = broker.clock.now_ms() - start_ms
    errors: list[int] = []
    deadline = time.monotonic() + lead_s + window_s + 60
    while len(received) < n and time.monotonic() < deadline:
        got = await broker.receive("bench", "precision", batch_size=64, wait_ms=1000, invisible_duration_ms=60_000)
        now = broker.clock.now_ms()
        for m in got:
            if m.message.message_id in received:
                duplicates += 1
                continue
            received[m.message.message_id] = now
            errors.append(now - due_of[m.message.message_id])
        for m in got:
            await broker.ack("bench", "precision", m.receipt_handle)
    fire = broker.stats()["timer"]["latencies"]["delivery_error_ms"]
    await broker.close()
    if trace_out is not None:  # the delivery trace, for `chronoq spark report`
        from chronoq.spark.trace import write_trace
        from chronoq.trace import export_rows

        write_trace(export_rows(data_dir), trace_out)
    return {"messages": n, "window_s": window_s, "send_seconds": round(send_s, 2),
            "sending_ended_ms_after_first_due": late_start_ms,
            "received_minus_due_ms": _percentiles(errors), "early": sum(1 for e in errors if e < 0),
            "lost": n - len(received), "duplicates": duplicates, "broker_fired_minus_due_ms": fire}


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--lead-s", type=float, default=0.0,
                    help="due window starts this long after sending begins (default: sized to the accept rate)")
    ap.add_argument("--out", default="bench/results/timers.json")
    ap.add_argument("--trace-out", default=None, help="also write the precision run's delivery trace (Parquet)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="chronoq-bench-timers-", dir=os.environ.get("BENCH_DIR")))
    try:
        accept = await accept_phase(root / "accept", args.n)
        a = accept["batched"]
        print(f"accept: {a['msgs_per_s']:,} timer msgs/s in batches of {BATCH} ({a['messages']} in {a['seconds']} s); "
              f"{accept['one_at_a_time_16_producers']['msgs_per_s']:,}/s one at a time, 16 producers", flush=True)
        lead_s = args.lead_s or (args.n / max(a["msgs_per_s"], 1)) * 1.5 + 3
        precision = await precision_phase(root / "precision", args.n, args.window_s, lead_s, args.trace_out)
        e = precision["received_minus_due_ms"]
        f = precision["broker_fired_minus_due_ms"]
        print(f"precision: {args.n} due over {args.window_s} s; received - due ms: p50 {e.get('p50')} "
              f"p90 {e.get('p90')} p99 {e.get('p99')} p999 {e.get('p999')} max {e.get('max')}; "
              f"early {precision['early']}, lost {precision['lost']}, duplicates {precision['duplicates']}")
        print(f"           broker fired - due ms: p50 {f.get('p50')} p99 {f.get('p99')} p999 {f.get('p999')} "
              f"max {f.get('max')}", flush=True)
        result = {"benchmark": "timer messages, in-process broker", "accept": accept, "precision": precision,
                  "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                  "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
        return 0 if precision["early"] == 0 and precision["lost"] == 0 else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
