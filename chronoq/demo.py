"""The main job's demo: a broker on the default data directory, a few normal and timer messages,
each printed as it arrives with how late it was.

Theory of operation: starts an in-process broker with background tasks (the real clock), sends
three normal messages and five timer messages (delay, deliver-at, a RocketMQ 4 delay level, and
one that is cancelled before it is due), then long-polls a consumer group until every expected
message has arrived or a timeout passes. The exit code is non-zero if a message is missing,
arrives early, or the cancelled one arrives.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from chronoq.broker import Broker
from chronoq.config import Config
from chronoq.model import OutgoingMessage

TOPIC = "demo-orders"
GROUP = "demo-group"


async def run_demo(data_dir: Path, timeout_s: float = 20.0) -> int:
    broker = await Broker.open(Config(data_dir=data_dir))
    try:
        return await _demo(broker, timeout_s)
    finally:
        await broker.close()


async def _demo(broker: Broker, timeout_s: float) -> int:
    now = broker.clock.now_ms()
    # Start the group at the end of the topic, so earlier runs' messages do not show up here.
    await broker.create_topic(TOPIC) if TOPIC not in {t.name for t in broker.list_topics()} else None
    while await broker.receive(GROUP, TOPIC, batch_size=64, invisible_duration_ms=1000):
        pass
    expected: dict[str, int | None] = {}
    for i in range(3):
        r = await broker.send(OutgoingMessage(TOPIC, f"order {i} created".encode(), tag="created"))
        expected[r.message_id] = None
    plans = [
        ("cancel-if-unpaid after 2 s", {"delay_ms": 2000}),
        ("reminder at now + 3.5 s", {"deliver_at_ms": now + 3500}),
        ("retry after delay level 1 (1 s)", {"delay_level": 1}),
        ("follow-up after 5 s", {"delay_ms": 5000}),
    ]
    for body, when in plans:
        r = await broker.send(OutgoingMessage(TOPIC, body.encode(), tag="timer", **when))  # type: ignore[arg-type]
        expected[r.message_id] = r.deliver_at_ms
        print(f"sent   {body!r:40} due in {(r.deliver_at_ms or now) - broker.clock.now_ms():>6} ms")
    doomed = await broker.send(OutgoingMessage(TOPIC, b"this one is cancelled", delay_ms=4000))
    await broker.cancel(recall_handle=doomed.recall_handle)
    print(f"cancelled {doomed.message_id} before it was due")
    problems = 0
    deadline = time.monotonic() + timeout_s
    while expected and time.monotonic() < deadline:
        for rm in await broker.receive(GROUP, TOPIC, batch_size=16, wait_ms=1000):
            m = rm.message
            received_ms = broker.clock.now_ms()
            due = m.deliver_at_ms
            late = f"{received_ms - due:+5d} ms vs due" if due is not None else "normal message"
            print(f"received {m.body.decode()!r:40} {late}")
            if m.message_id == doomed.message_id:
                print("  PROBLEM: the cancelled message arrived")
                problems += 1
            if due is not None and received_ms < due:
                print("  PROBLEM: early")
                problems += 1
            expected.pop(m.message_id, None)
            await broker.ack(GROUP, TOPIC, rm.receipt_handle)
    if expected:
        print(f"PROBLEM: {len(expected)} messages did not arrive within {timeout_s} s")
        problems += len(expected)
    stats = broker.stats()["timer"]
    print(f"pending timers now: {stats['pending_total']}; delivery error so far: "
          f"{stats['latencies']['delivery_error_ms']}")
    print("demo OK" if not problems else f"demo FAILED: {problems} problems")
    return 0 if not problems else 1


def main(data_dir: str = "data") -> int:
    return asyncio.run(run_demo(Path(data_dir)))
