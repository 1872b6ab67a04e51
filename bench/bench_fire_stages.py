"""Benchmark: where firing's CPU goes, stage by stage, for N timers due in the same millisecond.

Theory of operation: the set-up of `bench_path.py` (one in-process broker on a FakeClock, no
background tasks, `flush = "sync"`), N timers accepted in batches of 100, all due at once; then
the functions each fired timer passes through are wrapped, on their classes, in a timer of their
own (`time.perf_counter`), and `run_due()` fires them all. Reported: the whole fire's CPU per timer
(`time.process_time`, the fsync thread included) and each wrapped stage's time per timer. The
wrappers add their own call cost (~0.2 us per call), so the stages sum to a little more than they
cost unwrapped; what is not wrapped (the fire loop itself, the dispatch around the consume-queue
entries, the group commit's hand-offs) is the difference. "links" includes the frame check.

    .venv/bin/python bench/bench_fire_stages.py --timers 100000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_fire_instructions import broker_with_due_timers  # noqa: E402
from chronoq.store.consumequeue import ConsumeQueue  # noqa: E402
from chronoq.store.messagestore import MessageStore  # noqa: E402
from chronoq.timer import service as timer_service  # noqa: E402
from chronoq.timer.index import RocksTimerIndex  # noqa: E402
from chronoq.timer.service import TimerService  # noqa: E402

STAGES: tuple[tuple[Any, str, str], ...] = (
    (RocksTimerIndex, "due", "due scan"),
    (MessageStore, "check_records", "check the timer records' frames"),
    (TimerService, "_links_for", "links (the frame check included)"),
    (MessageStore, "append", "encode and write the link record"),
    (ConsumeQueue, "append_many", "consume-queue entries"),
    (timer_service, "index_batch", "index batch from the dispatched records"),  # as the service calls it
    (RocksTimerIndex, "apply", "index: mark fired"),
)


def _timed(fn: Callable[..., Any], spent: collections.Counter[str], label: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t
    return wrapper


async def measure(n: int, data: Path, fire_batch: int | None = None) -> dict[str, float]:
    broker = await broker_with_due_timers(data, n, fire_batch)
    try:
        spent: collections.Counter[str] = collections.Counter()
        originals = [(cls, name, getattr(cls, name)) for cls, name, _ in STAGES]
        for (cls, name, label), (_, _, fn) in zip(STAGES, originals, strict=True):
            setattr(cls, name, _timed(fn, spent, label))
        try:
            t = time.process_time()
            fired = await broker.run_due()
            total = time.process_time() - t
        finally:
            for cls, name, fn in originals:
                setattr(cls, name, fn)
        assert fired == n, fired
        return {"timers": n, "fire_cpu_us_per_timer": total * 1e6 / n,
                **{label: spent[label] * 1e6 / n for _, _, label in STAGES}}
    finally:
        await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timers", type=int, default=100_000)
    parser.add_argument("--fire-batch", type=int, default=None, help="timer_fire_batch (default: the config's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = asyncio.run(measure(args.timers, Path(tmp), args.fire_batch))
    print(f"fire, all stages: {out.pop('fire_cpu_us_per_timer'):.1f} us of CPU per timer ({out.pop('timers')} timers)")
    for label, us in sorted(out.items(), key=lambda kv: -kv[1]):
        print(f"  {label:45s} {us:6.2f} us")


if __name__ == "__main__":
    main()
