"""A restart with a backlog: Apache Pulsar's official Python client (tests/interop/pulsar_backlog_flow.py,
its own process) against a real `chronoq serve --pulsar-port`, SIGKILLed with 10,000 delayed
messages pending and acks with holes, then started again on the same data directory.

Pulsar keeps its delayed-delivery index in memory: after a broker restart it re-reads the
subscription's backlog from the mark-delete position to rebuild it, and its consumers wait
meanwhile (PIP-195: minutes to hours on a large backlog); its redelivery counter is in memory
too, so it starts again at 0. chronoq's timers and acks are on disk, so the door is ready as soon
as the process has opened its files: this test measures the time from the process's start until
the Pulsar port answers a CONNECT and a LOOKUP (polled every few ms with the codec's frames),
for a fresh start and for the restart, and asserts a bound on it. Then nothing acked comes back,
every delayed message arrives and none before its due time, and a message left unacked keeps
its `redelivery_count` across the restart.

Delays are drawn from 20-40 s (not the 20-60 s of the scenario this reproduces): long enough
that every one is still pending when the server is killed, short enough to keep the test near
a minute.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chronoq.client import AsyncAdmin
from chronoq.client.testing import ServerProcess, free_port
from chronoq.pulsar import codec
from chronoq.pulsar import pulsar_api_pb2 as api
from chronoq.pulsar.codec import Type
from tests.support.extras import missing

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
PLAIN = 1000
DELAYED = 10_000
DELAY_MIN_MS, DELAY_MAX_MS = 20_000, 40_000
INVISIBLE_MS = 3000
TOPIC, SUBSCRIPTION = "persistent://public/default/backlog", "backlog-sub"
READY_BOUND_S = 5.0
"""The bound asserted on process start to a served LOOKUP (the figure is printed; a couple of
hundred ms beyond the Python interpreter's own start on an idle machine). Generous: the
machine running the tests may be shared."""
PROBE_EVERY_S = 0.005
QUIET_S = 4.0
"""After the last expected message: long enough for an acked message the restart brought back
to show up (held messages come back INVISIBLE_MS after the kill at the latest)."""


def _flow(*args: str, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(HERE / "pulsar_backlog_flow.py"), *args], capture_output=True,
                          timeout=timeout_s, env=env, check=False)
    # The client's log goes to stdout too (its last lines may follow the report's).
    lines = [line for line in done.stdout.decode().splitlines() if line.startswith("{")]
    assert lines, f"flow printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    report = json.loads(lines[-1])
    assert "fatal" not in report, f"client raised:\n{report['fatal']}\nstderr:\n{done.stderr.decode()[-2000:]}"
    return report


def lookup_answers(port: int) -> bool:
    """One CONNECT and one LOOKUP on the Pulsar port, as a client's first two requests."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            frames = codec.FrameReader()
            sock.sendall(codec.encode_command(codec.make_command(Type.CONNECT, connect=api.CommandConnect(
                client_version="readiness-probe", protocol_version=20))))
            sock.sendall(codec.encode_command(codec.make_command(Type.LOOKUP, lookupTopic=api.CommandLookupTopic(
                topic=TOPIC, request_id=1))))
            seen: list[int] = []
            while Type.LOOKUP_RESPONSE not in seen:
                data = sock.recv(65536)
                if not data:
                    return False
                for frame in frames.feed(data):
                    seen.append(frame.command.type)
                    if frame.command.type == Type.LOOKUP_RESPONSE:
                        return frame.command.lookupTopicResponse.response == api.CommandLookupTopicResponse.Connect
            return False
    except OSError:
        return False


def start_timed(server: ServerProcess, pulsar_port: int) -> float:
    """Start the server; seconds from just before its process is spawned until the Pulsar
    port answered a LOOKUP (probed from a thread while `start` waits for its ready line)."""
    ready: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            if lookup_answers(pulsar_port):
                ready.append(time.monotonic())
                return
            time.sleep(PROBE_EVERY_S)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    started = time.monotonic()
    try:
        server.start()
        prober.join(30)
    finally:
        stop.set()
    assert ready, "the Pulsar port never answered a LOOKUP"
    return ready[0] - started


def pending_timers(address: str) -> int:
    async def go() -> int:
        async with AsyncAdmin(address) as admin:
            return int((await admin.stats())["timer"]["pending_total"])

    return asyncio.run(go())


@pytest.mark.timeout(420)
def test_a_sigkill_with_a_backlog_of_delayed_messages_and_ack_holes(tmp_path: Path) -> None:
    if importlib.util.find_spec("pulsar") is None:
        missing("test", "the pulsar-client package is not installed")
    pulsar_port = free_port()
    server = ServerProcess(tmp_path / "data", args=["--pulsar-port", str(pulsar_port)],
                           settings={"default_invisible_duration_ms": INVISIBLE_MS})
    url = f"pulsar://127.0.0.1:{pulsar_port}"
    try:
        fresh_s = start_timed(server, pulsar_port)
        load = _flow("load", url, TOPIC, SUBSCRIPTION, str(PLAIN), str(DELAYED), str(DELAY_MIN_MS),
                     str(DELAY_MAX_MS), timeout_s=300)
        pending_at_kill = pending_timers(server.address)
        killed_ms = time.time_ns() // 1_000_000
        assert server.kill() is not None  # SIGKILL: no clean shutdown
        restart_s = start_timed(server, pulsar_port)
        pending_after = pending_timers(server.address)
        due = load["delayed_due_ms"]
        unacked = sorted(set(load["plain"]) - set(load["acked"]))
        deadline_ms = max(due.values()) + 30_000
        drain = _flow("drain", url, TOPIC, SUBSCRIPTION, str(DELAYED + len(unacked)), str(deadline_ms),
                      str(QUIET_S), timeout_s=(deadline_ms - time.time_ns() // 1_000_000) / 1000 + 120)
    finally:
        server.stop()

    print(f"Pulsar port served a LOOKUP {fresh_s * 1000:.0f} ms after the process started (empty data dir), "
          f"{restart_s * 1000:.0f} ms after the restart with {pending_at_kill} timers pending and "
          f"{len(unacked)} unacked of {PLAIN} plain; the drain's subscribe took {drain['subscribe_ms']} ms")
    assert len(due) == DELAYED and len(load["plain"]) == PLAIN
    # Every delayed message was still pending when the server was killed, and is after the restart.
    assert min(due.values()) > killed_ms, "a delayed message was due before the kill: the restart tested less"
    assert pending_at_kill == DELAYED, pending_at_kill
    assert pending_after == DELAYED, f"{pending_after} timers pending after the restart, {DELAYED} before"
    assert restart_s <= READY_BOUND_S, f"the Pulsar door answered {restart_s:.2f} s after the restart"
    assert fresh_s <= READY_BOUND_S, f"the Pulsar door answered {fresh_s:.2f} s after a fresh start"

    before = load["received"]
    after = drain["received"]
    assert {r["id"] for r in before} >= set(load["plain"]), "the load run did not receive every plain message"
    ids_after = [r["id"] for r in after]
    assert not [r for r in before if r["id"].startswith("d")], "a delayed message arrived before its time"
    # Nothing acked comes back.
    assert not set(load["acked"]) & set(ids_after), sorted(set(load["acked"]) & set(ids_after))[:20]
    # Nothing lost: every delayed message and every unacked plain one arrives after the restart.
    missing_ids = (set(due) | set(unacked)) - set(ids_after)
    assert not missing_ids, f"{len(missing_ids)} never arrived, e.g. {sorted(missing_ids)[:20]}"
    # None early.
    early = [(r["id"], due[r["id"]] - r["arrived_ms"]) for r in after if r["id"] in due
             and r["arrived_ms"] < due[r["id"]]]
    assert not early, f"{len(early)} arrived before their due time (id, ms early): {early[:20]}"
    # The redelivery count survives the restart: one more than the last seen before it.
    last_before: dict[str, int] = {}
    for r in before:
        last_before[r["id"]] = max(last_before.get(r["id"], -1), r["redelivery"])
    first_after: dict[str, int] = {}
    for r in after:
        first_after.setdefault(r["id"], r["redelivery"])
    nacked = set(load["nacked"])
    assert nacked and all(last_before[i] == 1 for i in nacked), "the negative acks were not redelivered"
    kept = {i: (last_before[i], first_after[i]) for i in unacked}
    assert all(a >= b + 1 for b, a in kept.values()), {i: v for i, v in kept.items() if v[1] < v[0] + 1}
    lateness = sorted(r["arrived_ms"] - due[r["id"]] for r in after if r["id"] in due)
    print(f"delayed lateness after the restart (ms): P50 {lateness[len(lateness) // 2]}, "
          f"P99 {lateness[int(len(lateness) * 0.99)]}, max {lateness[-1]}; duplicates after the restart: "
          f"{len(ids_after) - len(set(ids_after))}")
