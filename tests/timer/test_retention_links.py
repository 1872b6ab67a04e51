"""Retention under a steady timer load: the log holds `retention_ms` of data plus what pending
timers, in-flight messages and live links need, and no more (design.md, "Retention of fired
timers").

Timer records and the link records that fire them share one log, so a segment kept because a
later link names a timer in it also holds link records naming older timers. If the segments kept
for that reason kept what their own links name, each would hold the one before it, back to the
first segment, and a broker whose timers keep firing would never delete anything. Only links in
segments retained for their own sake keep their records; these tests run many simulated hours of
timers crossing segment boundaries and watch the disk.
"""

from __future__ import annotations

import random
from pathlib import Path

from timer_helpers import START_MS, drain, open_broker, run

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS, MINUTE_MS, SECOND_MS
from chronoq.model import OutgoingMessage
from chronoq.store import files
from chronoq.store.check import check_data_dir

STEP_MS = 10 * SECOND_MS
SEGMENT_BYTES = 256 * 1024


def _log_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in (data / files.COMMITLOG_DIR).iterdir())


async def _steady_load(b: Broker, clock: FakeClock, hours: float, *, timers: bool,
                       samples: dict[int, tuple[int, int]]) -> tuple[int, int, int]:
    """Every 10 s: 10 timers due in 1 to 50 minutes (if `timers`) and 10 fillers of 1 KB; fire,
    receive and ack everything due; retention every minute. `samples[hour]` = (log bytes on
    disk, bytes written so far) at each whole hour. Returns (sent timers, received timers, early)."""
    rng = random.Random(7)
    sent = received = early = 0
    due_by_id: dict[str, int] = {}
    steps = int(hours * HOUR_MS // STEP_MS)
    for step in range(1, steps + 1):
        batch = [OutgoingMessage("filler", b"f" * 1024, message_id=f"f{step}-{i}") for i in range(10)]
        if timers:
            for i in range(10):
                delay = rng.randrange(MINUTE_MS, 50 * MINUTE_MS)
                mid = f"t{step}-{i}"
                due_by_id[mid] = clock.now_ms() + delay
                batch.append(OutgoingMessage("orders", b"t" * 200, message_id=mid, delay_ms=delay))
                sent += 1
        await b.send_batch(batch)
        clock.advance(STEP_MS)
        while await b.run_due():
            pass
        for m in await drain(b, "orders"):
            received += 1
            early += m.store_ms < due_by_id[m.message_id]
        await drain(b, "filler")
        if step % 6 == 0:
            await b.enforce_retention()
        if (step * STEP_MS) % HOUR_MS == 0:
            samples[step * STEP_MS // HOUR_MS] = (_log_bytes(b.config.data_dir), b.store.log.end_position)
    return sent, received, early


def test_a_steady_timer_load_keeps_the_disk_flat_under_retention(tmp_path: Path) -> None:
    """Six simulated hours, an hour's retention, timers due 1 to 50 minutes after they are sent,
    everything fired, received and acked: the log keeps what the last hour wrote plus the
    records its links name (at most 50 minutes older), not everything since the start (a log
    that kept every segment held 127 segments, 33 MB, after six hours, and grew by 5.5 MB an
    hour; now about 40, 10 MB, from the second hour on)."""
    async def body() -> dict[int, tuple[int, int]]:
        clock = FakeClock(START_MS)
        b = await open_broker(tmp_path / "data", clock, retention_ms=HOUR_MS, segment_size_bytes=SEGMENT_BYTES,
                              max_message_size_bytes=64 * 1024, retention_inflight_hold_ms=0)
        samples: dict[int, tuple[int, int]] = {}
        await b.create_topic("orders", 4)
        try:
            sent, received, early = await _steady_load(b, clock, 6, timers=True, samples=samples)
            assert early == 0
            assert b.store.log.start_position > 0, "retention deleted nothing"
            # Everything due has been received once (the rest is still pending).
            assert received == sent - b.timer.engine.pending_total
        finally:
            await b.close()
        return samples

    samples = run(body())
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
