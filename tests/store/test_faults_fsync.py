"""fsync errors: any failed fsync fails the store for good, and nothing after it is acknowledged.

Why "for good": after an fsync error the kernel may have dropped the dirty pages it could not
write and marked them clean, so a second fsync returns 0 having written nothing (PostgreSQL's
"fsyncgate", 2018). A broker that retries, or that fsyncs an empty set and calls it durable,
acknowledges messages that a power loss then takes away.

The faults are injected at the system-call boundary: `os.fsync` / `os.fdatasync` raise EIO for
the files a test names (by path, read from /proc/self/fd). `test_real_eio_under_strace` injects
the same fault into a real `chronoq serve` with `strace -e inject=`.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.client.testing import free_port
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.errors import BrokerClosed, ChronoqError, FlushFailed
from chronoq.model import LINKS_TOPIC, OutgoingMessage, StoredMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir, format_report
from chronoq.store.links import decode_links
from chronoq.store.meta import read_checkpoint
from tests.support.brokers import SimulatedBrokers, open_broker


@pytest.fixture
def eio(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[str], bool]], list[str]]]:
    """`eio(match, syscalls)`: from now on fsync/fdatasync (or only the ones named) of a file whose
    path satisfies `match` fails with EIO. Returns the list of paths that failed, as it happens."""
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def arm(match: Callable[[str], bool], syscalls: tuple[str, ...] = ("fsync", "fdatasync")) -> list[str]:
        failed: list[str] = []

        def wrap(real: Callable[[int], None]) -> Callable[[int], None]:
            def call(fd: int) -> None:
                try:
                    path = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    path = ""
                if real.__name__ in syscalls and match(path):
                    failed.append(path)
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                real(fd)
            return call

        monkeypatch.setattr(os, "fsync", wrap(real_fsync))
        monkeypatch.setattr(os, "fdatasync", wrap(real_fdatasync))
        return failed

    yield arm
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(os, "fdatasync", real_fdatasync)


def _config(tmp_path: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {"segment_size_bytes": 4096, "max_message_size_bytes": 2048,
                                   "default_queue_count": 1, **overrides}
    return Config(data_dir=tmp_path / "data", **settings)  # type: ignore[arg-type]


async def _refused(broker: Broker, body: bytes) -> ChronoqError:
    with pytest.raises((FlushFailed, BrokerClosed)) as info:
        await asyncio.wait_for(broker.send(OutgoingMessage("t", body)), 5)
    return info.value


def test_an_fsync_error_at_segment_roll_fails_the_log_for_good(brokers: SimulatedBrokers, tmp_path: Path, eio) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        acked = []
        # Group commits fdatasync the active segment; a roll fsyncs the full one before the next is
        # made. If the roll stopped using fsync, `failed` stays empty and the test says so.
        failed = eio(lambda p: p.endswith(files.SEGMENT_SUFFIX), ("fsync",))
        for i in range(100):
            try:
                acked.append((await broker.send(OutgoingMessage("t", b"x" * 300, message_id=f"m{i}"))).message_id)
            except ChronoqError:
                break
        assert failed, "no segment fsync was attempted: the test did not reach a roll"
        assert broker.fatal is not None, "an fsync error must stop the broker (fatal), not only fail one sender"
        eio(lambda p: False)  # the disk "recovers": a retry would now return 0 on dropped pages
        await _refused(broker, b"after the error")
        await broker.close()
        # What was acknowledged before the error is all there after a restart.
        broker = await brokers.open(_config(tmp_path))
        got = [m.message.message_id for m in await broker.receive("g", "t", batch_size=64)]
        got += [m.message.message_id for m in await broker.receive("g", "t", batch_size=64)]
        assert set(acked) <= set(got)
        await broker.close()

    asyncio.run(body())


def test_after_a_failed_group_commit_nothing_is_checkpointed_past_it(brokers: SimulatedBrokers, tmp_path: Path,
                                                                     eio) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path, segment_size_bytes=1 << 20))
        first = await broker.send(OutgoingMessage("t", b"durable"))
        durable_end = broker.store.log.flushed_position
        broker.store.checkpoint()
        failed = eio(lambda p: p.endswith(files.SEGMENT_SUFFIX))
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"not durable")), 5)
        assert failed
        assert broker.fatal is not None, "a failed fsync must set broker.fatal"
        eio(lambda p: False)
        await _refused(broker, b"later")
        await broker.close()  # must not "sync" an empty fd set and checkpoint past the failure
        checkpoint = read_checkpoint(tmp_path / "data" / files.CHECKPOINT)
        assert checkpoint is not None and checkpoint <= durable_end, (checkpoint, durable_end)
        assert not (tmp_path / "data" / (files.CHECKPOINT + ".tmp")).exists()
        del first

    asyncio.run(body())


def test_a_group_commit_fsync_that_fails_while_the_broker_closes_is_not_lost(brokers: SimulatedBrokers,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group commit's fdatasync is still running when `close` cancels the flusher, and then
    fails (EIO). Its outcome used to be dropped with the cancelled flusher: close's own flush
    found the descriptors taken, fsynced nothing, called everything durable, acknowledged the
    sender and checkpointed past the failure."""
    import threading

    held, release, armed = threading.Event(), threading.Event(), threading.Event()
    real = os.fdatasync
    failed: list[str] = []

    def fdatasync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if armed.is_set() and path.endswith(files.SEGMENT_SUFFIX):
            armed.clear()
            held.set()
            assert release.wait(10)
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)

    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        await broker.send(OutgoingMessage("t", b"first"))
        broker.store.checkpoint()
        durable = broker.store.log.flushed_position
        armed.set()
        sender = asyncio.create_task(broker.send(OutgoingMessage("t", b"never durable", message_id="X")))
        while not held.is_set():
            await asyncio.sleep(0.001)
        closer = asyncio.create_task(broker.close())
        await asyncio.sleep(0.05)  # close has cancelled the flusher and started its own flush
        release.set()
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(sender, 5)
        await closer
        assert failed and broker.store.log.failure is not None
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == durable

    asyncio.run(body())


