"""The official RocketMQ 5 clients against a real `chronoq serve`, each in its own process.

One `chronoq serve` (free port, temp data dir) serves the module; each flow uses its own topic
and group. The flows (`python_simple_flow.py`, `python_push_flow.py`, `node/flow.js`) print one
JSON report; the assertions live here. The Node client must be installed by
`scripts/install-node-client.sh`; if it is missing the Node test fails and says so (it does not
skip). The recalled message's state is also checked on the server through the admin service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import chronoq
from chronoq.client.testing import ServerProcess
from tests.support.extras import missing, need_command

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = Path(chronoq.__file__).resolve().parent.parent
NODE_DIR = HERE / "node"
FLOW_TIMEOUT_S = 60
READY_TIMEOUT_S = 30
ON_TIME_SLACK_MS = 1000
"""A timer message must arrive no earlier than its time and at most this much later."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = ServerProcess(tmp_path_factory.mktemp("interop") / "data").start()
    try:
        yield proc.address
    finally:
        code = proc.stop()  # SIGTERM: the clean shutdown path
        assert code == 0, f"chronoq serve exited {code} after SIGTERM\n{proc.log()}"


def _run_flow(cmd: list[str], cwd: Path | None = None) -> dict:
    # The client processes get a clean environment: no PYTHONPATH into chronoq, whose generated
    # modules must never meet a second copy of the same protos.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, capture_output=True, timeout=FLOW_TIMEOUT_S, cwd=cwd, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"flow printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, f"client raised:\n{report['fatal']}\nstderr:\n{done.stderr.decode()[-2000:]}"
    assert done.returncode == 0
    return report


def _admin(address: str, method: str, body: dict) -> dict:
    with grpc.insecure_channel(address) as channel:
        reply = channel.unary_unary(f"/chronoq.admin.v1.Admin/{method}")(json.dumps(body).encode(), timeout=10)
    return json.loads(reply)


def _check_simple_flow(report: dict, server: str, topic: str, timer_earliest_ms: int, timer_latest_ms: int) -> None:
    by_id: dict[str, list[dict]] = {}
    for entry in report["received"]:
        by_id.setdefault(entry["id"], []).append(entry)
    # Each live message arrived exactly once (acks held; the changed invisible duration of 2 s
    # ran out inside the watch window, so a lost ack would show up as a second delivery).
    extra = report.get("extra_timers", [])
    assert set(by_id) == {report["normal_id"], report["timer_id"], *(t["id"] for t in extra)}, report
    assert all(len(v) == 1 for v in by_id.values()), report
    normal, timer = by_id[report["normal_id"]][0], by_id[report["timer_id"]][0]
    assert (normal["body"], normal["tag"], normal["properties"], normal["keys"]) == (
        "normal-body", "TagN", {"color": "red"}, ["key-normal"])
    assert normal["changed_invisible"] is True
    assert normal["attempt"] == 1 and timer["attempt"] == 1
    assert not normal["corrupted"] and not timer["corrupted"]  # the MD5 digest verified client-side
    assert timer["body"] == "timer-body" and timer["tag"] == "TagT"
    assert timer_earliest_ms <= timer["arrived_ms"], f"timer arrived {timer_earliest_ms - timer['arrived_ms']} ms early"
    assert timer["arrived_ms"] <= timer_latest_ms + ON_TIME_SLACK_MS, (
        f"timer arrived {timer['arrived_ms'] - timer_latest_ms} ms late")
    for t in extra:
        arrived_ms = by_id[t["id"]][0]["arrived_ms"]
        assert by_id[t["id"]][0]["body"] == t["body"]
        assert t["deliver_at_ms"] <= arrived_ms <= t["deliver_at_ms"] + ON_TIME_SLACK_MS, (t, arrived_ms)
    assert report["timer_recall_handle_present"] is True
    assert report["recall_returned_id"] == report["recalled_id"]
    assert report["recalled_id"] not in by_id
    statuses = _admin(server, "QueryMessage", {"message_id": report["recalled_id"], "topic": topic})
    assert statuses["code"] == 20000, statuses
    assert [s["state"] for s in statuses["statuses"]] == ["cancelled"]


def test_python_producer_and_simple_consumer(server: str) -> None:
    topic = "py_simple"
    report = _run_flow([sys.executable, str(HERE / "python_simple_flow.py"), server, topic, "py_simple_group"])
    deliver_at_ms = report["timer_deliver_at_ms"]
    _check_simple_flow(report, server, topic, deliver_at_ms, deliver_at_ms)


def test_python_push_consumer(server: str) -> None:
    report = _run_flow([sys.executable, str(HERE / "python_push_flow.py"), server, "py_push", "py_push_group"])
    assert report["all_consumed"] is True, report
    seen = report["seen"]
    assert {s["id"] for s in seen} == set(report["sent_ids"])
    assert not any(s["corrupted"] for s in seen)
    failed = [s for s in seen if s["body"] == "push-1"]
    # The listener failed the first delivery; the client nacked it and chronoq redelivered it.
    assert [s["attempt"] for s in failed] == [1, 2], failed
    others = [s for s in seen if s["body"] != "push-1"]
    assert len(others) == len({s["id"] for s in others}), "a successfully consumed message came back"
    timer = next(s for s in seen if s["body"] == "push-timer")
    assert report["timer_deliver_at_ms"] <= timer["arrived_ms"] <= report["timer_deliver_at_ms"] + ON_TIME_SLACK_MS


def test_node_producer_and_simple_consumer(server: str) -> None:
    node = need_command("node", extra="node")
    if not (NODE_DIR / "node_modules" / "rocketmq-client-nodejs" / "package.json").exists():
        missing("node", "npm rocketmq-client-nodejs is not installed in tests/interop/node")
    topic = "node_simple"
    report = _run_flow([node, str(NODE_DIR / "flow.js"), server, topic, "node_simple_group"], cwd=NODE_DIR)
    # The client computes deliveryTimestamp = now + delay inside send(); bound it by the times
    # before the call and after it returned.
    _check_simple_flow(report, server, topic, report["timer_sent_before_ms"] + 3000,
                       report["timer_sent_after_ms"] + 3000)


def test_python_producer_send_to_a_mistyped_topic_is_refused_naming_the_topic(server: str) -> None:
    """The official client's send to a missing topic whose name is near an existing one's gets
    TOPIC_NOT_FOUND (its NotFoundException) with chronoq's words naming the near topic, and
    nothing is created (`chronoq/topics.py`)."""
    topic, typo = "py_invoices", "py_invocies"
    report = _run_flow([sys.executable, str(HERE / "python_near_topic_flow.py"), server, topic, typo])
    assert report["sent_id"] and "typo_sent_id" not in report, report
    refused = report["refused"]
    assert (refused["class"], refused["code"]) == ("NotFoundException", 40402), refused
    assert f"topic '{typo}' does not exist; did you mean '{topic}'?" in refused["text"], refused
    names = {t["name"] for t in _admin(server, "ListTopics", {})["topics"]}
    assert topic in names and typo not in names
