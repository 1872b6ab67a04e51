"""A broker with timers under load, for test_power_loss.py:
`python -m tests.e2e.powerloss_driver DATA_DIR JOURNAL SEED`.

Runs a real broker (SystemClock, sync flush, background tasks: the timer loop fires in real time,
checkpoints every 40 ms) with producers sending normal messages, timers due 0.2-2 s ahead and
delay-level messages, a canceller recalling some timers, and consumers receiving and acking.
Journal lines, each written after the call returned (one `os.write` on an O_APPEND descriptor):

    S <id> <topic> <queue id> <queue offset>    a normal send returned (durable)
    T <id> <topic> <due ms>                      a timer send returned (durable, pending)
    L <id> <topic> <level>                       a delay-level send returned
    c <id> <topic>                               a cancel is about to be made (outcome unknown until C)
    C <id> <topic>                               a cancel returned (the timer must never fire)
    A <id>                                       an ack returned

Prints READY once the broker is open; exits by itself after `MAX_RUN_S`.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from chronoq.broker import Broker
from chronoq.clock import SystemClock
from chronoq.config import Config
from chronoq.errors import ChronoqError
from chronoq.model import OutgoingMessage
from tests.e2e.crash_driver import Journal
from tests.support.brokers import open_broker

TOPIC = "orders"
TIMER_TOPIC = "later"
GROUP = "g"
MAX_RUN_S = 60


def config_for(data_dir: Path) -> Config:
    return Config(data_dir=data_dir, flush="sync", segment_size_bytes=64 * 1024, max_message_size_bytes=16 * 1024,
                  default_queue_count=2, checkpoint_interval_ms=40, delay_levels="1s 2s 5s")


async def produce(broker: Broker, journal: Journal, rng: random.Random, p: int, recallable: list[str]) -> None:
    i = 0
    while True:
        kind = rng.random()
        mid = f"p{p}n{i}"
        i += 1
        if kind < 0.5:
            r = await broker.send(OutgoingMessage(TOPIC, b"n" * rng.choice((16, 400, 3000)), message_id=mid))
            journal.line("S", r.message_id, r.topic, r.queue_id, r.queue_offset)
        elif kind < 0.9:
            r = await broker.send(OutgoingMessage(TIMER_TOPIC, b"t" * rng.choice((16, 400)), message_id=mid,
                                                  delay_ms=rng.randrange(200, 2_000)))
            journal.line("T", r.message_id, TIMER_TOPIC, r.deliver_at_ms)
            if rng.random() < 0.3:
                recallable.append(r.message_id)
        else:
            level = rng.randrange(1, 4)
            r = await broker.send(OutgoingMessage(TIMER_TOPIC, b"l", message_id=mid, delay_level=level))
            journal.line("L", r.message_id, TIMER_TOPIC, level)


async def cancel(broker: Broker, journal: Journal, rng: random.Random, recallable: list[str]) -> None:
    while True:
        await asyncio.sleep(rng.uniform(0.001, 0.02))
        if not recallable:
            continue
        mid = recallable.pop(rng.randrange(len(recallable)))
        journal.line("c", mid, TIMER_TOPIC)
        try:
            await broker.cancel(topic=TIMER_TOPIC, message_id=mid)
        except ChronoqError:
            continue  # too late (fired or firing): not journaled
        journal.line("C", mid, TIMER_TOPIC)


async def consume(broker: Broker, journal: Journal, topic: str) -> None:
    while True:
        got = await broker.receive(GROUP, topic, batch_size=16, invisible_duration_ms=600_000, wait_ms=50)
        for m in got:
            await broker.ack(GROUP, topic, m.receipt_handle)
            journal.line("A", m.message.message_id)


async def main(data_dir: str, journal_path: str, seed: int) -> None:
    journal = Journal(journal_path)
    broker = await open_broker(config_for(Path(data_dir)), clock=SystemClock(), background=True)
    for topic in (TOPIC, TIMER_TOPIC):
        broker.topics.ensure(topic)  # consumers never create topics, and may start before the first send
    print("READY", flush=True)
    rng = random.Random(seed)
    recallable: list[str] = []
    tasks = [produce(broker, journal, random.Random(rng.random()), p, recallable) for p in range(4)]
    tasks += [cancel(broker, journal, random.Random(rng.random()), recallable)]
    tasks += [consume(broker, journal, TOPIC), consume(broker, journal, TIMER_TOPIC)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), MAX_RUN_S)
    except TimeoutError:
        pass
    finally:
        await broker.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
