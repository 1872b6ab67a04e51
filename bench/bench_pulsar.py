"""chronoq's Pulsar door in the side-by-side benchmark: the official Pulsar client against `chronoq serve`.

Theory of operation: `chronoq-pulsar` is a system of `python -m bench` (registered in
`bench.peers.base.SYSTEMS`), so it runs the same phases, workload, worker processes, server-CPU
sampling and report as every peer; the server is the one `chronoq` runs (`bench.peers.chronoq_peer`),
started with `--pulsar-port` as well, and only the clients differ: Apache Pulsar's official Python
client (`pulsar-client` 3.13.0, the C++ client 4.2.0 inside) where `chronoq` uses chronoq's SDK
over the gRPC door. Run beside `chronoq` in one invocation, the two rows are the two doors of
one broker under the same load:

    python -m bench --systems chronoq,chronoq-pulsar --phases accept,precision

(`python bench/bench_pulsar.py` is that command; further options pass through). The precision
phase is the comparison asked of the door: a fixed 2,000 messages/s, delays drawn from 5-30 s,
one Shared subscription receiving; its rows are the accept rate, the delivery error's
P50/P99/P999 (receive time minus due time), early and lost counts, and server CPU per message.

- Producer: `create_producer(topic)` with the Python client's defaults (no batching; a delayed
  message is sent on its own by the client anyway). One at a time is `send()`, which waits for
  the receipt; batched is `send_async()` for each message of the chunk, then a wait for every
  receipt (pipelined: the client keeps them all in flight on one connection). The due time is
  given as `deliver_at=due_ms`: the client turns `deliver_after` into the same `deliver_at_time`
  from its own clock inside the call, so passing the absolute time the harness stamped keeps
  the measured error the server's, not the client's microseconds between stamp and call.
- Consumer: `subscribe(topic, "bench", Shared, Earliest)` with a message listener, the client's
  push path (its receiver queue of 1,000 filled by the door within the FLOW permits); the
  harness takes what the listener queued, stamps the time, and acks each message
  (`acknowledge`, which the client groups for up to 100 ms into one ACK).
- `chronoq-pulsar-delay-all` is the same with the topic named in
  `pulsar_delay_all_subscriptions_topics`: the door then stores a delayed message once (its
  timer) instead of a timer plus an immediate copy for Exclusive and Failover subscriptions
  (`chronoq/pulsar/messages.py`); beside `chronoq-pulsar` it shows what the copy costs.
Pending counts and the server's own timer figures come from the admin API, as for `chronoq`.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path, for `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness.procs import free_port
from bench.peers.base import ConsumerClient, Msg, ProducerClient
from bench.peers.chronoq_peer import GROUP, TOPIC, Chronoq

PULSAR_TOPIC = f"persistent://public/default/{TOPIC}"
PENDING_MAX = 5000
"""The producer's `max_pending_messages`: above any chunk the harness sends (256 by default)."""
RECEIPT_TIMEOUT_S = 120.0
CACHE_MAX_MESSAGES = 1024
"""Messages handed to the harness per receive, as `chronoq`'s consumer hands them."""
COMMAND = ["--systems", "chronoq,chronoq-pulsar", "--phases", "accept,precision"]


def _url(addr: dict[str, Any]) -> str:
    return f"pulsar://{addr['host']}:{addr['pulsar_port']}"


def _client(addr: dict[str, Any]) -> Any:
    import pulsar

    return pulsar.Client(_url(addr), operation_timeout_seconds=30,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))


class Receipts:
    """Counts `send_async` callbacks (on the client's threads); keeps the first failure."""

    def __init__(self) -> None:
        self.done = 0
        self.failure: str | None = None
        self.changed = threading.Condition()

    def callback(self, result: Any, _msg_id: Any) -> None:
        import pulsar

        with self.changed:
            self.done += 1
            if result != pulsar.Result.Ok and self.failure is None:
                self.failure = str(result)
            self.changed.notify_all()

    def wait(self, count: int) -> None:
        end = time.monotonic() + RECEIPT_TIMEOUT_S
        with self.changed:
            while self.done < count:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.done} of {count} sends receipted within {RECEIPT_TIMEOUT_S:.0f} s")
                self.changed.wait(left)
        if self.failure is not None:
            raise RuntimeError(f"a send failed: {self.failure}")