_CRASH_AFTER_AN_APPEND = """
import os, sys
from pathlib import Path
from chronoq.config import Config
from chronoq.model import MessageType
from chronoq.store.messagestore import MessageStore, PreparedMessage
store, _ = MessageStore.open(Config(data_dir=Path(sys.argv[1]), default_queue_count=1))
store.create_topic("t", 1, frozenset(MessageType), 0)
store.checkpoint()
store.append([PreparedMessage("t", "never-fsynced", MessageType.NORMAL, b"body", 1)], 1)
os._exit(0)  # a crash before the group commit: written to the page cache, never fsynced
"""


def test_records_a_crash_left_unsynced_are_made_durable_before_recovery_delivers_them(brokers: SimulatedBrokers,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crashed run's last records may be in the page cache only (their senders were never
    acknowledged). Recovery dispatches them, so consumers can see them: the segment must be
    fsynced first, or a power loss would take back a message a consumer has seen."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-c", _CRASH_AFTER_AN_APPEND, str(data)], check=True)
    synced: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def spy(real: Callable[[int], None]) -> Callable[[int], None]:
        def call(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)
        return call

    monkeypatch.setattr(os, "fsync", spy(real_fsync))
    monkeypatch.setattr(os, "fdatasync", spy(real_fdatasync))

    async def body() -> None:
        broker = await brokers.open(Config(data_dir=data, default_queue_count=1))
        try:
            assert [p for p in synced if p.endswith(files.SEGMENT_SUFFIX)], "recovered without an fsync"
            got = await broker.receive("g", "t", batch_size=8)
            assert [m.message.message_id for m in got] == ["never-fsynced"]
        finally:
            await broker.close()

    asyncio.run(body())


def test_an_fsync_error_at_open_refuses_to_open_and_releases_the_directory(brokers: SimulatedBrokers, tmp_path: Path,
                                                                           eio) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        await broker.send(OutgoingMessage("t", b"kept", message_id="kept"))
        await broker.close()
        broken = [True]
        failed = eio(lambda path: broken[0] and path.endswith(files.SEGMENT_SUFFIX))
        with pytest.raises(FlushFailed):
            await brokers.open(_config(tmp_path))
        assert failed
        broken[0] = False  # the disk is well again: the directory was released, so it opens
        broker = await brokers.open(_config(tmp_path))
        got = await broker.receive("g", "t", batch_size=8)
        assert [m.message.message_id for m in got] == ["kept"]
        await broker.close()

    asyncio.run(body())


