"""Benchmark: CPU per message in each room of the message path, in process (no gRPC).

Theory of operation: one in-process broker (FakeClock, no background tasks, `flush = "sync"`,
so every group commit is a real fdatasync) on a fresh temporary directory. N timer messages are
accepted in batches (`send_batch`), all due at the same time; the clock moves past it and
`run_due()` fires them; a consumer group receives them in batches of 32 (`receive`) and acks each
batch (`ack_many`). Each stage is timed with `time.process_time()` (this process's CPU, the
fsync thread included) and reported in microseconds per message, so a change to one room shows
in its own row. What this leaves out is the protocol: gRPC and protobuf cost as much again or
more (`python -m bench` measures that, beside a server that stores nothing).

    .venv/bin/python bench/bench_path.py --messages 50000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chronoq.broker import Broker  # noqa: E402
from chronoq.clock import FakeClock  # noqa: E402
from chronoq.config import Config  # noqa: E402
from chronoq.model import OutgoingMessage  # noqa: E402

START_MS = 1_800_000_000_000


async def measure(n: int, batch: int, body_bytes: int, data: Path) -> dict[str, float]:
    clock = FakeClock(START_MS)
    broker = await Broker.open(Config(data_dir=data), clock=clock, background=False)
    out: dict[str, float] = {"messages": n, "batch": batch, "body_bytes": body_bytes}
    try:
        await broker.create_topic("orders", 4)
        body = b"b" * body_bytes
        due = START_MS + 60_000
        msgs = [OutgoingMessage("orders", body, message_id=f"m{i:08d}", deliver_at_ms=due) for i in range(n)]
        t = time.process_time()
        for i in range(0, n, batch):
            await broker.send_batch(msgs[i:i + batch])
        out["accept_us"] = (time.process_time() - t) * 1e6 / n
        clock.advance(60_000)
        t = time.process_time()
        fired = await broker.run_due()
        out["fire_us"] = (time.process_time() - t) * 1e6 / n
        assert fired == n, fired
        receive_s = ack_s = 0.0
        got = 0
        while True:
            t = time.process_time()
            batch_got = await broker.receive("g", "orders", batch_size=32, invisible_duration_ms=60_000)
            receive_s += time.process_time() - t
            if not batch_got:
                break
            got += len(batch_got)
            t = time.process_time()
            await broker.ack_many("g", "orders", [r.receipt_handle for r in batch_got])
            ack_s += time.process_time() - t
        assert got == n, got
        out["receive_us"] = receive_s * 1e6 / n
        out["ack_us"] = ack_s * 1e6 / n
        out["total_us"] = out["accept_us"] + out["fire_us"] + out["receive_us"] + out["ack_us"]
        return out
    finally:
        await broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--body-bytes", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "path.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(measure(args.messages, args.batch, args.body_bytes, Path(tmp) / "data"))
    result["command"] = " ".join(sys.argv)
    for key in ("accept_us", "fire_us", "receive_us", "ack_us", "total_us"):
        print(f"{key:12s} {result[key]:8.1f} us/message")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
