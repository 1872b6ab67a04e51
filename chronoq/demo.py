"""The main job's demo: `chronoq serve` on the default data directory, then a producer and a
consumer using chronoq's SDK over the RocketMQ 5 gRPC protocol.

Theory of operation: starts `chronoq serve` as a child process (as a deployment would run it),
sends three normal messages and five timer messages (a delay, a deliver-at, a RocketMQ 4 delay
level, and one that is recalled before it is due), then long-polls a consumer group until every
expected message has arrived or a timeout passes, printing each with how late it was. The exit
code is non-zero if a message is missing, arrives early, or the recalled one arrives. The server
runs with its web console and /metrics on (`--http-port`), and the demo prints their URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from pathlib import Path

from chronoq.client import AsyncConsumer, AsyncProducer
from chronoq.client.testing import ServerProcess, free_port
from chronoq.errors import TopicExists
from chronoq.timefmt import duration

TOPIC = "demo-orders"
GROUP = "demo-group"


async def _demo(server: str, timeout_s: float) -> int:
    async with AsyncProducer(server) as producer, AsyncConsumer(GROUP, TOPIC, server=server) as consumer:
        # A consumer never creates a topic; the first run makes it here (later runs find it).
        with contextlib.suppress(TopicExists):
            await producer.create_topic(TOPIC)
        # Messages of earlier runs in this data directory are not part of this demo.
        while stale := await consumer.receive(32):
            await consumer.ack(*stale)
        expected: set[str] = set()
        for i in range(3):
            r = await producer.send(TOPIC, f"order {i} created", tag="created")
            expected.add(r.message_id)
            print(f"sent     {f'order {i} created'!r:36} normal")
        now_ms = int(time.time() * 1000)
        plans = [
            ("cancel-if-unpaid after 2 s", {"delay": timedelta(seconds=2)}),
            ("reminder at now + 3.5 s", {"deliver_at": now_ms + 3500}),
            ("retry after delay level 1 (1 s)", {"delay_level": 1}),
            ("follow-up after 5 s", {"delay": timedelta(seconds=5)}),
        ]
        for body, when in plans:
            r = await producer.send(TOPIC, body, tag="timer", **when)  # type: ignore[arg-type]
            expected.add(r.message_id)
            print(f"sent     {body!r:36} timer, recall handle {r.recall_handle or '-'}")
        doomed = await producer.send(TOPIC, "recalled before it is due", delay=timedelta(seconds=4))
        await producer.recall(TOPIC, doomed.recall_handle or "")
        print(f"recalled {doomed.message_id} before it was due")
        problems = 0
        deadline = time.monotonic() + timeout_s
        while expected and time.monotonic() < deadline:
            for m in await consumer.receive(16, wait=timedelta(seconds=2)):
                late = f"{duration(m.lateness_ms):>7} after due" if m.lateness_ms is not None else "normal message"
                print(f"received {m.body.decode()!r:36} {late}")
                if m.message_id == doomed.message_id:
                    print("  PROBLEM: the recalled message arrived")
                    problems += 1
                if m.lateness_ms is not None and m.lateness_ms < 0:
                    print("  PROBLEM: early")
                    problems += 1
                expected.discard(m.message_id)
                await consumer.ack(m)
        if expected:
            print(f"PROBLEM: {len(expected)} messages did not arrive within {duration(int(timeout_s * 1000))}")
            problems += len(expected)
        timer = (await producer.stats()).get("timer", {})
        err = timer.get("latencies", {}).get("delivery_error_ms", {})
        if err.get("count"):
            print(f"broker: {timer.get('pending_total')} timers pending; fired minus due so far: p50 "
                  f"{duration(err['p50'])}, p99 {duration(err['p99'])}, max {duration(err['max'])} over {err['count']}")
    print("demo OK" if not problems else f"demo FAILED: {problems} problems")
    return 0 if not problems else 1


def main(data_dir: str = "data", port: int | None = None, timeout_s: float = 20.0, *,
         http_port: int | None = None, stay: bool = False) -> int:
    """`http_port`: the web console's port (default: a free one). `stay`: keep the server (and the
    console) running after the demo until Ctrl-C, so a person can look around."""
    path = Path(data_dir)
    http_port = http_port or free_port()
    with ServerProcess(path, port=port, settings={"http_port": http_port}) as server:
        print(f"chronoq serve is running on {server.address} (pid {server.pid}), data in {path.resolve()}")
        print(f"web console: http://127.0.0.1:{http_port}/  (Prometheus metrics: /metrics, health: /healthz)")
        status = asyncio.run(_demo(server.address, timeout_s))
        if stay:
            print(f"still serving; the console is at http://127.0.0.1:{http_port}/ ; Ctrl-C stops", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        return status
