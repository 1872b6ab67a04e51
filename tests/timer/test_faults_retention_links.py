"""Faults that meet retention while timers fire by link records (design.md, "Roll", "Retention of
fired timers", "A full disk", "Consume queues and recovery").

A retention step rolls the pending timers in segments past retention forward (re-appends them),
checkpoints, deletes whole segments, then forgets the link records it deleted. A full disk can
meet any of those writes. Whatever it meets, the step must delete nothing it must keep (a pending
timer's record, a record a live link names, a message within retention), leave no half state a
timer could be lost, fired twice or fired early by (a roll copy written without its deletion is
fine: the next step finds nothing left to roll), and once space returns the next step must go on
and free the disk. The disk is a real tmpfs (`tests/support/disks.py`), filled by a real filler
file: before the step (the roll's first append meets it), or from a dispatch listener at the
moment a roll chunk is dispatched (the roll's next append, or the checkpoint after the roll,
meets it); or the timer index's own tmpfs is full, so the roll's dispatch is held back.

After retention has deleted early segments (timer records among them whose link records are
still retained, past retention themselves), a consume queue damaged or removed is rebuilt from
the log at the next start: it must deliver what the undamaged queue does, entry by entry, and
`chronoq check` must say what a restart does about it. Faults are real files removed or bytes
flipped in a closed data directory. Time is a `FakeClock`; retention and firing run when the
test calls them.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, HOUR_MS, MINUTE_MS
from chronoq.errors import DiskFull
from chronoq.model import SYS_TIMER_ROLLED_FROM, TIMER_TOPIC, OutgoingMessage, StoredMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir, format_report
from tests.support.brokers import simulated_broker
from tests.support.disks import PAGE, Disk, MiB
from tests.support.timers import drain, run_without_cycle_collector

pytestmark = pytest.mark.usefixtures("each_timer_engine")

START_MS = 1_700_000_000_000
FAR_DUE_MS = START_MS + 30 * DAY_MS
ROLL_BATCH = 8
SETTINGS: dict[str, object] = {
    "retention_ms": HOUR_MS, "segment_size_bytes": 64 * 1024, "max_message_size_bytes": 16 * 1024,
    "timer_roll_batch": ROLL_BATCH, "disk_min_free_bytes": 0, "disk_reserve_file_bytes": 1 * MiB,
    "disk_full_retry_ms": 20, "default_queue_count": 2}
"""An hour's retention, 64 KiB segments, a roll of 20 timers in three chunks of 8; the broker's own
writes run into the full disk itself (no send reserve)."""


@dataclass
class World:
    """What the broker holds two hours in: `far` timers (due in 30 days) whose records lie in
    segments past retention, so the roll must carry them; `late` timers fired 100 minutes in by
    link records inside retention, naming timer records past it (retention must keep those);
    `kept` messages sent 90 minutes in (within retention), never received; `soon` timers fired
    10 minutes in, their link records past retention."""

    far: set[str]
    late: set[str]
    kept: set[str]
    soon: set[str]
    far_positions: dict[str, int]


async def _fillers(b: Broker, tag: str, n: int = 80) -> None:
    for i in range(0, n, 20):
        await b.send_batch([OutgoingMessage("filler", b"f" * 1000, message_id=f"{tag}-{j}") for j in range(i, i + 20)])


async def _two_hours(b: Broker, clock: FakeClock, extra: tuple[OutgoingMessage, ...] = ()) -> World:
    """Build the `World`, `extra` sent among the far timers, one at the head of each roll chunk;
    the clock ends two hours in."""
    await b.create_topic("orders", 2)
    far = {f"far-{i:02d}" for i in range(20)}
    first = [OutgoingMessage("orders", b"F" * 1500, message_id=m, deliver_at_ms=FAR_DUE_MS, properties={"k": m},
                             tag="far") for m in sorted(far)]
    for i, msg in enumerate(extra):
        first.insert(i * ROLL_BATCH, msg)
    await b.send_batch(first)
    soon = {f"soon-{i}" for i in range(10)}
    await b.send_batch([OutgoingMessage("orders", b"S" * 300, message_id=m, delay_ms=10 * MINUTE_MS)
                        for m in sorted(soon)])
    await _fillers(b, "t0")
    clock.advance(5 * MINUTE_MS)
    late = {f"late-{i}" for i in range(10)}
    await b.send_batch([OutgoingMessage("orders", b"L" * 300, message_id=m, delay_ms=95 * MINUTE_MS)
                        for m in sorted(late)])
    await _fillers(b, "t5")
    clock.advance(5 * MINUTE_MS)
    assert await b.run_due() == 10  # the soon timers: link records 10 minutes in
    assert len(await drain(b, "orders", "g")) == 10
    await _fillers(b, "t10")
    clock.advance(80 * MINUTE_MS)
    kept = {f"kept-{i}" for i in range(30)}
    await b.send_batch([OutgoingMessage("orders", b"K" * 300, message_id=m) for m in sorted(kept)])
    await _fillers(b, "t90")
    clock.advance(10 * MINUTE_MS)
    assert await b.run_due() == 10  # the late timers: live link records naming records 95 minutes old
    await _fillers(b, "t100")
    clock.advance(20 * MINUTE_MS)  # two hours in: the first two segments' worth is past retention
    positions = {m: b.query(m, "orders")[0].position for m in far}
    return World(far, late, kept, soon, positions)


def _log_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / files.COMMITLOG_DIR).iterdir())


def _roll_copies(b: Broker) -> Counter[str]:
    """Roll copies in the retained log, by message id."""
    return Counter(m.message_id for m in b.store.scan(b.store.log.start_position)
                   if m.topic == TIMER_TOPIC and SYS_TIMER_ROLLED_FROM in m.system_properties)


def _fill_at_roll_chunk(b: Broker, disk: Disk, chunk: int, leave_bytes: int) -> None:
    """Make the last step of dispatch (after the queues, the timer index and the trace: the long
    polls') fill the disk, all but `leave_bytes`, when the `chunk`-th roll chunk is dispatched:
    its copies are durable and indexed, and the next write the step makes meets a full disk."""
    seen = 0
    wake_long_polls = b.dispatch.long_polls

    class FillAfterLongPolls:
        def arrived(self, batch: list[StoredMessage]) -> None:
            nonlocal seen
            if wake_long_polls is not None:
                wake_long_polls.arrived(batch)
            if any(m.topic == TIMER_TOPIC and SYS_TIMER_ROLLED_FROM in m.system_properties for m in batch):
                seen += 1
                if seen == chunk:
                    disk.fill(leave_bytes)

    b.dispatch.long_polls = FillAfterLongPolls()


@pytest.mark.durable_index("`chronoq check` reads the retention horizon from the index on disk")
@pytest.mark.parametrize("meets", ["the roll's first append", "the roll's second append", "the checkpoint"])
def test_a_retention_step_that_meets_a_full_disk_keeps_every_timer_and_goes_on_when_space_returns(
        mount: Callable[[Path, int], Disk], tmp_path: Path, meets: str) -> None:
    """The fault: the disk fills while a retention step runs, where `meets` says: before the step,
    so the roll's first append (its first chunk of 8 timers) meets ENOSPC; after the first chunk
    is durable, so the second append meets it (a page is left both times: room for a checkpoint,
    none for a chunk); after the last chunk, all of it, so the checkpoint before the deletion
    meets it. What must hold: the step raises DiskFull and deletes no segment; the broker
    stays up; every far timer stays pending at its due time, at its own record or at one roll copy
    (a chunk that reached the log stays rolled); nothing fires, early or at all; with space back
    the next step rolls only what is left (one copy per timer in all), deletes the segments past
    retention and frees the disk; afterwards every message within retention and every message a
    live link fired is delivered, each far timer fires once at its due time, and `chronoq check`
    finds nothing wrong."""
    disk = mount(tmp_path / "fs", 24 * MiB)
    data = disk.root / "data"

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(data, clock, **SETTINGS)
        try:
            world = await _two_hours(b, clock)
            segments = [(s.base, s.end) for s in b.store.log.segments()]
            start, end, log_bytes = b.store.log.start_position, b.store.log.end_position, _log_bytes(data)
            assert await b.store.expired_before(clock.now_ms()) > start, "nothing is past retention"
            # A page left where an append meets the full disk (a roll chunk needs three or more),
            # so a checkpoint would still fit and only the roll's own failure stops the deletion.
            leave = 0 if meets == "the checkpoint" else PAGE
            if meets == "the roll's first append":
                disk.fill(leave)
            else:
                _fill_at_roll_chunk(b, disk, 1 if meets == "the roll's second append" else 3, leave)
            with pytest.raises(DiskFull):
                await b.enforce_retention()
            assert b.fatal is None and b.store.log.failure is None
            # Nothing deleted (nothing freed); what the roll wrote is whole chunks past the old end.
            assert b.store.log.start_position == start, "the step deleted segments"
            assert disk.free() <= leave
            assert [(s.base, s.end) for s in b.store.log.segments()][:len(segments) - 1] == segments[:-1]
            rolled = {m for m in world.far if b.query(m, "orders")[0].position >= end}
            assert len(rolled) == {"the roll's first append": 0, "the roll's second append": 8,
                                   "the checkpoint": 20}[meets]
            assert b.store.log.end_position == end if not rolled else b.store.log.end_position > end
            assert set(_roll_copies(b).values()) <= {1}
            for m in world.far:
                [status] = b.query(m, "orders")
                assert status.state is TimerState.PENDING and status.deliver_at_ms == FAR_DUE_MS
                assert status.position == world.far_positions[m] or m in rolled
            assert await b.run_due() == 0
            assert not list(data.rglob("*.tmp"))

            disk.unfill()
            await b.enforce_retention()
            assert b.store.log.start_position > start, "retention did not go on once space returned"
            assert _log_bytes(data) < log_bytes, "the disk was not freed"
            assert _roll_copies(b) == Counter(dict.fromkeys(world.far, 1)), "a timer was rolled twice, or lost"
            for m in world.far:
                [status] = b.query(m, "orders")
                assert status.state is TimerState.PENDING and status.position >= b.store.log.start_position
            got = await drain(b, "orders", "h")  # a group that never read: what retention kept for it
            assert sorted(m.message_id for m in got) == sorted(world.kept | world.late)
            clock.set(FAR_DUE_MS - 1)
            assert await b.run_due() == 0  # never early
            clock.set(FAR_DUE_MS)
            assert await b.run_due() == len(world.far)
            fired = await drain(b, "orders", "h")
            assert sorted(m.message_id for m in fired) == sorted(world.far)
            assert all(m.store_ms == FAR_DUE_MS and m.body == b"F" * 1500 and m.properties == {"k": m.message_id}
                       for m in fired)
        finally:
            await b.close()
        b = await simulated_broker(data, clock, **SETTINGS)
        try:
            assert await b.run_due() == 0 and await drain(b, "orders", "h") == []  # nothing fires twice
        finally:
            await b.close()
        report = check_data_dir(data)
        assert report.ok, format_report(report, data)

    asyncio.run(body())


async def _until(predicate: Callable[[], bool], timeout_s: float = 5) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.rocksdb_index("the RocksDB index's own writes meet the full disk")
@pytest.mark.slow
def test_a_timer_index_out_of_space_holds_the_roll_and_a_fire_racing_it_fires_once(
        mount: Callable[[Path, int], Disk], tmp_path: Path) -> None:
    """The fault: the timer index's own disk (a tmpfs on `DATA_DIR/timer`) is full when retention
    rolls. A roll chunk reaches the log and its fsync, but its index batch finds no space:
    dispatch is held back and the roll waits; a timer in that chunk falls due meanwhile and fires
    from its old record (the index still says so), its link record held back too. (Which chunk
    meets the full disk depends on the room left in the index's last WAL page, so each chunk
    carries one such `edge` timer.) What must hold: while the index has no room, nothing is
    deleted, the broker stays up and sends are refused; with room back the roll and the fire both
    finish; every edge timer is delivered once (the held one read through its link from its old
    record, which retention keeps while that link is live, deleted once it is past retention);
    the roll copy of the held one is not left pending; each far timer fires once at its due time,
    and nothing fires again after a restart."""
    main = mount(tmp_path / "fs", 24 * MiB)
    data = main.root / "data"
    index_disk = mount(data / files.TIMER_DIR, 4 * MiB)
    edge_due = START_MS + 2 * HOUR_MS + MINUTE_MS  # in the first segment; due while the roll waits
    edges = tuple(OutgoingMessage("orders", b"E" * 300, message_id=f"edge-{i}", deliver_at_ms=edge_due)
                  for i in range(3))

    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await simulated_broker(data, clock, **SETTINGS)
        try:
            world = await _two_hours(b, clock, edges)
            old = {e.message_id: b.query(e.message_id, "orders")[0].position for e in edges}
            start = b.store.log.start_position
            index_disk.fill()
            step = asyncio.ensure_future(b.enforce_retention())
            await _until(lambda: b.store.disk_stats()["dispatch_blocked"] is not None)
            copies = _roll_copies(b)  # in the log: durable, indexed or held back
            [held] = [m for m in old if copies[m] and b.query(m, "orders")[0].position == old[m]]
            clock.set(edge_due)
            fire = asyncio.ensure_future(b.run_due())
            await asyncio.sleep(0.2)
            assert not step.done() and not fire.done()
            assert b.store.log.start_position == start and b.fatal is None
            with pytest.raises(DiskFull):
                await b.send(OutgoingMessage("orders", b"refused", message_id="refused"))

            index_disk.unfill()
            await asyncio.wait_for(step, 5)
            assert await asyncio.wait_for(fire, 5) == len(edges)
            # The held edge's link is live and names its old record in the first segment: kept, and
            # with it the records the soon timers' (expired) links name, so those read too.
            assert b.store.log.start_position == start, "the record a live link names was deleted"
            got = await drain(b, "orders", "h")
            assert sorted(m.message_id for m in got) == sorted(world.kept | world.late | world.soon | set(old))
            assert all(m.store_ms == edge_due and m.body == b"E" * 300 for m in got if m.message_id in old)
            assert b.query(held, "orders")[-1].state is TimerState.DELIVERED
            assert await b.run_due() == 0, "the held edge's roll copy was left pending"

            clock.advance(HOUR_MS + MINUTE_MS)  # the edges' link records past retention too
            await _fillers(b, "later", 200)
            await b.enforce_retention()
            assert b.store.log.start_position > old[held], "retention did not go on"
            assert _roll_copies(b) == Counter(dict.fromkeys(world.far, 1))  # rolled again, the old copies gone
            clock.set(FAR_DUE_MS)
            assert await b.run_due() == len(world.far)
            assert sorted(m.message_id for m in await drain(b, "orders", "h")) == sorted(world.far)
        finally:
            await b.close()
        b = await simulated_broker(data, clock, **SETTINGS)
        try:
            assert await b.run_due() == 0 and await drain(b, "orders", "h") == []
        finally:
            await b.close()
        report = check_data_dir(data)
        assert report.ok, format_report(report, data)

    run_without_cycle_collector(body())


# --- consume queues rebuilt after retention ---------------------------------------------------------

QUEUE_SETTINGS: dict[str, object] = {
    "retention_ms": HOUR_MS, "segment_size_bytes": 16 * 1024, "max_message_size_bytes": 8192,
    "consume_queue_entries_per_file": 16, "retention_inflight_hold_ms": 0, "default_queue_count": 2}
"""Small segments and queue files, so seven hours of a light load roll both many times."""


async def _retained_hours(b: Broker, clock: FakeClock) -> None:
    """Every 5 minutes for 400 minutes: 3 messages and 3 timers due 20 to 60 minutes later on
    "orders", everything due fired; retention every 20 minutes. Group "g" reads and acks all
    but the last hour, and holds one message in flight, unacked."""
    await b.create_topic("orders", 2)
    for step in range(80):
        batch = [OutgoingMessage("orders", b"o" * 300, message_id=f"o{step}-{i}") for i in range(3)]
        batch += [OutgoingMessage("orders", b"t" * 200, message_id=f"t{step}-{i}",
                                  delay_ms=(20 + step % 5 * 10) * MINUTE_MS) for i in range(3)]
        await b.send_batch(batch)
        clock.advance(5 * MINUTE_MS)
        while await b.run_due():
            pass
        if step % 4 == 3:
            await b.enforce_retention()
        if step == 66:
            await drain(b, "orders", "g")
    [held] = await b.receive("g", "orders", batch_size=1, invisible_duration_ms=10 * MINUTE_MS)
    assert held.message.message_id


def _readable(b: Broker) -> dict[tuple[int, int], tuple[str, int, int]]:
    """What each "orders" queue delivers: (queue id, offset) -> (message id, entry position, size),
    for every entry a reader can read (removed, expired and past-retention links skipped)."""
    out = {}
    for qid in range(2):
        cq = b.store.queue("orders", qid)
        offset = cq.min_offset
        while entries := cq.read_range(offset, cq.next_offset - offset):  # (one file at a time)
            for off, position, size, _ in entries:
                m = b.store.readable_entry("orders", qid, off, position, size)
                if m is not None:
                    out[(qid, off)] = (m.message_id, position, size)
            offset = entries[-1][0] + 1
    return out


def _damage(data: Path, how: str) -> None:
    qdir = data / files.QUEUES_DIR / "orders" / "0"
    names = sorted(qdir.iterdir())
    if how == "its directory removed":
        shutil.rmtree(qdir)
    elif how == "every queue removed":
        shutil.rmtree(data / files.QUEUES_DIR)
    elif how == "a middle file removed":
        names[len(names) // 2].unlink()
    elif how == "an entry flipped":
        raw = bytearray(names[0].read_bytes())
        raw[24 + 20 * 3 + 5] ^= 0x5A  # the fourth entry of the oldest file, inside its position
        names[0].write_bytes(bytes(raw))
    else:
        raise AssertionError(how)


async def _next_for(b: Broker, clock: FakeClock) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """What group "g" receives next (new messages, acked), then what comes back from its in-flight
    entry once visible (id, attempt), and what a new group receives: the same calls on any copy."""
    new = [m.message_id for m in await drain(b, "orders", "g")]
    clock.advance(10 * MINUTE_MS)
    back = [(r.message.message_id, r.delivery_attempt) for r in await b.receive("g", "orders", batch_size=8)]
    fresh = [m.message_id for m in await drain(b, "orders", "fresh")]
    return new, back, fresh


@pytest.mark.durable_index("`chronoq check` reads the retention horizon from the index on disk")
@pytest.mark.slow
@pytest.mark.parametrize("how", ["its directory removed", "a middle file removed", "an entry flipped",
                                 "every queue removed"])
def test_a_consume_queue_damaged_after_retention_is_rebuilt_to_deliver_what_it_did(tmp_path: Path, how: str) -> None:
    """The fault: after hours of retention (its earliest segments deleted, among them timer
    records whose link records are still retained, past retention themselves), a consume queue of
    the closed broker is damaged: `how` says (its directory removed, a file in its middle
    removed, a byte of an entry flipped, every queue of the broker removed). What must hold:
    `chronoq check` says a restart rebuilds it and finds no problem, the restart rebuilds it from
    the log, and the rebuilt queue delivers exactly what the undamaged one does, entry by entry
    (same offsets, same records, links past retention skipped), so a group goes on from its
    offset with the same messages, its unacked in-flight message comes back once as its next
    attempt, and a new group receives the same, each once; afterwards `chronoq check` is clean."""
    data, undamaged = tmp_path / "data", tmp_path / "undamaged"
    clock = FakeClock(START_MS)

    async def body() -> None:
        b = await simulated_broker(data, clock, **QUEUE_SETTINGS)
        try:
            await _retained_hours(b, clock)
            assert b.store.log.start_position > 0 and b.store.queue("orders", 0).min_offset > 0
        finally:
            await b.close()
        before = check_data_dir(data)
        assert before.ok and before.expired_links > 0, format_report(before, data)
        shutil.copytree(data, undamaged)
        _damage(data, how)
        report = check_data_dir(data)
        assert not report.problems and any("rebuild" in r for r in report.repairs), format_report(report, data)

        results = []
        for copy in (undamaged, data):
            same_time = FakeClock(clock.now_ms())
            b = await simulated_broker(copy, same_time, **QUEUE_SETTINGS)
            try:
                if copy == data:
                    assert "orders/0" in b.open_report.rebuilt_queues and not b.open_report.hole_entries
                results.append((_readable(b), await _next_for(b, same_time)))
            finally:
                await b.close()
        (want, want_next), (got, got_next) = results
        assert got == want, "the rebuilt queue delivers other entries than the undamaged one"
        assert got_next == want_next
        new, back, fresh = got_next
        assert len(back) == 1 and back[0][1] == 2 and len(set(fresh)) == len(fresh) and set(new) <= set(fresh)
        report = check_data_dir(data)
        assert report.ok, format_report(report, data)

    asyncio.run(body())


async def _retained_then_closed(data: Path, clock: FakeClock) -> None:
    b = await simulated_broker(data, clock, **QUEUE_SETTINGS)
    try:
        await _retained_hours(b, clock)
    finally:
        await b.close()


@pytest.mark.durable_index("`chronoq check` reads the retention horizon from the index on disk")
def test_a_queue_missing_the_file_at_its_start_is_a_problem_check_names_with_its_remedy(tmp_path: Path) -> None:
    """The fault: after hours of retention, the oldest file of a consume queue is removed while
    the log still holds records whose entries were in it. Retention removes a queue's files only
    once all their entries lie below the log's start, so this is a loss, not retention; a restart
    cannot tell it from retention's removals and does not rebuild the queue (design.md, "Known
    limits"). What must hold: `chronoq check`, which used to call the directory OK, names the
    queue, the offsets the log still holds below its first offset, and the remedy; and the remedy
    (the queue's directory removed, then a restart) rebuilds the queue to deliver exactly what the
    undamaged one does."""
    data, undamaged = tmp_path / "data", tmp_path / "undamaged"
    clock = FakeClock(START_MS)

    async def body() -> None:
        await _retained_then_closed(data, clock)
        shutil.copytree(data, undamaged)
        qdir = data / files.QUEUES_DIR / "orders" / "0"
        first = sorted(qdir.iterdir())[0]
        first.unlink()
        report = check_data_dir(data)
        [problem] = report.problems
        assert problem.startswith(f"{qdir}: ") and "below the queue's first offset" in problem, problem
        assert f"Remove the directory {qdir}" in problem and not report.repairs, problem

        shutil.rmtree(qdir)  # the remedy check gives
        assert not check_data_dir(data).problems
        results = []
        for copy in (undamaged, data):
            same_time = FakeClock(clock.now_ms())
            b = await simulated_broker(copy, same_time, **QUEUE_SETTINGS)
            try:
                results.append((_readable(b), await _next_for(b, same_time)))
            finally:
                await b.close()
        assert results[1] == results[0]
        assert check_data_dir(data).ok

    asyncio.run(body())
