"""`python -m bench`: parse options, run every system through the chosen phases, write the report.

Theory of operation: defaults are the full comparison of issue 6 (every system, every phase,
10 M pending in the backlog run); `--smoke` shrinks it to chronoq alone with tiny counts and short
delays so the test suite can run it in seconds. Systems run one after another, never at once, so
they do not share the two cores; a system that is not installed is reported, not skipped.
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

from bench.harness import report
from bench.harness.runner import PHASES, RunConfig, run_system
from bench.peers.base import SYSTEMS, load_peer

DESCRIPTION = ("Side-by-side benchmark: chronoq against Redis (sorted set), NATS (message schedules), RabbitMQ "
               "(TTL + dead letter) and beanstalkd (delayed jobs), each started here on 127.0.0.1. Writes "
               "results.json, results.md and chart.png.")
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
SMOKE = {"systems": ["chronoq"], "accept_n": 300, "accept_seconds": 10.0, "n": 200, "rate": 200.0,
         "delay_min_s": 1.0, "delay_max_s": 2.0, "grace_s": 5.0, "crash_n": 100, "crash_delay_min_s": 1.0,
         "crash_delay_max_s": 4.0, "crash_kill_after_s": 1.5, "backlog_n": 1000, "backlog_seconds": 20.0}


def build_parser() -> argparse.ArgumentParser:
    d = RunConfig(systems=[], phases=[])
    p = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    p.add_argument("--smoke", action="store_true", help="tiny run of chronoq only (the test suite runs this)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list from {','.join(PHASES)}")
    p.add_argument("--out", type=Path, help="results directory (default bench/results/<UTC timestamp>)")
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
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--keep-data", action="store_true", help="keep the servers' temporary data dirs")
    p.add_argument("--profile", action="store_true",
                   help="record chronoq's server with py-spy in the accept and precision phases (logs/)")
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
        "profile": args.profile,
    }
    if args.smoke:
        values.update(SMOKE)
    cfg = RunConfig(**values)
    if cfg.producers < 1 or cfg.chunk < 1 or cfg.rate <= 0 or cfg.n < 1:
        raise SystemExit("--producers, --chunk, --n and --rate must be positive")
    if not 0 < cfg.delay_min_s <= cfg.delay_max_s:
        raise SystemExit("need 0 < --delay-min-s <= --delay-max-s")
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir = args.out or RESULTS_DIR / started

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
