"""Benchmark: timer messages accepted per second by `chronoq serve`, and delivery error.

Theory of operation: one `chronoq serve` child process on loopback (fresh temp data dir, the
default configuration: sync flush), driven by
  1. chronoq's SDK, one producer sending batches (SendMessage with many messages, and the admin
     SendBatch), then one message per call (sequentially, and with a window of concurrent calls);
  2. the official `rocketmq-python-client` Producer, in its own process (this script re-run with
     `--official-child`), sending one message per call (`send`) and with futures (`send_async`);
  3. a delivery run: SDK consumers long-poll, then timer messages due 3-8 s after the send
     began, spread evenly, are sent in batches; delivery error = the client's receive time -
     the due time (same machine, same clock), beside the broker's own fire time - due time.
     Never-early is checked: any negative error is counted.
Throughput phases send timers due in an hour, so the timer wheel holds them and nothing fires
while sending. Each throughput run also reports the server's CPU per message (its process's
user + system time over the run, psutil). Results go to `sdk.json` under `bench.results_dir()`
(or `--out`) and a table on stdout.

    .venv/bin/python bench/bench_sdk.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import results_dir  # noqa: E402

HOUR_MS = 3_600_000
BODY = b"x" * 100


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])


# -- chronoq SDK phases ------------------------------------------------------------------------


async def sdk_batches(address: str, topic: str, n: int, batch: int, via: str) -> dict[str, Any]:
    from chronoq.client import AsyncProducer, outgoing

    async with AsyncProducer(address, batch_via=via, max_batch=batch, timeout_ms=60_000) as p:
        await p.create_topic(topic)
        due_ms = now_ms() + HOUR_MS
        msgs = [outgoing(topic, BODY, deliver_at=due_ms + i % 1000) for i in range(n)]
        start, cpu = time.perf_counter(), time.process_time()
        receipts = await p.send_batch(msgs)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(receipts) == n
    return {"messages": n, "batch": batch, "via": via, "seconds": elapsed, "per_second": n / elapsed,
            "client_cpu_seconds": cpu}


async def sdk_single(address: str, topic: str, n: int, window: int) -> dict[str, Any]:
    from chronoq.client import AsyncProducer

    async with AsyncProducer(address, timeout_ms=60_000) as p:
        await p.create_topic(topic)
        due_ms = now_ms() + HOUR_MS
        sem = asyncio.Semaphore(window)

        async def one(i: int) -> None:
            async with sem:
                await p.send(topic, BODY, deliver_at=due_ms + i % 1000)

        start, cpu = time.perf_counter(), time.process_time()
        if window == 1:
            for i in range(n):
                await p.send(topic, BODY, deliver_at=due_ms + i % 1000)
        else:
            await asyncio.gather(*(one(i) for i in range(n)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"messages": n, "window": window, "seconds": elapsed, "per_second": n / elapsed,
            "client_cpu_seconds": cpu}


async def delivery_run(address: str, topic: str, n: int, consumers: int, batch: int,
                       lead_ms: int, spread_ms: int) -> dict[str, Any]:
    """Consumers long-poll from the start; the producer then sends `n` timers due `lead_ms` to
    `lead_ms + spread_ms` from now. `lead_ms` must cover the whole send, or the first messages
    are overdue before they are stored (recorded as `send_finished_before_first_due_ms`)."""
    from chronoq.client import AsyncConsumer, AsyncProducer, outgoing

    errors: list[int] = []
    seen: set[str] = set()
    all_sent = asyncio.Event()

    async def consume(deadline_ms: list[int]) -> None:
        async with AsyncConsumer("bench", topic, server=address, timeout_ms=10_000) as c:
            while len(seen) < n and (not all_sent.is_set() or now_ms() < deadline_ms[0]):
                got = await c.receive(64, invisible=60_000, wait=1000)
                for m in got:
                    if m.message_id not in seen:
                        seen.add(m.message_id)
                        errors.append(m.received_ms - m.deliver_at_ms)
                if got:
                    await c.ack(*got)

    async with AsyncProducer(address, max_batch=batch, timeout_ms=60_000) as p:
        await p.create_topic(topic)
        deadline = [now_ms() + 600_000]
        tasks = [asyncio.create_task(consume(deadline)) for _ in range(consumers)]
        await asyncio.sleep(0.5)  # consumers are polling before the first send
        base_ms = now_ms() + lead_ms
        msgs = [outgoing(topic, BODY, deliver_at=base_ms + (spread_ms * i) // n) for i in range(n)]
        await p.send_batch(msgs)
        sent_done_ms = now_ms()
        deadline[0] = base_ms + spread_ms + 30_000
        all_sent.set()
        await asyncio.gather(*tasks)
    errors.sort()
    return {
        "messages": n, "received": len(seen), "consumers": consumers, "lead_ms": lead_ms, "spread_ms": spread_ms,
        "send_finished_before_first_due_ms": base_ms - sent_done_ms,
        "early": sum(1 for e in errors if e < 0),
        "error_ms": {"min": errors[0] if errors else None, "p50": percentile(errors, 0.50),
                     "p99": percentile(errors, 0.99), "p999": percentile(errors, 0.999),
                     "max": errors[-1] if errors else None},
    }


# -- the official client, in its own process -----------------------------------------------------


def official_child(address: str, topic: str, n: int, mode: str, window: int) -> None:
    """Runs in a separate process: chronoq's protocol modules and the client's cannot share one."""
    from rocketmq import ClientConfiguration, Credentials, Message, Producer

    producer = Producer(ClientConfiguration(address, Credentials(), request_timeout=30), (topic,))
    producer.startup()
    try:
        due_s = int(time.time()) + 3600  # the client writes this int into Timestamp.seconds

        def message() -> Any:
            m = Message()
            m.topic = topic
            m.body = BODY
            m.delivery_timestamp = due_s
            return m

        producer.send(message())  # warm up: route, telemetry, channel
        start = time.perf_counter()
        if mode == "sync":
            for _ in range(n):
                producer.send(message())
        else:
            # A window of `window` sends in flight, like the SDK's windowed run (all 3,000 at once
            # made the client cancel its own RPCs).
            in_flight: collections.deque[Any] = collections.deque()
            for _ in range(n):
                if len(in_flight) >= window:
                    in_flight.popleft().result(timeout=120)
                in_flight.append(producer.send_async(message()))
            for f in in_flight:
                f.result(timeout=120)
        elapsed = time.perf_counter() - start
    finally:
        producer.shutdown()
    print(json.dumps({"messages": n, "mode": mode, "window": window if mode != "sync" else 1, "seconds": elapsed,
                      "per_second": n / elapsed}), flush=True)


def run_official(address: str, topic: str, n: int, mode: str, window: int) -> dict[str, Any]:
    from chronoq.client import Admin

    with Admin(address) as a:
        a.create_topic(topic)
    proc = subprocess.run([sys.executable, __file__, "--official-child", address, topic, str(n), mode, str(window)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = proc.stderr or proc.stdout
        return {"messages": n, "mode": mode, "error": err if len(err) < 6000 else err[:3000] + "\n...\n" + err[-3000:]}
    return json.loads(lines[-1])


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20_000, help="messages per batched throughput run")
    ap.add_argument("--single", type=int, default=3_000, help="messages per one-at-a-time run")
    ap.add_argument("--official", type=int, default=3_000, help="messages per official-client run")
    ap.add_argument("--delivery", type=int, default=5_000, help="messages in the delivery-error run")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lead-ms", type=int, default=3000, help="delivery run: first due time after the start")
    ap.add_argument("--spread-ms", type=int, default=5000, help="delivery run: due times spread over this")
    ap.add_argument("--window", type=int, default=64, help="concurrent single sends")
    ap.add_argument("--out", default=str(results_dir() / "sdk.json"))
    ap.add_argument("--official-child", nargs=5, metavar=("ADDR", "TOPIC", "N", "MODE", "WINDOW"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.official_child:
        addr, topic, n, mode, window = args.official_child
        official_child(addr, topic, int(n), mode, int(window))
        return 0

    from chronoq.client.testing import ServerProcess

    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "python": platform.python_version(), "body_bytes": len(BODY),
        "load_average_at_start": os.getloadavg(), "server": "chronoq serve, default config",
    }
    with tempfile.TemporaryDirectory(prefix="chronoq-bench-") as tmp, ServerProcess(Path(tmp) / "data") as server:
        addr = server.address
        assert server.pid is not None
        server_cpu = psutil.Process(server.pid).cpu_times

        def with_server_cpu(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
            """`run`'s result plus the server's CPU over it, per message (a client process's
            start-up, for the official client, counts: it is a few connection set-up RPCs)."""
            before = server_cpu()
            result = run()
            after = server_cpu()
            cpu_s = (after.user + after.system) - (before.user + before.system)
            if "error" not in result:
                result["server_cpu_us_per_message"] = cpu_s * 1e6 / result["messages"]
            return result

        results["sdk_batch_grpc"] = with_server_cpu(lambda: asyncio.run(
            sdk_batches(addr, "bench-batch-grpc", args.messages, args.batch, "grpc")))
        results["sdk_batch_admin"] = with_server_cpu(lambda: asyncio.run(
            sdk_batches(addr, "bench-batch-admin", args.messages, args.batch, "admin")))
        results["sdk_single_sequential"] = with_server_cpu(
            lambda: asyncio.run(sdk_single(addr, "bench-single", args.single, 1)))
        results["sdk_single_window"] = with_server_cpu(
            lambda: asyncio.run(sdk_single(addr, "bench-window", args.single, args.window)))
        results["official_sync"] = with_server_cpu(
            lambda: run_official(addr, "bench-official-sync", args.official, "sync", 1))
        results["official_async"] = with_server_cpu(
            lambda: run_official(addr, "bench-official-async", args.official, "async", args.window))
        from chronoq.client import Admin

        with Admin(addr) as a:
            before = a.stats()["timer"]["latencies"]["delivery_error_ms"]["count"]
            if before:
                results["note"] = f"{before} timers fired before the delivery run"
            results["delivery"] = asyncio.run(delivery_run(addr, "bench-delivery", args.delivery, 4, args.batch,
                                                            args.lead_ms, args.spread_ms))
            results["server_stats"] = a.stats()
            # The broker's own measure: fire time - due time, over every timer it fired (only the
            # delivery run's, since the throughput runs' timers are due in an hour).
            results["delivery"]["broker_fire_error_ms"] = results["server_stats"]["timer"]["latencies"][
                "delivery_error_ms"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print(f"\nwritten to {out}")
    return 0


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    load = ", ".join(f"{x:.1f}" for x in results["load_average_at_start"])
    table = Table(title=f"chronoq serve on loopback, {results['cpus']} cpus, load {load}, {results['when']}")
    for col in ("run", "messages", "seconds", "timer msgs/s", "server CPU µs/msg"):
        table.add_column(col, justify="right" if col != "run" else "left")
    labels = {
        "sdk_batch_grpc": f"SDK batches of {results['sdk_batch_grpc']['batch']} (SendMessage)",
        "sdk_batch_admin": f"SDK batches of {results['sdk_batch_admin']['batch']} (admin SendBatch)",
        "sdk_single_sequential": "SDK one at a time, sequential",
        "sdk_single_window": f"SDK one at a time, {results['sdk_single_window']['window']} in flight",
        "official_sync": "official Python client, send()",
        "official_async": f"official Python client, send_async(), {results['sdk_single_window']['window']} in flight",
    }
    for key, label in labels.items():
        r = results[key]
        if "error" in r:
            table.add_row(label, str(r["messages"]), "-", "failed: " + r["error"].splitlines()[-1][:60], "-")
        else:
            table.add_row(label, f"{r['messages']:,}", f"{r['seconds']:.2f}", f"{r['per_second']:,.0f}",
                          f"{r['server_cpu_us_per_message']:,.0f}")
    console = Console()
    console.print(table)
    d = results["delivery"]
    e = d["error_ms"]
    b = d["broker_fire_error_ms"]
    console.print(f"delivery run: {d['received']}/{d['messages']} timer messages due over {d['spread_ms']} ms "
                  f"starting {d['lead_ms']} ms after the send began; sending ended "
                  f"{d['send_finished_before_first_due_ms']} ms before the first due time; {d['consumers']} SDK "
                  "consumers long-polling")
    console.print(f"  received - due (SDK consumer): P50 {e['p50']:.0f} ms, P99 {e['p99']:.0f} ms, "
                  f"P999 {e['p999']:.0f} ms, max {e['max']} ms, early {d['early']}")
    console.print(f"  fired - due (broker stats):    P50 {b['p50']} ms, P99 {b['p99']} ms, P999 {b['p999']} ms, "
                  f"max {b['max']} ms")


if __name__ == "__main__":
    sys.exit(main())
