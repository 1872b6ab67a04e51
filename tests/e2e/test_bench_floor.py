"""The benchmark's floor peer serves chronoq's SDK end to end: real server process, real client.

The floor (`bench/peers/floor_server.py`) is the stub MessagingService the benchmark compares
chronoq with. If it stopped answering what the SDK expects, the bench's floor row would fail or,
worse, measure a different exchange than chronoq's; so this drives it with the SDK as a user
would: SendMessage (one and batched), the admin SendBatch, a server-side delay, long-polled
receive after the due time, ack, change-invisible, and the pending count the harness reads.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from bench.peers.base import load_peer
from bench.peers.chronoq_peer import TOPIC
from chronoq.client import AsyncAdmin, AsyncConsumer, AsyncProducer, outgoing

DUE_IN_MS = 800
pytestmark = pytest.mark.slow


@pytest.fixture()
def floor(tmp_path: Path) -> Any:
    peer = load_peer("floor")
    assert peer.check() is None
    server = peer.start(tmp_path / "data", tmp_path / "logs")
    try:
        peer.setup(server.addr)
        yield peer, server
    finally:
        server.stop()
    assert server.procs[0].popen.returncode == 0, (tmp_path / "logs" / "floor.log").read_text()


def _target(server: Any) -> str:
    return f"{server.addr['host']}:{server.addr['port']}"


async def _pending(target: str) -> int:
    async with AsyncAdmin(target) as admin:
        return int((await admin.stats())["timer"]["pending_total"])


async def _send_all(target: str, due_ms: int) -> dict[str, int | None]:
    """Every way the SDK sends; returns message id -> the due time it asked for (None: now)."""
    expected: dict[str, int | None] = {}
    async with AsyncProducer(target) as p:
        r = await p.send(TOPIC, b"one", deliver_at=due_ms, message_id="one")  # SendMessage, 1 message
        expected[r.message_id] = due_ms
        r = await p.send(TOPIC, b"delayed", delay=DUE_IN_MS, message_id="delayed")  # the server's clock adds it
        expected[r.message_id] = due_ms
        r = await p.send(TOPIC, b"now", message_id="now")  # not a timer: deliverable at once
        expected[r.message_id] = None
        batch = [outgoing(TOPIC, f"admin-{i}".encode(), deliver_at=due_ms, message_id=f"admin-{i}") for i in range(3)]
        for r in await p.send_batch(batch):  # the admin SendBatch (JSON), what the bench's producer uses
            expected[r.message_id] = due_ms
    async with AsyncProducer(target, batch_via="grpc") as p:
        batch = [outgoing(TOPIC, f"grpc-{i}".encode(), deliver_at=due_ms, message_id=f"grpc-{i}") for i in range(3)]
        for r in await p.send_batch(batch):  # SendMessage with many messages
            expected[r.message_id] = due_ms
    return expected


def test_floor_serves_the_sdk_send_receive_after_due_ack(floor: Any) -> None:
    peer, server = floor
    target = _target(server)

    async def go() -> None:
        due_ms = int(time.time() * 1000) + DUE_IN_MS
        expected = await _send_all(target, due_ms)
        assert len(expected) == 9
        assert await _pending(target) >= 7  # the 8 timers, less any already due on a slow machine
        received: dict[str, Any] = {}
        async with AsyncConsumer("g", TOPIC, server=target) as c:
            deadline = time.monotonic() + 10
            while len(received) < len(expected) and time.monotonic() < deadline:
                got = await c.receive(64, wait=2000)
                for m in got:
                    assert m.message_id not in received, f"{m.message_id} delivered twice"
                    received[m.message_id] = m
                if got:
                    old = got[0].receipt_handle
                    assert await c.change_invisible(got[0], 5000) != old
                    await c.ack(*got)
            assert await c.receive(8, wait=300) == []  # acked and gone: a long poll that times out
        assert set(received) == set(expected)
        for mid, m in received.items():
            assert m.body_digest_ok is True and m.receipt_handle
            due = expected[mid]
            if due is not None:
                # "delayed" got its due time from the server's clock, a few ms after `due_ms`.
                assert m.deliver_at_ms is not None and m.received_ms >= m.deliver_at_ms >= due - 50, mid
            assert m.body == {"one": b"one", "delayed": b"delayed", "now": b"now"}.get(mid, mid.encode())
        assert received["now"].received_ms < due_ms  # the non-timer message did not wait
        assert await _pending(target) == 0

    asyncio.run(go())
    assert peer.pending(server.addr) == 0  # what the harness reads


def test_floor_through_the_bench_clients(floor: Any) -> None:
    """The harness's own producer and consumer classes (the chronoq peer's) against the floor."""
    from bench.harness.workload import decode_body, encode_body
    from bench.peers.base import Msg

    peer, server = floor

    async def go() -> None:
        producer = peer.producer(server.addr)
        await producer.open()
        due_ms = int(time.time() * 1000) + 300
        msgs = [Msg(f"m{i}", due_ms, encode_body(f"m{i}", due_ms)) for i in range(200)]
        await producer.send_many(msgs[:150])
        for m in msgs[150:]:
            await producer.send_one(m)
        await producer.close()
        consumer = peer.consumer(server.addr)
        await consumer.open()
        seen: list[tuple[str, int, float]] = []
        deadline = time.monotonic() + 10
        while len(seen) < len(msgs) and time.monotonic() < deadline:
            got = await consumer.receive(0.2)
            now_ms = time.time() * 1000
            seen += [(*decode_body(body), now_ms) for body, _token in got]
            await consumer.ack([token for _body, token in got])
        await consumer.close()
        assert sorted(mid for mid, _, _ in seen) == sorted(m.id for m in msgs)
        assert all(recv >= due for _, due, recv in seen)

    asyncio.run(go())
