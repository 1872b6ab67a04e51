"""The Pulsar door's traffic where an operator looks: /metrics (a real scrape), the console's
overview, `chronoq stats` and the delivery trace, after Apache Pulsar's official Python client
(tests/interop/pulsar_cases.py, case `delay_semantics`, its own process) sent a delayed and a
plain message to a topic with one subscription of each type (Exclusive, Failover, Shared,
Key_Shared), and each received both and acked them.

What each must read, as for the same traffic through the gRPC door: 2 accepted, 1 timer
enqueued and fired, 8 deliveries (2 per subscription) on the topic; the immediate copy the door
stores for Exclusive and Failover subscriptions counts neither as accepted nor under a topic of
its own, and the console does not list its topic; the four subscriptions are consumer groups in
`chronoq stats`; the timer has its trace row (accepted, fired, first received, none early).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chronoq.client.testing import ServerProcess, free_port
from chronoq.trace import read_trace
from tests.support.extras import missing

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
TOPIC = "seen"
DELAY_MS = 1500
SUBSCRIPTIONS = ("sub-exclusive", "sub-failover", "sub-shared", "sub-key_shared")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        body: bytes = reply.read()
    return body.decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_console_stats_and_trace_count_the_pulsar_doors_traffic(tmp_path: Path) -> None:
    if importlib.util.find_spec("pulsar") is None:
        missing("test", "the pulsar-client package is not installed")
    pulsar_port, http_port = free_port(), free_port()
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir, args=["--pulsar-port", str(pulsar_port), "--http-port", str(http_port)],
                           settings={"trace_enable": True})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with server:
        done = subprocess.run([sys.executable, str(HERE / "pulsar_cases.py"), "delay_semantics",
                               f"pulsar://127.0.0.1:{pulsar_port}", TOPIC, json.dumps({"delay_ms": DELAY_MS})],
                              capture_output=True, timeout=90, env=env, check=False)
        report = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert "fatal" not in report, report["fatal"]
        assert all(len(got) == 2 for got in report["received"].values()), report["received"]
        base = f"http://127.0.0.1:{http_port}"
        scraped = samples(get(f"{base}/metrics"))
        overview = json.loads(get(f"{base}/api/overview"))
        stats_json = subprocess.run([sys.executable, "-m", "chronoq", "stats", "--server", server.address, "--json"],
                                    capture_output=True, timeout=60, check=False)
        stats_text = subprocess.run([sys.executable, "-m", "chronoq", "stats", "--server", server.address],
                                    capture_output=True, timeout=60, check=False)
    topic = (("topic", TOPIC),)
    assert scraped[("chronoq_messages_accepted_total", topic)] == 2
    assert scraped[("rocketmq_timer_enqueue_total", topic)] == 1
    assert scraped[("rocketmq_timer_dequeue_total", topic)] == 1
    assert scraped[("chronoq_messages_delivered_total", topic)] == 2 * len(SUBSCRIPTIONS)
    assert scraped[("rocketmq_delay_message_latency_count", topic)] == 1
    assert scraped[("chronoq_timer_delivery_error_ms_count", ())] >= 1
    assert scraped[("chronoq_trace_active", ())] == 1
    copies = [key for key in scraped if key[0].startswith(("chronoq_messages_", "rocketmq_timer_enqueue"))
              and any(value.startswith("%PULSAR_NOW%") for _, value in key[1])]
    assert copies == [], copies
    rows = {row["name"]: row for row in overview["topics"]}
    assert set(rows) == {TOPIC}, sorted(rows)
    assert (rows[TOPIC]["accepted"], rows[TOPIC]["delivered"]) == (2, 2 * len(SUBSCRIPTIONS))
    assert {(g["group"], g["topic"]) for g in overview["groups"]} >= {(s, TOPIC) for s in SUBSCRIPTIONS}

    assert stats_json.returncode == 0, stats_json.stderr.decode()
    stats = json.loads(stats_json.stdout)
    assert {(g["group"], g["topic"]) for g in stats["groups"]} >= {(s, TOPIC) for s in SUBSCRIPTIONS}
    assert stats["timer"]["pending_total"] == 0 and stats["trace"]["active"]
    text = stats_text.stdout.decode()
    assert stats_text.returncode == 0 and "trace" in text and f"on {TOPIC}" in text, text

    (row,) = [r for r in read_trace(data_dir).rows if r["topic"] == TOPIC]
    assert row["fired_ms"] is not None and row["fired_ms"] >= row["due_ms"], row
    assert row["first_received_ms"] is not None and row["first_received_ms"] >= row["due_ms"], row
    print(f"trace row: due {row['due_ms']}, fired +{row['fired_ms'] - row['due_ms']} ms, "
          f"first received +{row['first_received_ms'] - row['due_ms']} ms")
