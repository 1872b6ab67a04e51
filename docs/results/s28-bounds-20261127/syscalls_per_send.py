"""Probe: system calls the server makes per one-message SendMessage, counted by `strace -f -c`.

Starts the bench peer named (floor, chronoq, chronoq-async) in a temporary directory, sends 100
one-message requests to warm it, then counts every system call of the server's threads over
2,000 more (one in flight, chronoq's SDK over gRPC, each a timer an hour ahead) and writes
strace's table to `--out`. Divide the calls by 2,000 for calls per request.

    PYTHONPATH=. .venv/bin/python docs/results/s28-bounds-20261127/syscalls_per_send.py chronoq --out strace-chronoq.txt
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.peers.base import load_peer  # noqa: E402
from chronoq.client import AsyncProducer, outgoing  # noqa: E402

REQUESTS = 2000


async def probe(server: object, out: Path) -> None:
    target = f"{server.addr['host']}:{server.addr['port']}"  # type: ignore[attr-defined]
    later = int(time.time() * 1000) + 3_600_000
    async with AsyncProducer(target, batch_via="grpc") as p:
        for i in range(100):
            await p.send_batch([outgoing("t", b"x" * 48, deliver_at=later, message_id=f"w{i}")])
        pid = server.tree()[0].pid  # type: ignore[attr-defined]
        st = subprocess.Popen(["strace", "-f", "-c", "-p", str(pid), "-o", str(out)])
        await asyncio.sleep(1)  # strace attached to every thread
        for i in range(REQUESTS):
            await p.send_batch([outgoing("t", b"x" * 48, deliver_at=later, message_id=f"m{i}")])
        st.send_signal(signal.SIGINT)
        st.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = load_peer(args.peer).start(Path(tmp) / "data", Path(tmp) / "logs")
        try:
            asyncio.run(probe(server, args.out.resolve()))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
