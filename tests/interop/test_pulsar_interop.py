"""Apache Pulsar's official Python client (`pulsar-client`, pinned in pyproject's test extra)
against a real `chronoq serve --pulsar-port`, each in its own process.

The client produces 100 messages to `persistent://public/default/<topic>`, two thirds of them
delayed 1-3 s (`deliver_at` and `deliver_after`), and a Shared subscription receives and acks
the first half; then the server is SIGKILLed and started again on the same data directory, and
a second client process receives the rest on the same subscription. Every message arrives at
the application exactly once over both runs, none before its due time, no acked message comes
back after the restart, and none that was sent is lost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chronoq.client.testing import ServerProcess, free_port
from tests.support.extras import missing

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
FLOW_TIMEOUT_S = 120
COUNT = 100
ACK_FIRST = 50
INVISIBLE_MS = 3000
"""The server's default_invisible_duration_ms here: what its Pulsar consumers held when it was
killed comes back this long after, within the second run's watch."""
QUIET_S = INVISIBLE_MS / 1000 + 2
ON_TIME_SLACK_MS = 1500
"""Before the restart, a delayed message arrives at most this long after its due time (loaded
shared machine; the typical lateness is a few ms, printed by the test)."""


def _flow(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(HERE / "pulsar_flow.py"), *args], capture_output=True,
                          timeout=FLOW_TIMEOUT_S, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"flow printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, f"client raised:\n{report['fatal']}\nstderr:\n{done.stderr.decode()[-2000:]}"
    return report


def test_pulsar_client_delayed_delivery_shared_subscription_and_a_sigkill(tmp_path: Path) -> None:
    if importlib.util.find_spec("pulsar") is None:
        missing("test", "the pulsar-client package is not installed")
    pulsar_port = free_port()
    server = ServerProcess(tmp_path / "data", args=["--pulsar-port", str(pulsar_port)],
                           settings={"default_invisible_duration_ms": INVISIBLE_MS})
    url = f"pulsar://127.0.0.1:{pulsar_port}"
    topic, subscription = "persistent://public/default/orders", "orders-sub"
    server.start()
    try:
        first = _flow("produce", url, topic, subscription, str(COUNT), str(ACK_FIRST))
        assert server.kill() is not None  # SIGKILL: no clean shutdown, acks and timers as the disk has them
        server.start()
        second = _flow("consume", url, topic, subscription, str(COUNT - ACK_FIRST), str(QUIET_S))
    finally:
        server.stop()
    sent = {s["id"]: s for s in first["sent"]}
    assert len(sent) == COUNT
    before, after = first["received"], second["received"]
    assert len(before) == ACK_FIRST, before
    ids_before = [r["id"] for r in before]
    ids_after = [r["id"] for r in after]
    # Exactly once at the application over both runs: nothing acked came back, nothing was lost.
    assert not set(ids_before) & set(ids_after), sorted(set(ids_before) & set(ids_after))
    assert sorted(ids_before + ids_after, key=int) == sorted(sent, key=int), (
        f"missing {sorted(set(sent) - set(ids_before) - set(ids_after), key=int)}, "
        f"duplicates {[i for i in set(ids_after) if ids_after.count(i) > 1]}")
    for r in before + after:
        s = sent[r["id"]]
        assert r["body"] == f"m-{r['id']}" and r["key"] == f"k{r['id']}"
        assert r["arrived_ms"] >= s["due_ms"], f"message {r['id']} ({s['kind']}) arrived " \
                                               f"{s['due_ms'] - r['arrived_ms']} ms before its due time"
    late = sorted(r["arrived_ms"] - sent[r["id"]]["due_ms"] for r in before if sent[r["id"]]["kind"] == "at")
    assert late, "no deliver_at message arrived before the restart"
    assert late[-1] <= ON_TIME_SLACK_MS, late
    delayed_after = [r for r in after if sent[r["id"]]["kind"] != "plain"]
    assert delayed_after, "every delayed message was due before the restart: the restart tested no pending timer"
    print(f"deliver_at lateness before the restart (ms): min {late[0]}, median {late[len(late) // 2]}, "
          f"max {late[-1]}; after the restart: {len(after)} received, {len(delayed_after)} of them delayed, "
          f"{sum(1 for r in after if r['redelivery'] > 0)} redelivered")
