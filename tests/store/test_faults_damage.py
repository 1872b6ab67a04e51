"""Damaged and restored files: quarantined and reported, never a silent cut, never a crash loop.

Faults are real bytes on disk: a byte flipped inside a record of the last segment, inside an
older segment, inside a pending timer; files restored from copies taken at different moments; three
bytes flipped anywhere in a copy of a data directory. After each, the broker opens, says what it
lost, and serves everything else; `chronoq check` tells a torn tail from damage.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.client.testing import free_port
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, Config
from chronoq.model import SYS_TIMER_OUT_MS, OutgoingMessage, StoredMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir
from tests.support.brokers import open_broker
from tests.support.timers import run_without_cycle_collector

START_MS = 1_800_000_000_000


def _config(data: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {"segment_size_bytes": 1 << 20, "max_message_size_bytes": 2048,
                                   "default_queue_count": 1, **overrides}
    return Config(data_dir=data, **settings)  # type: ignore[arg-type]


async def _open(data: Path, clock: FakeClock | None = None, **overrides: object) -> Broker:
    return await open_broker(_config(data, **overrides), clock=clock or FakeClock(START_MS), background=False)


async def _drain(broker: Broker, topic: str, group: str = "g") -> list[StoredMessage]:
    out: list[StoredMessage] = []
    while True:
        got = await broker.receive(group, topic, batch_size=64)
        if not got:
            return out
        for r in got:
            await broker.ack(group, topic, r.receipt_handle)
            out.append(r.message)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def _segment_offset(data: Path, position: int) -> tuple[Path, int]:
    """(segment file, byte offset in it) of log `position`."""
    segments = sorted((data / files.COMMITLOG_DIR).glob("*" + files.SEGMENT_SUFFIX))
    base_path = max((p for p in segments if int(p.name[:20]) <= position), key=lambda p: int(p.name[:20]))
    return base_path, position - int(base_path.name[:20]) + 24


# --- a flipped byte inside the last segment ---------------------------------------------------


def test_a_flipped_byte_in_the_last_segment_quarantines_one_record_and_keeps_the_rest(tmp_path: Path) -> None:
    async def body() -> None:
        live, data = tmp_path / "live", tmp_path / "data"
        broker = await _open(live)
        sent = [await broker.send(OutgoingMessage("t", f"body-{i}".encode() * 5, message_id=f"m{i:02d}"))
                for i in range(50)]
        # What a SIGKILL leaves: every record acknowledged (fsynced), the checkpoint behind them,
        # so recovery walks the last segment from its start.
        shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))
        await broker.close()
        victim = sent[9]  # record 10 of 50
        segment, offset = _segment_offset(data, victim.position)
        _flip(segment, offset + 100)  # inside the body: the CRC32C catches it
        report = check_data_dir(data)
        assert report.damaged and not report.repairs, (report.problems, report.repairs)
        assert "valid records follow" in report.problems[0]
        assert "torn tail" not in " ".join(report.problems)

        broker = await _open(data)
        try:
            damage = broker.store.log.damage.ranges()
            assert [(d.start, d.end) for d in damage] == [(victim.position, sent[10].position)]
            got = [m.message_id for m in await _drain(broker, "t")]
            assert got == [s.message_id for s in sent if s is not victim], "records after the damage were cut"
            assert broker.stats()["commitlog"]["damaged_ranges"] == 1
            # The group goes on with new messages (nothing was cut, no offset points past the end).
            new = await broker.send(OutgoingMessage("t", b"after", message_id="new"))
            assert [m.message_id for m in await _drain(broker, "t")] == [new.message_id]
        finally:
            await broker.close()

    asyncio.run(body())


@pytest.mark.slow
def test_a_torn_tail_is_still_truncated_and_check_says_repairable(tmp_path: Path) -> None:
    async def body() -> None:
        live, data = tmp_path / "live", tmp_path / "data"
        broker = await _open(live)
        sent = [await broker.send(OutgoingMessage("t", b"x" * 100, message_id=f"m{i}")) for i in range(4)]
        broker.store.checkpoint()
        # The last record past the checkpoint: a torn write there was never acknowledged. (Cut
        # below the checkpoint, it was: tests/store/test_faults_async_power_loss.py.)
        sent.append(await broker.send(OutgoingMessage("t", b"x" * 100, message_id="m4")))
        shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))
        await broker.close()
        segment, offset = _segment_offset(data, sent[-1].position)
        with open(segment, "r+b") as f:
            f.truncate(offset + 50)  # the last record cut short: a torn write
        report = check_data_dir(data)
        assert not report.damaged and "torn tail" in report.repairs[0], report.problems
        assert _check_cli(data) == 3
        broker = await _open(data)
        try:
            assert broker.open_report.log.truncated_at == sent[-1].position
            assert not broker.store.log.damage.ranges()
            assert [m.message_id for m in await _drain(broker, "t")] == [s.message_id for s in sent[:-1]]
        finally:
            await broker.close()
        assert check_data_dir(data).ok and _check_cli(data) == 0

    asyncio.run(body())


def test_a_whole_last_record_with_a_bad_checksum_is_damage_not_a_torn_tail(tmp_path: Path) -> None:
    """Nothing valid follows, but the record is whole: it may have been acknowledged. It is
    reported as damage (check exits 1), not silently cut."""

    async def body() -> None:
        live, data = tmp_path / "live", tmp_path / "data"
        broker = await _open(live)
        sent = [await broker.send(OutgoingMessage("t", b"y" * 100, message_id=f"m{i}")) for i in range(5)]
        shutil.copytree(live, data, ignore=shutil.ignore_patterns(files.LOCK))  # checkpoint behind: recovery walks it
        await broker.close()
        segment, offset = _segment_offset(data, sent[-1].position)
        _flip(segment, offset + 90)
        assert check_data_dir(data).damaged and _check_cli(data) == 1
        broker = await _open(data)
        try:
            assert broker.open_report.log.truncated_at is None
            assert [d.start for d in broker.open_report.log.damaged] == [sent[-1].position]
            assert [m.message_id for m in await _drain(broker, "t")] == [s.message_id for s in sent[:-1]]
            await broker.send(OutgoingMessage("t", b"next", message_id="next"))
            assert [m.message_id for m in await _drain(broker, "t")] == ["next"]
        finally:
            await broker.close()

    asyncio.run(body())


def _check_cli(data: Path) -> int:
    return subprocess.run([str(Path(sys.executable).with_name("chronoq")), "check", str(data)],
                          capture_output=True, timeout=60).returncode


# --- offsets restored from a later copy than the log ------------------------------------------


def test_group_offsets_ahead_of_their_queue_are_clamped_so_new_messages_are_not_skipped(tmp_path: Path) -> None:
    async def body() -> None:
        data, early = tmp_path / "data", tmp_path / "early"
        broker = await _open(data)
        for i in range(5):
            await broker.send(OutgoingMessage("t", b"a", message_id=f"a{i}"))
        broker.store.checkpoint()
        shutil.copytree(data, early, ignore=shutil.ignore_patterns(files.LOCK))  # the log as of 5 messages
        for i in range(5):
            await broker.send(OutgoingMessage("t", b"b", message_id=f"b{i}"))
        assert len(await _drain(broker, "t")) == 10  # the group's offset is now 10
        await broker.close()
        # Restore: the log from the early copy, the consumer-group store from the late one.
        shutil.rmtree(early / files.GROUPS_DIR)
        shutil.copytree(data / files.GROUPS_DIR, early / files.GROUPS_DIR)
        broker = await _open(early)
        try:
            assert broker.groups.offset("g", "t", 0) == 5
            new = [await broker.send(OutgoingMessage("t", b"c", message_id=f"c{i}")) for i in range(3)]
            assert [m.message_id for m in await _drain(broker, "t")] == [r.message_id for r in new]
        finally:
            await broker.close()

    asyncio.run(body())


# --- damage outside the last segment ----------------------------------------------------------


def test_a_damaged_record_in_an_older_segment_is_skipped_not_fatal_to_the_queue(tmp_path: Path) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        broker = await _open(data, segment_size_bytes=4096)
        sent = [await broker.send(OutgoingMessage("t", b"z" * 200, message_id=f"m{i:02d}")) for i in range(40)]
        assert len(broker.store.log.segments()) >= 3
        await broker.close()
        victim = sent[3]
        segment, offset = _segment_offset(data, victim.position)
        assert segment.name != sorted((data / files.COMMITLOG_DIR).iterdir())[-1].name
        _flip(segment, offset + 150)
        broker = await _open(data, segment_size_bytes=4096)
        try:
            got = [m.message_id for m in await _drain(broker, "t")]
            assert got == [s.message_id for s in sent if s is not victim]
            assert [d.start for d in broker.store.log.damage.ranges()] == [victim.position]
            assert broker.store.skipped_damaged == 1
            later = await broker.send(OutgoingMessage("t", b"later", message_id="later"))
            assert [m.message_id for m in await _drain(broker, "t")] == [later.message_id]
        finally:
            await broker.close()

    asyncio.run(body())


def test_a_damaged_pending_timer_is_marked_damaged_and_the_broker_keeps_firing(tmp_path: Path) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        clock = FakeClock(START_MS)
        broker = await _open(data, clock, segment_size_bytes=4096)
        timers = [await broker.send(OutgoingMessage("t", b"tick" * 40, message_id=f"t{i}", delay_ms=10_000 + i))
                  for i in range(5)]
        for i in range(30):  # roll a few segments past the timers
            await broker.send(OutgoingMessage("other", b"o" * 200, message_id=f"o{i}"))
        await broker.close()
        victim = timers[2]
        segment, offset = _segment_offset(data, victim.position)
        _flip(segment, offset + 120)
        for restart in range(2):  # and again: no crash loop
            broker = await _open(data, clock, segment_size_bytes=4096)
            try:
                clock.advance(20_000)
                fired = await broker.run_due()
                assert fired == (5 if restart == 0 else 0)  # 4 fired + 1 marked damaged, then nothing
                [status] = broker.query(victim.message_id, "t")
                assert status.state is TimerState.DAMAGED
                got = await _drain(broker, "t")
                if restart == 0:
                    assert sorted(m.message_id for m in got) == sorted(t.message_id for t in timers if t is not victim)
                    assert all(m.store_ms >= int(m.system_properties[SYS_TIMER_OUT_MS]) for m in got)
                    assert broker.stats()["timer"]["damaged"] == 1
                else:
                    assert got == []
            finally:
                await broker.close()

    asyncio.run(body())


# --- three flipped bytes anywhere -------------------------------------------------------------


async def _template(data: Path, clock: FakeClock) -> None:
    """A data directory with something in every file: normal and timer messages over several
    segments, fired and pending timers, a delay-level message, a group mid-way through a topic."""
    broker = await _open(data, clock, segment_size_bytes=8192, default_queue_count=2)
    try:
        for i in range(60):
            await broker.send(OutgoingMessage("orders", f"order-{i}".encode() * 8, message_id=f"o{i}"))
        for i in range(20):
            await broker.send(OutgoingMessage("later", b"t" * 64, message_id=f"t{i}", delay_ms=1_000 * (i + 1)))
        await broker.send(OutgoingMessage("later", b"lvl", message_id="lvl", delay_level=2))
        got = await broker.receive("g", "orders", batch_size=20)
        for r in got[:15]:
            await broker.ack("g", "orders", r.receipt_handle)
        clock.advance(10_500)
        await broker.run_due()
        broker.store.checkpoint()
    finally:
        await broker.close()


@pytest.mark.parametrize("seed", range(12))
def test_three_flipped_bytes_anywhere_never_stop_the_broker(tmp_path: Path, seed: int) -> None:
    """A copy of a data directory with three bytes flipped anywhere (log, queues, checkpoint,
    topic table, either RocksDB): the broker opens, takes and delivers new messages, fires what
    is due (never early), and opens again after that."""

    async def body() -> None:
        clock = FakeClock(START_MS)
        template, data = tmp_path / "template", tmp_path / "data"
        await _template(template, clock)
        shutil.copytree(template, data)
        rng = random.Random(seed)
        candidates = [p for p in sorted(data.rglob("*")) if p.is_file() and p.stat().st_size and p.name != files.LOCK]
        flipped = []
        for _ in range(3):
            path = rng.choice(candidates)
            offset = rng.randrange(path.stat().st_size)
            _flip(path, offset)
            flipped.append(f"{path.relative_to(data)}@{offset}")
        for restart in range(2):
            broker = await _open(data, clock, segment_size_bytes=8192, default_queue_count=2)
            try:
                r = await broker.send(OutgoingMessage("fresh", b"new", message_id=f"fresh{restart}"))
                got = await _drain(broker, "fresh", group=f"g{restart}")
                assert r.message_id in [m.message_id for m in got], flipped
                clock.advance(DAY_MS)
                await broker.run_due()
                for m in await _drain(broker, "later", group="check"):
                    assert m.store_ms >= int(m.system_properties[SYS_TIMER_OUT_MS]), (flipped, m.message_id)
                await _drain(broker, "orders")
            finally:
                await broker.close()

    asyncio.run(body())


# --- the small files and the RocksDB stores ---------------------------------------------------


def test_a_damaged_topic_table_is_rebuilt_from_the_queues_and_the_log(tmp_path: Path) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        broker = await _open(data)
        await broker.create_topic("wide", 3)
        await broker.send(OutgoingMessage("wide", b"w", message_id="w", queue_id=2))
        await broker.send(OutgoingMessage("auto", b"a", message_id="a"))
        await broker.close()
        _flip(data / files.TOPICS, 20)
        assert check_data_dir(data).damaged
        broker = await _open(data)
        try:
            assert broker.open_report.topics_damaged and "rebuilt" in broker.open_report.topics_damaged
            assert broker.get_topic("wide").queue_count == 3 and broker.get_topic("auto").queue_count == 1
            assert [m.message_id for m in await _drain(broker, "wide")] == ["w"]
            assert list(data.glob(files.TOPICS + ".damaged-*")), "the damaged table is kept for inspection"
        finally:
            await broker.close()
        assert not check_data_dir(data).damaged

    asyncio.run(body())


def test_a_damaged_group_store_is_moved_aside_and_groups_start_over_losing_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        broker = await _open(data)
        sent = [await broker.send(OutgoingMessage("t", b"m", message_id=f"m{i}")) for i in range(6)]
        got = await broker.receive("g", "t", batch_size=4)  # 4 in flight, unacked
        await broker.ack("g", "t", got[0].receipt_handle)
        await broker.close()
        current = data / files.GROUPS_DIR / "CURRENT"
        current.write_text("MANIFEST-999999\n")  # points at a manifest that is not there
        broker = await _open(data)
        try:
            assert broker.open_report.groups_reset and "damaged" in broker.open_report.groups_reset
            # At least once: every retained message comes again, the acked one included.
            assert sorted(m.message_id for m in await _drain(broker, "t")) == sorted(s.message_id for s in sent)
        finally:
            await broker.close()
        assert list(data.glob(files.GROUPS_DIR + ".damaged-*"))

    asyncio.run(body())


def test_a_timer_index_that_fails_while_running_is_rebuilt_and_nothing_fires_twice(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        broker = await open_broker(_config(data), clock=clock, background=True)
        try:
            first = await broker.send(OutgoingMessage("t", b"1", message_id="one", delay_ms=1_000))
            clock.advance(1_000)
            for _ in range(100):
                if broker.query("one", "t")[0].state is TimerState.DELIVERED:
                    break
                await asyncio.sleep(0.01)
            # The index starts failing as a damaged RocksDB block would.
            real_due = broker.timer.engine.due_timers  # what a fire step reads

            def broken(now_ms: int, limit: int) -> list:  # type: ignore[type-arg]
                from chronoq.errors import TimerIndexCorrupt
                raise TimerIndexCorrupt(data / files.TIMER_DIR, "Corruption: block checksum mismatch (injected)")

            broker.timer.engine.due_timers = broken  # type: ignore[method-assign]
            second = await broker.send(OutgoingMessage("t", b"2", message_id="two", delay_ms=1_000))
            clock.advance(1_000)
            for _ in range(200):
                statuses = broker.query("two", "t")
                if broker.index_rebuilds and statuses and statuses[0].state is TimerState.DELIVERED:
                    break
                await asyncio.sleep(0.01)
            assert broker.index_rebuilds == 1 and broker.timer.engine.due_timers is not broken
            assert broker.fatal is None
            got = [m.message_id for m in await _drain(broker, "t")]
            assert sorted(got) == sorted([first.message_id, second.message_id])  # each once
            # Every part of the timer side reads the rebuilt index, the delay-level queues too
            # (they kept the closed one, and the next level message was never fired).
            await broker.send(OutgoingMessage("t", b"3", message_id="three", delay_level=1))
            clock.advance(broker.timer.levels.delay_ms(1))
            for _ in range(200):
                if got := await _drain(broker, "t"):
                    break
                await asyncio.sleep(0.01)
            assert [m.message_id for m in got] == ["three"]
            assert broker.fatal is None
            del real_due
        finally:
            await broker.close()

    asyncio.run(body())


def test_a_timer_index_damaged_inside_a_dispatch_write_is_rebuilt(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The damage is found inside the index's own write (as a malformed value read back from
    RocksDB is: `IndexTxn.finish` raises it here), so the error's traceback holds that write's
    frames and the RocksDB handle in them. The loop used to keep the error itself until the
    rebuild, whose reopen then found the index "in use by another broker" (its own old handle)
    and the broker stopped. The cyclic collector is off: no collection may hide a kept handle."""
    from chronoq.timer import index_txn
    from chronoq.timer.index_codec import MalformedValue

    real_finish = index_txn.IndexTxn.finish
    calls = []

    def finish(self: index_txn.IndexTxn, indexed_position: int) -> None:
        calls.append(indexed_position)
        if len(calls) == 1:
            raise MalformedValue("a pending count would go negative (injected)")
        real_finish(self, indexed_position)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await open_broker(_config(tmp_path / "data"), clock=clock, background=True)
        try:
            monkeypatch.setattr(index_txn.IndexTxn, "finish", finish)
            await broker.send(OutgoingMessage("t", b"1", message_id="one", delay_ms=1_000))
            clock.advance(1_000)
            for _ in range(300):
                if broker.fatal is not None or (broker.index_rebuilds and await _drain(broker, "t")):
                    break
                await asyncio.sleep(0.01)
            assert broker.fatal is None, broker.fatal
            assert broker.index_rebuilds == 1
            assert broker.query("one", "t")[0].state is TimerState.DELIVERED
        finally:
            await broker.close()

    run_without_cycle_collector(body())


