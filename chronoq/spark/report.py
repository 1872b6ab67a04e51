"""The delivery-accuracy report: a trace (see `trace.py`) in, a table, JSON and a chart out.

Theory of operation: the report follows the table Tencent's TDMQ article publishes for its
timer engine (accepted per second; delay error P50/P90/P99/P999; plus max and the count of early
deliveries, which must be zero). Two errors are measured per message: `received - due` (what a
consumer saw) and `fired - due` (what the timer engine did; the difference is the delivery path).
Spark does the aggregation (`compute_report`), overall and per minute; errors are grouped by the
minute the message was due, acceptances by the minute they happened. An error counts from the
due time, or from the acceptance when the message was due before it was accepted (a deliver-at in
the past is delivered at once, and is not hours late): the broker's `stats` counts the same way. Percentiles are
exact by default (Spark's `percentile`, linear interpolation like numpy's default); `approx=True`
switches to `percentile_approx` for traces too large to sort per group. Rendering (markdown, JSON,
PNG) is plain Python over the small result, so it is testable without Spark. The markdown is for
people: errors as durations ("4.69s", "30m04s"), the acceptance rate said over the window it is a
mean of (a per-minute table of rates beside a mean over a few busy seconds read as a
contradiction, so the minutes show counts); report.json keeps every number in ms.

The chart's y-axis is linear while the largest value it plots is within `LOG_SCALE_FROM` times the
overall P90 (of the error it plots); beyond that it turns logarithmic (symmetric log: linear
within a millisecond of zero, so zero and early deliveries still show), and both the chart and
report.md say so. One message delivered late (a past-dated send received 17 s after its
acceptance) otherwise set a linear axis to 17,500 ms and pressed every other minute's 2-9 ms
onto zero. Nothing is clipped: the outlier stays on the chart at its value.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chronoq.timefmt import duration

PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
ERRORS: tuple[tuple[str, str, str], ...] = (
    # (prefix, minuend column, label)
    ("recv", "first_received_ms", "received - due"),
    ("fire", "fired_ms", "fired - due"),
)
MINUTE_MS = 60_000
APPROX_ACCURACY = 100_000
"""percentile_approx accuracy: relative error about 1/accuracy of the rank."""
LOG_SCALE_FROM = 20
"""The chart's y-axis turns logarithmic when its largest value exceeds this many times the overall P90."""


def _error_aggs(approx: bool) -> list[Any]:
    from pyspark.sql import functions as F

    aggs = []
    fractions = ", ".join(str(frac) for _, frac in PERCENTILES)
    for prefix, column, _ in ERRORS:
        err = f"({column} - greatest(due_ms, accepted_ms))"
        if approx:
            pct = F.expr(f"percentile_approx({err}, array({fractions}), {APPROX_ACCURACY})")
        else:
            pct = F.expr(f"percentile({err}, array({fractions}))")
        aggs += [
            F.count(F.col(column)).alias(f"{prefix}_count"),
            pct.alias(f"{prefix}_pcts"),
            F.expr(f"max({err})").alias(f"{prefix}_max"),
            F.expr(f"min({err})").alias(f"{prefix}_min"),
            F.expr(f"avg({err})").alias(f"{prefix}_mean"),
            F.expr(f"count_if({err} < 0)").alias(f"{prefix}_early"),
        ]
    return aggs


