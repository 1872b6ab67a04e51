"""Open consume-queue files are bounded: `max_open_queue_files`, least recently used closed first.

Before, every consume-queue file stayed open for the store's life: a topic of 65,000 queues ran
out of descriptors at its creation (an EMFILE on a directory fsync, reported as an fsync error
that failed the store for good), and a broker that had ever created that many could not open.
The fault is caused for real: a child process with a low RLIMIT_NOFILE. The rest watches the
system-call boundary (which files get fdatasynced before they are closed), not the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronoq.config import Config
from chronoq.errors import Throttled
from chronoq.model import MessageType
from chronoq.store.consumequeue import ConsumeQueue, OpenFiles
from chronoq.store.messagestore import MessageStore, PreparedMessage

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """tmpfs when there is one: creating thousands of queues fsyncs thousands of directories,
    and what is tested is the count of descriptors, not the disk's fsync latency."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="chronoq-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


CHILD = textwrap.dedent('''
    import asyncio, os, resource, sys
    from pathlib import Path
    from chronoq.broker import Broker
    from chronoq.clock import FakeClock
    from chronoq.config import Config
    from chronoq.model import OutgoingMessage

    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    queues = int(sys.argv[2])
    peak = 0

    def fds() -> int:
        global peak
        peak = max(peak, len(os.listdir("/proc/self/fd")))
        return peak

    async def main() -> None:
        config = Config(data_dir=Path(sys.argv[1]))
        per_topic = config.max_queue_count
        spread = [(f"wide{i // per_topic}", i % per_topic) for i in range(queues)]
        broker = await Broker.open(config, clock=FakeClock(1_800_000_000_000), background=False)
        for i in range(0, queues, per_topic):
            broker.topics.create(f"wide{i // per_topic}", min(per_topic, queues - i))
        fds()
        for i, (topic, qid) in enumerate(spread):
            await broker.send(OutgoingMessage(topic, b"x", message_id=f"m{i}", queue_id=qid))
            if i % 500 == 0:
                await broker.store.checkpoint_in_background()  # duplicates of the dirty files
                fds()
        fds()
        await broker.close()
        broker = await Broker.open(config, clock=FakeClock(1_800_000_000_000), background=False)
        fds()
        for i in (0, queues // 2, queues - 1):
            [msg] = await broker.read(*spread[i], 0, 10)
            assert msg.message_id == f"m{i}", msg
        fds()
        await broker.close()
        print(peak)

    asyncio.run(main())
''')