def test_a_full_disk_while_a_damaged_timer_is_marked_does_not_stop_the_broker(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two faults at once: a due timer's record is damaged (a flipped byte) and the index write
    that marks it damaged finds no space (RocksDB's ENOSPC error, raised at the index transaction:
    a real full disk cannot be made to fail exactly that one write). The loop waits
    `disk_full_retry_ms`, then tries again. It used to wait inside its `except DiskFull` block, so
    the error's traceback kept the failed write's RocksDB handle, and a send meanwhile, whose
    dispatch reopens the index, found it "in use by another broker" and stopped the broker."""
    from chronoq.timer import index_txn

    real_damage = index_txn.IndexTxn.damage
    failures = [1]

    def damage(self: index_txn.IndexTxn, position: int, damaged_ms: int) -> None:
        if failures:
            failures.pop()
            raise Exception("IO error: No space left on device: While appending to file: 000004.log")
        real_damage(self, position, damaged_ms)

    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        broker = await open_broker(_config(data, read_cache_bytes=0, disk_full_retry_ms=1_000), clock=clock,
                                   background=True)
        try:
            one = await broker.send(OutgoingMessage("t", b"x" * 100, message_id="one", delay_ms=1_000))
            segment, offset = _segment_offset(data, one.position)
            _flip(segment, offset + 100)  # inside the body: the CRC32C catches it
            monkeypatch.setattr(index_txn.IndexTxn, "damage", damage)
            clock.advance(1_000)
            for _ in range(300):
                if not failures:
                    break
                await asyncio.sleep(0.01)
            assert not failures, "the loop never tried to mark the damaged timer"
            await asyncio.sleep(0.05)  # the loop is in its wait now
            two = await broker.send(OutgoingMessage("t", b"2", message_id="two"))
            assert broker.fatal is None, broker.fatal
            clock.advance(1_000)  # the loop's wait for a full disk is on the clock
            for _ in range(500):  # the loop's next try marks it (after its 1 s wait)
                if broker.query("one", "t")[0].state is TimerState.DAMAGED:
                    break
                await asyncio.sleep(0.01)
            assert broker.query("one", "t")[0].state is TimerState.DAMAGED
            assert [m.message_id for m in await _drain(broker, "t")] == [two.message_id]
            assert broker.fatal is None
        finally:
            await broker.close()

    run_without_cycle_collector(body())


def test_a_timer_index_found_damaged_during_the_fire_gap_is_rebuilt_before_the_next_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index is found damaged while the loop waits out its fire gap: the dispatch that found
    it (a fired copy's, from a FireTimers call) could not mark that timer fired, so the index
    says it is pending. The step at the gap's end fired from that stale index, a second time;
    it must rebuild the index first. Meanwhile a call that would act on the index is refused."""
    from chronoq.errors import TimerIndexRebuilding
    from chronoq.timer import index_txn
    from chronoq.timer.index_codec import MalformedValue

    real_finish = index_txn.IndexTxn.finish
    armed = [False]

    def finish(self: index_txn.IndexTxn, indexed_position: int) -> None:
        if armed[0]:
            armed[0] = False
            raise MalformedValue("a pending count would go negative (injected)")
        real_finish(self, indexed_position)

    async def body() -> None:
        clock = FakeClock(START_MS)
        broker = await open_broker(_config(tmp_path / "data", timer_fire_gap_ms=5), clock=clock, background=True)
        try:
            monkeypatch.setattr(index_txn.IndexTxn, "finish", finish)
            await broker.send(OutgoingMessage("t", b"a", message_id="a", delay_ms=1_000))
            b = await broker.send(OutgoingMessage("t", b"b", message_id="b", delay_ms=1_002))
            clock.advance(1_000)  # "a" fires; the loop waits out the gap until +1_005
            for _ in range(300):
                if broker.query("a", "t")[0].state is TimerState.DELIVERED:
                    break
                await asyncio.sleep(0.01)
            clock.advance(2)
            # A new timer due within the gap wakes the loop, which then sleeps out the rest of
            # the gap (the damage below cannot wake it from that sleep).
            await broker.send(OutgoingMessage("t", b"c", message_id="c", delay_ms=1))
            await asyncio.sleep(0.05)
            armed[0] = True  # "b"'s fired copy is durable, its index write finds the damage
            assert await broker.fire_timers([b.position]) == (1, 0)
            assert broker.timer.index_damaged is not None and broker.index_rebuilds == 0
            with pytest.raises(TimerIndexRebuilding):
                await broker.fire_timers([b.position])
            clock.advance(3)  # the gap ends
            for _ in range(300):
                if broker.index_rebuilds:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert broker.index_rebuilds == 1 and broker.fatal is None
            assert broker.query("b", "t")[0].state is TimerState.DELIVERED
            for _ in range(300):
                if broker.query("c", "t")[0].state is TimerState.DELIVERED:
                    break
                await asyncio.sleep(0.01)
            assert sorted(m.message_id for m in await _drain(broker, "t")) == ["a", "b", "c"]  # each once
        finally:
            await broker.close()

    run_without_cycle_collector(body())


@pytest.mark.slow
def test_chronoq_serve_on_a_damaged_copy_stays_up_and_serves(tmp_path: Path) -> None:
    """As a new user would: copy a data directory, flip bytes in a pending timer's record and in
    an older segment, start `chronoq serve` on the copy. It used to exit within a second of every
    start (the timer task died on the damaged timer). It must stay up and serve."""
    import time

    from chronoq.client import Consumer, Producer

    async def build(data: Path) -> tuple[list[int], int]:
        clock = FakeClock(int(time.time() * 1000) - 60_000)  # timers due a minute ago in real time
        broker = await _open(data, clock, segment_size_bytes=8192)
        try:
            timers = [await broker.send(OutgoingMessage("later", b"t" * 300, message_id=f"t{i}", delay_ms=1_000))
                      for i in range(5)]
            normal = [await broker.send(OutgoingMessage("orders", b"n" * 300, message_id=f"n{i}")) for i in range(40)]
            return [timers[2].position, normal[3].position], len(normal)
        finally:
            await broker.close()

    template, data = tmp_path / "template", tmp_path / "data"
    victims, n_normal = asyncio.run(build(template))
    shutil.copytree(template, data)
    for position in victims:
        segment, offset = _segment_offset(data, position)
        _flip(segment, offset + 120)
    port = free_port()
    env_config = tmp_path / "chronoq.toml"
    env_config.write_text('segment_size_bytes = 8192\ndefault_queue_count = 1\nmax_message_size_bytes = 2048\n')
    proc = subprocess.Popen([str(Path(sys.executable).with_name("chronoq")), "serve", "--data-dir", str(data),
                             "--port", str(port), "--config", str(env_config), "--log-level", "ERROR"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert b"serving on" in proc.stdout.readline(), proc.stderr.read() if proc.stderr else b""
        time.sleep(3)  # the timers are due: the timer loop meets the damaged one
        assert proc.poll() is None, f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}"
        with Producer(f"127.0.0.1:{port}") as producer:
            producer.send("orders", b"after", message_id="after-restart")
        got: set[str] = set()
        with Consumer("g", "orders", server=f"127.0.0.1:{port}") as consumer:
            for _ in range(20):
                batch = consumer.receive(32, wait=200)
                for m in batch:
                    got.add(m.message_id)
                    consumer.ack(m)
                if "after-restart" in got and len(got) >= n_normal:
                    break
        assert "after-restart" in got and len(got) == n_normal, sorted(got)  # 39 old + 1 new
        with Consumer("g", "later", server=f"127.0.0.1:{port}") as consumer:
            fired = {m.message_id for m in consumer.receive(32, wait=500)}
        assert fired == {"t0", "t1", "t3", "t4"}, fired
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_check_reads_the_rocksdb_stores_and_writes_nothing(tmp_path: Path) -> None:
    """`chronoq check` never looked at groups/ or timer/: a consumer-group store a restart would
    move aside (every group receiving its acknowledged messages again) was reported OK."""
    data = tmp_path / "data"

    async def build() -> None:
        broker = await _open(data)
        await broker.send(OutgoingMessage("t", b"x", message_id="m"))
        await broker.send(OutgoingMessage("t", b"later", message_id="timer", delay_ms=60_000))
        got = await broker.receive("g", "t", batch_size=4)
        await broker.ack("g", "t", got[0].receipt_handle)
        await broker.close()

    asyncio.run(build())

    def listing() -> list[tuple[str, int]]:
        return sorted((str(p.relative_to(data)), p.stat().st_size) for p in data.rglob("*") if p.is_file())

    before = listing()
    clean = check_data_dir(data)
    assert clean.ok and not clean.problems and not clean.repairs, (clean.problems, clean.repairs)
    assert listing() == before  # read-only: RocksDB writes nothing when opened read-only
    (data / files.TIMER_DIR / "CURRENT").write_text("MANIFEST-999999\n")
    timer_damaged = check_data_dir(data)
    assert not timer_damaged.problems and any("timer index cannot be read" in r for r in timer_damaged.repairs)
    (data / files.GROUPS_DIR / "CURRENT").write_text("MANIFEST-999999\n")
    groups_damaged = check_data_dir(data)
    assert any("consumer-group store cannot be read" in p and "acknowledged messages included" in p
               for p in groups_damaged.problems)
