"""Pulsar's semantics through chronoq's Pulsar door, each checked with the official Python client
(`pulsar-client`) in its own process (tests/interop/pulsar_cases.py) against a real `chronoq serve`:
delayed delivery per subscription type, the maximum delay, Key_Shared, UNSUBSCRIBE,
GET_LAST_MESSAGE_ID, SEEK, negative acks, ack timeouts, and a closing consumer's messages going
to another."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronoq.client.testing import ServerProcess, free_port
from tests.support.extras import missing

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
CASE_TIMEOUT_S = 90
IMMEDIATE_SLACK_MS = 1500
"""An Exclusive or Failover subscription receives a delayed message within this of its send."""
MAX_DELAY_MS = 30_000


def run_case(name: str, url: str, topic: str, **opts: object) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(HERE / "pulsar_cases.py"), name, url, topic, json.dumps(opts)],
                          capture_output=True, timeout=CASE_TIMEOUT_S, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"case printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, f"client raised:\n{report['fatal']}\nstderr:\n{done.stderr.decode()[-2000:]}"
    return report


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if importlib.util.find_spec("pulsar") is None:
        missing("test", "the pulsar-client package is not installed")
    port = free_port()
    server = ServerProcess(tmp_path_factory.mktemp("pulsar") / "data", args=["--pulsar-port", str(port)],
                           settings={"pulsar_max_delivery_delay_ms": MAX_DELAY_MS,
                                     "pulsar_delay_all_subscriptions_topics": "slow-*, other",
                                     "default_invisible_duration_ms": 5000})
    server.start()
    try:
        yield f"pulsar://127.0.0.1:{port}"
    finally:
        server.stop()


def test_a_delay_holds_on_shared_and_key_shared_and_not_on_exclusive_or_failover(url: str) -> None:
    r = run_case("delay_semantics", url, "semantics")
    for name in ("shared", "key_shared", "exclusive", "failover"):
        got = r["received"][name]
        assert sorted(m["body"] for m in got) == ["delayed", "plain"], (name, got)
        assert r["extra"][name] == [], f"{name} received a message twice: {r['extra'][name]}"
        delayed = next(m for m in got if m["body"] == "delayed")
        if name in ("shared", "key_shared"):
            assert delayed["at_ms"] >= r["due_ms"], (name, delayed["at_ms"] - r["due_ms"])
        else:
            assert delayed["at_ms"] - r["sent_ms"] < IMMEDIATE_SLACK_MS, (name, delayed["at_ms"] - r["sent_ms"])
        assert delayed["key"] == "k1" and delayed["redelivery"] == 0


def test_a_topic_named_in_the_setting_delays_every_subscription_type(url: str) -> None:
    r = run_case("delay_semantics", url, "slow-orders")
    for name in ("shared", "key_shared", "exclusive", "failover"):
        delayed = next(m for m in r["received"][name] if m["body"] == "delayed")
        assert delayed["at_ms"] >= r["due_ms"], (name, delayed["at_ms"] - r["due_ms"])
        assert r["extra"][name] == []


def test_a_delay_beyond_the_maximum_fails_that_send(url: str) -> None:
    r = run_case("max_delay", url, "limited")
    assert r["far"] != "sent" and "ChecksumError" in r["far"], r
    assert r["far_s"] < 10, r  # refused, not retried until the send timeout
    assert r["near"] == "sent"


def test_key_shared_gives_each_key_to_one_consumer(url: str) -> None:
    got = run_case("key_shared", url, "keyed")["got"]
    assert sum(len(v) for v in got.values()) == 80, {k: len(v) for k, v in got.items()}
    owners: dict[str, set[str]] = {}
    for consumer, rows in got.items():
        for row in rows:
            owners.setdefault(row["key"], set()).add(consumer)
    assert all(len(o) == 1 for o in owners.values()), owners
    assert {c for o in owners.values() for c in o} == {"c0", "c1"}, "one consumer got every key"


def test_unsubscribe_forgets_the_subscription(url: str) -> None:
    r = run_case("unsubscribe", url, "unsub")
    assert sorted(m["body"] for m in r["first"]) == ["u0", "u1", "u2"]
    # A subscription made again from Earliest is new: it receives everything retained again.
    assert sorted(m["body"] for m in r["second"]) == ["u0", "u1", "u2"]
    assert all(m["redelivery"] == 0 for m in r["second"])


def test_get_last_message_id_is_the_last_message_sent(url: str) -> None:
    r = run_case("last_message_id", url, "lastid")
    assert r["last"] == r["sent"][-1], r


def test_seek_by_message_id_and_by_time(url: str) -> None:
    r = run_case("seek", url, "seeking")
    assert sorted(m["body"] for m in r["first"]) == [f"s{i}" for i in range(6)]
    # Pulsar's seek to a message id goes on after that message (the client drops the message
    # itself when the broker sends it again).
    assert sorted(m["body"] for m in r["by_id"]) == ["s4", "s5"], r["by_id"]
    assert sorted(m["body"] for m in r["by_time"]) == ["s4", "s5"], r["by_time"]


def test_a_negative_ack_comes_back_after_the_clients_delay(url: str) -> None:
    r = run_case("negative_ack", url, "nacks")
    again = r["again"]
    assert [m["body"] for m in again] == ["n0"] and again[0]["redelivery"] == 1
    assert again[0]["at_ms"] - r["nacked_ms"] >= 900, again[0]["at_ms"] - r["nacked_ms"]


def test_an_ack_timeout_redelivers(url: str) -> None:
    r = run_case("ack_timeout", url, "acktimeout")
    assert [m["body"] for m in r["again"]] == ["t0"] and r["again"][0]["redelivery"] == 1
    assert r["again"][0]["at_ms"] - r["first"][0]["at_ms"] >= 9_000


def test_a_closed_consumers_unacked_messages_go_to_another(url: str) -> None:
    r = run_case("handoff", url, "handoff")
    assert len(r["held"]) == 5 and r["before_close"] == []
    assert sorted(m["body"] for m in r["taken"]) == [f"h{i}" for i in range(5)]
    assert all(m["redelivery"] == 1 and m["at_ms"] >= r["closed_ms"] for m in r["taken"])