@pytest.mark.slow
def test_thousands_of_queues_work_under_an_open_file_limit_of_1024(scratch: Path) -> None:
    """3,000 queues (topics of `max_queue_count` queues, its most) under `ulimit -n` 1024 with the
    default `max_open_queue_files` (256): create, a send to every queue with checkpoints among
    them, close, reopen, read. Before: EMFILE at the creation of a topic of 3,000 queues."""
    limit = 1024
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's chronoq, not an installed one
    run = subprocess.run([sys.executable, "-c", CHILD, str(scratch / "data"), "3000", str(limit)],
                         capture_output=True, text=True, timeout=110, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    peak = int(run.stdout.split()[-1])
    # Queue files: at most 256 open plus their duplicates while a checkpoint syncs them; the
    # rest is the log, RocksDB's files and the interpreter's own.
    assert peak <= 2 * Config().max_open_queue_files + 150, peak


def _queues(directory: Path, open_files: OpenFiles, n: int) -> list[ConsumeQueue]:
    return [ConsumeQueue(directory / str(i), 100, open_files) for i in range(n)]


def test_a_dirty_queue_file_is_fdatasynced_before_it_is_closed_to_make_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint syncs only the files still open and dirty; one closed to make room must have
    been made durable first, or the next checkpoint would cover entries no fsync reached."""
    synced: list[str] = []
    real_fdatasync = os.fdatasync

    def recording_fdatasync(fd: int) -> None:  # the syscall boundary: which file, then the real call
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fdatasync(fd)

    open_files = OpenFiles(2)
    q0, q1, q2 = _queues(tmp_path, open_files, 3)
    q0.append(100, 10, 0)
    q1.append(200, 10, 0)
    monkeypatch.setattr(os, "fdatasync", recording_fdatasync)
    q2.append(300, 10, 0)  # the third open file: q0's, least recently used and dirty, is closed
    assert synced == [str(q0._files[0].path)]
    assert len(open_files) == 2 and open_files.evicted_dirty == 1
    taken = q0.take_dirty()
    assert taken.files == [] and taken.directory is not None  # its entries are durable already
    taken.close()
    assert q0.get(0) == (100, 10, 0)  # reopened on use, closing q1's (dirty: synced too)
    assert synced == [str(q0._files[0].path), str(q1._files[0].path)]
    q1.take_dirty().close()
    for q in (q0, q1, q2):
        q.close()
    assert len(open_files) == 0


def test_a_clean_queue_file_is_closed_without_an_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    open_files = OpenFiles(1)
    q0, q1 = _queues(tmp_path, open_files, 2)
    q0.append(100, 10, 0)
    q0.flush()  # a checkpoint covered it
    synced: list[int] = []
    monkeypatch.setattr(os, "fdatasync", synced.append)
    q1.ensure_file()
    assert synced == [] and open_files.evictions == 1


def test_bad_limits_are_refused_with_their_value() -> None:
    with pytest.raises(ValueError, match="at least 1, not 0"):
        OpenFiles(0)
    with pytest.raises(ValueError, match="max_open_queue_files"):
        Config(max_open_queue_files=0)


def test_background_checkpoints_racing_evictions_lose_nothing(tmp_path: Path,
                                                              assert_queues_match_log: Callable) -> None:
    """The checkpoint thread syncs duplicated descriptors while the loop closes the originals to
    make room (4 open files, 40 queues written in turn): every checkpoint succeeds, and after a
    reopen every queue agrees with the log."""
    config = Config(data_dir=tmp_path / "data", max_open_queue_files=4, max_queue_count=40)

    async def body() -> None:
        store, _ = MessageStore.open(config)
        try:
            store.create_topic("t", 40, frozenset(MessageType), 0)
            for round_ in range(5):
                msgs = [PreparedMessage("t", f"m{round_}-{q}", MessageType.NORMAL, b"x" * 10, 0, queue_id=q)
                        for q in range(40)]
                stored = store.append(msgs[:20], 1)
                checkpoint = asyncio.ensure_future(store.checkpoint_in_background())
                stored += store.append(msgs[20:], 1)
                await store.log.flush_now()  # the group commit: dispatches, evicting dirty files
                await checkpoint
                assert len(store.queue_files) <= 4
            assert store.queue_files.evicted_dirty > 0
        finally:
            store.close()
        store, _ = MessageStore.open(config)
        try:
            assert assert_queues_match_log(store) == 200
            assert len(store.queue_files) <= 4
        finally:
            store.close()

    asyncio.run(body())


def test_a_limit_too_close_to_ulimit_is_named_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit to compare with")
    cap = soft // 2
    with caplog.at_level(logging.WARNING, logger="chronoq"):
        store, _ = MessageStore.open(Config(data_dir=tmp_path / "data", max_open_queue_files=cap))
        store.close()
    assert f"max_open_queue_files = {cap}: consume queues may hold {2 * cap} descriptors" in caplog.text
    assert f"(ulimit -n) {soft}" in caplog.text


def test_a_checkpoint_syncs_the_queues_written_since_the_last_one_and_visits_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint takes only from queues written since their last take (visiting all of them
    held the loop ~0.9 us a queue, every second); a written queue it skipped would be covered by
    the checkpoint without an fsync. Watched at the syscall boundary."""
    config = Config(data_dir=tmp_path / "data")  # the store's create_topic: no max_queue_count

    async def body() -> None:
        store, _ = MessageStore.open(config)
        try:
            store.create_topic("t", 300, frozenset(MessageType), 0)
            store.checkpoint()
            assert store.queue_files.dirty_queues() == []
            store.append([PreparedMessage("t", "m", MessageType.NORMAL, b"x", 0, queue_id=7)], 1)
            await store.log.flush_now()
            synced: list[str] = []
            real_fdatasync = os.fdatasync

            def recording_fdatasync(fd: int) -> None:
                synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                real_fdatasync(fd)

            monkeypatch.setattr(os, "fdatasync", recording_fdatasync)
            assert store.queue_files.dirty_queues() == [store.queue("t", 7)]
            store.checkpoint()
            queue_files = [p for p in synced if "/queues/" in p]
            assert queue_files == [str(store.queue("t", 7)._files[0].path)]
            assert store.queue_files.dirty_queues() == []
        finally:
            store.close()

    asyncio.run(body())


def test_a_checkpoint_that_runs_out_of_descriptors_while_taking_gives_back_what_it_took(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint duplicates each dirty file's descriptor; an EMFILE on the third (a real
    RLIMIT_NOFILE, lowered for the moment) fails it. The queues taken before it must count as
    dirty again: before, they were left clean, their duplicates unsynced and leaked, and the
    next checkpoint covered their entries without an fsync."""
    config = Config(data_dir=tmp_path / "data", max_queue_count=5)

    async def body() -> None:
        store, _ = MessageStore.open(config)
        try:
            store.create_topic("t", 5, frozenset(MessageType), 0)
            store.checkpoint()
            store.append([PreparedMessage("t", f"m{q}", MessageType.NORMAL, b"x", 0, queue_id=q) for q in range(5)], 1)
            await store.log.flush_now()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            in_use = len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
            # Room for exactly two more: a new descriptor takes the lowest free number, holes
            # first. The listing's own (the lowest free then, closed after) is the first; the
            # limit is the third, the second free number the listing shows.
            used = {int(n) for n in os.listdir("/proc/self/fd")}
            third_free = list(itertools.islice((n for n in itertools.count() if n not in used), 2))[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (third_free, hard))
            try:
                with pytest.raises(OSError) as raised:
                    store.checkpoint()
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert raised.value.errno == errno.EMFILE
            assert len(os.listdir("/proc/self/fd")) - 1 == in_use  # no duplicate leaked
            assert len(store.queue_files.dirty_queues()) == 5
            synced: list[str] = []
            real_fdatasync = os.fdatasync

            def recording_fdatasync(fd: int) -> None:
                synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                real_fdatasync(fd)

            monkeypatch.setattr(os, "fdatasync", recording_fdatasync)
            store.checkpoint()
            assert sorted(p for p in synced if "/queues/" in p) == sorted(
                str(store.queue("t", q)._files[0].path) for q in range(5))
        finally:
            store.close()

    asyncio.run(body())


def test_a_dispatch_out_of_descriptors_gives_up_a_queue_file_instead_of_failing(tmp_path: Path) -> None:
    """Queue files are opened on use, so a group commit's dispatch may open one. When the process
    has no descriptor left (connections took them; here a real RLIMIT_NOFILE lowered to the
    descriptors in use) while the store holds other queue files open, it closes one and opens
    the file it needs. Before, the EMFILE raised out of the group commit's dispatch: the
    flusher, and with it the broker, stopped."""
    config = Config(data_dir=tmp_path / "data", max_queue_count=2, default_queue_count=1)

    async def body() -> None:
        store, _ = MessageStore.open(config)
        store.create_topic("t", 2, frozenset(MessageType), 0)
        store.close()
        store, _ = MessageStore.open(config)  # no queue file open: each opens on use
        try:
            store.append([PreparedMessage("t", "m0", MessageType.NORMAL, b"x", 0, queue_id=0)], 1)
            await store.log.flush_now()  # queue 0's file is open now (and the fsync thread started)
            [m1] = store.append([PreparedMessage("t", "m1", MessageType.NORMAL, b"x", 0, queue_id=1)], 1)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            used = {int(n) for n in os.listdir("/proc/self/fd")}
            # The limit: the listing's own descriptor, free again now (the lowest closed number).
            limit = next(n for n in itertools.count() if n not in used or not _is_open(n))
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            try:
                await store.log.flush_now()  # dispatch opens queue 1's file
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert store.dispatched_position == m1.position + m1.size
            entry = store.queue("t", 1).get(0)
            assert entry is not None and entry[:2] == (m1.position, m1.size)
            assert store.queue_files.evictions == 1  # queue 0's file, given up for it
            assert store.queue("t", 0).get(0) is not None  # and opened again on use
        finally:
            store.close()

    asyncio.run(body())


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _no_descriptor_left() -> Iterator[None]:
    """A real RLIMIT_NOFILE, lowered to the lowest free descriptor number for the block: any
    open, of an existing file or a new one, fails with EMFILE until something is closed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = {int(n) for n in os.listdir("/proc/self/fd")}
    limit = next(n for n in itertools.count() if n not in used or not _is_open(n))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _one_queue_of_two_entry_files(tmp_path: Path, flush: str) -> Config:
    config = Config(data_dir=tmp_path / "data", flush=flush, consume_queue_entries_per_file=2,  # type: ignore[arg-type]
                    max_queue_count=1, default_queue_count=1)
    store, _ = MessageStore.open(config)
    try:
        store.create_topic("t", 1, frozenset(MessageType), 0)
    finally:
        store.close()
    return config


async def _two_written_then_reopened(config: Config) -> MessageStore:
    """A store with m0 and m1 written and fsynced, closed, and opened again (no queue file open)."""
    store, _ = MessageStore.open(config)
    try:
        store.append([_msg(0), _msg(1)], 1)
        await store.log.flush_now()
    finally:
        store.close()
    store, _ = MessageStore.open(config)
    return store


def _msg(i: int) -> PreparedMessage:
    return PreparedMessage("t", f"m{i}", MessageType.NORMAL, b"x", 0, queue_id=0)


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_queue_rolling_to_a_new_file_out_of_descriptors_gives_up_an_open_one(tmp_path: Path, flush: str) -> None:
    """The queue's file is full and the process has no descriptor left (a real RLIMIT_NOFILE):
    creating its next file closes the full one (the only one open) and goes on. Before, only
    opening an existing file did that; creating one raised EMFILE out of dispatch: out of the
    group commit in sync mode (the broker stopped), and out of `append` in async mode, where
    dispatch runs inside it, so a sender whose record was written heard "refused"."""
    config = _one_queue_of_two_entry_files(tmp_path, flush)

    async def body() -> None:
        store, _ = MessageStore.open(config)
        try:
            store.append([_msg(0), _msg(1)], 1)
            await store.log.flush_now()  # the queue's first file is full, and open
            with _no_descriptor_left():
                [m2] = store.append([_msg(2)], 1)
                await store.log.flush_now()
            assert store.dispatched_position == m2.position + m2.size
            await store.wait_durable(m2.position + m2.size)
            q = store.queue("t", 0)
            assert len(q._files) == 2 and q.next_offset == 3
            entry = q.get(2)
            assert entry is not None and entry[:2] == (m2.position, m2.size)
            assert store.queue_files.evictions == 1
        finally:
            store.close()

    asyncio.run(body())


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_dispatch_with_no_queue_file_to_give_up_is_held_back_never_refused(tmp_path: Path, flush: str) -> None:
    """No queue file is open (a reopened store) and the process has no descriptor left: the
    queue's next file cannot be made. The written record is not refused (async mode: its
    sender would retry and store it twice) nor does the flusher die (sync mode): dispatch is
    held back, new sends are refused (Throttled, nothing written), and once a descriptor is free
    the flusher's retry dispatches it and its sender is answered, once."""
    config = _one_queue_of_two_entry_files(tmp_path, flush)

    async def body() -> None:
        store = await _two_written_then_reopened(config)  # nothing open now: files open on use
        try:
            assert len(store.queue_files) == 0
            with _no_descriptor_left():
                [m2] = store.append([_msg(2)], 1)
                await store.log.flush_now()
                waiter = asyncio.ensure_future(store.wait_durable(m2.position + m2.size))
                await asyncio.sleep(0)
                assert not waiter.done()
                assert store.dispatched_position == m2.position
                with pytest.raises(Throttled, match="out of file descriptors"):
                    store.check_room_for_send()
            await store.log.flush_now()  # the flusher's retry, now that there is room
            await asyncio.wait_for(waiter, 5)
            assert store.dispatched_position == m2.position + m2.size
            store.check_room_for_send()
            q = store.queue("t", 0)
            assert q.next_offset == 3 and q.get(2) is not None
            assert [m.message_id for m in store.scan(0)] == ["m0", "m1", "m2"]
        finally:
            store.close()

    asyncio.run(body())


def test_dispatch_held_back_out_of_descriptors_shows_in_stats_beside_the_disk_full_hold(tmp_path: Path) -> None:
    """Dispatch held back for lack of descriptors (a real RLIMIT_NOFILE) was only a log warning:
    `disk_stats` (`Broker.stats()["disk"]`) says it, `chronoq stats` gives it a line below the
    disk's, and /metrics a `chronoq_held_back` sample, while it lasts; all go once a descriptor
    is free and dispatch resumes."""
    from chronoq.cli.stats import render
    from chronoq.http.metrics import held_back

    config = _one_queue_of_two_entry_files(tmp_path, "sync")

    def fds_lines(disk: dict[str, object]) -> list[str]:
        return [line for line in render({"now_ms": 0, "disk": disk}) if line.startswith("dispatch")]

    def held_samples(disk: dict[str, object]) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(s.labels.items())): s.value for s in held_back(disk).samples}

    async def body() -> None:
        store = await _two_written_then_reopened(config)  # nothing open now: files open on use
        try:
            assert store.disk_stats()["dispatch_out_of_fds"] is None and fds_lines(store.disk_stats()) == []
            with _no_descriptor_left():
                [m2] = store.append([_msg(2)], 1)
                await store.log.flush_now()
                held = store.disk_stats()
            assert f"position {m2.position} held back: out of file descriptors" in str(held["dispatch_out_of_fds"])
            assert fds_lines(held) == ["dispatch    HELD BACK: out of file descriptors, sends refused (ulimit -n)"]
            assert held_samples(held) == {(("reason", "out_of_fds"), ("what", "dispatch")): 1}  # /metrics
            await store.log.flush_now()  # the flusher's retry, now that there is room
            assert store.dispatched_position == m2.position + m2.size
            assert store.disk_stats()["dispatch_out_of_fds"] is None and fds_lines(store.disk_stats()) == []
            assert held_samples(store.disk_stats()) == {}
        finally:
            store.close()

    asyncio.run(body())