def _flatten(row: Mapping[str, Any]) -> dict[str, Any]:
    """Spread the percentile arrays into named fields, nulls for empty groups."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key.endswith("_pcts"):
            prefix = key[: -len("_pcts")]
            for i, (name, _) in enumerate(PERCENTILES):
                out[f"{prefix}_{name}"] = float(value[i]) if value is not None else None
        elif isinstance(value, float) and math.isnan(value):
            out[key] = None
        else:
            out[key] = value
    return out


def compute_report(spark: Any, trace_path: str, *, approx: bool = False) -> dict[str, Any]:
    """Aggregate the trace at `trace_path` (Parquet file or directory) on Spark."""
    from pyspark.sql import functions as F

    from chronoq.spark.trace import read_trace_notes, trace_spark_ddl

    df = spark.read.schema(trace_spark_ddl()).parquet(str(trace_path)).cache()
    overall_row = df.agg(
        F.count(F.lit(1)).alias("messages"),
        F.count("fired_ms").alias("fired"),
        F.count("cancelled_ms").alias("cancelled"),
        F.min("accepted_ms").alias("first_accepted_ms"),
        F.max("accepted_ms").alias("last_accepted_ms"),
        *_error_aggs(approx),
    ).first()
    overall = _flatten(overall_row.asDict())
    overall["pending"] = overall["messages"] - overall["fired"] - overall["cancelled"]
    per_second = df.groupBy(F.floor(F.col("accepted_ms") / 1000).alias("s")).count()
    overall["accepted_per_s_peak"] = per_second.agg(F.max("count")).first()[0] or 0
    if overall["messages"]:
        # Over the whole seconds the accept window touches, so the mean never exceeds the peak.
        seconds = overall["last_accepted_ms"] // 1000 - overall["first_accepted_ms"] // 1000 + 1
        overall["accepted_per_s_mean"] = overall["messages"] / seconds
    else:
        seconds = 0
        overall["accepted_per_s_mean"] = 0.0
    overall["accept_window_s"] = seconds

    accepted = df.groupBy((F.floor(F.col("accepted_ms") / MINUTE_MS) * MINUTE_MS).alias("minute_ms")).agg(
        F.count(F.lit(1)).alias("accepted"))
    errors = df.groupBy((F.floor(F.col("due_ms") / MINUTE_MS) * MINUTE_MS).alias("minute_ms")).agg(
        F.count(F.lit(1)).alias("due"), *_error_aggs(approx))
    minutes = accepted.join(errors, "minute_ms", "full_outer").orderBy("minute_ms").collect()
    per_minute = []
    for row in minutes:
        item = _flatten(row.asDict())
        item["accepted"] = item["accepted"] or 0
        item["due"] = item["due"] or 0
        item["accepted_per_s"] = item["accepted"] / 60
        per_minute.append(item)
    df.unpersist()
    return {"trace": str(trace_path), "percentile_method": "approx" if approx else "exact",
            "overall": overall, "per_minute": per_minute, "notes": read_trace_notes(trace_path)}


def _ms(value: float | int | None) -> str:
    return "-" if value is None else duration(round(value))


def _minute_label(minute_ms: int) -> str:
    return dt.datetime.fromtimestamp(minute_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M")


def _second_label(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms // 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _accepted_line(o: Mapping[str, Any]) -> str:
    if not o["messages"]:
        return "Accepted: none."
    window_s = o.get("accept_window_s") or 1
    span = (f"in {duration(window_s * 1000)} ({_second_label(o['first_accepted_ms'])} to "
            f"{_second_label(o['last_accepted_ms'])} UTC)" if window_s > 1
            else f"within one second ({_second_label(o['first_accepted_ms'])} UTC)")
    return (f"Accepted: {o['messages']:,} messages {span}: {o['accepted_per_s_mean']:,.1f} per second on average "
            f"over those seconds, {o['accepted_per_s_peak']:,} in the busiest second.")


def _chart_series(report: Mapping[str, Any]) -> tuple[str, str]:
    """(the error the chart plots, the other one): received - due when the trace has receipts."""
    return ("recv", "fire") if report["overall"]["recv_count"] else ("fire", "recv")


def _plotted_values(report: Mapping[str, Any]) -> list[float]:
    main, other = _chart_series(report)
    names = [f"{main}_{name}" for name, _ in PERCENTILES] + [f"{main}_max"]
    if report["overall"][f"{other}_count"]:
        names.append(f"{other}_p99")
    return [float(m[n]) for m in report["per_minute"] for n in names if m.get(n) is not None]


def chart_scale(report: Mapping[str, Any]) -> tuple[str, str | None]:
    """("linear", None), or ("symlog", the sentence saying why) when the largest plotted value
    exceeds `LOG_SCALE_FROM` times the overall P90 of the plotted error (at least 1 ms)."""
    main, _ = _chart_series(report)
    values = _plotted_values(report)
    p90 = report["overall"].get(f"{main}_p90")
    if not values or p90 is None:
        return "linear", None
    top = max(abs(v) for v in values)
    base = max(abs(float(p90)), 1.0)
    if top <= LOG_SCALE_FROM * base:
        return "linear", None
    return "symlog", (f"the chart's y-axis is logarithmic: its largest value ({duration(round(top))}) is over "
                      f"{LOG_SCALE_FROM} times the overall P90 ({duration(round(float(p90)))}), which a linear axis "
                      "would press flat")


def render_markdown(report: Mapping[str, Any]) -> str:
    o = report["overall"]
    lines = [
        "# chronoq delivery report",
        "",
        f"Trace: `{report['trace']}` ({report['percentile_method']} percentiles). "
        f"Messages {o['messages']:,}, fired {o['fired']:,}, received {o['recv_count']:,}, "
        f"cancelled {o.get('cancelled', 0):,}, pending {o['pending']:,}.",
        _accepted_line(o),
        *(f"Note: {note}." for note in report.get("notes", ())),
        *(f"Chart: {why}." for why in [chart_scale(report)[1]] if why),
        "",
        "Delay error: how late each message was, counted from its due time, or from its acceptance when it was "
        "due before it was accepted (a time in the past is delivered at once).",
        "",
        "| delay error | count | P50 | P90 | P99 | P999 | max | min | early (< 0) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for prefix, _, label in ERRORS:
        lines.append(
            f"| {label} | {o[f'{prefix}_count']:,} | "
            + " | ".join(_ms(o[f"{prefix}_{name}"]) for name, _ in PERCENTILES)
            + f" | {_ms(o[f'{prefix}_max'])} | {_ms(o[f'{prefix}_min'])} | {o[f'{prefix}_early']} |"
        )
    lines += [
        "",
        "## Per minute (messages accepted in the minute; errors of the messages due in it, received - due; "
        "fired - due P99 last)",
        "",
        "| minute (UTC) | accepted | due | received | P50 | P90 | P99 | P999 | max | early | fired P99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report["per_minute"]:
        lines.append(
            f"| {_minute_label(m['minute_ms'])} | {m['accepted']:,} | {m['due']:,} | {m['recv_count'] or 0:,} | "
            + " | ".join(_ms(m[f"recv_{name}"]) for name, _ in PERCENTILES)
            + f" | {_ms(m['recv_max'])} | {m['recv_early'] or 0} | {_ms(m['fire_p99'])} |"
        )
    return "\n".join(lines) + "\n"


def render_chart(report: Mapping[str, Any], path: str | Path) -> None:
    """A PNG of the delay-error percentiles per due minute: received - due when the trace has
    receipts, else fired - due; the other error's P99 dashed when it exists; the y-axis as
    `chart_scale` says."""
    fig = build_chart(report)
    fig.savefig(str(path), format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)


def build_chart(report: Mapping[str, Any]) -> Any:
    """The chart's matplotlib Figure (`render_chart` saves it; a test reads its axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main, other = _chart_series(report)
    scale, why = chart_scale(report)
    labels = {"recv": "received", "fire": "fired"}
    rows = [m for m in report["per_minute"] if m["recv_count"] or m["fire_count"]]
    xs = [dt.datetime.fromtimestamp(m["minute_ms"] / 1000, tz=dt.UTC) for m in rows]
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    for name, _ in PERCENTILES:
        ax.plot(xs, [m[f"{main}_{name}"] for m in rows], marker="o", markersize=3,
                label=f"{labels[main]} {name.upper()}")
    ax.plot(xs, [m[f"{main}_max"] for m in rows], color="grey", linewidth=0.8, marker="_", markersize=10,
            label=f"{labels[main]} max")
    if report["overall"][f"{other}_count"]:
        ax.plot(xs, [m[f"{other}_p99"] for m in rows], linestyle="--", marker="x", markersize=5,
                label=f"{labels[other]} P99")
    ax.axhline(0, color="black", linewidth=0.6)
    if xs:
        # A short run has one or two minutes: keep the axis on them, not on matplotlib's years.
        pad = dt.timedelta(minutes=1)
        ax.set_xlim(xs[0] - pad, xs[-1] + pad)
        from matplotlib.dates import DateFormatter, MinuteLocator

        span_min = int((xs[-1] - xs[0]).total_seconds() // 60) + 3
        ax.xaxis.set_major_locator(MinuteLocator(interval=max(1, span_min // 10)))
        ax.xaxis.set_major_formatter(DateFormatter("%m-%d %H:%M", tz=dt.UTC))
    ax.set_xlabel("due minute (UTC)")
    if scale == "symlog":
        from matplotlib.ticker import FuncFormatter, SymmetricalLogLocator

        ax.set_yscale("symlog", linthresh=1.0, linscale=0.5)
        # Matplotlib's margin would reach far below zero on this scale: the axis starts at the lowest
        # value (zero unless a message was early) and ends a little above the highest.
        values = _plotted_values(report)
        low, high = min(values), max(values)
        ax.set_ylim(bottom=min(0.0, low * 2), top=high * 2)
        ax.yaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=1.0))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: duration(round(v))))
        ax.set_ylabel("delay error, log scale (actual - max(due, accepted))")
        ax.set_title(f"chronoq delivery error per minute ({report['overall']['messages']} messages)\n"
                     f"log scale: {why.split(': ', 1)[1]}", fontsize="medium")
    else:
        ax.set_ylabel("delay error (ms, actual - max(due, accepted))")
        ax.set_title(f"chronoq delivery error per minute ({report['overall']['messages']} messages)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.autofmt_xdate()
    fig.tight_layout()
    return fig


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write report.md, report.json and report.png into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "json": out / "report.json", "png": out / "report.png"}
    paths["markdown"].write_text(render_markdown(report), encoding="utf-8")
    paths["json"].write_text(json.dumps(report, indent=2, sort_keys=True), encoding="utf-8")
    render_chart(report, paths["png"])
    return paths
