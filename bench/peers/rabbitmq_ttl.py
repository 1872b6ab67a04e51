"""RabbitMQ (Debian package) with per-queue TTL and a dead-letter exchange, bucketed by delay.

Theory of operation: RabbitMQ has no scheduled delivery in the box (the delayed-message plugin is
not packaged here), so the usual substitute is a set of durable queues `delay.<k>s`, each with
`x-message-ttl = k s` and dead-lettering into the durable queue `ready`. A message with k seconds
left (rounded up, so never early) goes to bucket k; within a bucket every message has the same TTL,
so the head always expires first and nothing waits behind a longer delay (one queue with
per-message TTLs would block at the head). Producers declare buckets as they need them.
One-at-a-time sends wait for a publisher confirm each; the batched mode commits a chunk in one AMQP
transaction. The consumer reads `ready` with a prefetch window and acks each delivery.

Server: `rabbitmq-server` run as a child with its own node name, cookie (HOME), mnesia and log dirs
under the temp data dir, every listener on 127.0.0.1 (the Erlang distribution port too, through
`inet_dist_use_interface`), and its own epmd started first in the foreground, because an epmd the
broker starts itself daemonises and outlives it.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, free_port, tcp_open, wait_ready
from bench.peers.base import ConsumerClient, Msg, Peer, ProducerClient

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
READY = "ready"
PREFETCH = 500


def bucket(k: int) -> str:
    return f"delay.{k}s"


def _params(addr: dict[str, Any]) -> Any:
    import pika

    return pika.ConnectionParameters(host=addr["host"], port=addr["port"], heartbeat=0,
                                     blocked_connection_timeout=60, connection_attempts=1)


def _connect(addr: dict[str, Any]) -> Any:
    import pika

    return pika.BlockingConnection(_params(addr))


def _env(addr: dict[str, Any], data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HOME": str(data_dir),
        "RABBITMQ_NODENAME": addr["node"],
        "RABBITMQ_NODE_IP_ADDRESS": LOOPBACK,
        "RABBITMQ_NODE_PORT": str(addr["port"]),
        "RABBITMQ_DIST_PORT": str(addr["dist_port"]),
        "ERL_EPMD_ADDRESS": LOOPBACK,
        "ERL_EPMD_PORT": str(addr["epmd_port"]),
        "RABBITMQ_MNESIA_BASE": str(data_dir / "mnesia"),
        "RABBITMQ_LOG_BASE": str(data_dir / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(data_dir / "enabled_plugins"),
        "RABBITMQ_CONFIG_FILE": str(data_dir / "rabbitmq"),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
    })
    return env


class RabbitProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr
        self.declared: set[int] = set()

    async def open(self) -> None:
        import pika

        self.conn = _connect(self.addr)
        self.confirm_ch = self.conn.channel()
        self.confirm_ch.confirm_delivery()
        self.tx_ch = self.conn.channel()
        self.tx_ch.tx_select()
        self.props = pika.BasicProperties(delivery_mode=2)

    def _route(self, msg: Msg) -> str:
        k = math.ceil((msg.due_ms - time.time() * 1000) / 1000)
        if k <= 0:
            return READY
        if k not in self.declared:
            self.confirm_ch.queue_declare(bucket(k), durable=True, arguments={
                "x-message-ttl": k * 1000, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": READY})
            self.declared.add(k)
        return bucket(k)

    async def send_one(self, msg: Msg) -> None:
        self.confirm_ch.basic_publish("", self._route(msg), msg.body, self.props, mandatory=True)

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        for m in msgs:
            self.tx_ch.basic_publish("", self._route(m), m.body, self.props)
        self.tx_ch.tx_commit()

    async def close(self) -> None:
        self.conn.close()


class RabbitConsumer(ConsumerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.conn = _connect(self.addr)
        self.ch = self.conn.channel()
        self.ch.basic_qos(prefetch_count=PREFETCH)
        self.ch.queue_declare(READY, durable=True)
        self.gen: Any = None

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        if self.gen is None:
            self.gen = self.ch.consume(READY, inactivity_timeout=max_wait_s)
        method, _props, body = next(self.gen)
        if method is None:
            return []
        return [(body, method.delivery_tag)]

    async def ack(self, tokens: Sequence[Any]) -> None:
        for tag in tokens:
            self.ch.basic_ack(tag)

    async def close(self) -> None:
        self.conn.close()


class RabbitTtl(Peer):
    name = "rabbitmq"
    design = "durable queue per whole-second delay (x-message-ttl) dead-lettering to 'ready'"
    durability = "persistent messages, fsynced before the publisher confirm / tx.commit-ok"
    burst_note = ("delays are whole seconds, rounded up as each message is sent: the common due time becomes "
                  "up to 1 s of due times after it")
    batch_label = "tx batch"

    def check(self) -> str | None:
        if not (RABBIT_BIN / "rabbitmq-server").exists():
            return "rabbitmq-server is not installed (Debian package rabbitmq-server; scripts/install-peers.sh)"
        if shutil.which("epmd") is None:
            return "epmd is not on PATH (Debian package erlang-base)"
        try:
            import pika  # noqa: F401
        except ImportError as e:
            return f"Python client missing: {e}"
        return None

    def version(self) -> str:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"], capture_output=True,
                             text=True, check=False).stdout
        return out or "unknown"

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        if addr is None:
            port = free_port()
            addr = {"host": LOOPBACK, "port": port, "dist_port": free_port(), "epmd_port": free_port(),
                    "node": f"bench{port}@localhost", "data_dir": str(data_dir)}
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {LOOPBACK}:{addr['port']}\nloopback_users = none\n")
        (data_dir / "enabled_plugins").write_text("[].\n")
        env = _env(addr, data_dir)
        started = time.monotonic()
        epmd = ChildProcess("epmd", ["epmd", "-address", LOOPBACK, "-port", str(addr["epmd_port"])],
                             log_dir / "epmd.log", env=env)
        procs = [epmd]
        server = Server(procs, addr, data_dir)
        wait_ready(server, lambda: tcp_open(addr["epmd_port"]), 30, started)
        procs.append(ChildProcess("rabbitmq-server", [str(RABBIT_BIN / "rabbitmq-server")],
                                   log_dir / "rabbitmq.log", env=env, cwd=data_dir))

        def probe() -> bool:
            if not tcp_open(addr["port"]):
                return False
            _connect(addr).close()
            return True

        wait_ready(server, probe, 180, started)
        return server

    def setup(self, addr: dict[str, Any]) -> None:
        conn = _connect(addr)
        try:
            conn.channel().queue_declare(READY, durable=True)
        finally:
            conn.close()

    def pending(self, addr: dict[str, Any]) -> int:
        """Messages in the delay buckets, from rabbitmqctl (AMQP cannot list queues)."""
        env = _env(addr, Path(addr["data_dir"]))  # HOME holds the node's Erlang cookie
        out = subprocess.run([str(RABBIT_BIN / "rabbitmqctl"), "-n", addr["node"], "-q", "list_queues", "name",
                              "messages"], capture_output=True, text=True, env=env, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl list_queues failed: {out.stderr.strip()[-300:]}")
        total = 0
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].startswith("delay.") and parts[1].isdigit():
                total += int(parts[1])
        return total

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return RabbitProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return RabbitConsumer(addr)


PEER = RabbitTtl()
