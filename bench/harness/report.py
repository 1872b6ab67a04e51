"""Results: one JSON file, a markdown report of tables, and a PNG chart, from the same dict.

Theory of operation: the runner's dict is the single source; the markdown and the chart only
read it. Ratios are chronoq's figure divided by the peer's, so for accept rate above 1 is better
for chronoq and for error, memory and CPU below 1 is better. A missing figure (a phase that failed,
a system not installable) shows as "-" and the reason is printed under the table, never hidden.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Figure = tuple[str, Callable[[dict[str, Any]], Any], str]

FIGURES: list[Figure] = [
    ("accepted/s one-at-a-time", lambda r: _get(r, "accept", "sync", "per_s"), "higher"),
    ("accepted/s batched", lambda r: _get(r, "accept", "batch", "per_s"), "higher"),
    ("error P50 ms", lambda r: _get(r, "precision", "error_p50_ms"), "lower"),
    ("error P90 ms", lambda r: _get(r, "precision", "error_p90_ms"), "lower"),
    ("error P99 ms", lambda r: _get(r, "precision", "error_p99_ms"), "lower"),
    ("error P999 ms", lambda r: _get(r, "precision", "error_p999_ms"), "lower"),
    ("error max ms", lambda r: _get(r, "precision", "error_max_ms"), "lower"),
    ("early", lambda r: _get(r, "precision", "early"), "lower"),
    ("duplicates", lambda r: _get(r, "precision", "duplicates"), "lower"),
    ("lost", lambda r: _get(r, "precision", "lost"), "lower"),
    ("precision rate achieved/s", lambda r: _get(r, "precision", "produce", "per_s"), "higher"),
    ("server RSS peak MB (accept)", lambda r: _get(r, "accept", "resources", "rss_peak_mb"), "lower"),
    ("server CPU s (accept)", lambda r: _get(r, "accept", "resources", "cpu_s"), "lower"),
    ("server RSS peak MB (precision)", lambda r: _get(r, "precision", "resources", "rss_peak_mb"), "lower"),
    ("server CPU s (precision)", lambda r: _get(r, "precision", "resources", "cpu_s"), "lower"),
]

CRASH_COLS = ["accepted", "pending_at_kill", "delivered_before_kill", "restart_ready_s", "lost", "early",
              "duplicates", "unexpected"]
BACKLOG_COLS = ["pending", "rss_end_mb", "rss_peak_mb", "rss_per_pending_B", "disk_mb", "restart_ready_s",
                "pending_after_restart"]


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
             f"Machine: {results['machine']}. Command: `{results['command']}`", "",
             "| system | version | how scheduled | durability of an acknowledged message |", "|---|---|---|---|"]
    for n in names:
        s = systems[n]
        if s.get("installable"):
            lines.append(f"| {n} | {s['version']} | {s['design']} | {s['durability']} |")
        else:
            lines.append(f"| {n} | - | {s['reason']} | - |")
    lines += ["", "## Accept and precision", "", "| figure | " + " | ".join(names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for label, get, _better in FIGURES:
        lines.append(f"| {label} | " + " | ".join(_fmt(get(systems[n])) for n in names) + " |")
    peers = [n for n in names if n != "chronoq"]
    if "chronoq" in systems and peers:
        lines += ["", "Ratio chronoq / peer (accept and rate: above 1 favours chronoq; the rest: below 1 does).",
                  "", "| figure | " + " | ".join(f"chronoq/{p}" for p in peers) + " |",
                  "|---" * (len(peers) + 1) + "|"]
        for label, get, _better in FIGURES:
            mine = get(systems["chronoq"])
            lines.append(f"| {label} | " + " | ".join(_ratio(mine, get(systems[p])) for p in peers) + " |")
    for phase, cols in (("crash", CRASH_COLS), ("backlog", BACKLOG_COLS)):
        if not any(phase in systems[n] for n in names):
            continue
        extra = ["accepted/s"] if phase == "backlog" else []
        lines += ["", f"## {phase.capitalize()} run", "", "| system | " + " | ".join(extra + cols) + " |",
                  "|---" * (len(cols) + len(extra) + 1) + "|"]
        for n in names:
            d = systems[n].get(phase)
            if d is None:
                continue
            vals = ([_get(d, "produce", "per_s")] if extra else []) + [d.get(c) for c in cols]
            lines.append(f"| {n} | " + " | ".join(_fmt(v) for v in vals) + " |")
    notes = []
    for n in names:
        for phase in ("accept", "precision", "crash", "backlog"):
            d = systems[n].get(phase) or {}
            if "failed" in d:
                notes.append(f"- {n} {phase}: {d['failed'].splitlines()[0]}")
            for err in _errors(d):
                notes.append(f"- {n} {phase}: {err.strip().splitlines()[-1]}")
    if notes:
        lines += ["", "## Failures and errors", "", *notes]
    lines += ["", f"Chart: `{results.get('chart', '-')}`", ""]
    return "\n".join(lines)


def _errors(d: dict[str, Any]) -> list[str]:
    out = []
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
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
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
