"""`python -m bench`: parse options, run every system through the chosen phases, write the report.

Theory of operation: defaults are the full comparison (every system, every default phase,
10 M pending in the backlog run); the rate sweep is opt-in (`--phases ...,sweep`)
because it is a precision run per rate. `--smoke` shrinks it to the floor and chronoq with tiny
counts and short delays so the test suite can run it in a minute. Systems run one after another,
never at once, so they do not share the two cores; a system that is not installed is reported,
not skipped. The floor (a stub server that only speaks the protocol) comes first, so every
figure after it can be read against it. Results go to `--out`, else to a new directory named
for the start time under `bench.results_dir()` (`$BENCH_RESULTS_DIR`, else the git-ignored
`bench/results/`).
`python -m bench timer-engines` runs the engine-level comparison instead (`bench/bench_timer_engines.py`:
the RocksDB index and the file wheel side by side, no servers); `python -m bench schedules`, the
recurring-schedules run (`bench/bench_schedules.py`: N schedules every minute beside the same due
times as one-shot timers, each on its own `chronoq serve`); `python -m bench spark-hold`, the Spark
engine holding N far timers (`bench/bench_spark_hold.py`: the broker's RSS and the job's state). Each
takes its own options.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench import RESULTS_ENV, results_dir
from bench.harness import report
from bench.harness.runner import DEFAULT_PHASES, PHASES, RunConfig, run_system
from bench.peers.base import SYSTEMS, load_peer

DESCRIPTION = ("Side-by-side benchmark: chronoq against the floor (a stub server of the same protocol that stores "
               "nothing), Redis (sorted set), NATS (message schedules), RabbitMQ (TTL + dead letter) and beanstalkd "
               "(delayed jobs), each started here on 127.0.0.1. Writes results.json, results.md and chart.png.")
SMOKE = {"systems": ["floor", "chronoq"], "accept_n": 300, "accept_seconds": 10.0, "n": 200, "rate": 200.0,
         "delay_min_s": 1.0, "delay_max_s": 2.0, "grace_s": 5.0, "crash_n": 100, "crash_delay_min_s": 1.0,
         "crash_delay_max_s": 4.0, "crash_kill_after_s": 1.5, "backlog_n": 1000, "backlog_seconds": 20.0,
         "burst_n": 500, "burst_lead_s": 2.0, "sweep_rates": (100.0, 200.0), "sweep_seconds": 1.0,
         "sweep_delay_min_s": 0.5, "sweep_delay_max_s": 1.0}


def build_parser() -> argparse.ArgumentParser:
    d = RunConfig(systems=[], phases=[])
    p = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    p.add_argument("--smoke", action="store_true",
                   help="tiny run of the floor and chronoq (the test suite runs this; --phases still applies)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES),
                   help=f"comma list from {','.join(PHASES)} (default: all but sweep)")
    p.add_argument("--out", type=Path, help=f"results directory (default: ${RESULTS_ENV}/<UTC timestamp> if set, "
                        "else bench/results/<UTC timestamp>, which git ignores)")
    p.add_argument("--producers", type=int, default=d.producers, help="producer processes per system")
    p.add_argument("--chunk", type=int, default=d.chunk, help="messages per batched/pipelined call")
    p.add_argument("--accept-n", type=int, default=d.accept_n, help="messages per accept mode")
    p.add_argument("--accept-seconds", type=float, default=d.accept_seconds, help="time cap per accept mode")
    p.add_argument("--n", type=int, default=d.n, help="messages in the precision phase")
    p.add_argument("--rate", type=float, default=d.rate, help="fixed send rate of the precision phase, msg/s")
    p.add_argument("--delay-min-s", type=float, default=d.delay_min_s)
    p.add_argument("--delay-max-s", type=float, default=d.delay_max_s)
    p.add_argument("--grace-s", type=float, default=d.grace_s, help="consumer wait after the last due time")
    p.add_argument("--crash-n", type=int, default=d.crash_n)
    p.add_argument("--crash-kill-after-s", type=float, default=d.crash_kill_after_s)
    p.add_argument("--backlog-n", type=int, default=d.backlog_n, help="pending messages in the backlog run")
    p.add_argument("--backlog-seconds", type=float, default=d.backlog_seconds, help="time cap of the backlog load")
    p.add_argument("--burst-n", type=int, default=d.burst_n, help="messages all due in the same millisecond")
    p.add_argument("--burst-lead-s", type=float, default=d.burst_lead_s,
                   help="seconds from the burst's start to its due time (0: 5 s + N / 4,000 msg/s)")
    p.add_argument("--sweep-rates", default=",".join(f"{r:g}" for r in d.sweep_rates),
                   help="comma list of fixed rates (msg/s) for the sweep phase")
    p.add_argument("--sweep-seconds", type=float, default=d.sweep_seconds, help="sending time per sweep rate")
    p.add_argument("--sweep-delay-min-s", type=float, default=d.sweep_delay_min_s)
    p.add_argument("--sweep-delay-max-s", type=float, default=d.sweep_delay_max_s)
    p.add_argument("--sweep-p99-ms", type=float, default=d.sweep_p99_limit_ms,
                   help="the P99 delivery error a sweep rate must meet")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--keep-data", action="store_true", help="keep the servers' temporary data dirs")
    p.add_argument("--profile", action="store_true",
                   help="record the Python servers (chronoq, floor) with py-spy in the accept, precision and "
                        "burst phases")
    return p


def config_from_args(args: argparse.Namespace) -> RunConfig:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    for ph in phases:
        if ph not in PHASES:
            raise SystemExit(f"unknown phase {ph!r}; choose from {', '.join(PHASES)}")
    values: dict[str, Any] = {
        "systems": systems, "phases": phases, "producers": args.producers, "chunk": args.chunk,
        "accept_n": args.accept_n, "accept_seconds": args.accept_seconds, "n": args.n, "rate": args.rate,
        "delay_min_s": args.delay_min_s, "delay_max_s": args.delay_max_s, "grace_s": args.grace_s,
        "crash_n": args.crash_n, "crash_kill_after_s": args.crash_kill_after_s, "backlog_n": args.backlog_n,
        "backlog_seconds": args.backlog_seconds, "seed": args.seed, "keep_data": args.keep_data,
        "profile": args.profile, "burst_n": args.burst_n, "burst_lead_s": args.burst_lead_s,
        "sweep_rates": _rates(args.sweep_rates), "sweep_seconds": args.sweep_seconds,
        "sweep_delay_min_s": args.sweep_delay_min_s, "sweep_delay_max_s": args.sweep_delay_max_s,
        "sweep_p99_limit_ms": args.sweep_p99_ms,
    }
    if args.smoke:
        values.update(SMOKE)
    cfg = RunConfig(**values)
    if cfg.producers < 1 or cfg.chunk < 1 or cfg.rate <= 0 or cfg.n < 1:
        raise SystemExit("--producers, --chunk, --n and --rate must be positive")
    if not 0 < cfg.delay_min_s <= cfg.delay_max_s:
        raise SystemExit("need 0 < --delay-min-s <= --delay-max-s")
    if not 0 < cfg.sweep_delay_min_s <= cfg.sweep_delay_max_s:
        raise SystemExit("need 0 < --sweep-delay-min-s <= --sweep-delay-max-s")
    if cfg.burst_n < 1 or cfg.burst_lead_s < 0 or cfg.sweep_seconds <= 0:
        raise SystemExit("--burst-n and --sweep-seconds must be positive, --burst-lead-s not negative")
    return cfg


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(sorted(float(r) for r in text.split(",") if r.strip()))
    except ValueError:
        raise SystemExit(f"--sweep-rates must be a comma list of numbers, not {text!r}") from None
    if not rates or rates[0] <= 0:
        raise SystemExit("--sweep-rates needs at least one positive rate")
    return rates


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["timer-engines"]:  # the engine-level comparison: no servers, its own options
        from bench.bench_timer_engines import main as timer_engines

        return timer_engines(given[1:])
    if given[:1] == ["schedules"]:  # recurring schedules beside one-shot timers: its own options
        from bench.bench_schedules import main as schedules

        return schedules(given[1:])
    if given[:1] == ["spark-hold"]:  # the Spark engine holding far timers: its own options
        from bench.bench_spark_hold import main as spark_hold

        return spark_hold(given[1:])
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir = args.out or results_dir() / started

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    results: dict[str, Any] = {
        "started": started, "command": shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}",
        "config": cfg.as_dict(), "systems": {},
    }
    for name in cfg.systems:
        results["systems"][name] = run_system(cfg, load_peer(name), out_dir, log)
    results["load_at_end"] = os.getloadavg()
    paths = report.write(results, out_dir)
    print(paths["markdown"].read_text())
    log(f"results: {paths['json']}, {paths['markdown']}, {paths['chart']}")
    failed = [n for n, s in results["systems"].items()
              if s.get("installable") and any("failed" in (s.get(ph) or {}) for ph in cfg.phases)]
    return 1 if failed else 0
