"""Probe: where the in-process accept's CPU goes, per thread and per room (issue 11).

Theory of operation: `run` opens an in-process broker (FakeClock, no background tasks, the read
cache at 1 MiB as in a broker that has run a while), accepts `--timers` timers in batches of
`--batch` after 5,000 not timed, and prints the CPU per message of the process and of each of its
threads (psutil): the event loop's thread is chronoq's Python, the others the log's fsync thread
and RocksDB. `fold` reads a py-spy raw profile of that run and shares the event loop's samples
out among the rooms a message walks through (a sample counts for the first room of the list
named in its stack: the timer index and dispatch before the store's append, which runs them
itself with `flush = "async"`; the bench's own message building is left out).

    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/accept_rooms.py run --timers 205000
    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/accept_rooms.py run --timers 25000 --batch 1
    .venv/bin/py-spy record -r 997 -f raw -o accept.txt -- \
        .venv/bin/python docs/results/s29-bounds-20261127/accept_rooms.py run --timers 205000
    .venv/bin/python docs/results/s29-bounds-20261127/accept_rooms.py fold accept.txt --us 17.9
    .venv/bin/python docs/results/s29-bounds-20261127/accept_rooms.py fold accept.txt --us 17.9 \
        --within RocksTimerIndex.apply   # one function, shared out among what it calls
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

START_MS = 1_800_000_000_000
WARM = 5_000
ROOMS = [
    ("admission: validate.prepare, topic checks", ["prepare (", "Topics.for_send", "_check_queue_id"]),
    ("timer routing: TimerService.route", ["TimerService.route"]),
    ("dedupe window: get, add, expire", ["DedupeWindow."]),
    ("timer index: TimerEntry per timer, RocksDB batch and write, counters", ["TimerLoop.on_dispatch"]),
    ("dispatch: consume queues, read cache", ["ConsumeQueue.append_many", "MessageStore._cache_records"]),
    ("store append: queue and offset, record encoding, StoredMessage, log write",
     ["MessageStore.append", "MessageStore.check_room_for_send"]),
    ("results: SendResult, recall handle", ["Accept._finish"]),
    ("broker's per-topic counters", ["DelayHistogram.record", "leaf:Broker.send_batch ("]),
    ("Accept.send_batch's own loop", ["leaf:Accept.send_batch ("]),
]
"""A mark matches anywhere in the stack, or, with `leaf:`, only the stack's last frame."""


async def accept(timers: int, batch: int, flush: str) -> None:
    import psutil

    from chronoq.broker import Broker
    from chronoq.clock import FakeClock
    from chronoq.config import Config
    from chronoq.model import OutgoingMessage

    clock = FakeClock(START_MS)
    broker = await Broker.open(Config(data_dir=Path(tempfile.mkdtemp()) / "data", read_cache_bytes=1 << 20,
                                      flush=flush), clock=clock, background=False)
    try:
        await broker.create_topic("orders", 4)
        due = START_MS + 60_000
        msgs = [OutgoingMessage("orders", b"b" * 100, message_id=f"m{i:08d}", deliver_at_ms=due + i)
                for i in range(timers)]
        for i in range(0, WARM, 100):
            await broker.send_batch(msgs[i:i + 100])
        proc = psutil.Process()
        before = {t.id: t.user_time + t.system_time for t in proc.threads()}
        cpu = time.process_time()
        for i in range(WARM, timers, batch):
            await broker.send_batch(msgs[i:i + batch])
        cpu = time.process_time() - cpu
        await asyncio.sleep(1)  # the fsync thread and RocksDB finish what the last batch started
        after = {t.id: t.user_time + t.system_time for t in proc.threads()}
    finally:
        await broker.close()
    n = timers - WARM
    print(f"{n} timers in batches of {batch}, flush={flush}: process {cpu / n * 1e6:.1f} µs a message")
    main_id = threading.get_native_id()
    for tid, t in sorted(after.items(), key=lambda kv: -(kv[1] - before.get(kv[0], 0))):
        spent = t - before.get(tid, 0)
        if spent > 0.005:
            print(f"  {'event loop' if tid == main_id else 'thread ' + str(tid)}: {spent / n * 1e6:.2f} µs a message")


def fold(path: str, us: float | None, within: str | None = None) -> None:
    shares: collections.Counter[str] = collections.Counter()
    total = inside = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if "Handle._run" not in stack or "_find_and_load" in stack or "accept.<locals>.<listcomp>" in stack:
            continue
        n = int(count)
        total += n
        if within is not None:
            frames = [f.split(" (")[0] for f in stack.split(";")]
            if within in frames:
                inside += n
                at = frames.index(within)
                shares[frames[at + 1] if at + 1 < len(frames) else within + " itself"] += n
            continue
        leaf = stack.split(";")[-1]
        room = next((name for name, marks in ROOMS
                     if any(leaf.startswith(m[5:]) if m.startswith("leaf:") else m in stack for m in marks)), None)
        shares[room or "other: " + leaf.split(" (")[0]] += n
    print(f"{total} event-loop samples" + (f", {inside} of them in {within}" if within else ""))
    for room, n in shares.most_common(14):
        print(f"{n / total * 100:5.1f} %" + (f" {n / total * us:5.2f} µs" if us else "") + f"  {room}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--timers", type=int, default=205_000)
    r.add_argument("--batch", type=int, default=100)
    r.add_argument("--flush", choices=("sync", "async"), default="sync")
    f = sub.add_parser("fold")
    f.add_argument("profile")
    f.add_argument("--us", type=float, default=None, help="the event loop's µs a message, to share out")
    f.add_argument("--within", default=None, help="a function: share out its samples among the functions it calls")
    args = ap.parse_args()
    if args.cmd == "run":
        asyncio.run(accept(args.timers, args.batch, args.flush))
    else:
        fold(args.profile, args.us, args.within)


if __name__ == "__main__":
    main()
