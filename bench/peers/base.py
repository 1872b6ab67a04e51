"""The contract every benchmarked system implements, and the registry of systems.

Theory of operation: a `Peer` lives in two kinds of process. In the harness process it checks that
its server is installed (`check` returns the reason it is not), starts the server on the ports it
is given (`start`; called again with the same data dir and address to restart after a crash),
creates what the workload needs (`setup`) and counts what is pending (`pending`). In producer and
consumer worker processes it opens a client (`producer` / `consumer`). Client methods are async so
one worker loop drives every system; a system with only a blocking client simply blocks inside
them, which is fine in a process of its own. Messages are opaque bodies to a peer: the harness puts
the id and due time inside the body, so a peer cannot misreport them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.harness.procs import Server


@dataclass(frozen=True, slots=True)
class Msg:
    id: str
    due_ms: int
    body: bytes


class ProducerClient(ABC):
    async def open(self) -> None:  # noqa: B027 (optional hook)
        pass

    @abstractmethod
    async def send_one(self, msg: Msg) -> None:
        """Send one message and return once the server has acknowledged it."""

    @abstractmethod
    async def send_many(self, msgs: Sequence[Msg]) -> None:
        """Send a chunk, pipelined or batched as the system allows; return once all are acknowledged."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        pass


class ConsumerClient(ABC):
    async def open(self) -> None:  # noqa: B027 (optional hook)
        pass

    @abstractmethod
    async def receive(self, max_wait_s: float) -> list[tuple[bytes, Any]]:
        """Due messages as (body, ack token); an empty list after waiting at most about `max_wait_s`."""

    @abstractmethod
    async def ack(self, tokens: Sequence[Any]) -> None:
        """Settle received messages so the system does not deliver them again."""

    def stats(self) -> dict[str, Any] | None:
        """What the client did to receive (calls, messages per call), if it counts; else None."""
        return None

    async def close(self) -> None:  # noqa: B027 (optional hook)
        pass


class Peer(ABC):
    name: str
    design: str
    """How this system schedules a message, in one line for the report."""
    durability: str
    """When an acknowledged message is on disk, in one line for the report."""
    batch_label: str = "pipelined"
    redelivery_after_s: float = 0.0
    """How long a message handed to a consumer that dies before acking it stays hidden before the
    system hands it out again (0: not modelled). The crash phase's second consumer waits at least
    this long after the kill: a message in a receive the kill cut short is not lost, only hidden."""
    unsupported: ClassVar[Mapping[str, str]] = {}
    """Phases that make no sense for this system, each with the reason the report prints instead
    of a figure (the floor stores nothing, so it has no crash or backlog run)."""
    burst_note: str | None = None
    """What "all due in the same millisecond" becomes for this system, if not that (whole-second
    delays); the report prints it beside the burst figures."""

    @abstractmethod
    def check(self) -> str | None:
        """None when the server and client are installed, else the reason they are not."""

    @abstractmethod
    def version(self) -> str:
        ...

    @abstractmethod
    def start(self, data_dir: Path, log_dir: Path, addr: dict[str, Any] | None = None) -> Server:
        """Start the server and wait until it is ready; `addr` given means restart on the same ports."""

    def setup(self, addr: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Create streams, queues or topics the workload needs (idempotent)."""

    @abstractmethod
    def pending(self, addr: dict[str, Any]) -> int:
        """Messages accepted and not yet due, as the server counts them."""

    def server_stats(self, addr: dict[str, Any]) -> dict[str, Any] | None:
        """The server's own view of the run (e.g. its delivery-error histogram), if it keeps one."""
        return None

    @abstractmethod
    def producer(self, addr: dict[str, Any]) -> ProducerClient:
        ...

    @abstractmethod
    def consumer(self, addr: dict[str, Any]) -> ConsumerClient:
        ...


SYSTEMS = {
    "floor": "bench.peers.floor:PEER",
    "chronoq": "bench.peers.chronoq_peer:PEER",
    "chronoq-async": "bench.peers.chronoq_peer:ASYNC_PEER",
    "chronoq-bulk": "bench.peers.chronoq_peer:BULK_PEER",
    "chronoq-stream": "bench.peers.chronoq_peer:STREAM_PEER",
    "chronoq-wheel": "bench.peers.chronoq_peer:WHEEL_PEER",
    "chronoq-pulsar": "bench.bench_pulsar:PEER",
    "chronoq-pulsar-delay-all": "bench.bench_pulsar:DELAY_ALL_PEER",
    "redis": "bench.peers.redis_zset:PEER",
    "nats": "bench.peers.nats_schedules:PEER",
    "rabbitmq": "bench.peers.rabbitmq_ttl:PEER",
    "beanstalkd": "bench.peers.beanstalkd:PEER",
}
"""System name -> "module:attribute" of its `Peer` (a module may hold variants of one system)."""


def load_peer(name: str) -> Peer:
    """The peer called `name`; importing its module needs no client library (they load lazily)."""
    if name not in SYSTEMS:
        raise KeyError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    module_name, _, attr = SYSTEMS[name].partition(":")
    peer: Peer = getattr(importlib.import_module(module_name), attr)
    return peer
