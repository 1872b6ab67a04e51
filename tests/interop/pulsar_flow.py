"""One run of Apache Pulsar's official Python client (`pulsar-client`) against chronoq's Pulsar door.

Run by tests/interop/test_pulsar_interop.py in its own process, with no path into chronoq:
`python pulsar_flow.py produce URL TOPIC SUBSCRIPTION COUNT ACK_FIRST` subscribes (Shared,
Earliest), produces COUNT messages (a third with `deliver_at`, a third with `deliver_after`, 1-3 s
ahead; the rest plain), then receives and acks ACK_FIRST of them and closes (which sends the
grouped acks). `python pulsar_flow.py consume URL TOPIC SUBSCRIPTION EXPECT QUIET_S` receives
until EXPECT messages came, acking each, then QUIET_S more seconds to catch any redelivery.
Each prints one JSON line: per received message its id, the time it arrived (ms, this host's
clock, the broker's too) and its redelivery count; per sent message the earliest it may be due.
"""

from __future__ import annotations

import datetime
import json
import random
import sys
import time
import traceback

import pulsar


def now_ms() -> int:
    return int(time.time() * 1000)


def receive_some(consumer: pulsar.Consumer, want: int, deadline_s: float, quiet_s: float = 0.0) -> list[dict]:
    got: list[dict] = []
    quiet_until = None
    while True:
        if len(got) >= want and quiet_until is None:
            quiet_until = time.monotonic() + quiet_s
        limit = quiet_until if quiet_until is not None else deadline_s
        left_ms = int((limit - time.monotonic()) * 1000)
        if left_ms <= 0:
            return got
        try:
            msg = consumer.receive(timeout_millis=min(left_ms, 1000))
        except pulsar.Timeout:
            continue
        arrived = now_ms()
        got.append({"id": msg.properties().get("id"), "arrived_ms": arrived, "redelivery": msg.redelivery_count(),
                    "body": msg.data().decode(), "key": msg.partition_key()})
        consumer.acknowledge(msg)


def produce(url: str, topic: str, subscription: str, count: int, ack_first: int) -> dict:
    client = pulsar.Client(url, operation_timeout_seconds=10)
    consumer = client.subscribe(topic, subscription, consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(topic)
    rng = random.Random(7)
    sent = []
    for i in range(count):
        kind = ("at", "after", "plain")[i % 3]
        delay_ms = rng.randint(1000, 3000)
        props = {"id": str(i)}
        before = now_ms()
        if kind == "at":
            due = before + delay_ms
            producer.send(f"m-{i}".encode(), properties=props, partition_key=f"k{i}", deliver_at=due)
        elif kind == "after":
            due = before + delay_ms  # the client adds the delay to its clock inside send(): no earlier than this
            producer.send(f"m-{i}".encode(), properties=props, partition_key=f"k{i}",
                          deliver_after=datetime.timedelta(milliseconds=delay_ms))
        else:
            due = before
            producer.send(f"m-{i}".encode(), properties=props, partition_key=f"k{i}")
        sent.append({"id": str(i), "kind": kind, "due_ms": due, "sent_ms": before})
    received = receive_some(consumer, ack_first, time.monotonic() + 30)
    consumer.close()  # sends the acks still grouped in the client, and waits for the broker's SUCCESS
    producer.close()
    client.close()
    return {"sent": sent, "received": received}


def consume(url: str, topic: str, subscription: str, expect: int, quiet_s: float) -> dict:
    client = pulsar.Client(url, operation_timeout_seconds=10)
    consumer = client.subscribe(topic, subscription, consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest)
    received = receive_some(consumer, expect, time.monotonic() + 60, quiet_s)
    consumer.close()
    client.close()
    return {"received": received}


def main() -> None:
    mode, url, topic, subscription = sys.argv[1:5]
    try:
        if mode == "produce":
            report = produce(url, topic, subscription, int(sys.argv[5]), int(sys.argv[6]))
        else:
            report = consume(url, topic, subscription, int(sys.argv[5]), float(sys.argv[6]))
    except Exception:
        report = {"fatal": traceback.format_exc()}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
