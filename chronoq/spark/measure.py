"""Measure the Spark timer engine's firing error on the host it runs on, end to end.

Theory of operation: start a real `chronoq serve` (timer_firer=spark, trace_enable=true) in a
child process, start the engine, send N timer messages due evenly over `spread_ms` starting
`lead_ms` after the sending begins, wait until the broker reports nothing pending, then stop
everything, export the broker's delivery trace and run the delivery report on it. The report's
`fired - due` row is the engine's firing error as the broker saw it; the micro-batch durations
(Spark's progress reports) say what bounded it. A measurement tool, not part of the broker.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEND_CHUNK = 1000
WAIT_LIMIT_S = 1800.0


@dataclass(frozen=True)
class MeasureOptions:
    work_dir: str
    messages: int = 10_000
    spread_ms: int = 60_000
    lead_ms: int = 20_000
    bucket_ms: int = 5_000
    shards: int = 2
    trigger_ms: int = 200


def _now_ms() -> int:
    return int(time.time() * 1000)


def _pending(admin: Any) -> int:
    return int(admin.stats()["timer"]["pending_total"])


def _wait(query: Any, done: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {WAIT_LIMIT_S} s")
        query.awaitTermination(0.5)


def run_measurement(spark: Any, options: MeasureOptions, log: Any = print) -> dict[str, Any]:
    from chronoq.client import Admin, Producer, outgoing
    from chronoq.client.testing import ServerProcess
    from chronoq.spark.engine import EngineOptions, run_engine
    from chronoq.spark.report import compute_report, render_markdown
    from chronoq.spark.trace import write_trace
    from chronoq.trace import export_rows

    work = Path(options.work_dir)
    data_dir = work / "data"
    server = ServerProcess(data_dir, settings={"timer_firer": "spark", "trace_enable": True}).start()
    engine_options = EngineOptions(server=server.address, checkpoint=str(work / "ckpt"), bucket_ms=options.bucket_ms,
                                   shards=options.shards, trigger_ms=options.trigger_ms)
    try:
        with Admin(server.address) as admin, Producer(server.address) as producer:
            admin.create_topic("bench", queue_count=4)
            producer.send("bench", b"warm", deliver_at=_now_ms(), message_id="warm")
            query = run_engine(spark, engine_options)
            try:
                _wait(query, lambda: _pending(admin) == 0, "the engine to start")
                log(f"engine up; sending {options.messages} timers due over {options.spread_ms} ms")
                start = _now_ms() + options.lead_ms
                step = options.spread_ms / max(1, options.messages)
                sent_at = time.monotonic()
                for base in range(0, options.messages, SEND_CHUNK):
                    batch = [outgoing("bench", b"x" * 64, deliver_at=int(start + i * step), message_id=f"m{i:08d}")
                             for i in range(base, min(options.messages, base + SEND_CHUNK))]
                    producer.send_batch(batch)
                send_s = time.monotonic() - sent_at
                log(f"sent in {send_s:.1f} s; waiting for every timer to fire")
                _wait(query, lambda: _pending(admin) == 0, "every timer to fire")
                durations = [p["durationMs"].get("triggerExecution", 0) for p in query.recentProgress]
            finally:
                query.stop()
    finally:
        server.stop()
    rows = export_rows(data_dir)
    trace_path = work / "trace.parquet"
    write_trace([r for r in rows if r["topic"] == "bench" and r["message_id"] != "warm"], trace_path)
    report = compute_report(spark, str(trace_path))
    batches = sorted(d for d in durations if d)
    report["engine"] = {
        "messages": options.messages, "spread_ms": options.spread_ms, "send_s": round(send_s, 2),
        "batches": len(batches),
        "batch_ms_p50": statistics.median(batches) if batches else None,
        "batch_ms_max": batches[-1] if batches else None,
    }
    log(render_markdown(report))
    log(f"micro-batches observed: {len(batches)}, duration p50 {report['engine']['batch_ms_p50']} ms, "
        f"max {report['engine']['batch_ms_max']} ms")
    return report
