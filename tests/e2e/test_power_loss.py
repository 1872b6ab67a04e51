"""Power loss and restores: data directories put together from copies taken at different moments.

`powerloss_driver.py` runs a real broker (SystemClock, timers firing in real time, producers,
a canceller, consumers) and journals every acknowledgement after the call returned. While it
runs, the test takes snapshots: SIGSTOP the process, copy the data directory (exactly what a
SIGKILL at that instant would leave), note how far the journal got, SIGCONT.

A power loss keeps what was fsynced: the commit log up to its last group commit (everything
acknowledged), and of each RocksDB store (written without an fsync per write) some earlier
state, each store its own. A restore from backups can put any store next to any log. So each
*world* is assembled from three snapshots: the log side (commit log, consume queues,
checkpoint, topic table) from snapshot j, the consumer-group store from snapshot i, the timer
index from snapshot k; with i, k <= j (power loss) and i, k > j (stores restored from a later
backup than the log). In every world:
  1. `chronoq check` finds no damage (a torn tail would be a repair, not damage);
  2. the broker opens;
  3. every send acknowledged before snapshot j is there: normal messages at the queue offset
     their send returned, timers known to the index;
  4. with the clock moved past every due time, every timer and delay-level message fires exactly
     once, never before its due time, and no cancel acknowledged before snapshot j is undone;
  5. the group receives a message sent now (offsets ahead of their queues were brought back).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from chronoq import envvars
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS
from chronoq.model import SYS_TIMER_OUT_MS, OutgoingMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir
from tests.e2e import powerloss_driver as driver
from tests.support import brokers as support_brokers
from tests.support.brokers import open_broker
from tests.support.children import child_env, module_argv
from tests.support.timers import fired_messages

DRIVER = "tests.e2e.powerloss_driver"

SNAPSHOTS = 6
LOG_SIDE = (files.COMMITLOG_DIR, files.QUEUES_DIR, files.CHECKPOINT, files.TOPICS)


def _snapshot(child: subprocess.Popen[bytes], data: Path, journal: Path, to: Path) -> int:
    """Stop the driver, copy its data directory, note the journal's length, let it go on."""
    os.kill(child.pid, signal.SIGSTOP)
    try:
        _wait_stopped(child.pid)
        journaled = journal.stat().st_size if journal.exists() else 0
        shutil.copytree(data, to, ignore=shutil.ignore_patterns(files.LOCK))
    finally:
        os.kill(child.pid, signal.SIGCONT)
    return journaled