class PulsarProducer(ProducerClient):
    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr

    async def open(self) -> None:
        self.client = _client(self.addr)
        self.producer = self.client.create_producer(PULSAR_TOPIC, block_if_queue_full=True,
                                                    max_pending_messages=PENDING_MAX)

    async def send_one(self, msg: Msg) -> None:
        self.producer.send(msg.body, deliver_at=msg.due_ms)

    async def send_many(self, msgs: Sequence[Msg]) -> None:
        receipts = Receipts()
        for m in msgs:
            self.producer.send_async(m.body, receipts.callback, deliver_at=m.due_ms)
        receipts.wait(len(msgs))

    async def close(self) -> None:
        self.producer.close()
        self.client.close()


class PulsarConsumer(ConsumerClient):
    """A Shared subscription's consumer with a message listener: the client's threads queue what
    the door pushes, `receive` hands it over."""

    def __init__(self, addr: dict[str, Any]) -> None:
        self.addr = addr
        self.cache: collections.deque[Any] = collections.deque()
        self.arrived = threading.Event()
        self.counts = collections.Counter[str]()

    async def open(self) -> None:
        import pulsar

        self.client = _client(self.addr)
        self.consumer = self.client.subscribe(PULSAR_TOPIC, GROUP, consumer_type=pulsar.ConsumerType.Shared,
                                              initial_position=pulsar.InitialPosition.Earliest,
                                              message_listener=self._on_message)

    def _on_message(self, _consumer: Any, msg: Any) -> None:
        self.cache.append(msg)
        self.arrived.set()

    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        if not self.cache:
            self.arrived.clear()
            if not self.cache:
                self.arrived.wait(max_wait_s)
        got = [self.cache.popleft() for _ in range(min(len(self.cache), CACHE_MAX_MESSAGES))]
        self.counts["received"] += len(got)
        if got:
            self.counts["handovers"] += 1
        return [(m.data(), m) for m in got]

    async def ack(self, tokens: Sequence[Any]) -> None:
        for m in tokens:
            self.consumer.acknowledge(m)
        self.counts["acked"] += len(tokens)

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {**c, "per_handover": round(c["received"] / c["handovers"], 2) if c["handovers"] else None}

    async def close(self) -> None:
        self.consumer.close()  # sends the acks the client still groups
        self.client.close()


class ChronoqPulsar(Chronoq):
    name = "chronoq-pulsar"
    design = ("Pulsar binary protocol, official pulsar-client (deliver_at) into chronoq's Pulsar door; "
              "Shared subscription; RocksDB time index + timing wheel")
    batch_label = "send_async"
    delay_all = False
    """Name the topic in `pulsar_delay_all_subscriptions_topics` (no immediate copies)."""

    def server_env(self) -> dict[str, str]:
        env = super().server_env()
        env.pop("CHRONOQ_PULSAR_DELAY_ALL_SUBSCRIPTIONS_TOPICS", None)
        if self.delay_all:
            env["CHRONOQ_PULSAR_DELAY_ALL_SUBSCRIPTIONS_TOPICS"] = TOPIC
        return env

    def check(self) -> str | None:
        reason = super().check()
        if reason is not None:
            return reason
        try:
            import pulsar  # noqa: F401
        except ImportError as e:
            return f"the Pulsar client is not installed (pip install pulsar-client==3.13.0): {e}"
        return None

    def version(self) -> str:
        from importlib.metadata import version

        return f"{super().version()}, pulsar-client {version('pulsar-client')}"

    def new_addr(self) -> dict[str, Any]:
        return {**super().new_addr(), "pulsar_port": free_port()}

    def serve_args(self, addr: dict[str, Any]) -> list[str]:
        return [*super().serve_args(addr), "--pulsar-port", str(addr["pulsar_port"])]

    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        return PulsarProducer(addr)

    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        return PulsarConsumer(addr)


class ChronoqPulsarDelayAll(ChronoqPulsar):
    name = "chronoq-pulsar-delay-all"
    design = ("Pulsar binary protocol as chronoq-pulsar, the topic in pulsar_delay_all_subscriptions_topics "
              "(a delayed message stored once, no immediate copy)")
    delay_all = True


PEER = ChronoqPulsar()
DELAY_ALL_PEER = ChronoqPulsarDelayAll()


def main(argv: list[str] | None = None) -> int:
    """`python -m bench --systems chronoq,chronoq-pulsar --phases accept,precision [more options]`."""
    from bench.harness.cli import main as bench_main

    return bench_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
