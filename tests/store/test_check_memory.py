"""`chronoq check`'s memory does not grow with the store, and what it finds does not depend on how
it reads.

Holding every consume-queue entry as a tuple would take about 160 bytes each (1.5 GB for a store
of 10 M messages), and each commit-log segment whole as much again; check reads both in bounded
pieces (`CHUNK_ENTRIES`, `MAX_HELD_CHUNKS`, `SEGMENT_WINDOW_BYTES`). The bound is shown for real: a
child process whose data segment (RLIMIT_DATA) may grow only `HEADROOM` (32 MiB) past what it
used after checking a small store checks a queue of 1 M entries. Holding the entries whole
would need between 128 and 160 MiB there, a MemoryError; the bounded reads fit in 8 MiB. The child's
threads get 1 MiB stacks (`ulimit -s`): RocksDB starts threads at each open, and their default
8 MiB stacks count against the limit, whatever check holds.
The findings are shown not to depend on the pieces: damaged stores checked with the sizes shrunk
to a few entries and bytes (every read crossing a chunk or window edge) give the report the
default sizes give.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import chronoq
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage
from chronoq.store import check, check_log, check_queues, files
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY_SIZE, encode_entry
from chronoq.store.record import HEADER_SIZE
from tests.support.brokers import open_broker

START_MS = 1_800_000_000_000
HEADROOM = 32 << 20

_CHILD = """
import resource, sys
from chronoq.store.check import check_data_dir
check_data_dir(sys.argv[3])  # RocksDB's threads and their allocator arenas, made before the limit
with open("/proc/self/status") as f:
    used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
resource.setrlimit(resource.RLIMIT_DATA, (used + int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_DATA)[1]))
report = check_data_dir(sys.argv[1])
print(report.exit_status, report.cq_entries, *report.repairs, *report.problems, sep="\\n")
"""


async def _build(data: Path, *, segment_size_bytes: int = 1 << 20, orders: int = 100, timers: int = 0) -> None:
    config = Config(data_dir=data, segment_size_bytes=segment_size_bytes, max_message_size_bytes=2048,
                    default_queue_count=2, consume_queue_entries_per_file=16)
    clock = FakeClock(START_MS)
    broker = await open_broker(config, clock=clock, background=False)
    try:
        for first in range(0, orders, 50):
            await broker.send_batch([OutgoingMessage("orders", f"order-{i}".encode() * 8, message_id=f"o{i}")
                                     for i in range(first, min(orders, first + 50))])
        for i in range(timers):
            await broker.send(OutgoingMessage("later", b"t" * 64, message_id=f"t{i}", delay_ms=1_000 * (i + 1)))
        clock.advance(5_500)
        await broker.run_due()
        broker.store.checkpoint()
    finally:
        await broker.close()


def _last_queue_file(data: Path, topic: str, qid: int) -> Path:
    return sorted((data / files.QUEUES_DIR / topic / str(qid)).glob("*" + files.CQ_SUFFIX))[-1]


@pytest.mark.slow
def test_check_of_a_queue_of_a_million_entries_fits_in_32_mib(tmp_path: Path) -> None:
    data = tmp_path / "data"
    asyncio.run(_build(data))
    before = check.check_data_dir(data)
    assert before.ok and before.cq_entries == 100
    shutil.copytree(data, tmp_path / "warm")
    path = _last_queue_file(data, "orders", 0)
    extra = 1_000_000
    with open(path, "ab") as f:  # entries for records past the log's end: what a restart drops
        f.write(encode_entry(1 << 40, 100, 0) * extra)
    env = {**os.environ, "PYTHONPATH": str(Path(chronoq.__file__).resolve().parents[1])}
    run = subprocess.run(["sh", "-c", 'ulimit -s 1024 && exec "$0" "$@"', sys.executable, "-c", _CHILD, str(data),
                          str(HEADROOM), str(tmp_path / "warm")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    status, entries, *findings = run.stdout.splitlines()
    assert (int(status), int(entries)) == (3, 100 + extra)
    assert findings == [f"{path.parent}: {extra} entries point past the log's end {before.log_end} "
                        "(a restart drops them)"]


def _damage(data: Path, rng: random.Random) -> list[str]:
    """Flip bytes in the log and the consume queues, and set one record's size to more than its
    segment holds (its magic broken too, half the time); return what was done."""
    done = []
    log = sorted((data / files.COMMITLOG_DIR).glob("*" + files.SEGMENT_SUFFIX))
    queues = sorted((data / files.QUEUES_DIR).rglob("*" + files.CQ_SUFFIX))
    for _ in range(3):
        path = rng.choice(log + queues)
        body = bytearray(path.read_bytes())
        if len(body) > CQ_HEADER_SIZE:
            at = rng.randrange(CQ_HEADER_SIZE, len(body))
            body[at] ^= 0x5A
            path.write_bytes(bytes(body))
            done.append(f"flip {path.name}@{at}")
    path = rng.choice(log)
    body = bytearray(path.read_bytes())
    at = 24  # the segment's first record
    body[at:at + 4] = (0x7FFF0000).to_bytes(4, "big")
    if rng.random() < 0.5:
        body[at + 8] ^= 0xFF
    path.write_bytes(bytes(body))
    done.append(f"size {path.name}@{at}")
    # A queue entry that disagrees with the log, and entries past the log's end.
    path = _last_queue_file(data, "orders", 1)
    body = bytearray(path.read_bytes())
    if len(body) >= CQ_HEADER_SIZE + ENTRY_SIZE:
        body[CQ_HEADER_SIZE:CQ_HEADER_SIZE + ENTRY_SIZE] = encode_entry(12_345, 77, 0)
    path.write_bytes(bytes(body) + encode_entry(1 << 40, 100, 0) * rng.randrange(1, 40))
    return done


@pytest.mark.parametrize("seed", range(8))
def test_findings_do_not_depend_on_the_chunk_and_window_sizes(tmp_path: Path, seed: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    template, data = tmp_path / "template", tmp_path / "data"
    asyncio.run(_build(template, segment_size_bytes=8192, orders=150, timers=20))
    shutil.copytree(template, data)
    done = _damage(data, random.Random(seed)) if seed else []
    usual = check.check_data_dir(data)
    assert usual.records > 0 and usual.cq_entries > 0
    if seed:
        assert usual.problems, done
    monkeypatch.setattr(check_queues, "CHUNK_ENTRIES", 3)
    monkeypatch.setattr(check_queues, "MAX_HELD_CHUNKS", 2)
    monkeypatch.setattr(check_log, "SEGMENT_WINDOW_BYTES", HEADER_SIZE + 5)
    peaks: list[int] = []

    class Counted(check_queues.QueueEntries):
        def get(self, q: check_queues.Queue, index: int) -> tuple[int, int, int] | None:
            entry = super().get(q, index)
            peaks.append(self.held_peak)
            return entry

    monkeypatch.setattr(check, "QueueEntries", Counted)
    small = check.check_data_dir(data)
    assert dataclasses.asdict(small) == dataclasses.asdict(usual), done
    assert peaks and max(peaks) <= 3 * 2  # entries held: CHUNK_ENTRIES * MAX_HELD_CHUNKS