def _wait_stopped(pid: int) -> None:
    """Until every thread of `pid` is stopped: SIGSTOP returns before a thread running on the other
    core has stopped, and a background checkpoint could still rename its file under the copy."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that exited
        if all(state in ("T", "t", "Z", "X") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within 10 s of SIGSTOP")


def _assemble(snaps: list[Path], j: int, i: int, k: int, to: Path) -> None:
    to.mkdir(parents=True)
    for name in LOG_SIDE:
        src = snaps[j] / name
        if src.is_dir():
            shutil.copytree(src, to / name)
        elif src.exists():
            shutil.copy2(src, to / name)
    for name, n in ((files.GROUPS_DIR, i), (files.TIMER_DIR, k), (files.TIMER_WHEEL_DIR, k)):
        if (snaps[n] / name).exists():
            shutil.copytree(snaps[n] / name, to / name)


def _journal(path: Path, upto: int) -> dict[str, dict]:
    """What the driver had acknowledged in the first `upto` bytes of its journal."""
    out: dict[str, dict] = {"S": {}, "T": {}, "L": {}, "C": {}, "c": {}}
    for line in path.read_bytes()[:upto].decode().splitlines():
        kind, *rest = line.split()
        if kind == "S":
            out["S"][rest[0]] = (rest[1], int(rest[2]), int(rest[3]))
        elif kind == "T":
            out["T"][rest[0]] = int(rest[2])
        elif kind == "L":
            out["L"][rest[0]] = int(rest[2])
        elif kind in ("C", "c"):
            out[kind][rest[0]] = True
    return out


async def _verify(world: Path, acked: dict[str, dict], label: str) -> None:
    report = check_data_dir(world)
    assert not report.problems, f"{label}: damage: {report.problems}"
    clock = FakeClock(int(time.time() * 1000) + DAY_MS)  # past every due time
    broker = await open_broker(driver.config_for(world), clock=clock, background=False)
    try:
        for mid, (topic, qid, offset) in acked["S"].items():
            entry = broker.store.queue(topic, qid).get(offset)
            msg = broker.store.read_at(entry[0], entry[1]) if entry else None
            assert msg is not None and msg.message_id == mid, f"{label}: acknowledged {mid} lost or moved"
        for mid in acked["T"]:
            assert broker.query(mid, driver.TIMER_TOPIC), f"{label}: acknowledged timer {mid} unknown to the index"
        for mid in acked["C"]:
            [status] = broker.query(mid, driver.TIMER_TOPIC)
            assert status.state is TimerState.CANCELLED, f"{label}: acknowledged cancel of {mid} undone"
        await broker.run_due()
        fired: Counter[str] = Counter()
        for m in fired_messages(broker.store, driver.TIMER_TOPIC):  # each time it fired, as consumers read it
            fired[m.message_id] += 1
            assert m.store_ms >= int(m.system_properties[SYS_TIMER_OUT_MS]), f"{label}: {m.message_id} early"
        twice = sorted(mid for mid, n in fired.items() if n > 1)
        assert not twice, f"{label}: fired more than once: {twice[:5]}"
        for mid in (*acked["T"], *acked["L"]):
            # A cancel begun ("c") but not returned ("C") before the snapshot may have taken effect.
            expected = {0} if mid in acked["C"] else {0, 1} if mid in acked["c"] else {1}
            assert fired[mid] in expected, f"{label}: {mid} fired {fired[mid]} times, expected {expected}"
        probe = await broker.send(OutgoingMessage(driver.TOPIC, b"probe", message_id="probe-after-restore"))
        seen = set()
        while got := await broker.receive(driver.GROUP, driver.TOPIC, batch_size=64):
            for r in got:
                seen.add(r.message.message_id)
                await broker.ack(driver.GROUP, driver.TOPIC, r.receipt_handle)
        assert probe.message_id in seen, f"{label}: the group skipped a message sent after the restore"
    finally:
        await broker.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["rocksdb", "wheel"])
def test_worlds_assembled_from_snapshots_lose_nothing_and_fire_nothing_twice(
        tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support_brokers, "TIMER_ENGINE", engine)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data, journal = tmp_path / "data", tmp_path / "journal"
    snaps: list[Path] = []
    marks: list[int] = []
    with open(tmp_path / "driver.log", "wb") as log:
        child = subprocess.Popen(module_argv(DRIVER, data, journal, seed), stdout=subprocess.PIPE, stderr=log,
                                 env=child_env(**{envvars.TEST_TIMER_ENGINE: engine}))
        try:
            assert child.stdout is not None and child.stdout.readline() == b"READY\n", "driver did not start"
            for n in range(SNAPSHOTS):
                time.sleep(rng.uniform(0.3, 0.9))  # long enough for timers to fire between snapshots
                snaps.append(tmp_path / f"snap{n}")
                marks.append(_snapshot(child, data, journal, snaps[-1]))
        finally:
            child.kill()
            child.wait(timeout=30)
    worlds = [(j, j, j) for j in range(SNAPSHOTS)]  # a SIGKILL at snapshot j
    worlds += [(j, rng.randrange(j), rng.randrange(j)) for j in range(1, SNAPSHOTS)]  # power loss
    worlds += [(j, rng.randrange(j + 1, SNAPSHOTS), rng.randrange(j + 1, SNAPSHOTS))
               for j in range(SNAPSHOTS - 1)]  # stores from a later backup than the log
    worlds += [(j, rng.randrange(SNAPSHOTS), rng.randrange(SNAPSHOTS)) for j in range(SNAPSHOTS)]  # any mix
    acked_total = _journal(journal, marks[-1])
    assert len(acked_total["S"]) > 50 and len(acked_total["T"]) > 50 and acked_total["L"] and acked_total["C"], \
        {k: len(v) for k, v in acked_total.items()}
    for n, (j, i, k) in enumerate(worlds):
        world = tmp_path / f"world{n}"
        _assemble(snaps, j, i, k, world)
        label = f"{engine}, seed {seed}, world log@{j} groups@{i} timer@{k}"
        asyncio.run(_verify(world, _journal(journal, marks[j]), label))
        shutil.rmtree(world)
