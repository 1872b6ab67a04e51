"""Measure the Spark timer engine's firing error on the host it runs on, end to end.

Theory of operation: start a real `chronoq serve` (timer_firer=spark, trace_enable=true, the
hand-off horizon and backstop given) in a child process, start the engine, send N timer messages
due evenly over `spread_ms` starting `lead_ms` after the sending begins, wait until the broker
reports nothing pending, then stop everything, export the broker's delivery trace and run the
delivery report on it. The report's `fired - due` row is the engine's firing error as the broker
saw it; the micro-batch durations (Spark's progress reports) say what bounded it.

Faults, to show that nothing is lost, fired early or twice:
- `kill_job_at` (a fraction of the spread): the engine's query is stopped at that point of the
  due-time window and started again from its checkpoint `job_down_s` later;
- `kill_broker_at`: the broker is SIGKILLed there and started again on its data directory; the
  engine's query, which fails with its broker gone, is started again from its checkpoint.
After the run every message is checked against the broker's own index (QueryMessage: delivered,
never early) and its topic (each id delivered once), apart from the trace; a trace segment the
kill cut short could miss a fire, the index cannot. A measurement tool, not part of the broker.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEND_CHUNK = 1000
WAIT_LIMIT_S = 1800.0
"""How long after the last due time a wait gives up."""
TOPIC = "bench"


@dataclass(frozen=True)
class MeasureOptions:
    work_dir: str
    messages: int = 10_000
    spread_ms: int = 60_000
    lead_ms: int = 20_000
    bucket_ms: int | None = None
    """The engine's bucket (None: its mode's default, `engine.bucket_ms_of`)."""
    shards: int = 2
    trigger_ms: int | None = None
    """The engine's micro-batch interval (None: its mode's default, `engine.trigger_ms_of`)."""
    mode: str = "arm"
    """The engine's mode: "arm" (hand over, the broker fires) or "fire" (FireTimers at due)."""
    horizon_ms: int = 5 * 60_000
    """The broker's `timer_handoff_horizon_ms`."""
    backstop_ms: int = 60_000
    """The broker's `timer_spark_backstop_ms`."""
    kill_job_at: float | None = None
    """Stop the engine at this fraction of the due-time window and restart it `job_down_s` later."""
    job_down_s: float = 10.0
    kill_broker_at: float | None = None
    """SIGKILL the broker at this fraction of the due-time window and start it again."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Run:
    """The broker child, the engine query and the faults, while the measurement waits."""

    def __init__(self, spark: Any, options: MeasureOptions, log: Any) -> None:
        from chronoq.client.testing import ServerProcess
        from chronoq.spark.engine import EngineOptions

        work = Path(options.work_dir)
        self.spark, self.options, self.log = spark, options, log
        self.data_dir = work / "data"
        self.server = ServerProcess(self.data_dir, settings={
            "timer_firer": "spark", "trace_enable": True, "timer_handoff_horizon_ms": options.horizon_ms,
            "timer_spark_backstop_ms": options.backstop_ms})
        self.engine_options = EngineOptions(server=self.server.address, checkpoint=str(work / "ckpt"),
                                            bucket_ms=options.bucket_ms, shards=options.shards,
                                            trigger_ms=options.trigger_ms, mode=options.mode)
        self.query: Any = None
        self.durations: list[int] = []
        self.events: list[str] = []
        self.last_handoff: dict[str, Any] = {}

    def start_engine(self) -> None:
        from chronoq.spark.engine import run_engine

        self.query = run_engine(self.spark, self.engine_options)

    def stop_engine(self) -> None:
        if self.query is not None:
            self.durations += [p["durationMs"].get("triggerExecution", 0) for p in self.query.recentProgress]
            try:
                self.query.stop()
            except Exception as e:  # a query that failed with its broker gone has stopped already
                self.log(f"engine stopped with: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            self.query = None

    def pending(self) -> int | None:
        """Timers the broker holds pending (None while it cannot be asked)."""
        from chronoq.client import Admin

        try:
            with Admin(self.server.address) as admin:
                timer = admin.stats()["timer"]
        except Exception:
            return None
        self.last_handoff = timer.get("handoff") or self.last_handoff
        return int(timer["pending_total"])

    def wait(self, what: str, window: tuple[int, int] | None = None) -> None:
        """Until nothing is pending, applying the faults due within the due-time `window`."""
        faults = []
        if window is not None:
            first, last = window
            for name, at in (("job", self.options.kill_job_at), ("broker", self.options.kill_broker_at)):
                if at is not None:
                    faults.append((first + int(at * (last - first)), name))
            faults.sort()
        # The limit counts from the last due time: a window of hours is waited out in full.
        until_last_s = max(0.0, (window[1] - _now_ms()) / 1000) if window is not None else 0.0
        deadline = time.monotonic() + until_last_s + WAIT_LIMIT_S
        while faults or self.pending() != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what} after {WAIT_LIMIT_S} s")
            if faults and _now_ms() >= faults[0][0]:
                self._fault(faults.pop(0)[1])
                continue
            self._revive()
            time.sleep(0.5)

    def wait_started(self) -> None:
        """Until the engine's first micro-batch has run."""
        deadline = time.monotonic() + WAIT_LIMIT_S
        while not (self.query is not None and self.query.recentProgress):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for the engine to start after {WAIT_LIMIT_S} s")
            self._revive()
            time.sleep(0.5)

    def _revive(self) -> None:
        """Start the engine's query again if it stopped (its broker went away), once the broker answers."""
        if (self.query is None or not self.query.isActive) and self.pending() is not None:
            self.log("the engine's query stopped; starting it again from its checkpoint")
            self.stop_engine()
            try:
                self.start_engine()
            except Exception as e:
                self.log(f"starting the engine failed ({type(e).__name__}); trying again")

    def _fault(self, name: str) -> None:
        if name == "job":
            self.log(f"stopping the engine (killed job); starting it again in {self.options.job_down_s} s")
            self.events.append(f"engine stopped at {_now_ms()} for {self.options.job_down_s} s")
            self.stop_engine()
            time.sleep(self.options.job_down_s)
            self.start_engine()
        else:
            self.log("SIGKILL to the broker; starting it again on its data directory")
            self.events.append(f"broker SIGKILLed at {_now_ms()}")
            self.server.kill()
            self.server.start()
            self.events.append(f"broker up again at {_now_ms()}")


