"""Benchmark: N recurring schedules firing every minute, beside the same load as one-shot timers.

Theory of operation: two runs, each on its own `chronoq serve` child (fresh temp data directory,
default settings unless `--set name=value`), measured as a user runs chronoq (the SDK only).

- `schedules`: `--creators` concurrent SDK calls create `--schedules` schedules `every 60s`
  (`AsyncAdmin.create_schedule`; `--every-s` for another interval), so their occurrences come at
  N different instants of each minute, spread over the time the creates took. Then `--minutes`
  occurrences of each are consumed: every occurrence whose nominal time (SCHEDULE_DUE_MS) lies
  in those minutes is owed (with `--steady`, only those due after the last create returned).
- `timers`: the same due times as one-shot timers: for each of N ids, `--minutes` timer messages
  sent one by one (`AsyncProducer.send`, the same concurrency), due one interval apart from one
  interval after the send, as the schedule created at that moment would have them.

Each run reports the create rate (schedules, or timer ids, per second; `calls_per_s` counts the
timers' sends, `--minutes` per id), the server's RSS (VmRSS of it and its children, from
/proc: idle, after the creates, peak while delivering), and per delivered message its delivery
error, the fired copy's store time minus its due time (the broker's clock both; `received_ms`
minus due, on this process's clock, beside it): P50, P99, P99.9 and max; early (stored or received
before due), missed (owed, never received by the end plus `--grace-s`) and duplicated (a message
id received twice; consumers ack each batch at once, with an invisible time longer than the run,
so a duplicate is the broker's) counts. Results go to `schedules.json` under `bench.results_dir()`
(or `--out`), and a table of both runs is printed. On a shared 2-core host the rates are
noisy; the counts are exact.

    python -m bench schedules --schedules 100000 --minutes 2
    python -m bench schedules --schedules 200 --minutes 2 --every-s 2 --grace-s 5   # in miniature
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import results_dir  # noqa: E402
from bench.bench_backlog_memory import tree_rss_bytes  # noqa: E402

MODES = ("schedules", "timers")
TOPIC = "ticks"
BODY = b"x" * 100
INVISIBLE_MS = 3_600_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def percentile(values: list[int], p: float) -> int | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def make_load(address: str, mode: str, n: int, minutes: int, creators: int,
                    every_ms: int) -> tuple[set[tuple[str, int]], float]:
    """Create the schedules (or send the timers); return what is owed ((name, due) for every
    occurrence in the measured minutes, a timer's id being `<name>@<due>`) and the seconds it took."""
    from chronoq.client import AsyncProducer

    owed: set[tuple[str, int]] = set()
    next_i = iter(range(n))

    async def worker() -> None:
        async with AsyncProducer(address, timeout_ms=60_000) as client:
            for i in next_i:
                name = f"s{i:06d}"
                if mode == "schedules":
                    s = await client.create_schedule(name, TOPIC, BODY, every_ms=every_ms)
                    owed.update((name, due) for due in s["upcoming_ms"][:minutes])
                else:
                    first = now_ms() + every_ms
                    for m in range(minutes):
                        due = first + m * every_ms
                        await client.send(TOPIC, BODY, deliver_at=due, message_id=f"{name}@{due}",
                                          properties={"SCHEDULE_DUE_MS": str(due)})
                        owed.add((name, due))

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(creators)))
    return owed, time.monotonic() - started


async def consume(address: str, seen: list[tuple[str, int, int, int]], stop: asyncio.Event) -> None:
    """Receive and ack until `stop`: (message id, due, store ms, received ms) per message."""
    from chronoq.client import AsyncConsumer

    async with AsyncConsumer("bench", TOPIC, server=address, timeout_ms=30_000) as c:
        while not stop.is_set():
            got = await c.receive(64, invisible=INVISIBLE_MS, wait=1000)
            for m in got:
                seen.append((m.message_id, int(m.properties["SCHEDULE_DUE_MS"]), m.store_ms or 0, m.received_ms))
            if got:
                await c.ack(*got)


