"""Retention under a steady timer load: the log holds `retention_ms` of data plus what pending
timers, in-flight messages and live links need, and no more (design.md, "Retention of fired
timers").

Timer records and the link records that fire them share one log, so a segment kept because a
later link names a timer in it also holds link records naming older timers. If the segments kept
for that reason kept what their own links name, each would hold the one before it, back to the
first segment, and a broker whose timers keep firing would never delete anything. Only links in
segments retained for their own sake keep their records, and pending timers leave an expired
segment by the roll (else each would fire from there and pin it again). These tests run many
simulated hours of timers crossing segment boundaries and watch the disk.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, MINUTE_MS, SECOND_MS
from chronoq.model import OutgoingMessage
from chronoq.store import files
from chronoq.store.check import check_data_dir
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, drain, run

pytestmark = pytest.mark.usefixtures("each_timer_engine")

STEP_MS = 10 * SECOND_MS
SEGMENT_BYTES = 256 * 1024


def _log_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / files.COMMITLOG_DIR).iterdir())


class Load:
    """Every 10 s: 10 timers due `delay_ms` (a range) after they are sent and 10 fillers of 1 KB;
    fire, receive and ack everything due; retention every minute. `samples[hour]` = (log bytes
    on disk, bytes written so far) at each whole hour."""

    def __init__(self, b: Broker, clock: FakeClock, delay_ms: tuple[int, int]) -> None:
        self.b, self.clock, self.delay_ms = b, clock, delay_ms
        self.rng = random.Random(7)
        self.due_by_id: dict[str, int] = {}
        self.received = self.early = self.step = 0
        self.samples: dict[int, tuple[int, int]] = {}

    async def run(self, hours: float, *, send: bool = True) -> None:
        b, clock = self.b, self.clock
        for _ in range(int(hours * HOUR_MS // STEP_MS)):
            self.step += 1
            if send:
                batch = [OutgoingMessage("filler", b"f" * 1024, message_id=f"f{self.step}-{i}") for i in range(10)]
                for i in range(10):
                    delay = self.rng.randrange(*self.delay_ms)
                    mid = f"t{self.step}-{i}"
                    self.due_by_id[mid] = clock.now_ms() + delay
                    batch.append(OutgoingMessage("orders", b"t" * 200, message_id=mid, delay_ms=delay))
                await b.send_batch(batch)
            clock.advance(STEP_MS)
            while await b.run_due():
                pass
            for m in await drain(b, "orders"):
                self.received += 1
                self.early += m.store_ms < self.due_by_id[m.message_id]
            await drain(b, "filler")
            if self.step % 6 == 0:
                await b.enforce_retention()
            if (self.step * STEP_MS) % HOUR_MS == 0:
                self.samples[self.step * STEP_MS // HOUR_MS] = (_log_bytes(b.config.data_dir),
                                                                 b.store.log.end_position)


async def _open(data: Path, clock: FakeClock, retention_ms: int) -> Broker:
    b = await simulated_broker(data, clock, retention_ms=retention_ms, segment_size_bytes=SEGMENT_BYTES,
                          max_message_size_bytes=64 * 1024, retention_inflight_hold_ms=0)
    await b.create_topic("orders", 4)
    return b


@pytest.mark.rocksdb_index("`chronoq check` reads the retention horizon from the index on disk")
@pytest.mark.slow
def test_a_steady_timer_load_keeps_the_disk_flat_under_retention(tmp_path: Path) -> None:
    """Six simulated hours, an hour's retention, timers due 1 to 50 minutes after they are sent,
    everything fired, received and acked: the log keeps what the last hour wrote plus the
    records its links name (at most 50 minutes older), not everything since the start (a log
    that kept every segment held 127 segments, 33 MB, after six hours, and grew by 5.5 MB an
    hour; now about 40, 10 MB, from the second hour on)."""
    async def body() -> Load:
        clock = FakeClock(START_MS)
        b = await _open(tmp_path / "data", clock, HOUR_MS)
        try:
            load = Load(b, clock, (MINUTE_MS, 50 * MINUTE_MS))
            await load.run(6)
            assert load.early == 0
            assert b.store.log.start_position > 0, "retention deleted nothing"
            # Everything due has been received once (the rest is still pending).
            assert load.received == len(load.due_by_id) - b.timer.engine.pending_total
        finally:
            await b.close()
        return load

    samples = run(body()).samples
    # Link records past retention name records it deleted: a note, not damage.
    report = check_data_dir(tmp_path / "data")
    assert report.ok, (report.problems, report.repairs)
    assert report.expired_links > 0 and any("past retention" in n for n in report.notes), report.notes
    per_hour = samples[6][1] - samples[5][1]
    # What the log genuinely needs: the last hour, the records its links name (up to 50 minutes
    # older), a segment being written and one past the limit (whole segments go).
    need = per_hour * (HOUR_MS + 50 * MINUTE_MS) // HOUR_MS + 2 * SEGMENT_BYTES
    for hour in (2, 3, 4, 5, 6):
        assert samples[hour][0] <= need, (hour, need, samples)
    # Flat: the sixth hour holds what the second did.
    assert samples[6][0] <= samples[2][0] * 11 // 10, samples


@pytest.mark.slow
def test_timers_due_after_the_retention_period_are_rolled_and_the_disk_stays_flat(tmp_path: Path) -> None:
    """Ten minutes' retention, timers due 20 to 60 minutes out: each is rolled forward as its
    segment leaves the live ones, so it fires from a record at most one retention period (and a
    retention step) older than its link, and no expired segment is kept by a timer fired from it
    (one left in place fired from there, and its live link kept that segment another period)."""
    async def body() -> tuple[Load, list[int]]:
        clock = FakeClock(START_MS)
        b = await _open(tmp_path / "data", clock, 10 * MINUTE_MS)
        sizes = []
        try:
            load = Load(b, clock, (20 * MINUTE_MS, 60 * MINUTE_MS))
            for _ in range(12):
                await load.run(0.25)
                sizes.append(_log_bytes(b.config.data_dir))
            assert load.early == 0 and load.received == len(load.due_by_id) - b.timer.engine.pending_total
            written_per_period = (b.store.log.end_position - load.samples[2][1]) // 6  # per 10 minutes
        finally:
            await b.close()
        return load, [s // written_per_period for s in sizes]

    _, periods = run(body())
    # From the second hour on: about two retention periods of writes (the live one, and the
    # records its links name), never growing.
    assert max(periods[4:]) <= 3, periods
    assert periods[-1] <= periods[4] + 1, periods


@pytest.mark.rocksdb_index("`chronoq check` reads the retention horizon from the index on disk")
@pytest.mark.slow
def test_the_log_shrinks_to_one_segment_once_writes_stop_and_timers_have_fired(tmp_path: Path) -> None:
    """After the load stops, once every timer has fired and the retention period has passed, the
    log holds only the segment being written: its link records are past retention too, and keep
    nothing (before, the last segment's links kept every record they named for good, because the
    segment being written never counts as expired)."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        b = await _open(tmp_path / "data", clock, 10 * MINUTE_MS)
        try:
            load = Load(b, clock, (MINUTE_MS, 30 * MINUTE_MS))
            await load.run(1)
            assert len(b.store.log.segments()) > 3
            await load.run(1, send=False)  # every timer fires, then ten minutes pass, and more
            assert b.timer.engine.pending_total == 0 and load.received == len(load.due_by_id)
            assert len(b.store.log.segments()) == 1, [s.base for s in b.store.log.segments()]
        finally:
            await b.close()
        report = check_data_dir(tmp_path / "data")
        assert report.ok, (report.problems, report.repairs)

    run(body())
