"""Auth probes run by the official `rocketmq-python-client` in its own process.

Usage: python python_auth_flow.py ENDPOINT ACCESS_KEY SECRET_KEY TOPIC GROUP TLS(0|1)
With the given credentials (empty strings: the client's `Credentials()`, which still sends an
`authorization` header), a Producer sends a normal message and a timer message to TOPIC and
recalls the timer; a SimpleConsumer in GROUP receives from TOPIC. Each step is recorded as
`{"ok": true}` or `{"ok": false, "error": "..."}`; one JSON object is printed, and the pytest
side asserts. With TLS=1 the clients use `tls_enable=True` (the CA comes from
GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, as the client offers no other way).

This file imports only the official client (never chronoq's generated modules).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from rocketmq import ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer

RECEIVE_GIVE_UP_S = 8


def step(report: dict, name: str, body: Callable[[], Any]) -> Any:
    try:
        value = body()
    except Exception as exc:  # the client's own exception types vary by version
        report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return None
    report[name] = {"ok": True}
    return value


def main(endpoint: str, ak: str, sk: str, topic: str, group: str, tls: str) -> dict:
    credentials = Credentials(ak, sk) if ak else Credentials()
    config = ClientConfiguration(endpoint, credentials, request_timeout=3)
    tls_enable = tls == "1"
    report: dict = {}
    producer = Producer(config, (topic,), tls_enable=tls_enable)
    step(report, "producer_startup", producer.startup)
    try:
        msg = Message()
        msg.topic, msg.body = topic, b"auth-normal"
        step(report, "send", lambda: producer.send(msg))
        timer = Message()
        timer.topic, timer.body = topic, b"auth-timer"
        timer.delivery_timestamp = int(time.time() * 1000) + 60_000
        receipt = step(report, "send_timer", lambda: producer.send(timer))
        if receipt is not None:
            step(report, "recall", lambda: producer.recall_message(topic, receipt.recall_handle))
    finally:
        producer.shutdown()
    consumer = SimpleConsumer(config, group, {topic: FilterExpression("*")}, await_duration=2, tls_enable=tls_enable)
    step(report, "consumer_startup", consumer.startup)
    try:
        def receive() -> int:
            deadline = time.monotonic() + RECEIVE_GIVE_UP_S
            got = 0
            while time.monotonic() < deadline and not got:
                for m in consumer.receive(16, 15):
                    consumer.ack(m)
                    got += 1
            return got
        report["received"] = step(report, "receive", receive)
    finally:
        consumer.shutdown()
    return report


if __name__ == "__main__":
    try:
        result = main(*sys.argv[1:7])
    except Exception:
        print(json.dumps({"fatal": traceback.format_exc()}))
        sys.exit(1)
    print(json.dumps(result))
