"""Interop flow for the official Python PushConsumer, in its own process.

Usage: python python_push_flow.py ENDPOINT TOPIC GROUP
A Producer sends COUNT normal messages and one timer message (due in 1 s); a PushConsumer (which
waits for the server's Settings, polls QueryAssignment, and receives with auto_renew) consumes
them with a listener that returns SUCCESS (the client then acks). The first delivery of one
chosen message returns FAILURE, so the client nacks it (ChangeInvisibleDuration) and the server
must redeliver it. Prints one JSON object; the pytest side asserts.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

from rocketmq import (
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
)

COUNT = 3
TIMER_DELAY_MS = 1000
GIVE_UP_S = 25.0


class Listener(MessageListener):
    def __init__(self, fail_body: bytes) -> None:
        self.lock = threading.Lock()
        self.seen: list[dict] = []
        self.failed_once = False
        self.fail_body = fail_body
        self.done = threading.Event()
        self.expected: set[str] = set()

    def consume(self, message) -> ConsumeResult:
        with self.lock:
            self.seen.append({"id": message.message_id, "body": message.body.decode(),
                              "attempt": message.delivery_attempt, "corrupted": message.corrupted,
                              "delivery_timestamp": message.delivery_timestamp,
                              "arrived_ms": time.time_ns() // 1_000_000})
            if message.body == self.fail_body and not self.failed_once:
                self.failed_once = True
                return ConsumeResult.FAILURE
            succeeded = {s["id"] for s in self.seen if not (s["body"] == self.fail_body.decode()
                                                            and s["attempt"] == 1)}
            if self.expected and self.expected <= succeeded:
                self.done.set()
            return ConsumeResult.SUCCESS


def main(endpoint: str, topic: str, group: str) -> dict:
    config = ClientConfiguration(endpoint, Credentials(), request_timeout=3)
    listener = Listener(fail_body=b"push-1")
    consumer = PushConsumer(config, group, listener, {topic: FilterExpression("*")})
    consumer.startup()
    producer = Producer(config, (topic,))
    producer.startup()
    report: dict = {}
    try:
        ids = []
        for i in range(COUNT):
            m = Message()
            m.topic, m.body = topic, f"push-{i}".encode()
            ids.append(producer.send(m).message_id)
        t = Message()
        t.topic, t.body = topic, b"push-timer"
        report["timer_deliver_at_ms"] = t.delivery_timestamp = time.time_ns() // 1_000_000 + TIMER_DELAY_MS
        ids.append(producer.send(t).message_id)
        report["sent_ids"] = ids
        with listener.lock:
            listener.expected = set(ids)
        report["all_consumed"] = listener.done.wait(GIVE_UP_S)
        with listener.lock:
            report["seen"] = list(listener.seen)
    finally:
        producer.shutdown()
        consumer.shutdown()
    return report


if __name__ == "__main__":
    try:
        result = main(*sys.argv[1:4])
    except Exception:
        print(json.dumps({"fatal": traceback.format_exc()}))
        sys.exit(1)
    print(json.dumps(result))
