"""The phases of one benchmark run, each against a fresh server of one system.

Theory of operation: a phase starts the system's server in its own temporary data dir, creates
what the workload needs, runs producer and consumer worker processes, reads their JSON results and
stops the server by pid, whatever happens (try/finally). Each phase returns a plain dict that goes
straight into the results JSON; the figures are computed by `workload.delivery_figures` for every
system alike. Server CPU is sampled over the server's whole process tree (`TreeSampler`) and
divided by the messages of the part it covers, so every system's "CPU per message" includes
whatever the server did meanwhile (idle ticks, long polls), as a user's machine would pay it.
- accept: deadlines an hour ahead, no consumer: messages/s accepted one at a time, then batched,
  and server CPU per request (one at a time) and per accepted message (batched).
- precision: one fixed rate for every system, delays in [a, b]: the delivery error, and server
  CPU per message end to end (accept + fire + deliver + ack, over the whole phase).
- burst: N messages all due in the same millisecond, `burst_lead_s` ahead (long enough to send
  them all first; a run whose sends ended after the due time is marked invalid, not scored as a
  burst): how long after the due time the server's pending count reached 0 (it says it fired
  them all) and the last one reached the consumer.
- crash: messages pending, SIGKILL of the whole server tree mid-run, restart, drain: lost, early,
  duplicates, and how long the restart took until the server answered.
- backlog: N pending far in the future: accept rate over time, RSS and disk at the end, pending
  count and time until ready after a graceful restart.
- sweep (opt-in, not in the default phases: it is a precision run per rate): precision at rising
  fixed rates for `sweep_seconds` each, with short delays (`sweep_delay_*`) so that for most of
  the run messages fall due as fast as they are sent (accept, fire and deliver all at the rate);
  the highest rate whose run met P99 <= `sweep_p99_limit_ms` with nothing lost or early and the
  rate achieved. It stops after `SWEEP_STOP_AFTER_FAILURES` failing rates in a row.
A phase a peer declares unsupported (`Peer.unsupported`) is recorded as skipped, with its reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import multiprocessing
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import profiling, workers
from bench.harness.procs import Server, ServerFailed, TreeSampler, dir_size_bytes
from bench.harness.workload import delay_spec, delivery_figures, message_id
from bench.peers.base import Peer

SPAWN = multiprocessing.get_context("spawn")
WORKER_START_ALLOWANCE_S = 3.0
"""Time a spawned worker needs to import and connect (used for the consumer's deadline)."""
PRODUCER_START_TIMEOUT_S = 120.0
JOIN_SLACK_S = 60.0
BURST_LEAD_BASE_S = 5.0
BURST_ASSUMED_ACCEPT_PER_S = 4000.0
"""The automatic burst lead is BASE + N / this: time to send N batched at the slowest batched
accept rate measured here among systems that can take a burst (chronoq ~4,000-7,000/s)."""
BURST_MIN_DRAIN_PER_S = 1000.0
"""The burst consumer gives up N / this seconds (plus grace) after the due time."""
BURST_POLL_S = 0.05
"""How often the harness asks the server for its pending count after the due time."""
SWEEP_STOP_AFTER_FAILURES = 2
"""Two failing rates in a row end a sweep: one may be noise (another workload shares the cores),
two are a limit, and rates above it only take longer to fail."""
SWEEP_MIN_ACHIEVED = 0.95
"""A sweep rate counts only if the producers achieved this fraction of it."""


@dataclass
class RunConfig:
    systems: list[str]
    phases: list[str]
    producers: int = 1
    chunk: int = 256
    """Messages per send_many call in batched mode."""
    accept_n: int = 50_000
    accept_seconds: float = 30.0
    """Each accept mode stops after this long even if not all accept_n were sent (slow peers)."""
    far_delay_s: float = 3600.0
    n: int = 50_000
    rate: float = 2000.0
    """Every system here sustains 2,000/s with one producer on 2 cores; at 5,000/s one producer of
    RabbitMQ (tx batches, ~3,800/s) falls behind, so the 5,000/s comparison uses `--producers 2`."""
    delay_min_s: float = 5.0
    delay_max_s: float = 30.0
    grace_s: float = 15.0
    """How long the consumer keeps waiting after the last message was due."""
    crash_n: int = 2000
    crash_delay_min_s: float = 3.0
    crash_delay_max_s: float = 15.0
    crash_kill_after_s: float = 7.0
    backlog_n: int = 10_000_000
    backlog_seconds: float = 1800.0
    seed: int = 20261122
    keep_data: bool = False
    burst_n: int = 100_000
    burst_lead_s: float = 0.0
    """Seconds from when the producers may start (WORKER_START_ALLOWANCE_S into the phase) to the
    burst's due time; 0 picks BURST_LEAD_BASE_S + N / BURST_ASSUMED_ACCEPT_PER_S."""
    sweep_rates: tuple[float, ...] = (1000.0, 2000.0, 3000.0, 5000.0, 8000.0, 12000.0)
    sweep_seconds: float = 20.0
    """Sending time per sweep rate."""
    sweep_delay_min_s: float = 3.0
    sweep_delay_max_s: float = 8.0
    sweep_p99_limit_ms: float = 20.0
    profile: bool = False
    """Record Python servers (chronoq, the floor) with py-spy during the accept and precision phases."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Phase:
    """One phase's scratch space: a data dir for the server, a log dir, a dir for worker results."""

    def __init__(self, cfg: RunConfig, peer: Peer, name: str, out_dir: Path) -> None:
        self.cfg, self.peer, self.name, self.out_dir = cfg, peer, name, out_dir
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-{peer.name}-{name}-"))
        self.data_dir = self.tmp / "data"
        self.work_dir = self.tmp / "work"
        self.work_dir.mkdir()
        self.log_dir = out_dir / "logs" / f"{peer.name}-{name}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._seq = 0

    def cleanup(self) -> None:
        if not self.cfg.keep_data:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def out_path(self, role: str) -> Path:
        self._seq += 1
        return self.work_dir / f"{role}-{self._seq}.json"

    def spawn(self, target: Callable[..., None], addr: dict[str, Any], spec: dict[str, Any],
              role: str, *extra: Any) -> tuple[multiprocessing.process.BaseProcess, Path]:
        out = self.out_path(role)
        proc = SPAWN.Process(target=target, args=(self.peer.name, addr, spec, str(out), *extra), name=f"{role}")
        proc.start()
        return proc, out


def _join(proc: multiprocessing.process.BaseProcess, out: Path, timeout_s: float) -> dict[str, Any]:
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()  # our own child, by its pid
        proc.join(5)
        raise RuntimeError(f"worker {proc.name} (pid {proc.pid}) did not finish within {timeout_s:.0f} s")
    if not out.exists():
        raise RuntimeError(f"worker {proc.name} exited {proc.exitcode} without writing {out}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_producers(ph: Phase, addr: dict[str, Any], tag: str, delays: dict[str, int], mode: str, *,
                  rate: float = 0.0, max_seconds: float = 0.0, chunk: int | None = None,
                  max_chunk: int | None = None, due_at_ms: int | None = None) -> dict[str, Any]:
    """Run P producers over the `delays` spec (split round-robin); return rate, counts and progress."""
    p = ph.cfg.producers
    chunk = chunk or ph.cfg.chunk
    # Producers start together once every one has connected, so start-up is never timed.
    start = SPAWN.Barrier(p + 1)
    procs = []
    for k in range(p):
        spec = {"tag": tag, "producer": k, "producers": p, "mode": mode, "delays": delays, "chunk": chunk,
                "max_chunk": max_chunk or chunk, "rate": rate / p if rate else 0.0, "max_seconds": max_seconds,
                "due_at_ms": due_at_ms}
        procs.append(ph.spawn(workers.producer_main, addr, spec, f"producer-{tag}-{k}", start))
    try:
        start.wait(PRODUCER_START_TIMEOUT_S)
    except threading.BrokenBarrierError:
        for proc, _out in procs:
            proc.kill()  # our own children, by pid
            proc.join(5)
        raise RuntimeError(f"producers did not connect within {PRODUCER_START_TIMEOUT_S:.0f} s") from None
    budget = (max_seconds or delays["n"] / max(rate, 1.0) + 600) + JOIN_SLACK_S
    results = [_join(proc, out, budget) for proc, out in procs]
    sent = sum(r["sent"] for r in results)
    elapsed_s = max(r["t_end_s"] for r in results) - min(r["t_start_s"] for r in results)
    errors = [r["error"] for r in results if r["error"]]
    return {"mode": mode, "sent": sent, "elapsed_s": round(elapsed_s, 3),
            "t_start_s": min(r["t_start_s"] for r in results),
            "per_s": round(sent / elapsed_s, 1) if elapsed_s > 0 else None, "errors": errors,
            "sent_by_producer": {r["producer"]: r["sent"] for r in results}, "tag": tag,
            "progress": [r["progress"] for r in results]}


def accepted_ids(prod: dict[str, Any]) -> list[str]:
    """Ids of every acknowledged message: a producer's first `sent` messages, in order."""
    return [message_id(prod["tag"], k, i) for k, sent in prod["sent_by_producer"].items() for i in range(sent)]


def start_consumer(ph: Phase, addr: dict[str, Any], expected: int,
                   deadline_s: float) -> tuple[multiprocessing.process.BaseProcess, Path]:
    return ph.spawn(workers.consumer_main, addr, {"expected": expected, "deadline_s": deadline_s}, "consumer")


def _public(prod: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in prod.items() if k not in ("sent_by_producer", "progress")}


def _with_server(ph: Phase, body: Callable[[Server], dict[str, Any]]) -> dict[str, Any]:
    server = ph.peer.start(ph.data_dir, ph.log_dir)
    profiler = None
    try:
        ph.peer.setup(server.addr)
        profiler = profiling.start(ph, server)
        out = body(server)
        out["ready_s"] = round(server.ready_s, 2)
        if profiler is not None:
            out["profile"] = profiling.finish(ph, profiler)
        return out
    finally:
        if profiler is not None:
            profiler.terminate(signal.SIGINT)
        server.stop()


def phase_accept(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    far_ms = int(cfg.far_delay_s * 1000)
    spread_ms = int((cfg.delay_max_s - cfg.delay_min_s) * 1000)

    def body(server: Server) -> dict[str, Any]:
        sampler = TreeSampler(server).start()
        out: dict[str, Any] = {}
        for mode in ("sync", "batch"):
            delays = delay_spec(cfg.accept_n, far_ms, far_ms + spread_ms, cfg.seed)
            cpu_before_s = sampler.cpu_s()
            prod = run_producers(ph, server.addr, f"acc{mode}", delays, mode, max_seconds=cfg.accept_seconds)
            out[mode] = {**_public(prod), **_cpu_figures(sampler.cpu_s() - cpu_before_s, prod["sent"])}
            server.check_alive()
        out["resources"] = sampler.stop()
        out["pending_after"] = ph.peer.pending(server.addr)
        return out

    return _with_server(ph, body)


def phase_precision(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    delays = delay_spec(cfg.n, int(cfg.delay_min_s * 1000), int(cfg.delay_max_s * 1000), cfg.seed + 1)
    chunk = max(1, int(cfg.rate / cfg.producers / 100))  # 10 ms worth of messages per call

    def body(server: Server) -> dict[str, Any]:
        sampler = TreeSampler(server).start()
        produce_s = cfg.n / cfg.rate
        deadline = time.time() + WORKER_START_ALLOWANCE_S + 2 * produce_s + cfg.delay_max_s + cfg.grace_s
        consumer, cout = start_consumer(ph, server.addr, cfg.n, deadline)
        consumer_profiler = profiling.start_pid(ph, consumer.pid, "consumer") if consumer.pid else None
        try:
            prod = run_producers(ph, server.addr, "prec", delays, "batch", rate=cfg.rate, chunk=chunk,
                                 max_chunk=cfg.chunk)
            cons = _join(consumer, cout, deadline - time.time() + JOIN_SLACK_S)
        finally:
            consumer_profile = profiling.finish(ph, consumer_profiler) if consumer_profiler else None
        out = {"produce": _public(prod), "consumer_error": cons["error"], "consumer_stats": cons.get("client_stats"),
               **delivery_figures(accepted_ids(prod), cons["received"])}
        if consumer_profile is not None:
            out["consumer_profile"] = consumer_profile
        server_view = ph.peer.server_stats(server.addr)
        if server_view is not None:
            out["server_stats"] = server_view
        out["resources"] = sampler.stop()
        out.update(_cpu_figures(out["resources"]["cpu_s"], out["delivered"]))
        consumer_cpu_s = (out["consumer_stats"] or {}).get("cpu_s")
        if consumer_cpu_s is not None and out["delivered"]:
            out["consumer_cpu_us_per_msg"] = round(consumer_cpu_s * 1e6 / out["delivered"], 1)
        return out

    return _with_server(ph, body)


def _cpu_figures(cpu_s: float, messages: int) -> dict[str, Any]:
    return {"server_cpu_s": round(cpu_s, 3),
            "cpu_us_per_msg": round(cpu_s * 1e6 / messages, 1) if messages else None}


def phase_burst(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    n = cfg.burst_n
    lead_s = cfg.burst_lead_s or BURST_LEAD_BASE_S + n / BURST_ASSUMED_ACCEPT_PER_S
    peer = ph.peer

    def body(server: Server) -> dict[str, Any]:
        sampler = TreeSampler(server).start()
        due_ms = int((time.time() + WORKER_START_ALLOWANCE_S + lead_s) * 1000)
        deadline = due_ms / 1000 + n / BURST_MIN_DRAIN_PER_S + cfg.grace_s
        consumer, cout = start_consumer(ph, server.addr, n, deadline)
        # Every message carries the same absolute due time; the delay spec only counts them.
        prod = run_producers(ph, server.addr, "burst", delay_spec(n, 0, 0, cfg.seed + 4), "batch",
                             due_at_ms=due_ms)
        sends_end_ms = (prod["t_start_s"] + prod["elapsed_s"]) * 1000
        watch = _watch_pending(peer, server, due_ms, consumer, deadline)
        cons = _join(consumer, cout, deadline - time.time() + JOIN_SLACK_S)
        figures = delivery_figures(accepted_ids(prod), cons["received"])
        out: dict[str, Any] = {
            "n": n, "lead_s": round(lead_s, 2), "due_at_ms": due_ms, "produce": _public(prod),
            "sends_ended_before_due_ms": round(due_ms - sends_end_ms, 1), "valid": sends_end_ms <= due_ms,
            "consumer_error": cons["error"], "consumer_stats": cons.get("client_stats"), **watch, **figures,
            "first_received_after_due_ms": figures["error_min_ms"],
            "last_received_after_due_ms": figures["error_max_ms"],
        }
        spread_ms = (figures["error_max_ms"] or 0) - (figures["error_min_ms"] or 0)
        out["drain_per_s"] = round(figures["delivered"] * 1000 / spread_ms, 1) if spread_ms > 0 else None
        if peer.burst_note:
            out["note"] = peer.burst_note
        out["resources"] = sampler.stop()
        out.update(_cpu_figures(out["resources"]["cpu_s"], out["delivered"]))
        return out

    return _with_server(ph, body)


def _watch_pending(peer: Peer, server: Server, due_ms: int, consumer: multiprocessing.process.BaseProcess,
                   deadline_s: float) -> dict[str, Any]:
    """The server's own pending count before the due time (None when no stats answer arrived before
    it), and when after it the count first read 0 (the server says it fired everything); polled every
    BURST_POLL_S, so the time is an upper bound by up to one poll and one stats call."""
    out: dict[str, Any] = {"pending_before_due": None, "fired_after_due_ms": None}
    try:
        # Read at once (the sends have ended) and again just before the due time; keep the last answer
        # that arrived before the due time, so a slow stats call on a loaded host cannot report what
        # fired on time as "not pending before due".
        for read_at_s in (time.time(), due_ms / 1000 - 0.2):
            time.sleep(max(0.0, read_at_s - time.time()))
            pending = peer.pending(server.addr)
            if time.time() * 1000 < due_ms:
                out["pending_before_due"] = pending
        time.sleep(max(0.0, due_ms / 1000 - time.time()))
        while time.time() < deadline_s:
            pending = peer.pending(server.addr)
            if pending == 0:
                out["fired_after_due_ms"] = round(time.time() * 1000 - due_ms, 1)
                break
            if not consumer.is_alive():
                break
            time.sleep(BURST_POLL_S)
    except Exception as e:  # a stats call failing must not lose the consumer's figures
        out["pending_error"] = f"{type(e).__name__}: {e}"
    return out


def phase_sweep(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    runs: list[dict[str, Any]] = []
    failing_in_a_row = 0
    for rate in cfg.sweep_rates:
        if failing_in_a_row >= SWEEP_STOP_AFTER_FAILURES:
            runs.append({"rate": rate, "ok": None, "why": "not run: the rates below it failed"})
            continue
        sub_cfg = dataclasses.replace(cfg, rate=rate, n=max(1, round(rate * cfg.sweep_seconds)),
                                      delay_min_s=cfg.sweep_delay_min_s, delay_max_s=cfg.sweep_delay_max_s)
        sub = Phase(sub_cfg, ph.peer, f"sweep-{rate:g}", ph.out_dir)
        try:
            res = phase_precision(sub)
        except Exception as e:
            res = {"failed": f"{type(e).__name__}: {e}"}
        finally:
            sub.cleanup()
        why = sweep_verdict(res, rate, cfg.sweep_p99_limit_ms)
        runs.append({"rate": rate, "ok": why is None, "why": why, "p99_ms": res.get("error_p99_ms"),
                     "p50_ms": res.get("error_p50_ms"), "achieved_per_s": _get_in(res, "produce", "per_s"),
                     "lost": res.get("lost"), "early": res.get("early"), "cpu_us_per_msg": res.get("cpu_us_per_msg")})
        failing_in_a_row = 0 if why is None else failing_in_a_row + 1
    best = max((r["rate"] for r in runs if r["ok"]), default=None)
    return {"p99_limit_ms": cfg.sweep_p99_limit_ms, "seconds_per_rate": cfg.sweep_seconds,
            "delays_s": [cfg.sweep_delay_min_s, cfg.sweep_delay_max_s], "runs": runs, "best_rate": best}


def sweep_verdict(res: dict[str, Any], rate: float, p99_limit_ms: float) -> str | None:
    """None when a sweep run passed, else why it did not."""
    if "failed" in res:
        return str(res["failed"]).splitlines()[0]
    errors = (_get_in(res, "produce", "errors") or []) + ([res["consumer_error"]] if res.get("consumer_error") else [])
    if errors:
        return "client error: " + str(errors[0]).strip().splitlines()[-1]
    achieved = _get_in(res, "produce", "per_s") or 0.0
    if achieved < SWEEP_MIN_ACHIEVED * rate:
        return f"sent {achieved:,.0f}/s of {rate:,.0f}/s"
    if res.get("lost") or res.get("early"):
        return f"lost {res.get('lost')}, early {res.get('early')}"
    p99 = res.get("error_p99_ms")
    if p99 is None or p99 > p99_limit_ms:
        return f"P99 {p99} ms > {p99_limit_ms:g} ms"
    return None


def _get_in(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def phase_crash(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    delays = delay_spec(cfg.crash_n, int(cfg.crash_delay_min_s * 1000), int(cfg.crash_delay_max_s * 1000),
                        cfg.seed + 2)
    server = ph.peer.start(ph.data_dir, ph.log_dir)
    restarted: Server | None = None
    try:
        ph.peer.setup(server.addr)
        consumer, cout = start_consumer(ph, server.addr, cfg.crash_n, time.time() + 3600)
        prod = run_producers(ph, server.addr, "crash", delays, "batch")
        time.sleep(max(0.0, prod["t_start_s"] + cfg.crash_kill_after_s - time.time()))
        consumer.terminate()  # SIGTERM: it writes what it received so far, then exits
        first = _join(consumer, cout, 30)
        pending_at_kill = ph.peer.pending(server.addr)
        server.kill()
        killed_s = time.time()
        restarted = ph.peer.start(ph.data_dir, ph.log_dir, server.addr)
        ph.peer.setup(restarted.addr)
        last_due_s = prod["t_start_s"] + prod["elapsed_s"] + cfg.crash_delay_max_s
        # Messages the first consumer had been handed when it stopped but never saw (in a receive
        # cut short) come back once their invisible duration ends: wait for that too.
        deadline = max(last_due_s, time.time(), killed_s + ph.peer.redelivery_after_s) + cfg.grace_s
        consumer2, cout2 = start_consumer(ph, restarted.addr, prod["sent"], deadline)
        second = _join(consumer2, cout2, deadline - time.time() + JOIN_SLACK_S)
        # The second consumer stops once it has every accepted id; ids seen only before the crash
        # count too, so a fast finish there cannot hide a loss.
        received = first["received"] + second["received"]
        figures = delivery_figures(accepted_ids(prod), received)
        return {"produce": _public(prod), "delivered_before_kill": len(first["received"]),
                "pending_at_kill": pending_at_kill, "restart_ready_s": round(restarted.ready_s, 2),
                "consumer_errors": [c["error"] for c in (first, second) if c["error"]], **figures}
    finally:
        (restarted or server).stop()
        if restarted is not None:
            server.stop()


def phase_backlog(ph: Phase) -> dict[str, Any]:
    cfg = ph.cfg
    far_ms = int(cfg.far_delay_s * 1000)
    spread_ms = int((cfg.delay_max_s - cfg.delay_min_s) * 1000)
    delays = delay_spec(cfg.backlog_n, far_ms, far_ms + spread_ms, cfg.seed + 3)
    server = ph.peer.start(ph.data_dir, ph.log_dir)
    restarted: Server | None = None
    try:
        ph.peer.setup(server.addr)
        sampler = TreeSampler(server).start()
        rss_idle_mb = sampler.rss_peak_bytes / 2**20
        prod = run_producers(ph, server.addr, "backlog", delays, "batch", max_seconds=cfg.backlog_seconds)
        rss_end_mb = sampler.current_rss_bytes() / 2**20
        res = sampler.stop()
        pending = ph.peer.pending(server.addr)
        disk_mb = dir_size_bytes(ph.data_dir) / 2**20
        server.stop()
        restarted = ph.peer.start(ph.data_dir, ph.log_dir, server.addr)
        pending_after = ph.peer.pending(restarted.addr)
        per_msg = (res["rss_peak_mb"] - rss_idle_mb) * 2**20 / pending if pending else None
        return {"produce": _public(prod), "rate_over_time": _rate_series(prod["progress"]),
                "pending": pending, "rss_idle_mb": round(rss_idle_mb, 1), "rss_end_mb": round(rss_end_mb, 1), **res,
                "rss_per_pending_B": round(per_msg, 1) if per_msg is not None else None,
                "disk_mb": round(disk_mb, 1), "restart_ready_s": round(restarted.ready_s, 2),
                "pending_after_restart": pending_after}
    finally:
        (restarted or server).stop()
        if restarted is not None:
            server.stop()


def _rate_series(progress: list[list[tuple[float, int]]], points: int = 100) -> list[tuple[float, float]]:
    """Accepted per second over time, summed over producers, in about `points` windows (>= 0.2 s)."""
    if not progress or not any(progress):
        return []
    end = max(p[-1][0] for p in progress if p)
    step_s = max(0.2, end / points)
    if 0 < end < step_s / 4:
        # The whole run is shorter than the narrowest window kept (a fast machine loads the smoke
        # backlog in tens of ms): one window, the whole run, rather than no figure at all.
        return [(round(end, 3), round(sum(_count_at(prod, end) for prod in progress) / end, 1))]
    series = []
    # Windows by index, not by adding step_s up: a float sum can overshoot `end` by a hair and
    # leave a last window ~1e-15 s wide, whose "rate" is then astronomically large.
    for k in range(1, math.ceil(end / step_s - 1e-9) + 1):
        start, t = (k - 1) * step_s, k * step_s
        width_s = min(t, end) - start  # the last window may be cut short by the end of the run
        if width_s < step_s / 4:
            continue  # too short to say anything (its few messages are counted in no window)
        total = sum(_count_at(prod, start + width_s) - _count_at(prod, start) for prod in progress)
        series.append((round(t, 2), round(total / width_s, 1)))
    return series


def _count_at(progress: list[tuple[float, int]], t: float) -> int:
    i = bisect.bisect_right(progress, t, key=lambda p: p[0])
    return progress[i - 1][1] if i else 0


PHASES: dict[str, Callable[[Phase], dict[str, Any]]] = {
    "accept": phase_accept,
    "precision": phase_precision,
    "burst": phase_burst,
    "crash": phase_crash,
    "backlog": phase_backlog,
    "sweep": phase_sweep,
}
DEFAULT_PHASES = [name for name in PHASES if name != "sweep"]


def run_system(cfg: RunConfig, peer: Peer, out_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    reason = peer.check()
    if reason is not None:
        log(f"{peer.name}: not installable: {reason}")
        return {"installable": False, "reason": f"not installable: {reason}"}
    result: dict[str, Any] = {"installable": True, "version": peer.version(), "design": peer.design,
                              "durability": peer.durability, "batch_label": peer.batch_label}
    for name in cfg.phases:
        if name in peer.unsupported:
            result[name] = {"skipped": peer.unsupported[name]}
            log(f"{peer.name}: {name} skipped: {peer.unsupported[name]}")
            continue
        log(f"{peer.name}: {name} ...")
        ph = Phase(cfg, peer, name, out_dir)
        t = time.monotonic()
        try:
            result[name] = PHASES[name](ph)
        except Exception as e:  # one system's failure must not lose the other systems' results
            detail = "" if isinstance(e, ServerFailed | RuntimeError) else "\n" + traceback.format_exc(limit=3)
            result[name] = {"failed": f"{type(e).__name__}: {e}{detail}"}
        finally:
            ph.cleanup()
        log(f"{peer.name}: {name} done in {time.monotonic() - t:.1f} s")
    return result
