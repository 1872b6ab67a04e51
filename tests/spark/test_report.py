"""`chronoq spark report`: percentiles, early counts and per-minute rows against numpy's answer."""

from __future__ import annotations

import json
import random

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark; the imports below need it too

import numpy as np  # noqa: E402

from chronoq.spark.trace import TraceRowInvalid, trace_schema, write_trace  # noqa: E402
from chronoq.timefmt import duration  # noqa: E402

pytestmark = pytest.mark.spark

T0_MS = 1_700_000_040_000  # a minute boundary
assert T0_MS % 60_000 == 0


def _minute(ms: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M")


def _row(i: int, accepted_ms: int, due_ms: int, fired_ms: int | None, received_ms: int | None) -> dict:
    return {"message_id": f"m{i:07d}", "topic": "t", "accepted_ms": accepted_ms, "due_ms": due_ms,
            "fired_ms": fired_ms, "first_received_ms": received_ms}


def _synthetic_rows() -> list[dict]:
    """Minute 0: errors 0..999 ms (shuffled). Minute 1: errors 1000..1199 plus 3 early (-5 ms).
    Minute 2: 10 pending (never fired) and 5 fired but never received."""
    rng = random.Random(7)
    rows = []
    errors0 = list(range(1000))
    rng.shuffle(errors0)
    for i, err in enumerate(errors0):
        due = T0_MS + i * 50
        rows.append(_row(i, T0_MS - 60_000 + i * 10, due, due + err // 2, due + err))
    for j in range(200):
        due = T0_MS + 60_000 + j * 100
        rows.append(_row(1000 + j, T0_MS - 60_000 + j, due, due + 1000, due + 1000 + j))
    for k in range(3):
        due = T0_MS + 61_000 + k
        rows.append(_row(1200 + k, T0_MS - 50_000, due, due, due - 5))
    for k in range(10):
        rows.append(_row(1300 + k, T0_MS - 50_000, T0_MS + 120_000 + k, None, None))
    for k in range(5):
        due = T0_MS + 121_000 + k
        rows.append(_row(1400 + k, T0_MS - 50_000, due, due + 7, None))
    return rows


def test_write_trace_refuses_bad_rows(tmp_path):
    with pytest.raises(TraceRowInvalid, match="due_ms"):
        write_trace([{"message_id": "a", "topic": "t", "accepted_ms": 1, "due_ms": None}], tmp_path / "x.parquet")
    with pytest.raises(TraceRowInvalid, match="fired_ms"):
        write_trace([{"message_id": "a", "topic": "t", "accepted_ms": 1, "due_ms": 2, "fired_ms": "3"}],
                    tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


def test_report_synthetic_known_percentiles(spark, tmp_path):
    from chronoq.spark.report import compute_report, write_report

    rows = _synthetic_rows()
    path = tmp_path / "trace.parquet"
    assert write_trace(rows, path) == len(rows)
    import pyarrow.parquet as pq

    assert pq.read_schema(path).equals(trace_schema())

    report = compute_report(spark, str(path))
    o = report["overall"]
    assert o["messages"] == 1218
    assert o["fired"] == 1208 and o["pending"] == 10
    assert o["recv_count"] == 1203
    assert o["recv_early"] == 3 and o["recv_min"] == -5
    assert o["fire_early"] == 0
    recv = np.array([r["first_received_ms"] - r["due_ms"] for r in rows if r["first_received_ms"] is not None])
    for name, frac in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        assert o[f"recv_{name}"] == pytest.approx(np.percentile(recv, frac))
    assert o["recv_max"] == 1199

    by_minute = {m["minute_ms"]: m for m in report["per_minute"]}
    m0 = by_minute[T0_MS]
    assert m0["due"] == 1000 and m0["recv_early"] == 0
    assert m0["recv_p50"] == pytest.approx(499.5)
    assert m0["recv_p90"] == pytest.approx(899.1)
    assert m0["recv_p99"] == pytest.approx(989.01)
    assert m0["recv_p999"] == pytest.approx(998.001)
    assert m0["recv_max"] == 999 and m0["fire_max"] == 499
    m1 = by_minute[T0_MS + 60_000]
    assert m1["due"] == 203 and m1["recv_early"] == 3 and m1["recv_max"] == 1199
    m2 = by_minute[T0_MS + 120_000]
    assert m2["due"] == 15 and m2["recv_count"] == 0 and m2["recv_p50"] is None and m2["fire_count"] == 5
    # Accepted per minute: everything was accepted in the minute before T0.
    assert by_minute[T0_MS - 60_000]["accepted"] == 1218 and by_minute[T0_MS - 60_000]["due"] == 0
    assert by_minute[T0_MS - 60_000]["accepted_per_s"] == pytest.approx(1218 / 60)
    # Second 0 of the accept window holds 100 minute-0 rows (one per 10 ms) and all 200 minute-1 rows.
    assert o["accepted_per_s_peak"] == 300
    assert o["accepted_per_s_mean"] == pytest.approx(1218 / 11)  # seconds 0..10 of the accept window

    paths = write_report(report, tmp_path / "out")
    md = paths["markdown"].read_text()
    p50, p90 = (duration(round(np.percentile(recv, q))) for q in (50, 90))
    assert f"| received - due | 1,203 | {p50} | {p90} |" in md
    # The mean over the accept window, said as such; the minutes show counts, not a rate beside it.
    assert "Accepted: 1,218 messages in 11s" in md and "110.7 per second on average over those seconds" in md
    assert "300 in the busiest second" in md
    assert f"| {_minute(T0_MS - 60_000)} | 1,218 | 0 |" in md
    assert json.loads(paths["json"].read_text())["overall"]["recv_early"] == 3
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_counts_cancelled_apart_from_pending_and_prints_the_trace_notes(spark, tmp_path):
    """A cancelled timer was counted pending for good; a trace missing rotated-away events read
    like a whole one. Both are said now, and a Parquet trace from before cancelled_ms still reads."""
    from chronoq.spark.report import compute_report, render_markdown

    rows = [_row(0, T0_MS, T0_MS + 1000, T0_MS + 1000, T0_MS + 1001), _row(1, T0_MS, T0_MS + 5000, None, None),
            {**_row(2, T0_MS, T0_MS + 5000, None, None), "cancelled_ms": T0_MS + 10}]
    path = tmp_path / "trace.parquet"
    write_trace(rows, path, notes=["3 older trace segment(s) were rotated away (trace_retention_bytes)"])
    report = compute_report(spark, str(path))
    assert (report["overall"]["cancelled"], report["overall"]["pending"]) == (1, 1)
    md = render_markdown(report)
    assert "cancelled 1, pending 1." in md and "Note: 3 older trace segment(s) were rotated away" in md
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = tmp_path / "old.parquet"  # written before cancelled_ms existed, no notes
    pq.write_table(pa.table({k: [r[k] for r in rows[:2]] for k in rows[0]}), old)
    report = compute_report(spark, str(old))
    assert (report["overall"]["cancelled"], report["overall"]["pending"], report["notes"]) == (0, 1, [])


def test_report_cli_100k_rows(spark, tmp_path):
    import argparse

    from chronoq.cli import spark as spark_cli

    n = 100_000
    rng = np.random.default_rng(11)
    accepted = T0_MS + np.sort(rng.integers(0, 300_000, n))
    due = accepted + rng.integers(1_000, 600_000, n)
    fire_err = rng.gamma(2.0, 150.0, n).astype(np.int64)
    recv_err = fire_err + rng.integers(0, 50, n)
    recv_err[:17] = -1  # 17 early receipts
    rows = ({"message_id": f"id{i}", "topic": "t", "accepted_ms": int(accepted[i]), "due_ms": int(due[i]),
             "fired_ms": int(due[i] + fire_err[i]), "first_received_ms": int(due[i] + recv_err[i])}
            for i in range(n))
    write_trace(rows, tmp_path / "trace" / "part-0.parquet")

    parser = argparse.ArgumentParser()
    spark_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["spark", "report", str(tmp_path / "trace"), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    o = report["overall"]
    assert o["messages"] == n and o["recv_early"] == 17 and o["fire_early"] == 0
    for name, frac in (("p50", 50), ("p99", 99), ("p999", 99.9)):
        assert o[f"recv_{name}"] == pytest.approx(np.percentile(recv_err, frac))
        assert o[f"fire_{name}"] == pytest.approx(np.percentile(fire_err, frac))
    assert o["fire_max"] == int(fire_err.max())
    assert sum(m["due"] for m in report["per_minute"]) == n
    assert sum(m["accepted"] for m in report["per_minute"]) == n
    assert (tmp_path / "out" / "report.png").stat().st_size > 10_000


def test_report_counts_a_past_due_message_from_its_acceptance_and_prints_no_spark_noise(tmp_path):
    """A deliver-at an hour in the past is delivered at once: its error is the few ms since it was
    accepted, not an hour. And `chronoq spark report` prints the report, not log4j's start-up lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import chronoq

    rows = [_row(0, T0_MS, T0_MS + 1000, T0_MS + 1002, T0_MS + 1010),  # on time: 2 ms / 10 ms
            _row(1, T0_MS, T0_MS - 3_600_000, T0_MS + 3, T0_MS + 7)]  # due an hour before it was accepted
    write_trace(rows, tmp_path / "trace.parquet")
    root = str(Path(chronoq.__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "chronoq", "spark", "report", str(tmp_path / "trace.parquet"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no "Using Spark's default log4j profile", no JVM warning
    o = json.loads((tmp_path / "out" / "report.json").read_text())["overall"]
    assert (o["fire_max"], o["recv_max"]) == (3, 10)
    assert "| fired - due | 2 | 2ms |" in proc.stdout, proc.stdout  # P50 of 2 and 3 ms: 2.5, rounded to even


def test_one_late_outlier_does_not_flatten_the_chart(spark, tmp_path):
    """One past-dated message received 17.5 s after its acceptance set a linear y-axis to 17,500 ms
    and pressed every minute's 2-9 ms onto zero. The axis turns logarithmic, the chart and report.md
    say so, the outlier stays on the chart, and 2 ms and 9 ms are far apart on it."""
    from chronoq.spark.report import build_chart, chart_scale, compute_report, render_markdown

    rows = []
    for i in range(300):  # five minutes of messages received 2-9 ms after due
        due = T0_MS + i * 1000
        rows.append(_row(i, due - 30_000, due, due + 1 + i % 5, due + 2 + i % 8))
    rows.append(_row(999, T0_MS + 10_000, T0_MS - 3_600_000, T0_MS + 10_003, T0_MS + 27_500))
    write_trace(rows, tmp_path / "trace.parquet")
    report = compute_report(spark, str(tmp_path / "trace.parquet"))
    assert report["overall"]["recv_max"] == 17_500
    scale, why = chart_scale(report)
    assert scale == "symlog" and why is not None and "17.5s" in why and "9ms" in why, why
    assert f"Chart: {why}." in render_markdown(report)
    fig = build_chart(report)
    ax = fig.axes[0]
    assert ax.get_yscale() == "symlog" and "log scale" in ax.get_ylabel() and "log scale" in ax.get_title()
    low, high = ax.get_ylim()
    assert low <= 2 and high >= 17_500  # nothing clipped
    to_px = ax.transData.transform
    gap_px = to_px((0, 9))[1] - to_px((0, 2))[1]
    assert gap_px > 40, gap_px  # on a linear axis to 17,500 ms this was under 2 px
    import matplotlib.pyplot as plt

    plt.close(fig)

    rows = [r for r in rows if r["message_id"] != "m0000999"]  # without the outlier: linear, as before
    write_trace(rows, tmp_path / "plain.parquet")
    plain = compute_report(spark, str(tmp_path / "plain.parquet"))
    assert chart_scale(plain) == ("linear", None)
    assert "Chart:" not in render_markdown(plain)
