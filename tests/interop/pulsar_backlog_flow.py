"""Apache Pulsar's official Python client loading a backlog into chronoq's Pulsar door, then draining it.

Run by tests/interop/test_pulsar_restart.py in its own process, with no path into chronoq:

`python pulsar_backlog_flow.py load URL TOPIC SUBSCRIPTION PLAIN DELAYED MIN_MS MAX_MS` subscribes
(Shared, Earliest), sends PLAIN plain messages and DELAYED ones with `deliver_after` drawn from
[MIN_MS, MAX_MS] (asynchronously, every receipt awaited), then receives the plain ones and acks
a scattered subset (ids drawn at random, so the acks leave holes), negatively acks about half of
the rest and receives those again (`redelivery_count` 1), leaves them unacked, and closes the
consumer (which sends the grouped acks and waits for the broker's SUCCESS).

`python pulsar_backlog_flow.py drain URL TOPIC SUBSCRIPTION EXPECT DEADLINE_MS QUIET_S` receives
and acks until EXPECT messages came or DEADLINE_MS (ms since the epoch) passed, then QUIET_S
more seconds to catch anything that comes back.

Each prints one JSON line. Times are ms since the epoch by this host's clock (the broker's too);
a delayed message's `due_ms` is the clock read before `send_async`, plus its delay: the client
adds the delay to its own clock inside the call, so the due time it sends is no earlier.
"""

from __future__ import annotations

import datetime
import json
import random
import sys
import threading
import time
import traceback

import pulsar

ACK_SHARE = 0.6
"""Of the plain messages, about this share is acked before the restart; the rest are the holes."""
NACK_DELAY_MS = 200


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Receipts:
    """Counts `send_async` callbacks; remembers the first failure."""

    def __init__(self) -> None:
        self.done = 0
        self.failure: str | None = None
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def callback(self, result: pulsar.Result, _msg_id: object) -> None:
        with self.changed:
            self.done += 1
            if result != pulsar.Result.Ok and self.failure is None:
                self.failure = str(result)
            self.changed.notify_all()

    def wait(self, count: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with self.changed:
            while self.done < count:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.done} of {count} sends receipted after {timeout_s} s")
                self.changed.wait(left)
        if self.failure is not None:
            raise RuntimeError(f"a send failed: {self.failure}")


def record(msg: pulsar.Message) -> dict:
    return {"id": msg.properties()["id"], "arrived_ms": now_ms(), "redelivery": msg.redelivery_count()}


def load(url: str, topic: str, subscription: str, plain: int, delayed: int, min_ms: int, max_ms: int) -> dict:
    client = pulsar.Client(url, operation_timeout_seconds=30, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))
    consumer = client.subscribe(topic, subscription, consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest,
                                negative_ack_redelivery_delay_ms=NACK_DELAY_MS)
    producer = client.create_producer(topic, block_if_queue_full=True, max_pending_messages=2000)
    rng = random.Random(20261128)
    receipts = Receipts()
    for i in range(plain):
        producer.send_async(f"p{i}".encode(), receipts.callback, properties={"id": f"p{i}"})
    sent_delayed = {}
    started_ms = now_ms()
    for i in range(delayed):
        delay_ms = rng.randint(min_ms, max_ms)
        before = now_ms()
        producer.send_async(f"d{i}".encode(), receipts.callback, properties={"id": f"d{i}"},
                            deliver_after=datetime.timedelta(milliseconds=delay_ms))
        sent_delayed[f"d{i}"] = before + delay_ms
    receipts.wait(plain + delayed, 120)
    sends_done_ms = now_ms()
    # Receive every plain message once; ack a scattered subset, negatively ack half the others.
    received: list[dict] = []
    messages: dict[str, pulsar.Message] = {}
    end = time.monotonic() + 60
    while len(messages) < plain and time.monotonic() < end:
        try:
            msg = consumer.receive(timeout_millis=1000)
        except pulsar.Timeout:
            continue
        received.append(record(msg))
        if msg.properties()["id"].startswith("p"):
            messages[msg.properties()["id"]] = msg
    acked, nacked = [], []
    for mid, msg in sorted(messages.items()):
        if rng.random() < ACK_SHARE:
            consumer.acknowledge(msg)
            acked.append(mid)
        elif rng.random() < 0.5:
            consumer.negative_acknowledge(msg)
            nacked.append(mid)
    # The negatively acked come back (redelivery_count 1); they stay unacked.
    back: set[str] = set()
    end = time.monotonic() + 30
    while len(back) < len(nacked) and time.monotonic() < end:
        try:
            msg = consumer.receive(timeout_millis=1000)
        except pulsar.Timeout:
            continue
        received.append(record(msg))
        if msg.properties()["id"] in nacked:
            back.add(msg.properties()["id"])
    consumer.close()
    producer.close()
    client.close()
    return {"started_ms": started_ms, "sends_done_ms": sends_done_ms, "closed_ms": now_ms(),
            "plain": [f"p{i}" for i in range(plain)], "delayed_due_ms": sent_delayed, "acked": acked,
            "nacked": nacked, "received": received}


def drain(url: str, topic: str, subscription: str, expect: int, deadline_ms: int, quiet_s: float) -> dict:
    client = pulsar.Client(url, operation_timeout_seconds=30, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))
    subscribed_ms = now_ms()
    consumer = client.subscribe(topic, subscription, consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest)
    subscribed_ms = now_ms() - subscribed_ms
    received: list[dict] = []
    quiet_until: float | None = None
    while True:
        if len(received) >= expect and quiet_until is None:
            quiet_until = time.monotonic() + quiet_s
        if quiet_until is not None and time.monotonic() >= quiet_until:
            break
        if quiet_until is None and now_ms() >= deadline_ms:
            break
        try:
            msg = consumer.receive(timeout_millis=500)
        except pulsar.Timeout:
            continue
        received.append(record(msg))
        consumer.acknowledge(msg)
    consumer.close()
    client.close()
    return {"subscribe_ms": subscribed_ms, "received": received}


def main() -> None:
    mode, url, topic, subscription = sys.argv[1:5]
    try:
        if mode == "load":
            plain, delayed, min_ms, max_ms = (int(a) for a in sys.argv[5:9])
            report = load(url, topic, subscription, plain, delayed, min_ms, max_ms)
        else:
            report = drain(url, topic, subscription, int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]))
    except Exception:
        report = {"fatal": traceback.format_exc()}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
