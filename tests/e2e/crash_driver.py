"""A broker under load, for test_crash.py to SIGKILL:
`python -m tests.e2e.crash_driver DATA_DIR JOURNAL MODE ROUND`.

Runs a real broker (SystemClock, sync flush, background tasks on, small segments so it rolls)
with concurrent producers and, in `mixed` mode, concurrent simple consumers. It appends one line
to JOURNAL for each acknowledgement it received, and only after the call returned:

    S <message id> <topic> <queue id> <queue offset>   a send returned (the message is durable)
    R <message id>                                      a receive handed the message out
    a <message id>                                      an ack is about to be made (its outcome unknown until A)
    A <message id>                                      an ack returned (the group is done with it)

Each line is one `os.write` on an O_APPEND descriptor, so a kill never leaves half a line in
the middle of the file. Prints READY once the broker is open. Exits by itself after
`MAX_RUN_S` so a test that dies cannot leave it running.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from chronoq.broker import Broker
from chronoq.clock import SystemClock
from chronoq.config import Config
from chronoq.errors import InvalidReceiptHandle
from chronoq.model import OutgoingMessage
from tests.support.brokers import open_broker

TOPICS = ("t0", "t1")
GROUP = "g"
PRODUCERS = 6
CONSUMERS = 3
INVISIBLE_MS = 600_000
"""Longer than the whole test: nothing received is redelivered while it runs."""
MAX_RUN_S = 30


def config_for(data_dir: Path) -> Config:
    return Config(data_dir=data_dir, flush="sync", segment_size_bytes=64 * 1024, max_message_size_bytes=32 * 1024,
                  default_queue_count=4, checkpoint_interval_ms=40)


class Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *fields: object) -> None:
        os.write(self.fd, (" ".join(str(f) for f in fields) + "\n").encode())


async def produce(broker: Broker, journal: Journal, round_no: int, p: int) -> None:
    rng = random.Random(round_no * 1000 + p)
    i = 0
    while True:
        topic = TOPICS[rng.randrange(len(TOPICS))]
        n = 3 if rng.random() < 0.2 else 1
        # Mostly small, sometimes several pages: a kill inside a multi-page write tears it.
        msgs = [OutgoingMessage(topic, bytes([65 + (i + k) % 26]) * rng.choice((16, 300, 5000, 20000)),
                                message_id=f"r{round_no}p{p}n{i + k}", tag=rng.choice(("a", "b")))
                for k in range(n)]
        results = await broker.send_batch(msgs) if n > 1 else [await broker.send(msgs[0])]
        for r in results:
            journal.line("S", r.message_id, r.topic, r.queue_id, r.queue_offset)
        i += n


async def consume(broker: Broker, journal: Journal, c: int) -> None:
    rng = random.Random(c)
    while True:
        got = []
        for topic in TOPICS:
            got += await broker.receive(GROUP, topic, batch_size=8, invisible_duration_ms=INVISIBLE_MS)
        for m in got:
            journal.line("R", m.message.message_id)
        for m in got:
            handle = m.receipt_handle
            if rng.random() < 0.25:
                handle = await broker.change_invisible_duration(GROUP, m.message.topic, handle, INVISIBLE_MS)
            if rng.random() < 0.1:
                continue  # leave it in flight: it must come back after the invisible duration
            # Journaled before the call: a kill between the ack's commit and the "A" line leaves
            # an ack whose outcome the client never learned; the test accepts either outcome then.
            journal.line("a", m.message.message_id)
            try:
                await broker.ack(GROUP, m.message.topic, handle)
            except InvalidReceiptHandle as e:  # must not happen: nothing expires during the test
                journal.line("E", m.message.message_id, str(e.details.get("reason")).replace(" ", "_"))
                raise
            journal.line("A", m.message.message_id)
        if not got:
            await asyncio.sleep(0.005)


async def main(data_dir: str, journal_path: str, mode: str, round_no: int) -> None:
    journal = Journal(journal_path)
    broker = await open_broker(config_for(Path(data_dir)), clock=SystemClock(), background=True)
    for topic in TOPICS:
        broker.topics.ensure(topic)  # consumers never create topics, and may start before the first send
    print("READY", flush=True)
    tasks = [produce(broker, journal, round_no, p) for p in range(PRODUCERS)]
    if mode == "mixed":
        tasks += [consume(broker, journal, c) for c in range(CONSUMERS)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), MAX_RUN_S)
    except TimeoutError:
        pass
    finally:
        await broker.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
