"""Opening with too few file descriptors: a resource problem, not damage.

The fault is real: a child process lowers its own open-file limit (RLIMIT_NOFILE) to a few more
descriptors than it holds and opens a broker on a data directory, once per limit, from one more
descriptor up to the limit at which the open succeeds. Each store meets EMFILE at every step of
its open in turn. Before, RocksDB's errors there read as damage: the consumer-group store was
moved aside (every group would receive the whole retained log again), five times over; the timer
index was called corrupt (destroyed and rebuilt); and an EMFILE on a RocksDB LOCK file was
reported as another broker holding the directory.

Also threads that cannot start (a real RLIMIT_NPROC): the group commit's fsync thread, and a
background checkpoint's worker, which must give back the queue files it took.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chronoq.config import Config
from chronoq.model import OutgoingMessage
from tests.support.brokers import SimulatedBrokers

_CHILD = """
import asyncio, json, os, resource, sys
from pathlib import Path
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config

data = Path(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
tries = []

async def open_and_close():
    broker = await Broker.open(Config(data_dir=data), clock=FakeClock(), background=False)
    await broker.close()

for extra in range(1, 200):
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + extra, hard))
    try:
        asyncio.run(open_and_close())
        outcome = "opened"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    tries.append([extra, outcome, sorted(p.name for p in data.iterdir() if "damaged" in p.name)])
    if outcome == "opened":
        break
print(json.dumps(tries))
"""


@pytest.mark.slow
def test_an_open_short_of_file_descriptors_fails_clearly_and_changes_nothing(brokers: SimulatedBrokers,
                                                                             tmp_path: Path) -> None:
    data = tmp_path / "data"

    async def setup() -> None:
        broker = await brokers.open(Config(data_dir=data))
        for i in range(5):
            await broker.send(OutgoingMessage("t", b"x", message_id=f"m{i}"))
        got = await broker.receive("g", "t", batch_size=2)
        for m in got:
            await broker.ack("g", "t", m.receipt_handle)
        await broker.send(OutgoingMessage("t", b"later", message_id="timer", delay_ms=60_000))
        await broker.close()

    asyncio.run(setup())
    done = subprocess.run([sys.executable, "-c", _CHILD, str(data)], capture_output=True, text=True, timeout=300)
    tries = json.loads(done.stdout)
    assert tries[-1][1] == "opened", tries[-1]
    failures = [outcome for _, outcome, _ in tries[:-1]]
    assert any(o.startswith("StoreUnavailable: cannot open the consumer-group store") for o in failures)
    assert any(o.startswith("StoreUnavailable: cannot open the timer index") for o in failures)
    for extra, outcome, damaged in tries:
        assert not damaged, f"limit +{extra}: {outcome}; moved aside: {damaged}"
        assert outcome == "opened" or outcome.startswith(("OSError: [Errno 24]", "StoreUnavailable: ")), \
            f"limit +{extra}: {outcome}"

    async def reopen() -> None:
        broker = await brokers.open(Config(data_dir=data))
        try:
            assert not broker.open_report.groups_reset
            got = await broker.receive("g", "t", batch_size=16)
            assert len(got) == 3  # the two acked stay acked: the group's progress was kept
            assert broker.query("timer", "t")[0].message_id == "timer"
        finally:
            await broker.close()

    asyncio.run(reopen())


_NO_THREAD_CHILD = """
import asyncio, json, os, resource, sys
from pathlib import Path
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage

async def main():
    data = Path(sys.argv[1])
    broker = await Broker.open(Config(data_dir=data, default_queue_count=1), clock=FakeClock(), background=False)
    if os.getuid() == 0:  # root is exempt from RLIMIT_NPROC: count threads against "nobody"
        os.setresuid(65534, 0, 0)  # (files are still opened as root: the effective uid stays)
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))  # this user may start no more threads
    out = {}
    try:
        await asyncio.wait_for(broker.send(OutgoingMessage("t", b"x")), 10)
        out["send"] = "acknowledged"
    except BaseException as e:
        out["send"] = type(e).__name__
    out["fatal"] = repr(broker.fatal)
    try:
        await asyncio.wait_for(broker.close(), 10)
        out["close"] = "closed"
    except BaseException as e:
        out["close"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))

