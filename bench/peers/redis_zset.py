"""Redis sorted-set delay queue: the most common do-it-yourself design.

Theory of operation: the producer ZADDs each body with its due time (ms) as the score; the
consumer runs a Lua script that claims up to `CLAIM_BATCH` members whose score is <= now and
removes them in the same atomic step, so two pollers could never take the same message. It polls
every `POLL_INTERVAL_S` when nothing is due and again at once after a full batch. Redis runs with
the append-only file fsynced every second (the usual production setting); a claimed message is
gone from Redis, so delivery is at-most-once after the claim.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, free_port, tcp_open, wait_ready
from bench.peers.base import ConsumerClient, Msg, Peer, ProducerClient

KEY = "bench:delayed"
CLAIM_BATCH = 500
POLL_INTERVAL_S = 0.01
CLAIM_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return due
"""


def _client(addr: dict[str, Any]) -> Any:
    import redis

    return redis.Redis(host=addr["host"], port=addr["port"], socket_timeout=10)


class RedisProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.r = _client(addr)

    async def send_one(self, msg: Msg) -> None:
        self.r.zadd(KEY, {msg.body: msg.due_ms})

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for m in msgs:
            pipe.zadd(KEY, {m.body: m.due_ms})
        pipe.execute()

    async def close(self) -> None:
        self.r.close()


class RedisConsumer(ConsumerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.r = _client(addr)
        self.claim = self.r.register_script(CLAIM_LUA)

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        deadline = time.monotonic() + max_wait_s
        while True:
            got = self.claim(keys=[KEY], args=[int(time.time() * 1000), CLAIM_BATCH])
            if got or time.monotonic() >= deadline:
                return [(body, None) for body in got]
            await asyncio.sleep(POLL_INTERVAL_S)

    async def ack(self, tokens: Sequence[Any]) -> None:
        return None  # the claim script already removed them

    async def close(self) -> None:
        self.r.close()


class RedisZset(Peer):
    name = "redis"
    design = (f"ZADD score=due ms; Lua ZRANGEBYSCORE+ZREM claims {CLAIM_BATCH}, polled every "
              f"{POLL_INTERVAL_S * 1000:.0f} ms")
    durability = "AOF, fsync every second"

    def check(self) -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server is not on PATH (Debian package redis-server; scripts/install-peers.sh)"
        try:
            import redis  # noqa: F401
        except ImportError as e:
            return f"Python client missing: {e}"
        return None

    def version(self) -> str:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=True).stdout
        return out.split()[2].removeprefix("v=")

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        addr = addr or {"host": LOOPBACK, "port": free_port()}
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = ["redis-server", "--port", str(addr["port"]), "--bind", LOOPBACK, "--dir", str(data_dir),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
                "--protected-mode", "yes"]
        started = time.monotonic()
        server = Server([ChildProcess("redis-server", argv, log_dir / "redis.log")], addr, data_dir)

        def probe() -> bool:
            if not tcp_open(addr["port"]):
                return False
            r = _client(addr)
            try:
                return bool(r.ping())
            finally:
                r.close()

        wait_ready(server, probe, 60, started)
        return server

    def pending(self, addr: dict[str, Any]) -> int:
        r = _client(addr)
        try:
            return int(r.zcard(KEY))
        finally:
            r.close()

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return RedisProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return RedisConsumer(addr)


PEER = RedisZset()
