"""Interop flow run by the official `rocketmq-python-client` in its own process.

Usage: python python_simple_flow.py ENDPOINT TOPIC GROUP
A Producer sends a normal message, a timer message due in TIMER_DELAY_MS (epoch milliseconds in
`delivery_timestamp`, as the client's docs say), one given in whole epoch seconds (as the
upstream example does), and a timer message due in RECALLED_DELAY_MS that it recalls at once.
A SimpleConsumer receives until the live messages arrived and the recalled one's time plus a
margin has passed, changes the invisible duration of the first message it gets to 2 s (acking
with the renewed handle), and acks everything. Prints one JSON object with what happened (times
in ms since the epoch, taken right after each call returns); the pytest side makes the
assertions. Exit code 0 unless the client raised.

This file imports only the official client: it must never share a process with chronoq's own
generated-module users (the same protos cannot be loaded twice).
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

TIMER_DELAY_MS = 3000
RECALLED_DELAY_MS = 4000
RECALL_WATCH_MARGIN_MS = 1500
GIVE_UP_MS = 15000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def main(endpoint: str, topic: str, group: str) -> dict:
    config = ClientConfiguration(endpoint, Credentials(), request_timeout=3)
    report: dict = {"errors": []}
    producer = Producer(config, (topic,))
    producer.startup()
    consumer = SimpleConsumer(config, group, {topic: FilterExpression("*")}, await_duration=2)
    consumer.startup()
    try:
        normal = Message()
        normal.topic, normal.body, normal.tag, normal.keys = topic, b"normal-body", "TagN", "key-normal"
        normal.add_property("color", "red")
        receipt = producer.send(normal)
        report["normal_id"] = receipt.message_id
        report["normal_sent_ms"] = now_ms()

        timer = Message()
        timer.topic, timer.body, timer.tag = topic, b"timer-body", "TagT"
        deliver_at_ms = now_ms() + TIMER_DELAY_MS
        timer.delivery_timestamp = deliver_at_ms  # the client's docs: milliseconds
        receipt = producer.send(timer)
        report["timer_id"] = receipt.message_id
        report["timer_deliver_at_ms"] = deliver_at_ms
        report["timer_recall_handle_present"] = bool(receipt.recall_handle)

        # The upstream example's style: whole epoch seconds in delivery_timestamp.
        timer_s = Message()
        timer_s.topic, timer_s.body, timer_s.tag = topic, b"timer-seconds-body", "TagS"
        deliver_at_s = (now_ms() + TIMER_DELAY_MS) // 1000 + 1
        timer_s.delivery_timestamp = deliver_at_s
        report["extra_timers"] = [{"id": producer.send(timer_s).message_id, "deliver_at_ms": deliver_at_s * 1000,
                                   "body": "timer-seconds-body"}]

        recalled = Message()
        recalled.topic, recalled.body = topic, b"recalled-body"
        recalled_at_ms = now_ms() + RECALLED_DELAY_MS
        recalled.delivery_timestamp = recalled_at_ms
        receipt = producer.send(recalled)
        report["recalled_id"] = receipt.message_id
        report["recall_returned_id"] = producer.recall_message(topic, receipt.recall_handle)
        report["recalled_deliver_at_ms"] = recalled_at_ms

        report["received"] = receive_all(consumer, report, recalled_at_ms + RECALL_WATCH_MARGIN_MS)
    finally:
        consumer.shutdown()
        producer.shutdown()
    return report


def receive_all(consumer: SimpleConsumer, report: dict, watch_until_ms: int) -> list[dict]:
    received: list[dict] = []
    changed = False
    give_up_ms = now_ms() + GIVE_UP_MS
    while now_ms() < give_up_ms:
        ids = {r["id"] for r in received}
        wanted = {report["normal_id"], report["timer_id"], *(t["id"] for t in report.get("extra_timers", ()))}
        if wanted <= ids and now_ms() >= watch_until_ms:
            break
        for msg in consumer.receive(16, 15):
            arrived_ms = now_ms()
            entry = {"id": msg.message_id, "body": msg.body.decode(), "tag": msg.tag, "arrived_ms": arrived_ms,
                     "attempt": msg.delivery_attempt, "corrupted": msg.corrupted,
                     "properties": dict(msg.properties or {}), "keys": sorted(msg.keys or ())}
            if not changed:
                old_handle = msg.receipt_handle
                consumer.change_invisible_duration(msg, 2)
                entry["changed_invisible"] = msg.receipt_handle != old_handle
                changed = True
            consumer.ack(msg)
            entry["acked"] = True
            received.append(entry)
    return received


if __name__ == "__main__":
    try:
        result = main(*sys.argv[1:4])
    except Exception:
        print(json.dumps({"fatal": traceback.format_exc()}))
        sys.exit(1)
    print(json.dumps(result))
