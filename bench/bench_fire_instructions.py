"""Benchmark: instructions per fired timer, counted by valgrind's callgrind (repeatable, unlike time).

Theory of operation: one in-process broker (FakeClock, no background tasks) accepts N timers in
batches of 100, all due at once, and either fires them (`fire`) or not (`accept`). Run each under
`valgrind --tool=callgrind` (every thread counted, RocksDB's included): the difference of the two
totals over N is what firing costs, in instructions per timer, whatever else the machine is doing.
`--code DIR` runs another tree's chronoq (a clone of an older commit), for a before/after.

    valgrind --tool=callgrind --callgrind-out-file=/tmp/a.out .venv/bin/python bench/bench_fire_instructions.py accept
    valgrind --tool=callgrind --callgrind-out-file=/tmp/f.out .venv/bin/python bench/bench_fire_instructions.py fire
    # ("Collected" on valgrind's stderr: (fire - accept) / N)

The accept alone, per timer: `accept --timers 25000` minus `accept --timers 5000`, over 20,000
(`--read-cache-bytes 1048576`: with the read cache full, as in a broker that has run a while).
The gRPC door's decoding, which the in-process accept skips: `decode` minus `requests` (the same
SendMessage requests of 100 timers, as chronoq's SDK encodes them, parsed and then decoded, or
only parsed), over `--timers`.
`--serve-gc`: the cyclic collector's thresholds as `chronoq serve` sets them (`settle_heap`),
rather than CPython's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

START_MS = 1_800_000_000_000


async def broker_with_due_timers(data: Path, n: int, fire_batch: int | None = None,
                                 read_cache_bytes: int | None = None) -> Any:
    """An in-process broker (FakeClock, no background tasks) holding `n` timers accepted in
    batches of 100 and all due now; `fire_batch`: its `timer_fire_batch`, `read_cache_bytes` its
    read cache (None: the defaults; a small cache is full after a few thousand timers).
    The set-up `bench_fire_stages.py` measures from too. chronoq is imported here, so that
    `--code` chooses which one."""
    from chronoq.broker import Broker
    from chronoq.clock import FakeClock
    from chronoq.config import Config
    from chronoq.model import OutgoingMessage

    clock = FakeClock(START_MS)
    overrides: dict[str, int] = {}
    if fire_batch is not None:
        overrides["timer_fire_batch"] = fire_batch
    if read_cache_bytes is not None:
        overrides["read_cache_bytes"] = read_cache_bytes
    config = Config(data_dir=data, **overrides)
    broker = await Broker.open(config, clock=clock, background=False)
    try:
        await broker.create_topic("orders", 4)
        due = START_MS + 60_000
        msgs = [OutgoingMessage("orders", b"b" * 100, message_id=f"m{i:08d}", deliver_at_ms=due) for i in range(n)]
        for i in range(0, n, 100):
            await broker.send_batch(msgs[i:i + 100])
        clock.advance(60_000)
    except BaseException:
        await broker.close()
        raise
    return broker


async def run(data: Path, n: int, fire: bool, read_cache_bytes: int | None) -> None:
    broker = await broker_with_due_timers(data, n, 8192, read_cache_bytes)
    try:
        if fire:
            assert await broker.run_due() == n
    finally:
        await broker.close()


def requests(n: int, decode: bool, data: Path) -> None:
    """Parse `n` timers in SendMessage requests of 100 and, with `decode`, decode them as the
    server does (`protocol.requests.decode_send`)."""
    from chronoq.client import outgoing, wire
    from chronoq.config import Config
    from chronoq.protocol.requests import decode_send
    from chronoq.protocol.v2 import service

    config = Config(data_dir=data)
    due = START_MS + 60_000
    msgs = [outgoing("orders", b"b" * 100, deliver_at=due, message_id=f"m{i:08d}") for i in range(n)]
    parsed = [service.SendMessageRequest.FromString(service.SendMessageRequest(
        messages=[wire.encode_message(m, START_MS) for m in msgs[i:i + 100]]).SerializeToString())
        for i in range(0, n, 100)]
    if decode:
        assert sum(len(decode_send(request, config).messages) for request in parsed) == n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("accept", "fire", "requests", "decode"))
    parser.add_argument("--timers", type=int, default=20_000)
    parser.add_argument("--read-cache-bytes", type=int, default=None,
                        help="the broker's read_cache_bytes (default: the broker's default)")
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the tree whose chronoq to run (default: this one)")
    parser.add_argument("--serve-gc", action="store_true",
                        help="the collector's thresholds as `chronoq serve` sets them (default: CPython's)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code))
    with tempfile.TemporaryDirectory() as tmp:
        if args.serve_gc:
            from chronoq.config import Config
            from chronoq.server.serve import GC_OLDER_THRESHOLDS

            gc.set_threshold(Config(data_dir=Path(tmp)).gc_young_objects, *GC_OLDER_THRESHOLDS)
        if args.mode in ("requests", "decode"):
            requests(args.timers, args.mode == "decode", Path(tmp) / "data")
        else:
            asyncio.run(run(Path(tmp) / "data", args.timers, args.mode == "fire", args.read_cache_bytes))


if __name__ == "__main__":
    main()