asyncio.run(main())
"""


def test_a_broker_that_cannot_start_its_fsync_thread_stops_and_closes(tmp_path: Path) -> None:
    """The group commit's fsync thread starts at the first send. When no thread can be made (a
    pids limit; here a real RLIMIT_NPROC on an unprivileged user), the send is refused and the
    broker stops (fatal), as for any dead background task; then it must close, so that `chronoq
    serve` exits for its supervisor. Its close used to wait forever for an fsync that never
    started (and would then have failed joining a thread that never ran)."""
    data = tmp_path / "data"
    # Without CAP_SYS_RESOURCE and CAP_SYS_ADMIN, which would exempt the child from the limit.
    drop = ["setpriv", "--bounding-set", "-sys_resource,-sys_admin"] if os.getuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("running as root needs setpriv to drop the capabilities that lift RLIMIT_NPROC")
    done = subprocess.run([*drop, sys.executable, "-c", _NO_THREAD_CHILD, str(data)], capture_output=True,
                          text=True, timeout=120)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["send"] in ("FlushFailed", "BrokerClosed"), out
    assert "can't start new thread" in out["fatal"], out
    assert out["close"] == "closed", out


_NO_CHECKPOINT_THREAD_CHILD = """
import asyncio, json, os, resource, sys
from pathlib import Path
from chronoq.config import Config
from chronoq.model import MessageType
from chronoq.store.messagestore import MessageStore, PreparedMessage

def fds():
    return len(os.listdir("/proc/self/fd")) - 1  # the listing's own

async def main():
    store, _ = MessageStore.open(Config(data_dir=Path(sys.argv[1]), default_queue_count=1))
    store.create_topic("t", 1, frozenset(MessageType), 0)
    store.append([PreparedMessage("t", "m0", MessageType.NORMAL, b"x", 0)], 1)
    await store.log.flush_now()  # the group commit's thread starts here, before the limit
    store.checkpoint()
    store.append([PreparedMessage("t", "m1", MessageType.NORMAL, b"x", 0)], 1)
    await store.log.flush_now()  # dispatched: the queue's file is written, not yet synced
    before = fds()
    if os.getuid() == 0:  # root is exempt from RLIMIT_NPROC: count threads against "nobody"
        os.setresuid(65534, 0, 0)  # (files are still opened as root: the effective uid stays)
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))  # this user may start no more threads
    out = {}
    try:
        await store.checkpoint_in_background()  # its worker thread cannot start
        out["background"] = "done"
    except BaseException as e:
        out["background"] = f"{type(e).__name__}: {e}"
    out["leaked"] = fds() - before
    out["dirty"] = len(store.queue_files.dirty_queues())
    synced = []
    real = os.fdatasync
    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    os.fdatasync = recording
    store.checkpoint()  # on this thread: covers m1's entry
    os.fdatasync = real
    out["queue_synced"] = any(p.endswith(".cq") for p in synced)
    store.close()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_a_checkpoint_whose_thread_cannot_start_gives_back_what_it_took(tmp_path: Path) -> None:
    """A background checkpoint takes the dirty queue files (duplicates, counted clean) and hands
    them to its worker thread, started on first use. When no thread can be made (a real
    RLIMIT_NPROC on an unprivileged user), the checkpoint fails and must give back what it took:
    before, the duplicates leaked and the queues stayed counted clean, so the next checkpoint (the
    broker's close, after this stopped it) recorded a position covering their entries without
    syncing them: a power loss then could lose acknowledged messages below the checkpoint."""
    data = tmp_path / "data"
    drop = ["setpriv", "--bounding-set", "-sys_resource,-sys_admin"] if os.getuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("running as root needs setpriv to drop the capabilities that lift RLIMIT_NPROC")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's chronoq
    done = subprocess.run([*drop, sys.executable, "-c", _NO_CHECKPOINT_THREAD_CHILD, str(data)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "can't start new thread" in out["background"], out
    assert out["leaked"] == 0, out
    assert out["dirty"] == 1, out
    assert out["queue_synced"], f"the next checkpoint covered the queue's entry without syncing it: {out}"
