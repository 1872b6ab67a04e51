"""Crash test: a real broker process under load, killed with SIGKILL at random moments.

`crash_driver.py` runs the broker (SystemClock, sync flush, concurrent producers, in later rounds
concurrent consumers too) and journals every acknowledgement only after the call returned.
After each kill this test:
  1. runs `check` on the directory exactly as the kill left it: the only damage allowed is a
     torn tail of the last segment (a write cut short), nothing a restart could not repair;
  2. reopens the store (recovery), reads every consume queue, and finds every acknowledged
     message at the topic, queue and offset its send returned; consume queues agree with the log;
  3. runs `check` again: clean.
At the end it opens the whole broker with a clock far past every invisible duration and drains
the group: no message whose ack returned comes back (group progress is durable), and every
acknowledged message was either acked or comes back now (none lost to the group).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.store.check import check_data_dir
from chronoq.store.messagestore import MessageStore
from tests.e2e import crash_driver
from tests.support.brokers import open_broker
from tests.support.children import child_env, module_argv

DRIVER = "tests.e2e.crash_driver"
"""The child's module; its config and names are shared with this test."""

PRODUCE_ROUNDS = 12
MIXED_ROUNDS = 12
TIME_BUDGET_S = 150
"""A guard, not the target: the test normally takes well under a minute."""


def _journal(path: Path) -> tuple[dict[str, tuple[str, int, int]], set[str], set[str], set[str]]:
    """(sent, received, acked, ack_unknown): ack_unknown are ids whose ack call began ("a") but
    never journaled its return ("A"), i.e. a kill landed inside the call: either outcome is right."""
    sent: dict[str, tuple[str, int, int]] = {}
    received: set[str] = set()
    acked: set[str] = set()
    acking: set[str] = set()
    if not path.exists():
        return sent, received, acked, set()
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # cannot happen (one write per line), but a half line proves nothing
        kind, *rest = line.split()
        if kind == "S":
            sent[rest[0]] = (rest[1], int(rest[2]), int(rest[3]))
        elif kind == "R":
            received.add(rest[0])
        elif kind == "A":
            acked.add(rest[0])
        elif kind == "a":
            acking.add(rest[0])
        else:
            raise AssertionError(f"the driver journaled a failure: {line!r}")
    return sent, received, acked, acking - acked


def _run_round(data: Path, journal: Path, mode: str, round_no: int, rng: random.Random, log: Path) -> str:
    """Start the driver, kill it with SIGKILL at a random moment; return what it had reached."""
    with open(log, "ab") as err:
        child = subprocess.Popen(module_argv(DRIVER, data, journal, mode, round_no), stdout=subprocess.PIPE,
                                 stderr=err, env=child_env())
    try:
        # One kill in five lands during start-up/recovery, the rest under load.
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.05, 0.6))
            stage = "starting"
        else:
            assert child.stdout is not None
            ready = child.stdout.readline()
            assert ready == b"READY\n", f"driver did not start: {ready!r}; see {log}"
            time.sleep(rng.uniform(0.05, 0.5))
            stage = "loaded"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL, f"driver exited by itself ({child.returncode}); see {log}"
    return stage


def _verify_after_kill(data: Path, sent: dict[str, tuple[str, int, int]], assert_queues_match_log: Callable,
                       context: str) -> None:
    if not data.exists():  # killed in the first start-up, before the broker made its directory
        assert not sent, context
        return
    raw = check_data_dir(data)
    assert not raw.problems, f"{context}: damage beyond a torn tail: {raw.problems}"
    store, _report = MessageStore.open(crash_driver.config_for(data))
    try:
        found: dict[str, tuple[str, int, int]] = {}
        for topic, qid in store.queue_keys():
            cq = store.queue(topic, qid)
            for offset in range(cq.min_offset, cq.next_offset):
                position, size, _ = cq.get(offset)
                msg = store.read_at(position, size)
                assert msg is not None and (msg.topic, msg.queue_id, msg.queue_offset) == (topic, qid, offset)
                found[msg.message_id] = (topic, qid, offset)
        missing = {i: where for i, where in sent.items() if found.get(i) != where}
        assert not missing, f"{context}: {len(missing)} acknowledged messages lost or moved: {list(missing)[:5]}"
        assert_queues_match_log(store)
    finally:
        store.close()
    after = check_data_dir(data)
    assert after.ok, f"{context}: check after recovery: {after.problems}"


@pytest.mark.slow
@pytest.mark.timeout(TIME_BUDGET_S + 60)
def test_sigkill_under_load_loses_no_acknowledged_message(tmp_path: Path,
                                                           assert_queues_match_log: Callable) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data, journal, log = tmp_path / "data", tmp_path / "journal", tmp_path / "driver.log"
    started = time.monotonic()
    stages: list[str] = []
    torn_tails = 0
    rounds = [("produce", r) for r in range(PRODUCE_ROUNDS)] + [("mixed", PRODUCE_ROUNDS + r)
                                                                for r in range(MIXED_ROUNDS)]
    for mode, round_no in rounds:
        assert time.monotonic() - started < TIME_BUDGET_S, f"too slow; {len(stages)} kills so far"
        stages.append(_run_round(data, journal, mode, round_no, rng, log))
        context = f"seed {seed}, kill {len(stages)} ({mode}, {stages[-1]})"
        if data.exists() and any("torn tail" in r for r in check_data_dir(data).repairs):
            torn_tails += 1
        sent, _received, _acked, _unknown = _journal(journal)
        _verify_after_kill(data, sent, assert_queues_match_log, context)
    assert len(stages) >= 20 and stages.count("loaded") >= 10, stages

    sent, received, acked, ack_unknown = _journal(journal)
    assert len(sent) > 500 and len(acked) > 50, (len(sent), len(acked))
    # At most one ack in progress per consumer per kill.
    assert len(ack_unknown) <= crash_driver.CONSUMERS * MIXED_ROUNDS, sorted(ack_unknown)[:5]
    drained = asyncio.run(_drain(data))
    assert not drained & acked, f"seed {seed}: acked messages delivered again: {sorted(drained & acked)[:5]}"
    lost = set(sent) - acked - ack_unknown - drained
    assert not lost, f"seed {seed}: acknowledged messages lost to the group: {sorted(lost)[:5]}"
    in_flight = received - acked - ack_unknown
    stuck = in_flight - drained
    assert not stuck, f"seed {seed}: received, unacked and not redelivered: {sorted(stuck)[:5]}"
    print(f"seed {seed}: {len(stages)} kills ({stages.count('loaded')} under load), {torn_tails} torn tails, "
          f"{len(sent)} sends, {len(acked)} acks, {len(drained)} redelivered or new at the end")


async def _drain(data: Path) -> set[str]:
    """Every message group `g` can still receive, once every invisible duration has passed."""
    clock = FakeClock(start_ms=int(time.time() * 1000) + 2 * crash_driver.INVISIBLE_MS)
    drained: set[str] = set()
    async with await open_broker(crash_driver.config_for(data), clock=clock, background=False) as broker:
        for topic in crash_driver.TOPICS:
            while got := await broker.receive(crash_driver.GROUP, topic, batch_size=64,
                                              invisible_duration_ms=crash_driver.INVISIBLE_MS):
                for m in got:
                    assert m.message.message_id not in drained, f"{m.message.message_id} twice in one drain"
                    drained.add(m.message.message_id)
                    await broker.ack(crash_driver.GROUP, topic, m.receipt_handle)
    return drained