def test_a_consume_queue_fsync_error_stops_checkpoints_and_sends(brokers: SimulatedBrokers, tmp_path: Path,
                                                                 eio) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path, segment_size_bytes=1 << 20))
        await broker.send(OutgoingMessage("t", b"one"))
        broker.store.checkpoint()
        before = read_checkpoint(tmp_path / "data" / files.CHECKPOINT)
        await broker.send(OutgoingMessage("t", b"two"))
        failed = eio(lambda p: p.endswith(files.CQ_SUFFIX))
        with pytest.raises(FlushFailed):
            broker.store.checkpoint()
        assert failed
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == before
        assert broker.fatal is not None
        eio(lambda p: False)
        await _refused(broker, b"three")
        await broker.close()
        assert read_checkpoint(tmp_path / "data" / files.CHECKPOINT) == before
        broker = await brokers.open(_config(tmp_path))
        got = [m.message.body for m in await broker.receive("g", "t", batch_size=8)]
        assert got == [b"one", b"two"]
        await broker.close()

    asyncio.run(body())


def test_a_failed_directory_fsync_at_roll_fails_the_log(brokers: SimulatedBrokers, tmp_path: Path, eio) -> None:
    async def body() -> None:
        broker = await brokers.open(_config(tmp_path))
        log_dir = str(tmp_path / "data" / files.COMMITLOG_DIR)
        failed = eio(lambda p: p == log_dir)
        for i in range(100):
            try:
                await broker.send(OutgoingMessage("t", b"y" * 300, message_id=f"d{i}"))
            except ChronoqError:
                break
        assert failed, "no directory fsync was attempted"
        assert broker.fatal is not None
        eio(lambda p: False)
        await _refused(broker, b"after")
        await broker.close()

    asyncio.run(body())


# --- a fire step's link records ----------------------------------------------------------------


FIRED = 200  # two link records: 128 and 72 links (`timer_links_per_record`)
FIRE_MS = 1_700_000_001_000


