"""Results: one JSON file, a markdown report of tables, and a PNG chart, from the same dict.

Theory of operation: the runner's dict is the single source; the markdown and the chart only
read it. Two ratio tables follow the figures. "System / floor" divides every system's figure by
the floor's (a stub server that only speaks the protocol, `bench/peers/floor_server.py`): for
server CPU it says how many times the protocol's own cost in Python a system spends, so a
chronoq figure near 1 is near the limit of the protocol here. "chronoq / peer" divides chronoq's
figure by each other system's, so for accept rate above 1 is better for chronoq and for error,
memory and CPU below 1 is better. A missing figure (a phase that failed, was skipped, or a system
not installable) shows as "-" and the reason is printed under the tables, never hidden; a burst
whose sends ended after its due time is shown in the burst table but not scored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Figure = tuple[str, Callable[[dict[str, Any]], Any], str, str]
"""(label, getter, which way is better, the phase it comes from: rows of phases nobody ran are left out)."""

FLOOR = "floor"
PHASE_ORDER = ("accept", "precision", "burst", "crash", "backlog", "sweep")


def _burst(r: dict[str, Any], key: str) -> Any:
    d = r.get("burst")
    return d.get(key) if isinstance(d, dict) and d.get("valid") else None


FIGURES: list[Figure] = [
    ("accepted/s one-at-a-time", lambda r: _get(r, "accept", "sync", "per_s"), "higher", "accept"),
    ("server CPU µs per request, one-at-a-time", lambda r: _get(r, "accept", "sync", "cpu_us_per_msg"), "lower",
     "accept"),
    ("accepted/s batched", lambda r: _get(r, "accept", "batch", "per_s"), "higher", "accept"),
    ("server CPU µs per accepted, batched", lambda r: _get(r, "accept", "batch", "cpu_us_per_msg"), "lower",
     "accept"),
    ("error P50 ms", lambda r: _get(r, "precision", "error_p50_ms"), "lower", "precision"),
    ("error P90 ms", lambda r: _get(r, "precision", "error_p90_ms"), "lower", "precision"),
    ("error P99 ms", lambda r: _get(r, "precision", "error_p99_ms"), "lower", "precision"),
    ("error P999 ms", lambda r: _get(r, "precision", "error_p999_ms"), "lower", "precision"),
    ("error max ms", lambda r: _get(r, "precision", "error_max_ms"), "lower", "precision"),
    ("early", lambda r: _get(r, "precision", "early"), "lower", "precision"),
    ("duplicates", lambda r: _get(r, "precision", "duplicates"), "lower", "precision"),
    ("lost", lambda r: _get(r, "precision", "lost"), "lower", "precision"),
    ("precision rate achieved/s", lambda r: _get(r, "precision", "produce", "per_s"), "higher", "precision"),
    ("server CPU µs per message end to end (precision)", lambda r: _get(r, "precision", "cpu_us_per_msg"), "lower",
     "precision"),
    ("consumer CPU µs per message received (precision)", lambda r: _get(r, "precision", "consumer_cpu_us_per_msg"),
     "lower", "precision"),
    ("messages per receive call (precision)", lambda r: _get(r, "precision", "consumer_stats", "per_receive"),
     "higher", "precision"),
    ("burst: all fired, ms after due (server's count)", lambda r: _burst(r, "fired_after_due_ms"), "lower", "burst"),
    ("burst: last received, ms after due", lambda r: _burst(r, "last_received_after_due_ms"), "lower", "burst"),
    ("sweep: highest rate/s with P99 within the limit", lambda r: _get(r, "sweep", "best_rate"), "higher", "sweep"),
    ("server RSS peak MB (accept)", lambda r: _get(r, "accept", "resources", "rss_peak_mb"), "lower", "accept"),
    ("server CPU s (accept)", lambda r: _get(r, "accept", "resources", "cpu_s"), "lower", "accept"),
    ("server RSS peak MB (precision)", lambda r: _get(r, "precision", "resources", "rss_peak_mb"), "lower",
     "precision"),
    ("server CPU s (precision)", lambda r: _get(r, "precision", "resources", "cpu_s"), "lower", "precision"),
    ("server's busiest thread, % of a core, P90 of 1 s windows (precision)",
     lambda r: _get(r, "precision", "resources", "busiest_thread_p90_pct"), "lower", "precision"),
]

CRASH_COLS = ["accepted", "pending_at_kill", "delivered_before_kill", "restart_ready_s", "lost", "early",
              "duplicates", "unexpected"]
BACKLOG_COLS = ["pending", "rss_end_mb", "rss_peak_mb", "rss_per_pending_B", "disk_mb", "restart_ready_s",
                "pending_after_restart"]
BURST_COLS = [("N", "n"), ("lead s", "lead_s"), ("sends ended before due ms", "sends_ended_before_due_ms"),
              ("pending before due", "pending_before_due"), ("all fired after due ms", "fired_after_due_ms"),
              ("first received after due ms", "first_received_after_due_ms"),
              ("last received after due ms", "last_received_after_due_ms"), ("drain msg/s", "drain_per_s"),
              ("lost", "lost"), ("early", "early"), ("duplicates", "duplicates"),
              ("server CPU µs/msg", "cpu_us_per_msg")]


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.2f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return "-"
    if b == 0:
        return "=" if a == 0 else "inf"
    return f"{a / b:.2f}"


def markdown(results: dict[str, Any]) -> str:
    systems: dict[str, Any] = results["systems"]
    names = list(systems)
    lines = [f"# chronoq side-by-side benchmark, {results['started']}", "",
             f"Machine: {results['machine']}. Command: `{results['command']}`", ""]
    if results.get("load_at_end") is not None:
        lines += [f"Load average at the end (1, 5, 15 min): {_loads(results['load_at_end'])}", ""]
    lines += ["| system | version | how scheduled | durability of an acknowledged message |", "|---|---|---|---|"]
    for n in names:
        s = systems[n]
        if s.get("installable"):
            lines.append(f"| {n} | {s['version']} | {s['design']} | {s['durability']} |")
        else:
            lines.append(f"| {n} | - | {s['reason']} | - |")
    ran = {ph for n in names for ph in systems[n] if ph in PHASE_ORDER}
    figures = [f for f in FIGURES if f[3] in ran]
    lines += ["", "## Figures", "", "| figure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, get, _better, _phase in figures:
        lines.append(f"| {label} | " + " | ".join(_fmt(get(systems[n])) for n in names) + " |")
    lines += _ratio_tables(systems, names, figures)
    for phase, cols in (("crash", CRASH_COLS), ("backlog", BACKLOG_COLS)):
        rows = [n for n in names if isinstance(systems[n].get(phase), dict) and "skipped" not in systems[n][phase]]
        if not rows:
            continue
        extra = ["accepted/s"] if phase == "backlog" else []
        lines += ["", f"## {phase.capitalize()} run", "", "| system | " + " | ".join(extra + cols) + " |",
                  "|---" * (len(cols) + len(extra) + 1) + "|"]
        for n in rows:
            d = systems[n][phase]
            vals = ([_get(d, "produce", "per_s")] if extra else []) + [d.get(c) for c in cols]
            lines.append(f"| {n} | " + " | ".join(_fmt(v) for v in vals) + " |")
    lines += _burst_table(systems, names) + _sweep_table(systems, names)
    notes = []
    for n in names:
        for phase in PHASE_ORDER:
            d = systems[n].get(phase) or {}
            if "skipped" in d:
                notes.append(f"- {n} {phase}: skipped: {d['skipped']}")
            if "failed" in d:
                notes.append(f"- {n} {phase}: {d['failed'].splitlines()[0]}")
            for err in _errors(d):
                notes.append(f"- {n} {phase}: {err.strip().splitlines()[-1]}")
    if notes:
        lines += ["", "## Skipped, failures and errors", "", *notes]
    lines += ["", f"Chart: `{results.get('chart', '-')}`", ""]
    return "\n".join(lines)


def _loads(loads: Any) -> str:
    try:
        return ", ".join(f"{float(x):.2f}" for x in loads)
    except (TypeError, ValueError):
        return str(loads)


def _ratio_tables(systems: dict[str, Any], names: list[str], figures: list[Figure]) -> list[str]:
    lines: list[str] = []
    over_floor = [n for n in names if n != FLOOR]
    if FLOOR in systems and systems[FLOOR].get("installable") and over_floor:
        lines += ["", "Ratio system / floor (the floor is the protocol's own cost in Python with grpc.aio here; "
                  "for server CPU, how many times that cost a system spends).", "",
                  "| figure | " + " | ".join(f"{n}/floor" for n in over_floor) + " |",
                  "|---" * (len(over_floor) + 1) + "|"]
        for label, get, _better, _phase in figures:
            floor = get(systems[FLOOR])
            lines.append(f"| {label} | " + " | ".join(_ratio(get(systems[n]), floor) for n in over_floor) + " |")
    peers = [n for n in names if n not in ("chronoq", FLOOR)]
    if "chronoq" in systems and peers:
        lines += ["", "Ratio chronoq / peer (accept and rate: above 1 favours chronoq; the rest: below 1 does).",
                  "", "| figure | " + " | ".join(f"chronoq/{p}" for p in peers) + " |",
                  "|---" * (len(peers) + 1) + "|"]
        for label, get, _better, _phase in figures:
            mine = get(systems["chronoq"])
            lines.append(f"| {label} | " + " | ".join(_ratio(mine, get(systems[p])) for p in peers) + " |")
    return lines


def _burst_table(systems: dict[str, Any], names: list[str]) -> list[str]:
    rows = [n for n in names if isinstance(systems[n].get("burst"), dict)
            and not ({"skipped", "failed"} & systems[n]["burst"].keys())]
    if not rows:
        return []
    lines = ["", "## Burst: N timers due in the same millisecond", "",
             "Times are from the due time. \"All fired\" is when the server's own pending count first read 0 "
             "(polled every 50 ms: an upper bound; for Redis the count drops as the consumer claims).", "",
             "| system | " + " | ".join(label for label, _ in BURST_COLS) + " | note |",
             "|---" * (len(BURST_COLS) + 2) + "|"]
    for n in rows:
        d = systems[n]["burst"]
        note = d.get("note") or ""
        if not d.get("valid"):
            note = (f"not scored: the sends ended {-d['sends_ended_before_due_ms']:,.0f} ms after the due time "
                    f"(raise --burst-lead-s). " + note).strip()
        lines.append(f"| {n} | " + " | ".join(_fmt(d.get(key)) for _, key in BURST_COLS) + f" | {note or '-'} |")
    return lines


def _sweep_table(systems: dict[str, Any], names: list[str]) -> list[str]:
    rows = [n for n in names if isinstance(systems[n].get("sweep"), dict) and "runs" in systems[n]["sweep"]]
    if not rows:
        return []
    first = systems[rows[0]]["sweep"]
    rates = sorted({r["rate"] for n in rows for r in systems[n]["sweep"]["runs"]})
    lines = ["", f"## Sweep: highest fixed rate with P99 <= {first['p99_limit_ms']:g} ms", "",
             f"Each rate: {first['seconds_per_rate']:g} s of sending, delays {first['delays_s'][0]:g}-"
             f"{first['delays_s'][1]:g} s. Cells: P99 ms (server CPU µs/msg end to end); x marks a failing rate "
             "(why below).", "",
             "| system | " + " | ".join(f"{r:,.0f}/s" for r in rates) + " | highest passing rate/s |",
             "|---" * (len(rates) + 2) + "|"]
    why = []
    for n in rows:
        by_rate = {r["rate"]: r for r in systems[n]["sweep"]["runs"]}
        cells = []
        for rate in rates:
            r = by_rate.get(rate)
            if r is None or r["ok"] is None:
                cells.append("-")
                continue
            cells.append(f"{_fmt(r.get('p99_ms'))} ({_fmt(r.get('cpu_us_per_msg'))})" + ("" if r["ok"] else " x"))
            if not r["ok"]:
                why.append(f"- {n} at {rate:,.0f}/s: {r['why']}")
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {_fmt(systems[n]['sweep'].get('best_rate'))} |")
    return lines + (["", *why] if why else [])


def _errors(d: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key in ("sync", "batch", "produce"):
        out += _get(d, key, "errors") or []
    if d.get("consumer_error"):
        out.append(d["consumer_error"])
    out += d.get("consumer_errors") or []
    return out


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = {n: s for n, s in results["systems"].items() if s.get("installable")}
    names = list(systems)
    fig, axes = plt.subplots(3, 2, figsize=(13, 13))
    _bars(axes[0][0], names, {"one-at-a-time": [_get(systems[n], "accept", "sync", "per_s") for n in names],
                              "batched": [_get(systems[n], "accept", "batch", "per_s") for n in names]},
          "accepted timer messages / s (higher is better)", log=True)
    _bars(axes[0][1], names, {p: [_get(systems[n], "precision", f"error_{p}_ms") for n in names]
                              for p in ("p50", "p99", "p999")} |
          {"max": [_get(systems[n], "precision", "error_max_ms") for n in names]},
          "delivery error ms (lower is better)", log=True)
    _bars(axes[1][0], names, {"precision": [_get(systems[n], "precision", "resources", "rss_peak_mb") for n in names],
                              "backlog": [_get(systems[n], "backlog", "rss_peak_mb") for n in names]},
          "server RSS peak MB (lower is better)", log=False)
    ax = axes[1][1]
    for n in names:
        series = _get(systems[n], "backlog", "rate_over_time") or []
        if series:
            ax.plot([t for t, _ in series], [r for _, r in series], label=n, marker=".")
    ax.set_title("backlog: accepted / s over time")
    ax.set_xlabel("s")
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no backlog run", ha="center", va="center", transform=ax.transAxes)
    _bars(axes[2][0], names, {
        "per request, one-at-a-time": [_get(systems[n], "accept", "sync", "cpu_us_per_msg") for n in names],
        "per accepted, batched": [_get(systems[n], "accept", "batch", "cpu_us_per_msg") for n in names],
        "per message end to end": [_get(systems[n], "precision", "cpu_us_per_msg") for n in names]},
        "server CPU µs per message (lower is better; floor = the protocol's cost)", log=True)
    _bars(axes[2][1], names, {"all fired": [_burst(systems[n], "fired_after_due_ms") for n in names],
                              "last received": [_burst(systems[n], "last_received_after_due_ms") for n in names]},
          "burst: ms after the common due time (lower is better)", log=True)
    fig.suptitle(f"chronoq vs delay-queue peers, {results['started']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(ax: Any, names: list[str], groups: dict[str, list[Any]], title: str, *, log: bool) -> None:
    width = 0.8 / max(1, len(groups))
    for i, (label, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(names))]
        ys = [v if isinstance(v, int | float) and v > 0 else 0 for v in values]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names)
    if log and any(isinstance(v, int | float) and v > 0 for values in groups.values() for v in values):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "chart": out_dir / "chart.png"}
    results["chart"] = str(paths["chart"])
    chart(results, paths["chart"])
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["markdown"].write_text(markdown(results))
    return paths
