"""Benchmark: server CPU per message for each RPC kind, at full batches: the floor, chronoq, or both.

Theory of operation: `python -m bench` measures whole workloads, whose cost per message depends
on how full the calls were (a consumer waiting for timers gets a few messages per receive). This
script measures each RPC alone with full calls, so its figures are the per-message prices the
workloads are made of, and the floor's are the protocol's own prices in Python with grpc.aio here:
  1. SendMessage with `--batch` messages per request (timers an hour ahead: nothing fires);
  2. the admin SendBatch (JSON) with `--batch` messages per request (what the bench's producer uses);
  3. SendMessage with one message per request (`--window` requests in flight);
  4. ReceiveMessage of 64 (messages already due, so every call streams a full 64);
  5. AckMessage of 32 entries.
Each system is a fresh server started by its bench peer (`bench/peers/`); the client is chronoq's
SDK in this process, `--window` calls in flight. Server CPU is user + system time of the server's
process tree (psutil) from just before the first call of a step to just after its last reply.

    PYTHONPATH=. .venv/bin/python bench/bench_rpc_cpu.py --systems floor,chronoq
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import results_dir  # noqa: E402
from bench.harness.procs import Server  # noqa: E402
from bench.peers.base import load_peer  # noqa: E402

TOPIC = "rpc-cpu"
GROUP = "rpc-cpu"
BODY = b"x" * 48
"""About the size of the side-by-side bench's bodies."""
HOUR_MS = 3_600_000
RECEIVE_BATCH = 64
ACK_BATCH = 32


