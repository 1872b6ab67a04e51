"""A power loss under `flush = "async"`: the log's unsynced tail comes back as zeros, or the file
shorter, while the consume queues, the checkpoint and the timer index may be past it.

Built with real files: a broker writes records, fsyncs some (the fsynced end P), writes more
(acknowledged before their fsync: that is the option), checkpoints, and the data directory is
copied while it runs (the page cache's view, as a power loss with writeback of everything but
the log's tail would leave it). The copy's last segment then gets zeros from P on, or is cut at
P, and the copy is opened. What is asked (docs/design.md, "Faults"):
- async: the broker starts, the tail is cut at P, the consume queues, the checkpoint and the
  timer index come back to the log's end (the index is rebuilt: it was ahead), the loss is
  reported, and nothing lost is delivered, fired or reported as damage;
- a checkpoint of version 1 (brokers before it was capped at the fsynced end wrote it past P)
  is walked from the segment's start;
- sync: records below the checkpoint were fsynced and acknowledged; losing them is a disk's
  fault, cut like any torn tail but reported as an error and a problem, never silently;
- a queue recovery cut back stays cut through a second power loss (the cut is fdatasynced), and so
  does a group offset brought back to its queue (fsynced; watched with strace).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import LINKS_TOPIC, OutgoingMessage, StoredMessage
from chronoq.store import files
from chronoq.store.check import check_data_dir
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE
from chronoq.store.meta import CHECKPOINT_MAGIC, read_checkpoint
from tests.support.brokers import open_broker

START_MS = 1_800_000_000_000


def _config(data: Path, flush: str) -> Config:
    # flush_interval_ms: the async flusher never runs by itself here; the test says when to fsync.
    return Config(data_dir=data, flush=flush, flush_interval_ms=600_000,  # type: ignore[arg-type]
                  segment_size_bytes=1 << 20, max_message_size_bytes=2048, default_queue_count=1)


async def _open(data: Path, flush: str, clock: FakeClock) -> Broker:
    return await open_broker(_config(data, flush), clock=clock, background=False)


async def _drain(broker: Broker, topic: str) -> list[str]:
    out: list[str] = []
    while got := await broker.receive("g", topic, batch_size=64):
        for r in got:
            await broker.ack("g", topic, r.receipt_handle)
            out.append(r.message.message_id)
    return out


async def _power_loss_copy(live: Path, data: Path, flush: str,
                           clock: FakeClock) -> tuple[int, int, list[StoredMessage]]:
    """Five messages and a timer fsynced (ending at P), then five more and a timer written after
    that fsync, a checkpoint, and a copy of the directory. Returns (P, the log's end, the first
    six as stored)."""
    broker = await _open(live, flush, clock)
    try:
        first = [await broker.send(OutgoingMessage("t", b"a" * 100, message_id=f"a{i}")) for i in range(5)]
        first.append(await broker.send(OutgoingMessage("t", b"ta", message_id="ta", delay_ms=10_000)))
        await broker.store.log.flush_now()
        fsynced = broker.store.log.flushed_position
        for i in range(5):
            await broker.send(OutgoingMessage("t", b"b" * 100, message_id=f"b{i}"))
        await broker.send(OutgoingMessage("t", b"tb", message_id="tb", delay_ms=10_000))
        broker.store.checkpoint()
        end = broker.store.log.end_position
        shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))
        return fsynced, end, first
    finally:
        await broker.close()


def _lose_tail(data: Path, fsynced: int, end: int, how: str) -> None:
    """What a power loss leaves of the log's unsynced tail: zeros (the size was journaled, the
    data blocks not written) or a file that ends at the fsynced end."""
    segment = sorted((data / files.COMMITLOG_DIR).glob("*" + files.SEGMENT_SUFFIX))[-1]
    at = fsynced - int(segment.name[:20]) + SEGMENT_HEADER_SIZE
    with open(segment, "r+b") as f:
        if how == "zeros":
            f.seek(at)
            f.write(bytes(end - fsynced))
        else:
            f.truncate(at)


def _write_checkpoint_v1(data: Path, position: int) -> None:
    """A checkpoint as brokers before version 2 wrote it (the same 32 bytes, version 1)."""
    head = struct.pack(">8sIIQI", CHECKPOINT_MAGIC, 1, 0, position, 0)
    (data / files.CHECKPOINT).write_bytes(head + struct.pack(">I", crc32c.crc32c(head)))


@pytest.mark.parametrize("how", ["zeros", "short"])
def test_an_async_power_loss_cuts_the_unsynced_tail_and_brings_derived_state_back(
        tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        live, data = tmp_path / "live", tmp_path / "data"
        fsynced, end, first = await _power_loss_copy(live, data, "async", clock)
        assert fsynced < end
        # The checkpoint never claims more than the log has fsynced (before: the log's end).
        assert read_checkpoint(data / files.CHECKPOINT) == fsynced
        _lose_tail(data, fsynced, end, how)
        before = check_data_dir(data)
        assert not before.damaged, before.problems  # the async price, repaired by a restart
        with caplog.at_level(logging.WARNING, logger="chronoq"):
            broker = await _open(data, "async", clock)
        try:
            report = broker.open_report
            assert broker.store.log.end_position == fsynced
            assert report.log.truncated_at == (fsynced if how == "zeros" else None)
            assert report.truncated_cq_entries == 6  # five messages and the timer record, acknowledged
            assert not broker.store.log.damage.ranges()
            assert "6 consume-queue entries pointed past the commit log's end" in caplog.text
            assert "past the log's end" in caplog.text  # the timer index was ahead: rebuilt
            assert await _drain(broker, "t") == [m.message_id for m in first[:5]]
            clock.advance(20_000)
            assert await broker.run_due() == 1  # "ta"; "tb" is gone, not fired and not damaged
            assert await _drain(broker, "t") == ["ta"]
            assert broker.stats()["timer"]["damaged"] == 0
            assert not broker.store.log.damage.ranges()
            link = next(broker.store.scan(fsynced))  # the log goes on right at the cut: "ta"'s fire
            links = broker.store.links_in(link)
            assert (link.position, link.topic) == (fsynced, LINKS_TOPIC)
            assert [broker.store.read_at(*links.target(i)).message_id for i in range(len(links))] == ["ta"]
            await broker.send(OutgoingMessage("t", b"next", message_id="next"))
            assert await _drain(broker, "t") == ["next"]
        finally:
            await broker.close()
        assert check_data_dir(data).ok

    asyncio.run(body())


@pytest.mark.parametrize("how", ["zeros", "short"])
def test_a_version_1_checkpoint_past_an_async_power_loss_is_walked_from_the_segment_start(
        tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Brokers before the checkpoint was capped at the fsynced end wrote it past P with "async".
    Before: zeros below it were kept as part of the log and met as damage by every reader (one
    overlapping range per record, each logged), the lost timer marked damaged."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        live, data = tmp_path / "live", tmp_path / "data"
        fsynced, end, first = await _power_loss_copy(live, data, "async", clock)
        _write_checkpoint_v1(data, end)
        _lose_tail(data, fsynced, end, how)
        before = check_data_dir(data)
        assert any(f"below the checkpoint {end}" in p for p in before.problems), before.problems
        with caplog.at_level(logging.WARNING, logger="chronoq"):
            broker = await _open(data, "async", clock)
        try:
            report = broker.open_report.log
            assert broker.store.log.end_position == fsynced
            assert (report.lost_below_checkpoint, report.checkpoint_past_end) == (end - fsynced, end)
            assert f"a power loss took {end - fsynced} bytes of records acknowledged before their fsync" in caplog.text
            assert not broker.store.log.damage.ranges()
            assert await _drain(broker, "t") == [m.message_id for m in first[:5]]
            clock.advance(20_000)
            assert await broker.run_due() == 1
            assert broker.stats()["timer"]["damaged"] == 0
        finally:
            await broker.close()
        assert check_data_dir(data).ok

    asyncio.run(body())


@pytest.mark.parametrize("how", ["zeros", "short"])
def test_sync_mode_says_out_loud_when_records_below_the_checkpoint_are_gone(
        tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """With "sync" the records below the checkpoint were fsynced before anyone saw them: zeros
    there (under a version-1 checkpoint, which has the walk start at the segment's start) or a
    segment cut short below a version-2 one is a disk that lost acknowledged records. The torn
    tail is still cut (nothing valid follows), but as an error naming the bytes lost, and
    `chronoq check` calls it a problem. Before: zeros were kept and met as damage by every
    reader (an overlapping range per record), a short segment was cut without a word, and check
    said "nothing acknowledged is in it"."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        live, data = tmp_path / "live", tmp_path / "data"
        fsynced, end, first = await _power_loss_copy(live, data, "sync", clock)
        assert read_checkpoint(data / files.CHECKPOINT) == end  # sync: everything was fsynced
        if how == "zeros":
            _write_checkpoint_v1(data, end)
        _lose_tail(data, fsynced, end, how)
        report = check_data_dir(data)
        assert any(f"below the checkpoint {end}" in p for p in report.problems), report.problems
        with caplog.at_level(logging.ERROR, logger="chronoq"):
            broker = await _open(data, "sync", clock)
        try:
            assert broker.store.log.end_position == fsynced
            assert broker.open_report.log.lost_below_checkpoint == end - fsynced
            assert f"{end - fsynced} bytes of records fsynced and acknowledged are gone" in caplog.text
            assert not broker.store.log.damage.ranges()
            assert await _drain(broker, "t") == [m.message_id for m in first[:5]]
        finally:
            await broker.close()
        assert check_data_dir(data).ok

    asyncio.run(body())


def test_zeros_the_log_still_spans_below_a_version_2_checkpoint_are_one_damaged_range(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Zeros below a version-2 checkpoint whose size survived are not looked for at open (that
    checkpoint is trusted to be fsynced): readers meet them as damage. Each reader that lands
    inside the run (a queue entry per lost record) must find the one range, not search again
    from its own position: before, each found and logged a new overlapping range."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        live, data = tmp_path / "live", tmp_path / "data"
        fsynced, end, first = await _power_loss_copy(live, data, "sync", clock)
        _lose_tail(data, fsynced, end, "zeros")
        # `chronoq check` says what a restart does with them: keeps them, as damage. Before, it
        # said a restart cuts them and drops the queues' entries for them; it does neither.
        checked = check_data_dir(data)
        assert any(f"damaged bytes at positions [{fsynced}, {end})" in p for p in checked.problems), checked.problems
        assert not any("restart cuts the tail" in p for p in checked.problems), checked.problems
        assert not any("past the log's end" in r for r in checked.repairs), checked.repairs
        broker = await _open(data, "sync", clock)
        try:
            with caplog.at_level(logging.ERROR, logger="chronoq"):
                assert await _drain(broker, "t") == [m.message_id for m in first[:5]]
            assert [(d.start, d.end) for d in broker.store.log.damage.ranges()] == [(fsynced, end)]
            assert caplog.text.count("quarantined damaged bytes") == 1
            clock.advance(20_000)
            assert await broker.run_due() == 2  # "ta" fired, "tb" marked damaged: reported, not dropped
            assert broker.stats()["timer"]["damaged"] == 1
        finally:
            await broker.close()

    asyncio.run(body())


def test_a_queue_cut_back_by_recovery_stays_cut_after_a_second_power_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery drops a queue's entries that point past the log's end (cut by the first power
    loss) and the log goes on at the cut: new records, of another queue, take those positions.
    The queue's cut must be durable before then. Before, it was a truncate no fsync covered (the
    queue got no new entry, so no checkpoint synced it): a second power loss brought its old
    entries back, now pointing at the other queue's records, and its consumers received them
    (same size: delivered whole, a message twice on two queues). The disk is modelled at the
    system-call boundary: after the second loss a queue file holds what its last fsync since the
    first open saw, or what it held before that open."""
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    durable: dict[str, bytes] = {}

    def remember(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(files.CQ_SUFFIX):
            with open(path, "rb") as f:
                durable[path] = f.read()

    def recording_fsync(fd: int) -> None:
        real_fsync(fd)
        remember(fd)

    def recording_fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        remember(fd)

    async def body() -> None:
        clock = FakeClock(START_MS)
        live, data, after = tmp_path / "live", tmp_path / "data", tmp_path / "after"
        broker = await _open(live, "async", clock)
        try:
            broker.topics.create("two", 2)
            kept = [await broker.send(OutgoingMessage("two", b"m" * 100, message_id=f"m{i}", queue_id=0))
                    for i in range(3)]
            await broker.store.log.flush_now()
            fsynced = broker.store.log.flushed_position
            lost = [await broker.send(OutgoingMessage("two", b"x" * 100, message_id=f"a{i}", queue_id=0))
                    for i in range(3)]
            broker.store.checkpoint()  # queue 0's entries for a0..a2 are durable, the log's tail is not
            end = broker.store.log.end_position
            shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))
        finally:
            await broker.close()
        _lose_tail(data, fsynced, end, "zeros")
        before_open = {str(p): p.read_bytes() for p in (data / files.QUEUES_DIR).rglob("*" + files.CQ_SUFFIX)}
        monkeypatch.setattr(os, "fsync", recording_fsync)
        monkeypatch.setattr(os, "fdatasync", recording_fdatasync)
        broker = await _open(data, "async", clock)
        try:
            assert broker.open_report.truncated_cq_entries == 3
            taken = [await broker.send(OutgoingMessage("two", b"x" * 100, message_id=f"b{i}", queue_id=1))
                     for i in range(3)]
            # The log goes on at the cut: queue 1's records where queue 0's lost ones were.
            assert [m.position for m in taken] == [m.position for m in lost]
            await broker.store.log.flush_now()
            broker.store.checkpoint()
            # The second power loss: every queue file as its last fsync left it.
            shutil.copytree(data, after, ignore=shutil.ignore_patterns(files.LOCK))
            for path, old in before_open.items():
                (after / Path(path).relative_to(data)).write_bytes(durable.get(path, old))
        finally:
            await broker.close()
        monkeypatch.undo()
        broker = await _open(after, "async", clock)
        try:
            got0 = [m.message_id for m in await broker.read("two", 0, 0, 10)]
            got1 = [m.message_id for m in await broker.read("two", 1, 0, 10)]
            assert got1 == ["b0", "b1", "b2"]
            assert got0 == [m.message_id for m in kept], \
                f"queue 0's entries dropped at the first recovery came back, pointing at queue 1's records: {got0}"
            assert sorted(await _drain(broker, "two")) == ["b0", "b1", "b2", "m0", "m1", "m2"]  # each once
        finally:
            await broker.close()

    asyncio.run(body())


_OPEN_CHILD = """
import asyncio, os, sys
from pathlib import Path
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config

async def main():
    config = Config(data_dir=Path(sys.argv[1]), flush="async", flush_interval_ms=600_000,
                    segment_size_bytes=1 << 20, max_message_size_bytes=2048, default_queue_count=1)
    broker = await Broker.open(config, clock=FakeClock(int(sys.argv[2])), background=False)
    print(broker.groups.offset("g", "t", 0), flush=True)
    os._exit(0)  # a crash right after the open: whatever is not fsynced yet is at the mercy of power

asyncio.run(main())
"""


def test_a_group_offset_brought_back_to_its_queue_is_fsynced(tmp_path: Path) -> None:
    """After an async power loss, recovery brings a group's offset back from past the lost
    records to its queue's end; new records then fill the queue back past the old offset. That
    move back must be durable: lost to a second power loss (the group store writes without an
    fsync: a lost write is usually a redelivery), the offset is ahead again, no longer past the
    queue's end, so nothing moves it back, and the group skips the new, acknowledged messages.
    Watched at the system-call boundary (strace): before, the move back's write to the group
    store's write-ahead log was the open's last, and no fsync followed it."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace to watch RocksDB's own system calls")

    async def body() -> Path:
        clock = FakeClock(START_MS)
        live, data = tmp_path / "live", tmp_path / "data"
        broker = await _open(live, "async", clock)
        try:
            for i in range(3):
                await broker.send(OutgoingMessage("t", b"a" * 100, message_id=f"a{i}"))
            await broker.store.log.flush_now()
            fsynced = broker.store.log.flushed_position
            for i in range(3):
                await broker.send(OutgoingMessage("t", b"b" * 100, message_id=f"b{i}"))
            assert len(await _drain(broker, "t")) == 6  # the group's offset: 6
            broker.store.checkpoint()
            end = broker.store.log.end_position
            shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))
        finally:
            await broker.close()
        _lose_tail(data, fsynced, end, "zeros")
        return data

    data = asyncio.run(body())
    trace = tmp_path / "trace.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's chronoq
    strace = ["strace", "-f", "-y", "--seccomp-bpf", "-e", "trace=write,pwrite64,writev,fsync,fdatasync",
              "-o", str(trace)]
    done = subprocess.run([*strace, sys.executable, "-c", _OPEN_CHILD, str(data), str(START_MS)],
                          capture_output=True, text=True, timeout=120, env=env)
    if done.returncode != 0 and done.stderr.startswith("strace:"):  # ptrace not permitted, say
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "3"  # brought back from 6 to the queue's end
    wal = re.compile(r"(?:write|pwrite64|writev)\(\d+<(" + re.escape(str(data / files.GROUPS_DIR)) + r"/\d+\.log)>")
    calls = trace.read_text().splitlines()
    writes = [(i, m.group(1)) for i, line in enumerate(calls) if (m := wal.search(line))]
    assert writes, "no write to the group store's write-ahead log"
    last, path = writes[-1]
    assert any(re.search(r"f(?:data)?sync\(\d+<" + re.escape(path) + ">", line) for line in calls[last + 1:]), \
        f"the group store's last write ({calls[last][:120]}) was not fsynced"
