"""Interop flow: the official `rocketmq-python-client` sends to a mistyped topic name.

Usage: python python_near_topic_flow.py ENDPOINT TOPIC TYPO
A Producer sends one message to TOPIC (auto-created), then a second Producer sends one to TYPO,
a name near TOPIC's that no topic has: chronoq refuses it with TOPIC_NOT_FOUND (40402) and a
message naming TOPIC. Prints one JSON object: the first receipt's id, and the refusal's
exception class, code and text (or the receipt, had the send passed); the pytest side makes
the assertions. Exit code 0 unless the client raised something else.

This file imports only the official client: it must never share a process with chronoq's own
generated-module users (the same protos cannot be loaded twice).
"""

from __future__ import annotations

import json
import sys
import traceback

from rocketmq import ClientConfiguration, Credentials, Message, Producer


def send_one(config: ClientConfiguration, topic: str, body: bytes) -> str:
    producer = Producer(config, (topic,))
    producer.startup()
    try:
        msg = Message()
        msg.topic, msg.body = topic, body
        return producer.send(msg).message_id
    finally:
        producer.shutdown()


def main(endpoint: str, topic: str, typo: str) -> dict:
    config = ClientConfiguration(endpoint, Credentials(), request_timeout=3)
    report: dict = {"sent_id": send_one(config, topic, b"to the real topic")}
    try:
        report["typo_sent_id"] = send_one(config, typo, b"to the typo")
    except Exception as e:  # the official client's exception for a 40402 status
        report["refused"] = {"class": type(e).__name__, "code": int(getattr(e, "code", 0) or 0),
                             "text": str(e)}
    return report


if __name__ == "__main__":
    try:
        out = main(*sys.argv[1:4])
    except Exception:
        out = {"fatal": traceback.format_exc()}
    print(json.dumps(out), flush=True)
    sys.exit(0)
