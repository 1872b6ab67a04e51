"""Retention judges a segment by the store times inside it, not by file times or a wrong clock.

Faults caused here, each on a real broker with a `FakeClock` and small segments (4 KiB, about a
dozen messages each), retention run by `enforce_retention()`:
- a data directory restored from a backup: every file's mtime a year old, the store times
  recent. Before, retention went by mtime for segments loaded at open and deleted all but the
  last segment at the first tick (unconsumed messages lost);
- records stored while the clock was ten days ahead, then the clock set right: their store times
  lie in the future. They count as stored when the broker opened, so their segment expires
  `retention_ms` after that, and it does not block the segments after it (retention deletes a
  prefix) until its false date;
- files copied without their times (mtimes recent) whose store times are old: still deleted;
- damaged records: stepped over (quarantined), their store times not trusted, the records after
  them still counted.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage, SendResult
from chronoq.store import files
from chronoq.store.commitlog import SEGMENT_HEADER_SIZE
from chronoq.store.record import STORE_MS, STORE_MS_OFFSET
from tests.support.brokers import open_broker

START_MS = 1_700_000_000_000
MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
RETENTION_MS = 72 * HOUR_MS  # the default
GROUP = "g-retention"
BODY = b"x" * 200  # about 330 bytes a record: a dozen per 4 KiB segment


async def send(b: Broker, n: int, prefix: str, every_ms: int = 0, clock: FakeClock | None = None) -> list[SendResult]:
    out = []
    for i in range(n):
        out.append(await b.send(OutgoingMessage("orders", BODY, message_id=f"{prefix}-{i:03d}")))
        if clock is not None and every_ms:
            clock.advance(every_ms)
    return out


async def drain_ids(b: Broker) -> set[str]:
    ids = set()
    while got := await b.receive(GROUP, "orders", batch_size=64):
        for r in got:
            await b.ack(GROUP, "orders", r.receipt_handle)
            ids.add(r.message.message_id)
    return ids


def segment_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / files.COMMITLOG_DIR).glob(f"*{files.SEGMENT_SUFFIX}"))


def set_mtimes(data_dir: Path, when_ms: int) -> int:
    """Set the access and modification times of every file under `data_dir` (a restore)."""
    n = 0
    for root, _dirs, names in os.walk(data_dir):
        for name in names:
            os.utime(Path(root) / name, (when_ms / 1000, when_ms / 1000))
            n += 1
    return n


def segment_base_of(b: Broker, position: int) -> int:
    [seg] = [s for s in b.store.log.segments() if s.base <= position < s.end]
    return seg.base


def test_a_restored_directory_with_year_old_mtimes_loses_nothing_at_the_first_tick(
        make_config: Callable[..., Config]) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        sent = {r.message_id for r in await send(b, 60, "m")}
        await b.close()
        assert len(segment_files(make_config().data_dir)) >= 4
        assert set_mtimes(make_config().data_dir, START_MS - 365 * DAY_MS) > 0

        clock.advance(HOUR_MS)  # restored and started an hour after the last send
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            before = [(s.base, s.end) for s in b.store.log.segments()]
            await b.enforce_retention()
            assert [(s.base, s.end) for s in b.store.log.segments()] == before  # nothing deleted
            assert await drain_ids(b) == sent  # all 60, unconsumed before the restore, are there
            # And they do expire, by their store times: 72 hours after they were stored.
            clock.set(START_MS + RETENTION_MS - 1)
            await b.enforce_retention()
            assert len(b.store.log.segments()) == len(before)
            clock.set(START_MS + RETENTION_MS + 1)
            await b.enforce_retention()
            assert len(b.store.log.segments()) == 1
        finally:
            await b.close()

    asyncio.run(body())


def test_segments_expired_by_store_time_are_deleted_though_their_files_look_new(
        make_config: Callable[..., Config]) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        old = await send(b, 30, "old")
        await b.close()
        clock.set(START_MS + 2 * DAY_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        new = await send(b, 30, "new")  # the first may join the last segment of the first run
        await b.close()
        clock.set(START_MS + 3 * DAY_MS + HOUR_MS)
        set_mtimes(make_config().data_dir, clock.now_ms())  # copied without their times

        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            start = b.store.log.start_position
            keep_from = segment_base_of(b, new[0].position)  # the first segment holding a 2-day-old record
            assert keep_from > start, "the test needs segments of old records only"
            await b.enforce_retention()
            assert b.store.log.start_position == keep_from
            kept_old = {r.message_id for r in old if r.position >= keep_from}
            assert await drain_ids(b) == kept_old | {r.message_id for r in new}
        finally:
            await b.close()

    asyncio.run(body())


def test_future_store_times_count_from_the_open_and_do_not_block_later_segments(
        make_config: Callable[..., Config]) -> None:
    async def body() -> None:
        ahead_ms = START_MS + 10 * DAY_MS
        b = await open_broker(make_config(), clock=FakeClock(ahead_ms), background=False)
        future = await send(b, 30, "future")  # stored while the clock was ten days ahead
        await b.close()
        # The files' times agree with their store times, as the same wrong clock wrote both.
        set_mtimes(make_config().data_dir, ahead_ms)

        clock = FakeClock(START_MS)  # the clock set right; the broker opens at START_MS
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            start = b.store.log.start_position
            clock.set(START_MS + DAY_MS)
            normal = await send(b, 30, "normal")  # stored at START + 1 day
            mixed = segment_base_of(b, normal[0].position)  # the first segment with a normal record
            assert mixed > start, "the test needs segments of future records only"
            segments = len(b.store.log.segments())

            clock.set(START_MS + RETENTION_MS - 1)
            await b.enforce_retention()  # nothing is older than retention yet
            assert (b.store.log.start_position, len(b.store.log.segments())) == (start, segments)

            clock.set(START_MS + RETENTION_MS + 1)  # retention_ms after the open, not after day 10
            await b.enforce_retention()
            assert b.store.log.start_position == mixed  # the future-only segments are gone
            kept_future = {r.message_id for r in future if r.position >= mixed}
            assert await drain_ids(b) == kept_future | {r.message_id for r in normal}

            clock.set(START_MS + DAY_MS + RETENTION_MS + 1)  # the normal records' own expiry
            await b.enforce_retention()
            assert len(b.store.log.segments()) == 1  # nothing held back by the false dates
            assert clock.now_ms() < ahead_ms + RETENTION_MS
        finally:
            await b.close()

    asyncio.run(body())


def test_damaged_records_are_stepped_over_and_their_store_times_not_trusted(
        make_config: Callable[..., Config]) -> None:
    """Segment A's youngest record gets a store time 100 days ahead (its CRC32C then fails):
    trusted, it would keep A. Segment B has a damaged record in its middle and a young record
    after it: a walk that stopped at the damage would call B old and delete the young record."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        sent = await send(b, 50, "m", every_ms=MINUTE_MS, clock=clock)  # one a minute
        records = [(m.position, m.size, m.store_ms) for m in b.store.log.scan(b.store.log.start_position)]
        seg_a, seg_b = b.store.log.segments()[:2]
        await b.close()
        assert len(segment_files(make_config().data_dir)) >= 3  # A and B are not the active one
        in_a = [r for r in records if seg_a.base <= r[0] < seg_a.end]
        in_b = [r for r in records if seg_b.base <= r[0] < seg_b.end]
        assert len(in_b) >= 3
        a_last, b_middle, b_last = in_a[-1], in_b[len(in_b) // 2], in_b[-1]
        with open(seg_a.path, "r+b") as f:
            f.seek(a_last[0] - seg_a.base + SEGMENT_HEADER_SIZE + STORE_MS_OFFSET)
            f.write(STORE_MS.pack(START_MS + 100 * DAY_MS))
        with open(seg_b.path, "r+b") as f:
            f.seek(b_middle[0] + b_middle[1] - 1 - seg_b.base + SEGMENT_HEADER_SIZE)  # last body byte
            f.write(b"\xff")

        # Reopened when B's youngest record is exactly retention_ms old: B is kept, A is not.
        clock.set(b_last[2] + RETENTION_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            assert await b.store.expired_before(clock.now_ms()) == seg_b.base
            assert {d.start for d in b.store.log.damage.ranges()} == {a_last[0], b_middle[0]}
            await b.enforce_retention()
            assert b.store.log.start_position == seg_b.base
            got = await drain_ids(b)
            expected = {r.message_id for r in sent if r.position >= seg_b.base and r.position != b_middle[0]}
            assert got == expected
        finally:
            await b.close()

    asyncio.run(body())


def test_a_retention_step_while_the_timer_index_waits_to_be_rebuilt_deletes_nothing(
        make_config: Callable[..., Config]) -> None:
    """A timer index found damaged is destroyed and made again; on a full disk the making waits,
    and the service holds the closed index meanwhile. Retention, the task that frees space, then
    died of the closed index (and stopped the broker); it must keep every segment instead, since
    which timers are pending there is unknown, and go on once the index is back."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            timer = await b.send(OutgoingMessage("orders", BODY, message_id="later", delay_ms=30 * DAY_MS))
            sent = await send(b, 60, "m")
            clock.advance(RETENTION_MS + HOUR_MS)
            before = [(s.base, s.end) for s in b.store.log.segments()]
            assert len(before) >= 4
            b.timer.index_damaged = "the test's damage"  # as the loop records it
            b.timer.engine.close()  # as `_rebuild_index` leaves it when the new index finds no room
            await b.enforce_retention()
            assert [(s.base, s.end) for s in b.store.log.segments()] == before
            b.timer_loop._rebuild_index("the test's closed index")  # the disk has room again
            await b.enforce_retention()
            assert len(b.store.log.segments()) < len(before)
            assert b.query("later", "orders")[0].deliver_at_ms == timer.deliver_at_ms  # rolled, pending
            assert b.store.log.start_position > sent[0].position
        finally:
            await b.close()

    asyncio.run(body())


def test_a_receive_while_retention_rolls_timers_keeps_what_it_put_in_flight(
        make_config: Callable[..., Config]) -> None:
    """Retention works out what groups hold in flight, then waits for its timer roll to be
    durable. A receive in that wait put older records in flight, and retention then deleted
    them: the unacked messages never came back."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await open_broker(make_config(), clock=clock, background=False)
        try:
            await b.send(OutgoingMessage("orders", BODY, message_id="far", delay_ms=20 * DAY_MS))
            sent = await send(b, 40, "m")
            clock.advance(RETENTION_MS + HOUR_MS)
            await send(b, 3, "young")
            step = asyncio.ensure_future(b.enforce_retention())
            await asyncio.sleep(0)  # the step has its limit and waits for the roll's fsync
            got = await b.receive("late", "orders", batch_size=4, invisible_duration_ms=10_000)
            taken = {m.message.message_id for m in got}
            assert len(taken) == 4 and taken <= {r.message_id for r in sent}
            await step
            clock.advance(10_000)
            again = await b.receive("late", "orders", batch_size=4, invisible_duration_ms=10_000)
            assert {m.message.message_id for m in again} == taken  # back, not deleted
            assert {m.delivery_attempt for m in again} == {2}
        finally:
            await b.close()

    asyncio.run(body())


def test_a_group_that_went_away_holds_segments_for_the_in_flight_hold_only(
        make_config: Callable[..., Config]) -> None:
    """A group that received one message and never came back kept every later segment for good:
    the disk filled. It keeps them `retention_inflight_hold_ms` past retention, then they go."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        config = make_config(retention_inflight_hold_ms=DAY_MS)
        b = await open_broker(config, clock=clock, background=False)
        try:
            sent = await send(b, 40, "m")
            (held,) = await b.receive("gone", "orders", batch_size=1, invisible_duration_ms=10_000)
            assert held.message.message_id == sent[0].message_id
            segments = len(b.store.log.segments())
            clock.advance(RETENTION_MS + DAY_MS - HOUR_MS)
            await send(b, 1, "today")
            await b.enforce_retention()
            assert b.store.log.start_position == 0 and len(b.store.log.segments()) >= segments  # held
            clock.advance(2 * HOUR_MS)
            await b.enforce_retention()
            assert b.store.log.start_position > held.message.position  # the hold is over: deleted
            # The group's entry for the deleted record goes at its next receive.
            got = await b.receive("gone", "orders", batch_size=64, invisible_duration_ms=10_000)
            assert held.message.message_id not in {m.message.message_id for m in got}
            assert b.groups.min_inflight_position() >= b.store.log.start_position
        finally:
            await b.close()

    asyncio.run(body())


def test_check_on_a_running_broker_whose_retention_removes_a_file_meanwhile(
        make_config: Callable[..., Config], monkeypatch: Any) -> None:
    """`chronoq check` lists a directory, then reads each file; retention on a running broker can
    remove one in between. The FileNotFoundError ended the check with exit status 1 (DAMAGED)."""
    from chronoq.store import check

    async def build() -> None:
        b = await open_broker(make_config(), clock=FakeClock(START_MS), background=False)
        await send(b, 60, "m")
        await b.close()

    asyncio.run(build())
    data = make_config().data_dir
    first = segment_files(data)[0]
    real_listdir = os.listdir

    def listdir_then_retention(path: Any) -> list[str]:
        names = real_listdir(path)
        if Path(path) == first.parent and first.exists():
            first.unlink()  # retention deletes the oldest segment right after the listing
        return names

    monkeypatch.setattr(check.os, "listdir", listdir_then_retention)
    report = check.check_data_dir(data)
    assert report.problems == [] and any("removed by retention while being checked" in n for n in report.notes)