def _check_delivered(address: str, count: int) -> dict[str, Any]:
    """Every message against the broker's index and its topic: delivered once, never early."""
    from chronoq.client import Admin

    states: Counter[str] = Counter()
    errors: list[int] = []
    delivered: Counter[str] = Counter()
    with Admin(address) as admin:
        for i in range(count):
            rows = admin.query(f"m{i:08d}", TOPIC)
            if not rows:
                states["missing"] += 1
                continue
            states[rows[0].state] += 1
            if rows[0].fired_ms is not None:
                errors.append(rows[0].fired_ms - max(rows[0].deliver_at_ms, rows[0].accepted_ms))
        for q in admin.describe_topic(TOPIC).queues:
            offset = q.min_offset
            while offset < q.max_offset:
                page = admin.read(TOPIC, q.queue_id, offset, 1000)
                if not page.messages:
                    break
                delivered.update(m.message_id for m in page.messages if m.message_id != "warm")
                offset = page.next_offset
    errors.sort()
    return {"states": dict(states), "early": sum(1 for e in errors if e < 0),
            "delivered_twice": sum(1 for n in delivered.values() if n > 1),
            "delivered_ids": len(delivered), "lost": count - len(delivered),
            "fire_p50_ms": errors[len(errors) // 2] if errors else None,
            "fire_p99_ms": errors[min(len(errors) - 1, int(len(errors) * 0.99))] if errors else None,
            "fire_max_ms": errors[-1] if errors else None}


def run_measurement(spark: Any, options: MeasureOptions, log: Any = print) -> dict[str, Any]:
    from chronoq.client import Admin, Producer, outgoing
    from chronoq.spark.report import compute_report, render_markdown
    from chronoq.spark.trace import write_trace
    from chronoq.trace import export_rows

    work = Path(options.work_dir)
    run = _Run(spark, options, log)
    run.server.start()
    try:
        with Admin(run.server.address) as admin, Producer(run.server.address) as producer:
            admin.create_topic(TOPIC, queue_count=4)
            producer.send(TOPIC, b"warm", deliver_at=_now_ms(), message_id="warm")
        run.start_engine()
        try:
            run.wait_started()
            run.wait("the warm-up timer to fire")
            log(f"engine up ({options.mode}); sending {options.messages} timers due over {options.spread_ms} ms "
                f"from {options.lead_ms} ms on")
            start = _now_ms() + options.lead_ms
            step = options.spread_ms / max(1, options.messages)
            sent_at = time.monotonic()
            with Producer(run.server.address) as producer:
                for base in range(0, options.messages, SEND_CHUNK):
                    batch = [outgoing(TOPIC, b"x" * 64, deliver_at=int(start + i * step), message_id=f"m{i:08d}")
                             for i in range(base, min(options.messages, base + SEND_CHUNK))]
                    producer.send_batch(batch)
            send_s = time.monotonic() - sent_at
            log(f"sent in {send_s:.1f} s; waiting for every timer to fire")
            run.wait("every timer to fire", (start, start + options.spread_ms))
            run.pending()
        finally:
            run.stop_engine()
        checked = _check_delivered(run.server.address, options.messages)
    finally:
        run.server.stop()
    rows = export_rows(run.data_dir)
    trace_path = work / "trace.parquet"
    write_trace([r for r in rows if r["topic"] == TOPIC and r["message_id"] != "warm"], trace_path)
    report = compute_report(spark, str(trace_path))
    batches = sorted(d for d in run.durations if d)
    report["engine"] = {
        "mode": options.mode, "messages": options.messages, "lead_ms": options.lead_ms,
        "spread_ms": options.spread_ms, "horizon_ms": options.horizon_ms, "backstop_ms": options.backstop_ms,
        "send_s": round(send_s, 2), "batches": len(batches),
        "batch_ms_p50": statistics.median(batches) if batches else None,
        "batch_ms_max": batches[-1] if batches else None,
        "events": run.events, "handoff": run.last_handoff, "checked": checked,
    }
    log(render_markdown(report))
    log(f"micro-batches observed: {len(batches)}, duration p50 {report['engine']['batch_ms_p50']} ms, "
        f"max {report['engine']['batch_ms_max']} ms")
    log(f"faults: {'; '.join(run.events) or 'none'}")
    log(f"broker hand-off counters: {run.last_handoff}")
    log(f"checked against the broker's index and topic: {checked}")
    return report