def server_cpu_s(server: Server) -> float:
    total = 0.0
    for proc in server.tree():
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def in_window(window: int, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
    """Run the calls with at most `window` in flight, in order."""
    it = iter(calls)

    async def lane() -> None:
        for call in it:
            await call()

    await asyncio.gather(*(lane() for _ in range(window)))


async def measure(server: Server, window: int, calls: Sequence[Callable[[], Awaitable[Any]]],
                  items: int) -> dict[str, Any]:
    cpu0, t0 = server_cpu_s(server), time.monotonic()
    await in_window(window, calls)
    cpu_s, wall_s = server_cpu_s(server) - cpu0, time.monotonic() - t0
    return {"items": items, "requests": len(calls), "server_cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3),
            "cpu_us_per_item": round(cpu_s * 1e6 / items, 1), "items_per_s": round(items / wall_s, 1)}


async def run_steps(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    from chronoq.client import AsyncAdmin, AsyncConsumer, AsyncProducer, outgoing

    target = f"{server.addr['host']}:{server.addr['port']}"
    out: dict[str, Any] = {}
    later_ms = int(time.time() * 1000) + HOUR_MS
    seq = iter(range(10**9))

    def msgs(n: int, due_ms: int) -> list[Any]:
        return [outgoing(TOPIC, BODY, deliver_at=due_ms, message_id=f"m{next(seq)}") for _ in range(n)]

    async with AsyncProducer(target, batch_via="grpc", max_batch=args.batch) as grpc_p, \
            AsyncProducer(target, batch_via="admin", max_batch=args.batch) as admin_p:
        await grpc_p.send_batch(msgs(1, later_ms))  # channels open, topic routed: not timed
        await admin_p.send_batch(msgs(1, later_ms))
        n_req = args.messages // args.batch
        # Messages are built before a step starts: the client's work is not what is measured.
        batches = [msgs(args.batch, later_ms) for _ in range(n_req)]
        out[f"SendMessage x{args.batch}"] = await measure(
            server, args.window, [lambda b=b: grpc_p.send_batch(b) for b in batches], n_req * args.batch)
        batches = [msgs(args.batch, later_ms) for _ in range(n_req)]
        out[f"SendBatch x{args.batch} (admin JSON)"] = await measure(
            server, args.window, [lambda b=b: admin_p.send_batch(b) for b in batches], n_req * args.batch)
        for window in sorted({1, args.window}):
            singles = msgs(args.single, later_ms)
            out[f"SendMessage x1, {window} in flight"] = await measure(
                server, window, [lambda m=m: grpc_p.send_batch([m]) for m in singles], args.single)
        # Messages for the receive step: due now, so they are all deliverable before it starts.
        now_due = msgs(args.messages, int(time.time() * 1000))
        for start in range(0, len(now_due), args.batch):
            await admin_p.send_batch(now_due[start:start + args.batch])
    async with AsyncAdmin(target) as admin:
        deadline = time.monotonic() + 120
        while await _pending(admin) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # let the server settle what the fire just did
    received: list[Any] = []
    async with AsyncConsumer(GROUP, TOPIC, server=target, timeout_ms=30_000) as c:
        async def receive() -> None:
            received.extend(await c.receive(RECEIVE_BATCH, invisible=600_000))

        n_recv = args.messages // RECEIVE_BATCH
        out[f"ReceiveMessage x{RECEIVE_BATCH}"] = await measure(server, args.window, [receive] * n_recv,
                                                                  n_recv * RECEIVE_BATCH)
        out[f"ReceiveMessage x{RECEIVE_BATCH}"]["items"] = len(received)  # what actually came
        chunks = [received[i:i + ACK_BATCH] for i in range(0, len(received) - ACK_BATCH + 1, ACK_BATCH)]
        out[f"AckMessage x{ACK_BATCH}"] = await measure(
            server, args.window, [lambda ch=ch: c.ack(*ch) for ch in chunks], len(chunks) * ACK_BATCH)
    for step in out.values():
        step["cpu_us_per_item"] = round(step["server_cpu_s"] * 1e6 / max(1, step["items"]), 1)
    return out


async def _pending(admin: Any) -> int:
    return int((await admin.stats())["timer"]["pending_total"])


def run_system(name: str, args: argparse.Namespace) -> dict[str, Any]:
    peer = load_peer(name)
    reason = peer.check()
    if reason is not None:
        return {"error": reason}
    with tempfile.TemporaryDirectory(prefix=f"rpc-cpu-{name}-") as tmp:
        server = peer.start(Path(tmp) / "data", Path(tmp) / "logs")
        try:
            return asyncio.run(run_steps(server, args))
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="floor,chronoq", help="comma list of bench systems with chronoq's SDK")
    ap.add_argument("--messages", type=int, default=20_000, help="messages per batched step and receive step")
    ap.add_argument("--single", type=int, default=2_000, help="requests in the one-message steps")
    ap.add_argument("--batch", type=int, default=100, help="messages per batched send")
    ap.add_argument("--window", type=int, default=4, help="calls in flight")
    ap.add_argument("--out", default=str(results_dir() / "rpc_cpu.json"))
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "cpus": os.cpu_count(), "load_at_start": os.getloadavg(), "args": vars(args),
                               "systems": {}}
    names = [s for s in args.systems.split(",") if s]
    for name in names:
        results["systems"][name] = run_system(name, args)
    results["load_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    steps = list(dict.fromkeys(k for s in results["systems"].values() for k in s if k != "error"))
    print(f"server CPU µs per message (per request for x1), load {results['load_at_start']} -> "
          f"{results['load_at_end']}")
    print("| RPC | " + " | ".join(names) + (" | chronoq/floor |" if {"floor", "chronoq"} <= set(names) else " |"))
    print("|---" * (len(names) + 1 + ({"floor", "chronoq"} <= set(names))) + "|")
    for step in steps:
        vals = [results["systems"][n].get(step, {}).get("cpu_us_per_item") for n in names]
        row = f"| {step} | " + " | ".join("-" if v is None else f"{v:,.1f}" for v in vals) + " |"
        if {"floor", "chronoq"} <= set(names):
            f = results["systems"]["floor"].get(step, {}).get("cpu_us_per_item")
            c = results["systems"]["chronoq"].get(step, {}).get("cpu_us_per_item")
            row += f" {c / f:.2f} |" if f and c else " - |"
        print(row)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
