"""chronoq itself, measured as a user runs it: `chronoq serve` in its own process plus the SDK.

Theory of operation: the server is `python -m chronoq serve --data-dir D --port P` with the
project's default configuration (commit log fsynced before a send is acknowledged), started by
`chronoq.client.testing.ServerProcess` (ready once it has printed "chronoq serving on" and
answers an admin call) and then stopped, killed and sampled by pid like every peer. Producers use
`chronoq.client.AsyncProducer`: `send(topic, body, deliver_at=ms, message_id=id)` one at a time,
and `send_batch` for the batched mode, through the RocketMQ SendMessage call with many messages
(`batch_via="grpc"`, the call the floor answers, not the SDK's default admin SendBatch: their
server CPU per message measured within 10 % of each other, 48.6 vs 52.2 µs). The
consumer is an `AsyncConsumer` used as RocketMQ's PushConsumer uses the same protocol: a few long
polls always in flight, streaming into a local cache that the harness drains; each drained batch
is acked by a background task that gathers acks for `ACK_LINGER_S` into one AckMessage request, so
an ack never delays a receive (the receive time is stamped before any ack either way).

The consumer receives through chronoq's batched receive (`AsyncConsumer(batch_receive=True)`, the
SDK's default: the messages of one receive in one gRPC response). `chronoq-stream` is the same
server and SDK with `batch_receive=False`: RocketMQ's ReceiveMessage, one streamed response per
message, the call the official clients make and the floor answers; beside `chronoq` it shows what
the batched call saves both processes.

`chronoq-async` is the same server with `CHRONOQ_FLUSH=async` in its environment (the commit log
is fsynced in the background, not before the ack): beside `chronoq` it shows the price of
fsync-before-ack, chiefly in the one-message-per-request row. Any `CHRONOQ_FLUSH` in the harness's
own environment is removed before `chronoq` starts, so that one runs the project's default.

`chronoq-bulk` is the same server with the producer's batched mode through the SDK's bulk send
(`send_columns`, admin SendColumns: a chunk's timers as packed columns in one request); its
one-at-a-time mode is chronoq's. Beside `redis` (pipelined ZADDs of the same chunk) it is the
same work: a chunk of timers, acknowledged once durable by each system's own rule.

`chronoq-wheel` is the same server with `CHRONOQ_TIMER_ENGINE=wheel`: its timers indexed by the
file wheel (RocketMQ 5's TimerLog + TimerWheel, `timer/wheel.py`) instead of the RocksDB index;
beside `chronoq` it shows what the timer engine changes end to end. `CHRONOQ_TIMER_ENGINE` is
removed from the harness's environment for the others the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.procs import LOOPBACK, ChildProcess, Server, ServerFailed, free_port
from bench.peers.base import ConsumerClient, Msg, Peer, ProducerClient

TOPIC = "bench"
GROUP = "bench"
RECEIVE_BATCH = 64
"""The server's default `max_receive_batch`."""
START_TIMEOUT_S = 180.0
"""A restart over a 10 M backlog replays the log before it serves."""
ACK_BATCH_MAX = 1000
"""Entries per AckMessage request, within the server's `max_send_batch` (1024 by default)."""
ACK_LINGER_S = 0.02
"""Acks gather this long before their request goes out: the invisible duration is seconds, so an
ack 20 ms later costs nothing, and it saves the server an RPC per handful of messages."""
PREFETCH_RECEIVES = 2
"""Long polls kept in flight, as the PushConsumer keeps receiving while messages are processed."""
PREFETCH_WAIT_MS = 5_000
RETURN_INVISIBLE_MS = 1_000
"""How soon a prefetched message handed back at close is visible again (the server's minimum)."""
CACHE_MAX_MESSAGES = 1024
"""Received but not yet handed to the harness; the PushConsumer's default maxCacheMessageCount."""


def _server(addr: dict[str, Any]) -> str:
    return f"{addr['host']}:{addr['port']}"


class ChronoqProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        from chronoq.client import AsyncProducer

        self.p = AsyncProducer(_server(self.addr), timeout_ms=30_000, batch_via="grpc")

    async def send_one(self, msg: Msg) -> None:
        await self.p.send(TOPIC, msg.body, deliver_at=msg.due_ms, message_id=msg.id)

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        from chronoq.client import outgoing

        await self.p.send_batch([outgoing(TOPIC, m.body, deliver_at=m.due_ms, message_id=m.id) for m in msgs])

    async def close(self) -> None:
        await self.p.close()


