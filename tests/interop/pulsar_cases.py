"""One case of Apache Pulsar's official Python client against chronoq's Pulsar door, in its own process.

Run by tests/interop/test_pulsar_semantics.py: `python pulsar_cases.py CASE URL TOPIC [JSON]`
(JSON: the case's options, e.g. auth or TLS). It imports only `pulsar` (no path into chronoq) and
prints one JSON line: what happened, with times in ms since the epoch taken right after each
call returned; the pytest side makes the assertions. A client exception in the case is reported
as `fatal` with its traceback.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from collections.abc import Callable

import pulsar

Case = Callable[[pulsar.Client, str, dict], dict]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def drain(consumer: pulsar.Consumer, want: int, timeout_s: float, *, ack: bool = True) -> list[dict]:
    """Receive until `want` messages came or `timeout_s` passed."""
    got: list[dict] = []
    end = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < end:
        try:
            msg = consumer.receive(timeout_millis=200)
        except pulsar.Timeout:
            continue
        got.append({"body": msg.data().decode(), "at_ms": now_ms(), "redelivery": msg.redelivery_count(),
                    "key": msg.partition_key(), "props": msg.properties(), "id": str(msg.message_id()),
                    "_msg": msg})
        if ack:
            consumer.acknowledge(msg)
    return got


def quiet(consumer: pulsar.Consumer, seconds: float) -> list[dict]:
    return drain(consumer, 1 << 30, seconds)


def public(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


@case
def delay_semantics(client: pulsar.Client, topic: str, opts: dict) -> dict:
    """A delayed and a plain message; one subscription of each type, made before the sends."""
    delay_ms = opts.get("delay_ms", 3000)
    # Those that receive at once first: each is drained in turn, and a time is taken at receive().
    types = {"exclusive": pulsar.ConsumerType.Exclusive, "failover": pulsar.ConsumerType.Failover,
             "shared": pulsar.ConsumerType.Shared, "key_shared": pulsar.ConsumerType.KeyShared}
    consumers = {name: client.subscribe(topic, f"sub-{name}", consumer_type=kind,
                                        initial_position=pulsar.InitialPosition.Earliest)
                 for name, kind in types.items()}
    producer = client.create_producer(topic)
    sent_ms = now_ms()
    producer.send(b"delayed", partition_key="k1", deliver_after=datetime.timedelta(milliseconds=delay_ms))
    producer.send(b"plain", partition_key="k2")
    received = {}
    for name, consumer in consumers.items():
        received[name] = public(drain(consumer, 2, delay_ms / 1000 + 5))
    extra = {name: public(quiet(consumer, 1.0)) for name, consumer in consumers.items()}
    return {"sent_ms": sent_ms, "due_ms": sent_ms + delay_ms, "received": received, "extra": extra}


@case
def max_delay(client: pulsar.Client, topic: str, opts: dict) -> dict:
    producer = client.create_producer(topic, send_timeout_millis=5000)
    out: dict = {}
    started = time.monotonic()
    try:
        producer.send(b"too far", deliver_after=datetime.timedelta(seconds=60))
        out["far"] = "sent"
    except Exception as exc:
        out["far"] = f"{type(exc).__name__}: {exc}"
    out["far_s"] = time.monotonic() - started
    producer.send(b"near", deliver_after=datetime.timedelta(milliseconds=200))
    out["near"] = "sent"
    return out


@case
def key_shared(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumers = [client.subscribe(topic, "ks", consumer_type=pulsar.ConsumerType.KeyShared,
                                  initial_position=pulsar.InitialPosition.Earliest, consumer_name=f"c{i}",
                                  receiver_queue_size=10)
                 for i in range(2)]
    producer = client.create_producer(topic)
    for i in range(80):
        producer.send(f"m{i}".encode(), partition_key=f"key-{i % 16}")
    got: dict[str, list[dict]] = {"c0": [], "c1": []}
    end = time.monotonic() + 20
    while sum(len(v) for v in got.values()) < 80 and time.monotonic() < end:
        for i, consumer in enumerate(consumers):
            got[f"c{i}"] += public(drain(consumer, 1 << 30, 0.3))
    return {"got": got}


@case
def unsubscribe(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumer = client.subscribe(topic, "gone", initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(topic)
    for i in range(3):
        producer.send(f"u{i}".encode())
    first = public(drain(consumer, 3, 10))
    consumer.unsubscribe()
    again = client.subscribe(topic, "gone", initial_position=pulsar.InitialPosition.Earliest)
    second = public(drain(again, 3, 10))
    return {"first": first, "second": second}


@case
def last_message_id(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumer = client.subscribe(topic, "last", initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(topic)
    ids = [str(producer.send(f"l{i}".encode())) for i in range(5)]
    return {"sent": ids, "last": str(consumer.get_last_message_id())}


@case
def seek(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumer = client.subscribe(topic, "seeker", initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(topic)
    ids, times = [], []
    for i in range(6):
        times.append(now_ms())
        ids.append(producer.send(f"s{i}".encode()))
        time.sleep(0.05)
    first = drain(consumer, 6, 10)
    consumer.seek(ids[3])
    by_id = public(drain(consumer, 3, 10)) + public(quiet(consumer, 1.0))
    consumer.seek(times[4])
    by_time = public(drain(consumer, 2, 10)) + public(quiet(consumer, 1.0))
    return {"first": public(first), "by_id": by_id, "by_time": by_time}


@case
def negative_ack(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumer = client.subscribe(topic, "nacker", consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest,
                                negative_ack_redelivery_delay_ms=1000)
    producer = client.create_producer(topic)
    producer.send(b"n0")
    first = drain(consumer, 1, 10, ack=False)
    nacked_ms = now_ms()
    consumer.negative_acknowledge(first[0]["_msg"])
    again = drain(consumer, 1, 10)
    return {"first": public(first), "nacked_ms": nacked_ms, "again": public(again)}


@case
def ack_timeout(client: pulsar.Client, topic: str, opts: dict) -> dict:
    consumer = client.subscribe(topic, "slowpoke", consumer_type=pulsar.ConsumerType.Shared,
                                initial_position=pulsar.InitialPosition.Earliest, unacked_messages_timeout_ms=10_000)
    producer = client.create_producer(topic)
    producer.send(b"t0")
    first = public(drain(consumer, 1, 10, ack=False))
    again = public(drain(consumer, 1, 20))
    return {"first": first, "again": again}


@case
def handoff(client: pulsar.Client, topic: str, opts: dict) -> dict:
    """A Shared consumer that received (prefetched) and acked nothing closes; another gets it all."""
    a = client.subscribe(topic, "hand", consumer_type=pulsar.ConsumerType.Shared,
                         initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(topic)
    for i in range(5):
        producer.send(f"h{i}".encode())
    held = public(drain(a, 5, 10, ack=False))
    other = pulsar.Client(opts["url"], operation_timeout_seconds=10)
    b = other.subscribe(topic, "hand", consumer_type=pulsar.ConsumerType.Shared)
    before_close = public(drain(b, 1, 1.0))
    closed_ms = now_ms()
    a.close()
    taken = public(drain(b, 5, 10))
    other.close()
    return {"held": held, "before_close": before_close, "closed_ms": closed_ms, "taken": taken}


@case
def produce_consume(client: pulsar.Client, topic: str, opts: dict) -> dict:
    """Send what `opts["send"]` lists, then receive `opts["expect"]` messages (two doors, auth, TLS)."""
    out: dict = {}
    if opts.get("subscribe_first"):
        consumer = client.subscribe(topic, opts.get("subscription", "both"),
                                    initial_position=pulsar.InitialPosition.Earliest)
    if opts.get("send"):
        producer = client.create_producer(topic)
        for item in opts["send"]:
            kwargs: dict = {"properties": item.get("props", {})}
            if item.get("key"):
                kwargs["partition_key"] = item["key"]
            if item.get("delay_ms"):
                kwargs["deliver_after"] = datetime.timedelta(milliseconds=item["delay_ms"])
            producer.send(item["body"].encode(), **kwargs)
        out["sent_ms"] = now_ms()
    if opts.get("expect"):
        if not opts.get("subscribe_first"):
            consumer = client.subscribe(topic, opts.get("subscription", "both"),
                                        initial_position=pulsar.InitialPosition.Earliest)
        out["received"] = public(drain(consumer, opts["expect"], opts.get("timeout_s", 15)))
    return out


def main() -> None:
    name, url, topic = sys.argv[1:4]
    opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    opts["url"] = url
    kwargs: dict = {"operation_timeout_seconds": 10}
    if "auth" in opts:
        kwargs["authentication"] = pulsar.AuthenticationBasic(*opts["auth"])
    if "trust" in opts:
        kwargs["tls_trust_certs_file_path"] = opts["trust"]
    try:
        client = pulsar.Client(url, **kwargs)
        try:
            report = CASES[name](client, topic, opts)
        finally:
            client.close()
    except Exception:
        report = {"fatal": traceback.format_exc()}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
