"""Child process for the real-time timer test: a real broker (SystemClock, background tasks)
that produces timer messages and consumes them, reporting every event as a JSON line.

Theory of operation: the parent test starts this script, reads its stdout, SIGKILLs it midway
and starts it again on the same data directory. Everything the parent needs to judge the run is
on stdout, written and flushed *before* the action it reports becomes irreversible where that
matters: `sending` before a batch is handed to the broker, `sent` after the broker acknowledged
it (durable), `got` before the consumer acks (so a message received but not yet acked at the
kill shows up as `got` without `ack`, and may legitimately come again after the restart).

Events: {"ev": "open", "pid", "now_ms", "pending"} · {"ev": "sending", "ids"} ·
{"ev": "sent", "items": [[id, delay_ms, before_ms, deliver_at_ms], ...]} ·
{"ev": "got", "id", "due", "store", "recv", "pos", "attempt"} · {"ev": "ack", "id"} ·
{"ev": "produced"} · {"ev": "done", "stats"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

from chronoq.broker import Broker
from chronoq.clock import SystemClock
from chronoq.config import Config
from chronoq.model import SYS_TIMER_OUT_MS, OutgoingMessage
from tests.support.brokers import open_broker

TOPIC = "realtime"
GROUP = "rt-consumer"


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def delay_for(seed: int, index: int, low_ms: int, high_ms: int) -> int:
    return random.Random(seed * 1_000_003 + index).randrange(low_ms, high_ms + 1)


async def produce(broker: Broker, clock: SystemClock, args: argparse.Namespace) -> None:
    i = args.start
    while i < args.count:
        idx = list(range(i, min(i + args.batch, args.count)))
        ids = [f"rt-{n:05d}-r{args.run}" for n in idx]
        delays = [delay_for(args.seed, n, args.min_delay_ms, args.max_delay_ms) for n in idx]
        emit({"ev": "sending", "ids": ids})
        before = clock.now_ms()
        results = await broker.send_batch([OutgoingMessage(TOPIC, f"{n}".encode(), message_id=mid, delay_ms=d)
                                           for n, mid, d in zip(idx, ids, delays, strict=True)])
        emit({"ev": "sent", "items": [[r.message_id, d, before, r.deliver_at_ms]
                                      for r, d in zip(results, delays, strict=True)]})
        i += len(idx)
        await asyncio.sleep(args.pace_ms / 1000)
    emit({"ev": "produced"})


async def consume(broker: Broker, clock: SystemClock, idle: asyncio.Event) -> None:
    while True:
        got = await broker.receive(GROUP, TOPIC, batch_size=64, invisible_duration_ms=2000, wait_ms=500)
        now = clock.now_ms()
        if not got:
            idle.set()
            continue
        idle.clear()
        for r in got:
            m = r.message
            emit({"ev": "got", "id": m.message_id, "due": int(m.system_properties[SYS_TIMER_OUT_MS]),
                  "store": m.store_ms, "recv": now, "pos": m.position, "attempt": r.delivery_attempt})
        for r in got:
            await broker.ack(GROUP, TOPIC, r.receipt_handle)
            emit({"ev": "ack", "id": r.message.message_id})


async def main(args: argparse.Namespace) -> None:
    clock = SystemClock()
    broker = await open_broker(Config(data_dir=Path(args.data)), clock=clock, background=True)
    broker.topics.ensure(TOPIC)  # consumers never create topics, and may start before the first send
    emit({"ev": "open", "now_ms": clock.now_ms(), "pending": broker.stats()["timer"]["pending_total"],
          "replayed": broker.open_report.replayed_records})
    idle = asyncio.Event()
    consumer = asyncio.create_task(consume(broker, clock, idle))
    try:
        await produce(broker, clock, args)
        if args.exit_when_idle:
            while True:
                await idle.wait()
                # Done when no timer is pending and no received message awaits redelivery.
                if (broker.stats()["timer"]["pending_total"] == 0
                        and broker.groups.next_visible_ms(GROUP, TOPIC) is None):
                    break
                await asyncio.sleep(0.2)
            stats = broker.stats()["timer"]
            emit({"ev": "done", "stats": {"pending_total": stats["pending_total"],
                                          "latencies": stats["latencies"]}})
        else:
            await asyncio.Event().wait()  # until killed
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await broker.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--start", type=int, default=0, help="first message index to send")
    p.add_argument("--run", type=int, default=0, help="run number, part of each message id")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--pace-ms", type=int, default=60)
    p.add_argument("--min-delay-ms", type=int, default=1000)
    p.add_argument("--max-delay-ms", type=int, default=5000)
    p.add_argument("--exit-when-idle", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