@pytest.mark.slow
@pytest.mark.parametrize("world", ["both link records kept", "the second cut short", "both zeroed"])
def test_an_fsync_error_on_a_fire_steps_link_records_loses_no_timer_and_fires_none_twice(
        tmp_path: Path, eio, world: str) -> None:
    """The fault: EIO from the group commit's fdatasync that carries a fire step's link records
    (200 timers fired in one step: two link records, written, not yet durable, and nothing else).
    What must hold: the step fails with FlushFailed and the broker stops for good (`fatal`, sends
    and receives refused), nothing it fired was dispatched (no consumer saw it, the index still
    calls it pending). After a restart from the data directory, in each world the disk may hold
    after such a failure (both link records there, the second cut short, both read back as zeros
    with the file's size kept), every timer is delivered to a group exactly once: the timers of a
    link record that survived as fired when the log says (its store time, replayed, never fired
    again), the rest pending and fired again at the restart, none early, none twice (nothing was
    visible before the failure, so not even at-least-once duplicates); a timer not yet due stays
    pending, and `chronoq check` finds nothing wrong."""
    data = tmp_path / "data"
    config = _config(tmp_path, segment_size_bytes=1 << 20, max_message_size_bytes=8192, default_queue_count=2)
    due_ms = FIRE_MS - 500

    async def body() -> None:
        clock = FakeClock(FIRE_MS - 1_000)
        broker = await open_broker(config, clock=clock, background=False)
        ids = [f"t{i:03d}" for i in range(FIRED)]
        await broker.send_batch([OutgoingMessage("orders", b"timer", message_id=m, deliver_at_ms=due_ms) for m in ids])
        await broker.send(OutgoingMessage("orders", b"later", message_id="later", deliver_at_ms=FIRE_MS + 60_000))
        before = broker.store.log.end_position
        clock.set(FIRE_MS)
        failed = eio(lambda p: p.endswith(files.SEGMENT_SUFFIX))
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.run_due(), 5)
        eio(lambda p: False)  # the disk "recovers": a retry would now return 0 on dropped pages
        assert failed, "no segment fsync failed: the fault did not reach the fire step's group commit"
        assert broker.fatal is not None, "an fsync error must stop the broker"
        links = list(broker.store.scan(before))
        assert [m.topic for m in links] == [LINKS_TOPIC, LINKS_TOPIC], "the group commit held more than the links"
        assert broker.store.log.flushed_position == before
        assert {s.state for m in ids for s in broker.query(m, "orders")} == {TimerState.PENDING}
        timer_at = {broker.query(m, "orders")[0].position: m for m in ids}
        assert [broker.queue_offsets("orders", q) for q in (0, 1)] == [(0, 0), (0, 0)]  # nothing dispatched
        with pytest.raises((FlushFailed, BrokerClosed)):
            await broker.receive("g", "orders", batch_size=8)
        await _refused(broker, b"after the error")
        await broker.close()
        checkpoint = read_checkpoint(data / files.CHECKPOINT)
        assert checkpoint is not None and checkpoint <= before, "a checkpoint past the failed fsync"

        segment = data / files.COMMITLOG_DIR / files.segment_name(0)
        first, second = links
        if world == "the second cut short":
            os.truncate(segment, 24 + second.position + second.size // 2)
        elif world == "both zeroed":
            with open(segment, "r+b") as f:
                f.seek(24 + first.position)
                f.write(bytes(second.position + second.size - first.position))
        survived = links[:{"both link records kept": 2, "the second cut short": 1, "both zeroed": 0}[world]]
        kept = {timer_at[p] for r in survived for p in decode_links(r.body).positions}  # fired as the log says

        clock.set(FIRE_MS + 500)  # the restart's fire step is told apart by its store time
        broker = await open_broker(config, clock=clock, background=False)
        try:
            assert await broker.run_due() == FIRED - len(kept)
            assert await broker.run_due() == 0
            got: list[StoredMessage] = []
            while batch := await broker.receive("g", "orders", batch_size=64):
                for rm in batch:
                    await broker.ack("g", "orders", rm.receipt_handle)
                    got.append(rm.message)
            assert sorted(m.message_id for m in got) == ids, "a timer was lost or delivered twice"
            for m in got:
                assert m.store_ms == (FIRE_MS if m.message_id in kept else FIRE_MS + 500) >= due_ms
            assert [s.state for s in broker.query("later", "orders")] == [TimerState.PENDING]
        finally:
            await broker.close()
        broker = await open_broker(config, clock=clock, background=False)
        try:
            assert await broker.run_due() == 0 and await broker.receive("g", "orders", batch_size=8) == []
        finally:
            await broker.close()
        report = check_data_dir(data)
        assert report.ok, format_report(report, data)

    asyncio.run(body())


# --- a real fault in a real server ----------------------------------------------------------


def _serve(data: Path, port: int, *, strace_inject: str | None = None,
           strace_path: Path | None = None) -> subprocess.Popen[bytes]:
    cmd = [str(Path(sys.executable).with_name("chronoq")), "serve", "--data-dir", str(data), "--port", str(port),
           "--log-level", "WARNING"]
    if strace_inject is not None:
        only = ["-P", str(strace_path)] if strace_path is not None else []
        cmd = ["strace", "-f", "-qq", "-o", "/dev/null", *only, "-e", "trace=fdatasync", "-e", strace_inject, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_ready(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if b"serving on" in line:
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
    raise AssertionError("server did not become ready")




@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_real_eio_under_strace(tmp_path: Path) -> None:
    """`strace -e inject=fdatasync:error=EIO:when=K` makes the K-th fdatasync fail, once (the disk
    "recovers": the shape of fsyncgate, where a retry returns 0 on pages the kernel dropped)
    in a real `chronoq serve`. Every send acknowledged before the fault is there after a restart;
    no send is acknowledged after it; the server exits with status 1."""
    from chronoq.client import Producer

    data = tmp_path / "data"
    port = free_port()
    # -P: only the first segment's fdatasyncs count (the group commits of the first sends).
    proc = _serve(data, port, strace_inject="inject=fdatasync:error=EIO:when=20",
                  strace_path=data / files.COMMITLOG_DIR / files.segment_name(0))
    acked: list[str] = []
    refused_after_first = 0
    try:
        _wait_ready(proc)
        with Producer(f"127.0.0.1:{port}", send_attempts=1) as producer:
            failed = False
            for i in range(400):
                try:
                    acked.append(producer.send("orders", f"m{i}".encode(), message_id=f"id{i:04d}").message_id)
                    assert not failed, f"send {i} was acknowledged after an fsync error"
                except ChronoqError:
                    if failed:
                        refused_after_first += 1
                    failed = True
                    if refused_after_first >= 3:
                        break
        assert failed, "the injected EIO never reached a send"
        assert proc.wait(timeout=30) == 1, "a broker whose fsync failed must exit with status 1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert acked, "nothing was acknowledged before the fault"
    port = free_port()
    proc = _serve(data, port)
    try:
        _wait_ready(proc)
        from chronoq.client import Consumer

        got: set[str] = set()
        with Consumer("g", "orders", server=f"127.0.0.1:{port}") as consumer:
            for _ in range(40):
                batch = consumer.receive(32, wait=200)
                if not batch and set(acked) <= got:
                    break
                for m in batch:
                    got.add(m.message_id)
                    consumer.ack(m)
        assert set(acked) <= got, f"lost: {sorted(set(acked) - got)[:10]}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