async def run(address: str, pid: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from chronoq.client import AsyncAdmin

    async with AsyncAdmin(address) as admin:
        await admin.create_topic(TOPIC, message_types=["DELAY"])
    await asyncio.sleep(1.0)
    rss_idle = tree_rss_bytes(pid)
    seen: list[tuple[str, int, int, int]] = []
    stop = asyncio.Event()
    consumers = [asyncio.create_task(consume(address, seen, stop)) for _ in range(args.consumers)]
    owed, create_s = await make_load(address, mode, args.schedules, args.minutes, args.creators, args.every_s * 1000)
    if args.steady:  # only what comes due once every create (or send) is done: firing alone
        created_ms = now_ms()
        owed = {(name, due) for name, due in owed if due > created_ms}
    rss_loaded = tree_rss_bytes(pid)
    print(json.dumps({"mode": mode, "created": args.schedules, "create_s": round(create_s, 1),
                      "rss_loaded_mb": round(rss_loaded / 2**20, 1)}), flush=True)
    last_due = max(d for _, d in owed)
    rss_peak = rss_loaded
    shown = time.monotonic()
    while now_ms() < last_due + args.grace_s * 1000:
        await asyncio.sleep(1.0)
        rss_peak = max(rss_peak, tree_rss_bytes(pid))
        owed_by_now = sum(1 for _, d in owed if d <= now_ms())
        if now_ms() > last_due + 2000 and owed <= {(mid.split("@")[0], due) for mid, due, _, _ in seen}:
            break  # every owed occurrence is in (copies beyond the measured minutes do not count)
        if time.monotonic() - shown >= 10:
            shown = time.monotonic()
            print(json.dumps({"mode": mode, "received": len(seen), "owed_by_now": owed_by_now}), flush=True)
    stop.set()
    await asyncio.gather(*consumers)

    per_id = Counter(mid for mid, _, _, _ in seen)
    received = {(mid.split("@")[0], due) for mid, due, _, _ in seen}
    in_window = [(mid, due, store, recv) for mid, due, store, recv in seen if (mid.split("@")[0], due) in owed]
    fire_error = [store - due for _, due, store, _ in in_window]
    receive_error = [recv - due for _, due, _, recv in in_window]
    async with AsyncAdmin(address) as admin:
        stats = await admin.stats()
    return {
        "mode": mode, "count": args.schedules, "minutes": args.minutes, "every_s": args.every_s,
        "creators": args.creators, "steady": args.steady,
        "create_per_s": round(args.schedules / create_s, 1), "create_s": round(create_s, 1),
        "calls_per_s": round(args.schedules * (1 if mode == "schedules" else args.minutes) / create_s, 1),
        "rss_idle_mb": round(rss_idle / 2**20, 1), "rss_loaded_mb": round(rss_loaded / 2**20, 1),
        "rss_peak_mb": round(rss_peak / 2**20, 1),
        "owed": len(owed), "received": len(seen),
        "missed": len(owed - received), "early": sum(1 for e in fire_error + receive_error if e < 0),
        "duplicated": sum(n - 1 for n in per_id.values() if n > 1),
        "beyond_window": len(seen) - len(in_window),
        "delivery_error_ms": {p: percentile(fire_error, q) for p, q in (("p50", 0.5), ("p99", 0.99),
                                                                          ("p999", 0.999))}
        | {"max": max(fire_error, default=None)},
        "receive_error_ms": {p: percentile(receive_error, q) for p, q in (("p50", 0.5), ("p99", 0.99),
                                                                            ("p999", 0.999))}
        | {"max": max(receive_error, default=None)},
        "server_schedules": stats.get("schedules"),
    }


def table(runs: list[dict[str, Any]]) -> str:
    """The runs side by side, as markdown (docs/performance.md's table)."""
    rows = [("created /s", lambda r: f"{r['create_per_s']:,.0f}"),
            ("RSS idle / loaded / peak, MB", lambda r: f"{r['rss_idle_mb']:.0f} / {r['rss_loaded_mb']:.0f} / "
                                                       f"{r['rss_peak_mb']:.0f}"),
            ("owed / received", lambda r: f"{r['owed']:,} / {r['received']:,}"),
            ("delivery error P50 / P99 / P99.9 / max, ms",
             lambda r: " / ".join(str(r["delivery_error_ms"][k]) for k in ("p50", "p99", "p999", "max"))),
            ("received - due P50 / P99 / P99.9, ms",
             lambda r: " / ".join(str(r["receive_error_ms"][k]) for k in ("p50", "p99", "p999"))),
            ("early / missed / duplicated", lambda r: f"{r['early']} / {r['missed']} / {r['duplicated']}")]
    lines = ["| | " + " | ".join(f"{r['mode']} ({r['count']:,})" for r in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(cell(r) for r in runs) + " |" for label, cell in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench schedules", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=100_000, help="schedules (and timer ids) in each run")
    ap.add_argument("--minutes", type=int, default=2,
                    help="occurrences measured per schedule (minutes at the default interval)")
    ap.add_argument("--every-s", type=int, default=60, help="the schedules' interval, s (at least 1)")
    ap.add_argument("--creators", type=int, default=16, help="concurrent create (or send) calls")
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--grace-s", type=int, default=30, help="how long after the last due time to wait")
    ap.add_argument("--steady", action="store_true",
                    help="owe only the occurrences due after the last create (or send) returned: the steady "
                         "state, with nothing being created meanwhile (give --minutes 4 or more)")
    ap.add_argument("--modes", default="schedules,timers")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="server config override")
    ap.add_argument("--out", type=Path, default=results_dir() / "schedules.json")
    args = ap.parse_args(argv)
    if args.schedules < 1 or args.minutes < 1 or args.every_s < 1 or args.creators < 1 or args.consumers < 1:
        ap.error("--schedules, --minutes, --every-s, --creators and --consumers must be at least 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes a comma list from {', '.join(MODES)}, not {args.modes!r}")
    from chronoq.client.testing import ServerProcess

    settings = dict(kv.split("=", 1) for kv in args.set)
    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="chronoq-bench-schedules-") as tmp:
            server = ServerProcess(Path(tmp) / "data", settings=settings, args=["--log-level", "WARNING"]).start()
            try:
                assert server.process is not None
                results.append(asyncio.run(run(server.address, server.process.pid, mode, args)))
            finally:
                server.stop()
        print(json.dumps(results[-1], indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "runs": results}, indent=2) + "\n")
    print("\n" + table(results), flush=True)
    return 1 if any(r["early"] or r["missed"] or r["duplicated"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