class ChronoqBulkProducer(ChronoqProducer):
    """Batched mode through the SDK's bulk send (`send_columns`: admin SendColumns, columns)."""

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        outcome = await self.p.send_columns(TOPIC, [m.body for m in msgs], message_ids=[m.id for m in msgs],
                                            deliver_at_ms=[m.due_ms for m in msgs])
        if outcome.errors:
            index = min(outcome.errors)
            raise RuntimeError(f"{outcome.refused} of {len(msgs)} refused; the first: {outcome.errors[index]}")


class ChronoqConsumer(ConsumerClient):
    """Consumes as RocketMQ's PushConsumer does: `PREFETCH_RECEIVES` long polls are always in
    flight, each streaming its messages into a local cache as they arrive (`receive_stream`), and
    `receive` hands over what the cache holds. So a message never waits for a receive call to be
    issued, nor for the rest of its batch to stream."""

    def __init__(self, addr: dict[str, Any], batch_receive: bool) -> None:
        self.addr = addr
        self.batch_receive = batch_receive
        self.unacked: list[Any] = []
        self.acker: asyncio.Task[None] | None = None
        self.cache: collections.deque[Any] = collections.deque()
        self.arrived = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.pollers: list[asyncio.Task[None]] = []
        self.failure: BaseException | None = None
        self.counts = collections.Counter[str]()

    async def open(self) -> None:
        from chronoq.client import AsyncConsumer

        self.c = AsyncConsumer(GROUP, TOPIC, server=_server(self.addr), timeout_ms=30_000,
                               batch_receive=self.batch_receive)
        self.pollers = [asyncio.create_task(self._poll()) for _ in range(PREFETCH_RECEIVES)]

    async def _poll(self) -> None:
        try:
            while True:
                await self.room.wait()
                self.counts["receive_calls"] += 1
                async for m in self.c.receive_stream(RECEIVE_BATCH, wait=PREFETCH_WAIT_MS):
                    self.counts["received"] += 1
                    self.cache.append(m)
                    self.arrived.set()
                if len(self.cache) >= CACHE_MAX_MESSAGES:
                    self.room.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the server died: the harness's next receive raises it
            self.failure = e
            self.arrived.set()

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        if not self.cache and self.failure is None:
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), max_wait_s)
        if self.failure is not None and not self.cache:
            raise self.failure
        got = [self.cache.popleft() for _ in range(min(len(self.cache), CACHE_MAX_MESSAGES))]
        self.room.set()
        return [(m.body, m) for m in got]

    async def ack(self, tokens: Sequence[Any]) -> None:
        """Acks coalesce: one AckMessage request in flight, carrying everything handed over since
        the previous one went out (the cache hands over a few messages at a time, and an RPC per
        handful would cost the server more than the messages do)."""
        self.unacked.extend(tokens)
        if self.acker is None or self.acker.done():
            self.acker = asyncio.create_task(self._ack_loop())

    async def _ack_loop(self) -> None:
        while self.unacked:
            await asyncio.sleep(ACK_LINGER_S)
            batch, self.unacked = self.unacked[:ACK_BATCH_MAX], self.unacked[ACK_BATCH_MAX:]
            self.counts["ack_calls"] += 1
            self.counts["acked"] += len(batch)
            await self.c.ack(*batch)

    def stats(self) -> dict[str, Any]:
        """The calls this consumer made: the server's cost per message is mostly its cost per call
        divided by how many messages a call carried."""
        c = self.counts
        return {**c, "per_receive": round(c["received"] / c["receive_calls"], 2) if c["receive_calls"] else None,
                "per_ack": round(c["acked"] / c["ack_calls"], 2) if c["ack_calls"] else None}

    async def close(self) -> None:
        for task in self.pollers:
            task.cancel()
        await asyncio.gather(*self.pollers, return_exceptions=True)
        if self.acker is not None:
            await asyncio.gather(self.acker, return_exceptions=True)
        # Prefetched but never handed over: give them back (visible again after the 1 s minimum)
        # instead of leaving them invisible for the retry backoff (10 s for a first attempt). A
        # consumer stopped mid-run (the crash phase) must not hide messages from the next one.
        if self.cache:
            await asyncio.gather(*(self.c.change_invisible(m, RETURN_INVISIBLE_MS) for m in self.cache),
                                 return_exceptions=True)
            self.cache.clear()
        await self.c.close()


