"""beanstalkd delayed jobs (Debian package), with its write-ahead log on.

Theory of operation: `put` carries a delay in whole seconds, so the producer rounds the time left
until the due time up (a job can be late by up to a second by construction, never early).
One-at-a-time sends use greenstalk; the pipelined mode writes a chunk of `put` commands on its own
socket and then reads the chunk's `INSERTED` replies, which the text protocol allows. The consumer
reserves one job at a time (beanstalkd hands out jobs singly) and deletes it as the ack. The binlog
is fsynced at most every 50 ms (beanstalkd's default with -b).
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, free_port, tcp_open, wait_ready
from bench.peers.base import ConsumerClient, Msg, Peer, ProducerClient

TUBE = "bench"
PRIORITY = 1024
TTR_S = 60


def _delay_s(due_ms: int) -> int:
    return max(0, math.ceil((due_ms - time.time() * 1000) / 1000))


def _client(addr: dict[str, Any]) -> Any:
    import greenstalk

    return greenstalk.Client((addr["host"], addr["port"]), encoding=None, use=TUBE, watch=TUBE)


class BeanstalkProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.client = _client(self.addr)
        self.sock = socket.create_connection((self.addr["host"], self.addr["port"]))
        self.reader = self.sock.makefile("rb")
        self.sock.sendall(f"use {TUBE}\r\n".encode())
        line = self.reader.readline()
        if not line.startswith(b"USING"):
            raise RuntimeError(f"beanstalkd answered {line!r} to use")

    async def send_one(self, msg: Msg) -> None:
        self.client.put(msg.body, priority=PRIORITY, delay=_delay_s(msg.due_ms), ttr=TTR_S)

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        buf = b"".join(b"put %d %d %d %d\r\n%b\r\n" % (PRIORITY, _delay_s(m.due_ms), TTR_S, len(m.body), m.body)
                       for m in msgs)
        self.sock.sendall(buf)
        for _ in msgs:
            line = self.reader.readline()
            if not line.startswith(b"INSERTED"):
                raise RuntimeError(f"beanstalkd answered {line!r} to put")

    async def close(self) -> None:
        self.client.close()
        self.reader.close()
        self.sock.close()


class BeanstalkConsumer(ConsumerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.client = _client(self.addr)

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        import greenstalk

        try:
            # reserve-with-timeout takes whole seconds; 0 would spin, so wait up to one second.
            job = self.client.reserve(timeout=max(1, round(max_wait_s)))
        except greenstalk.TimedOutError:
            return []
        return [(job.body, job)]

    async def ack(self, tokens: Sequence[Any]) -> None:
        for job in tokens:
            self.client.delete(job)

    async def close(self) -> None:
        self.client.close()


class Beanstalkd(Peer):
    name = "beanstalkd"
    design = "put with delay in whole seconds (rounded up); reserve + delete"
    durability = "binlog (-b), fsync at most every 50 ms (default)"
    burst_note = ("delays are whole seconds, rounded up as each message is sent: the common due time becomes "
                  "up to 1 s of due times after it")

    def check(self) -> str | None:
        if shutil.which("beanstalkd") is None:
            return "beanstalkd is not on PATH (Debian package beanstalkd; scripts/install-peers.sh)"
        try:
            import greenstalk  # noqa: F401
        except ImportError as e:
            return f"Python client missing: {e}"
        return None

    def version(self) -> str:
        out = subprocess.run(["beanstalkd", "-v"], capture_output=True, text=True, check=True).stdout
        return out.split()[-1]

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        addr = addr or {"host": LOOPBACK, "port": free_port()}
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = ["beanstalkd", "-l", LOOPBACK, "-p", str(addr["port"]), "-b", str(data_dir)]
        started = time.monotonic()
        server = Server([ChildProcess("beanstalkd", argv, log_dir / "beanstalkd.log")], addr, data_dir)

        def probe() -> bool:
            if not tcp_open(addr["port"]):
                return False
            c = _client(addr)
            try:
                return "version" in c.stats()
            finally:
                c.close()

        wait_ready(server, probe, 120, started)
        return server

    def pending(self, addr: dict[str, Any]) -> int:
        import greenstalk

        c = _client(addr)
        try:
            return int(c.stats_tube(TUBE)["current-jobs-delayed"])
        except greenstalk.NotFoundError:
            return 0  # the tube exists only while it holds jobs
        finally:
            c.close()

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return BeanstalkProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return BeanstalkConsumer(addr)


PEER = Beanstalkd()
