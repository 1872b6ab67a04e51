"""Probe: server CPU per one-message SendMessage, per thread, for the floor or chronoq (issue 11).

Theory of operation: start the server as the benchmark would (`floor`: `bench/peers/floor_server.py`;
`chronoq` / `chronoq-async`: `chronoq serve`, `flush = "sync"` / `"async"`), create the topic, send
50 one-timer requests with chronoq's SDK (not timed), then `--calls` more, one in flight, and print
the server's CPU per call and each of its threads' (psutil; the event loop is the process's main
thread, grpc's pollers are `event_engine`).

    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/one_message_threads.py floor --calls 3000
    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/one_message_threads.py chronoq-async --calls 3000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def start(system: str, data: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if system == "floor":
        cmd = [sys.executable, "-m", "bench.peers.floor_server", "--port", str(port)]
    else:
        env["CHRONOQ_FLUSH"] = "async" if system == "chronoq-async" else "sync"
        cmd = [sys.executable, "-m", "chronoq", "serve", "--data-dir", str(data), "--port", str(port)]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def drive(target: str, calls: int, pid: int) -> None:
    import psutil

    from chronoq.client import AsyncAdmin, AsyncProducer, outgoing

    later = int(time.time() * 1000) + 3_600_000
    msgs = [outgoing("one", b"x" * 48, deliver_at=later, message_id=f"m{i}") for i in range(calls + 50)]
    deadline = time.monotonic() + 30
    while True:
        try:
            async with AsyncAdmin(target) as admin:
                await admin.create_topic("one", 4)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    proc = psutil.Process(pid)
    async with AsyncProducer(target, batch_via="grpc", max_batch=1) as producer:
        for m in msgs[:50]:
            await producer.send_batch([m])
        before = {t.id: t.user_time + t.system_time for t in proc.threads()}
        t0 = time.monotonic()
        for m in msgs[50:]:
            await producer.send_batch([m])
        wall = time.monotonic() - t0
        after = {t.id: t.user_time + t.system_time for t in proc.threads()}
    total = sum(after.values()) - sum(before.get(k, 0.0) for k in after)
    print(f"{calls} calls, {calls / wall:.0f}/s, server CPU {total / calls * 1e6:.0f} µs a call")
    for tid, t in sorted(after.items(), key=lambda kv: -(kv[1] - before.get(kv[0], 0.0))):
        spent = t - before.get(tid, 0.0)
        if spent > 0.005:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            print(f"  {'event loop' if tid == pid else name + ' ' + str(tid)}: {spent / calls * 1e6:.0f} µs a call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("system", choices=("floor", "chronoq", "chronoq-async"))
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    from bench.harness.procs import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start(args.system, Path(tmp) / "data", port)
        try:
            print(args.system)
            asyncio.run(drive(f"127.0.0.1:{port}", args.calls, server.pid))
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
