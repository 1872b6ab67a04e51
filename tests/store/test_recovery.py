"""Torn tail: cut the last segment at every byte offset of its last records and reopen.

Two starting states: a clean close (the checkpoint covers the whole log, so the cut falls below
it) and a crash (the checkpoint lies inside the last segment, behind the end, and the consume
queues hold entries the checkpoint does not cover). For every cut: every record that ends at or
before the cut is kept, nothing after it; the consume queues agree with the log; `chronoq check`
is clean after recovery; and a new append lands right after the last kept record with the next
queue offset.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import MessageType, OutgoingMessage, StoredMessage
from chronoq.store import files
from chronoq.store.check import check_data_dir
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.store.meta import read_checkpoint
from tests.support.brokers import SimulatedBrokers, open_broker

LAST_RECORDS = 3


async def _fill(config: Config, crash_copy_to: Path | None) -> list[StoredMessage]:
    """Send ~2.5 segments of messages over two topics. With `crash_copy_to`, checkpoint in the
    middle of the last segment, send a few more, and copy the directory while the broker still
    runs (the state a SIGKILL leaves), then close."""
    broker = await open_broker(config, clock=FakeClock(), background=False)
    try:
        for i in range(30):
            await broker.send(OutgoingMessage("orders" if i % 3 else "audit", f"body-{i:03d}".encode() * 3,
                                              message_id=f"m{i:03d}", tag="t" if i % 2 else "", keys=(f"k{i}",)))
        if crash_copy_to is not None:
            broker.store.checkpoint()
            for i in range(30, 30 + LAST_RECORDS + 1):
                await broker.send(OutgoingMessage("orders", b"after checkpoint", message_id=f"m{i:03d}"))
            shutil.copytree(config.data_dir, crash_copy_to)
        return list(broker.store.scan(0))
    finally:
        await broker.close()


@pytest.fixture(scope="module", params=["clean-close", "crash"])
def template(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp(request.param)
    config = Config(data_dir=root / "live", segment_size_bytes=2048, max_message_size_bytes=1024,
                    default_queue_count=2)
    crash = root / "crashed" if request.param == "crash" else None
    records = asyncio.run(_fill(config, crash))
    data = crash or config.data_dir
    (data / files.LOCK).unlink(missing_ok=True)
    segments = sorted((data / files.COMMITLOG_DIR).iterdir())
    assert len(segments) >= 2, "the template must roll at least once"
    checkpoint = read_checkpoint(data / files.CHECKPOINT)
    assert checkpoint is not None
    last_base = int(segments[-1].name[:20])
    if crash:
        assert last_base < checkpoint < records[-1].position + records[-1].size
    return data, records


def _cut_points(records: list[StoredMessage], last_base: int, file_size: int) -> range:
    tail = [r for r in records if r.position >= last_base][-LAST_RECORDS:]
    assert len(tail) == LAST_RECORDS
    return range(SEGMENT_HEADER_SIZE + tail[0].position - last_base, file_size + 1)


def _reopen_and_verify(data: Path, records: list[StoredMessage], cut_position: int,
                       assert_queues_match_log: Callable) -> None:
    kept = [r for r in records if r.position + r.size <= cut_position]
    config = Config(data_dir=data, segment_size_bytes=2048, max_message_size_bytes=1024, default_queue_count=2)
    store, report = MessageStore.open(config)
    try:
        after = list(store.scan(0))
        assert [(m.message_id, m.position, m.size) for m in after] == [(r.message_id, r.position, r.size)
                                                                      for r in kept]
        assert after == kept  # every field of every kept record, decoded again
        end = kept[-1].position + kept[-1].size
        assert store.log.end_position == end
        assert report.log.truncated_bytes == cut_position - end
        assert assert_queues_match_log(store) == len(kept)
        # A new append goes right after the last kept record, with the next queue offset.
        expect_qoff = sum(1 for r in kept if (r.topic, r.queue_id) == ("orders", 0))
        new = store.append([PreparedMessage(topic="orders", message_id="new", message_type=MessageType.NORMAL,
                                            body=b"after recovery", born_ms=1, queue_id=0)], 2)
        asyncio.run(store.log.flush_now())
        assert (new[0].position, new[0].queue_offset) == (end, expect_qoff)
        assert store.queue("orders", 0).get(expect_qoff)[:2] == (end, new[0].size)
        assert_queues_match_log(store)
    finally:
        store.close()
    result = check_data_dir(data)
    assert result.ok, result.problems
    assert result.records == len(kept) + 1


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory on tmpfs when there is one: the sweep below opens and closes a store hundreds
    of times, and what it tests is the recovery logic, not the disk's fsync latency."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="chronoq-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# slow: a long walk over every byte offset (seconds); plain pytest stays under 2 minutes, scripts/test.sh runs it
@pytest.mark.slow
def test_truncate_last_segment_at_every_offset(template: tuple[Path, list], scratch: Path,
                                               assert_queues_match_log: Callable) -> None:
    source, records = template
    last_segment = sorted((source / files.COMMITLOG_DIR).iterdir())[-1]
    last_base = int(last_segment.name[:20])
    cuts = _cut_points(records, last_base, last_segment.stat().st_size)
    torn_seen = 0
    # The store alone (no groups or timer index): they play no part in the log's recovery.
    only_store = shutil.ignore_patterns(files.GROUPS_DIR, files.TIMER_DIR, files.LOCK)
    for cut in cuts:
        data = scratch / f"cut{cut}"
        shutil.copytree(source, data, ignore=only_store)
        os.truncate(data / files.COMMITLOG_DIR / last_segment.name, cut)
        before = check_data_dir(data)
        cut_position = last_base + cut - SEGMENT_HEADER_SIZE
        on_boundary = any(r.position + r.size == cut_position for r in records)
        checkpoint = read_checkpoint(data / files.CHECKPOINT)
        assert checkpoint is not None
        if cut_position < checkpoint:
            # Below the checkpoint (the clean-close template): acknowledged records are gone, a
            # problem whether or not the cut falls on a record boundary; a restart still cuts it.
            assert any(f"below the checkpoint {checkpoint}" in p for p in before.problems), (cut, before.problems)
            torn_seen += not on_boundary
        elif not on_boundary:
            assert any("torn tail" in r for r in before.repairs) and not before.problems, (cut, before.problems)
            torn_seen += 1
        _reopen_and_verify(data, records, cut_position, assert_queues_match_log)
        shutil.rmtree(data)
    assert torn_seen == len(cuts) - (LAST_RECORDS + 1)  # the cut range holds 4 record boundaries


@pytest.mark.slow
def test_torn_tail_then_the_whole_broker_reopens(brokers: SimulatedBrokers, template: tuple[Path, list], tmp_path: Path,
                                                 assert_queues_match_log: Callable) -> None:
    """A few cuts through the full broker: timer index, groups and topics recover with the log."""
    source, records = template
    last_segment = sorted((source / files.COMMITLOG_DIR).iterdir())[-1]
    last_base = int(last_segment.name[:20])
    cuts = _cut_points(records, last_base, last_segment.stat().st_size)
    for cut in (cuts[0] + 1, cuts[0] + 40, cuts[len(cuts) // 2], cuts[-1] - 1):
        data = tmp_path / f"cut{cut}"
        shutil.copytree(source, data)
        os.truncate(data / files.COMMITLOG_DIR / last_segment.name, cut)
        cut_position = last_base + cut - SEGMENT_HEADER_SIZE
        kept = [r for r in records if r.position + r.size <= cut_position]

        async def body(data: Path = data, kept: list[StoredMessage] = kept) -> None:
            config = Config(data_dir=data, segment_size_bytes=2048, max_message_size_bytes=1024,
                            default_queue_count=2)
            async with await brokers.open(config) as broker:
                assert broker.open_report.log.truncated_bytes > 0
                await broker.send(OutgoingMessage("orders", b"new", message_id="new"))
                seen = []
                for topic in ("orders", "audit"):
                    for qid in range(2):
                        seen += [m.message_id for m in await broker.read(topic, qid, 0, 1000)]
                assert sorted(seen) == sorted([*(r.message_id for r in kept), "new"])
                got = await broker.receive("g", "orders", batch_size=64)
                got += await broker.receive("g", "orders", batch_size=64)
                assert sorted(m.message.message_id for m in got) == sorted(
                    [r.message_id for r in kept if r.topic == "orders"] + ["new"])
                assert_queues_match_log(broker.store)

        asyncio.run(body())
        result = check_data_dir(data)
        assert result.ok, result.problems


def test_zero_filled_tail_is_truncated(template: tuple[Path, list], tmp_path: Path,
                                       assert_queues_match_log: Callable) -> None:
    """A crash can leave a file longer than its data, the rest zeros (size updated, blocks not)."""
    source, records = template
    data = tmp_path / "zeros"
    shutil.copytree(source, data)
    last_segment = sorted((data / files.COMMITLOG_DIR).iterdir())[-1]
    with open(last_segment, "ab") as f:
        f.write(bytes(5000))
    end = records[-1].position + records[-1].size
    store, report = MessageStore.open(Config(data_dir=data, segment_size_bytes=2048,
                                             max_message_size_bytes=1024, default_queue_count=2))
    try:
        assert report.log.truncated_bytes == 5000
        assert store.log.end_position == end
        assert assert_queues_match_log(store) == len(records)
    finally:
        store.close()
    assert check_data_dir(data).ok