class Chronoq(Peer):
    name = "chronoq"
    design = "SendMessage with delivery_timestamp (ms); RocksDB time index + timing wheel"
    durability = "commit log fsynced before the send is acknowledged (flush=sync, group commit)"
    batch_label = "send_batch"
    flush: str | None = None
    """`CHRONOQ_FLUSH` for the server (None: the project's default)."""
    timer_engine: str | None = None
    """`CHRONOQ_TIMER_ENGINE` for the server (None: the project's default, the RocksDB index)."""
    batch_receive = True
    """The consumer's `batch_receive`: chronoq's batched receive (the SDK's default), or False for
    RocketMQ's ReceiveMessage, one streamed response per message, as the official clients call it."""

    def server_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CHRONOQ_FLUSH", "CHRONOQ_TIMER_ENGINE")}
        if self.flush is not None:
            env["CHRONOQ_FLUSH"] = self.flush
        if self.timer_engine is not None:
            env["CHRONOQ_TIMER_ENGINE"] = self.timer_engine
        return env

    @property
    def redelivery_after_s(self) -> float:  # type: ignore[override]
        """The bench consumer names no invisible duration: over gRPC that is the server's
        `default_invisible_duration_ms` (30 s)."""
        from chronoq.config import Config

        return Config().default_invisible_duration_ms / 1000

    def check(self) -> str | None:
        try:
            import chronoq.client
            import chronoq.server.serve  # noqa: F401
        except ImportError as e:
            return f"chronoq's server or SDK cannot be imported: {e}"
        return None

    def version(self) -> str:
        import chronoq

        return str(getattr(chronoq, "__version__", "unknown"))

    def new_addr(self) -> dict[str, Any]:
        """The ports of a first start (a restart is given the same)."""
        return {"host": LOOPBACK, "port": free_port()}

    def serve_args(self, addr: dict[str, Any]) -> list[str]:
        """`chronoq serve` flags beyond the data dir and the gRPC port."""
        return ["--host", LOOPBACK, "--log-level", "WARNING"]

    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        from chronoq.client.testing import ServerFailedToStart, ServerProcess

        addr = addr or self.new_addr()
        log_path = log_dir / "chronoq.log"
        serve = ServerProcess(data_dir, port=addr["port"], log_path=log_path, env=self.server_env(),
                              args=self.serve_args(addr),
                              start_timeout_s=START_TIMEOUT_S, own_session=True)
        started = time.monotonic()
        try:
            serve.start()
        except ServerFailedToStart as e:
            raise ServerFailed(str(e)) from None
        assert serve.process is not None
        server = Server([ChildProcess.adopt("chronoq", serve.process, log_path)], addr, data_dir)
        server.ready_s = time.monotonic() - started
        return server

    def setup(self, addr: dict[str, Any]) -> None:
        from chronoq.client import AsyncAdmin

        async def go() -> None:
            async with AsyncAdmin(_server(addr)) as admin:
                if TOPIC not in {t.name for t in await admin.list_topics()}:
                    await admin.create_topic(TOPIC)

        asyncio.run(go())

    def pending(self, addr: dict[str, Any]) -> int:
        from chronoq.client import AsyncAdmin

        async def go() -> int:
            async with AsyncAdmin(_server(addr)) as admin:
                stats = await admin.stats()
            return int(stats["timer"]["pending_total"])

        return asyncio.run(go())

    def server_stats(self, addr: dict[str, Any]) -> dict[str, Any] | None:
        """chronoq's timer stats: the broker's own fire-time error, to tell server lag from client lag."""
        from chronoq.client import AsyncAdmin

        async def go() -> dict[str, Any]:
            async with AsyncAdmin(_server(addr)) as admin:
                stats = await admin.stats()
            timer = stats.get("timer", {})
            return {"pending_total": timer.get("pending_total"), "latencies": timer.get("latencies")}

        return asyncio.run(go())

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return ChronoqProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return ChronoqConsumer(addr, self.batch_receive)


class ChronoqAsync(Chronoq):
    name = "chronoq-async"
    durability = "commit log fsynced in the background every flush_interval_ms, not before the ack (flush=async)"
    flush = "async"


class ChronoqStream(Chronoq):
    name = "chronoq-stream"
    design = ("SendMessage with delivery_timestamp (ms); RocksDB time index + timing wheel; consumer on "
              "RocketMQ's ReceiveMessage (one streamed response per message, as the official clients)")
    batch_receive = False


class ChronoqWheel(Chronoq):
    name = "chronoq-wheel"
    design = "SendMessage with delivery_timestamp (ms); file wheel (RIP-43 TimerLog + TimerWheel) + timing wheel"
    timer_engine = "wheel"


class ChronoqBulk(Chronoq):
    name = "chronoq-bulk"
    design = ("the SDK's bulk send (admin SendColumns: one topic, packed columns, thousands of timers a request); "
              "RocksDB time index + timing wheel")
    batch_label = "send_columns"

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return ChronoqBulkProducer(addr)


PEER = Chronoq()
BULK_PEER = ChronoqBulk()
ASYNC_PEER = ChronoqAsync()
STREAM_PEER = ChronoqStream()
WHEEL_PEER = ChronoqWheel()
