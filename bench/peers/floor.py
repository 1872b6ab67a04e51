"""The floor: chronoq's protocol served by a stub that stores nothing, driven by chronoq's own clients.

Theory of operation: the server is `python -m bench.peers.floor_server` (see its docstring): a
grpc.aio MessagingService plus the admin calls the bench uses, which decodes every request and
builds every response protobuf per call and keeps messages in memory only (a heap by due time, so
timers are delivered when due). The clients are chronoq's, unchanged (`ChronoqProducer`,
`ChronoqConsumer`, and the admin calls of `setup`, `pending` and `server_stats`, all inherited
from the chronoq peer), so the floor and chronoq see byte-for-byte the same requests (but for
receive: chronoq's consumer uses chronoq's batched receive, which the floor does not serve; the
floor's consumer, like `chronoq-stream`'s, calls RocketMQ's ReceiveMessage): whatever the
floor's server spends per message is the price of the protocol in Python with grpc.aio on the
host at hand, and chronoq's figure divided by the floor's is how far chronoq is above that limit.

What the floor is not: a broker. It has no disk, no dedupe, no invisible duration or
redelivery (an ack is answered and forgotten), and a restart loses everything; so the crash and
backlog phases do not apply to it (a crash loses everything by design, and a 10 M backlog is
10 M Python objects in RAM, which says nothing about the protocol).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, free_port, tcp_open, wait_ready
from bench.peers.chronoq_peer import Chronoq

ROOT = Path(__file__).resolve().parent.parent.parent
"""The source tree holding `bench/`: the server runs as `python -m bench.peers.floor_server` from here."""
READY_LINE = "floor serving on"
"""Printed by the server once its port accepts calls (`floor_server.READY_LINE`, not imported: the
harness process need not load the protobuf modules)."""


class FloorPeer(Chronoq):
    name = "floor"
    design = ("stub MessagingService (grpc.aio): decodes each request, builds each response protobuf; "
              "timers in an in-memory heap")
    durability = "none: memory only, no redelivery (the cost of the protocol in Python, not a broker)"
    batch_label = "send_batch"
    batch_receive = False
    """The floor has no batched receive: its consumer calls ReceiveMessage, as the official clients do."""
    unsupported = {
        "crash": "stores nothing durable: a crash loses every message by design",
        "backlog": "holds timers as Python objects in RAM: a backlog measures nothing about the protocol",
    }

    @property
    def redelivery_after_s(self) -> float:  # type: ignore[override]
        return 0.0

    def check(self) -> str | None:
        try:
            import grpc  # noqa: F401
            import rocketmq.grpc_protocol.service_pb2  # noqa: F401

            import chronoq.client  # noqa: F401
        except ImportError as e:
            return f"grpc, the rocketmq protobuf modules or chronoq's SDK cannot be imported: {e}"
        return None

    def version(self) -> str:
        from importlib.metadata import version

        return f"grpcio {version('grpcio')}, protobuf {version('protobuf')}"

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        addr = addr or {"host": LOOPBACK, "port": free_port()}
        data_dir.mkdir(parents=True, exist_ok=True)  # nothing is written there; the harness measures its size
        argv = [sys.executable, "-m", "bench.peers.floor_server", "--host", LOOPBACK, "--port", str(addr["port"])]
        log_path = log_dir / "floor.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        started = time.monotonic()
        server = Server([ChildProcess("floor", argv, log_path, cwd=ROOT)], addr, data_dir)

        def probe() -> bool:
            with open(log_path, "rb") as f:
                f.seek(offset)
                return READY_LINE.encode() in f.read() and tcp_open(addr["port"])

        wait_ready(server, probe, 60, started)
        return server

    def server_stats(self, addr: dict[str, Any]) -> dict[str, Any] | None:
        """The floor's call counts: requests per RPC and the messages they carried, i.e. how full
        the receives and acks of the run were (the per-call cost is spread over that many)."""
        import asyncio

        from chronoq.client import AsyncAdmin

        async def go() -> dict[str, Any]:
            async with AsyncAdmin(f"{addr['host']}:{addr['port']}") as admin:
                stats = await admin.stats()
            return {"pending_total": stats["timer"]["pending_total"], "calls": stats.get("calls")}

        return asyncio.run(go())


PEER = FloorPeer()
