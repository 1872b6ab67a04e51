"""`chronoq stats`: pending timers by due time, delivery error, the log, the disk, the trace, groups, in one screen.

Theory of operation: the server's `Stats` admin call returns `Broker.stats()` as JSON; `--json`
prints it whole for programs. For a person, `render` lays the sections a person watches out as
lines of at most 80 columns, most watched first (pending timers by due time, then latency
percentiles), about 15 lines in all, so `--watch` fits an 80x24 terminal with room to spare; the
last line names the consumer groups, furthest behind first, as many as fit.
Counts are shortened to fit a column (12,345 / 340k / 1.2M), durations and times go through
`chronoq.timefmt`, bytes are binary units. The broker may grow the object: a field this module
does not know is shown as a `name: value` line at the end, never dropped (internal positions,
which only a program needs, are in `--json` only).

`--json` with `--watch` prints one object per line. `--watch SECONDS` redraws the whole screen in
place (the terminal's alternate screen, as `watch` and `top` do) when stdout is a terminal;
piped, it prints one snapshot after another, each headed by its time and flushed, so
`chronoq stats --watch 5 | tee stats.log` records as it goes.
A server that cannot be reached while watching is shown as such and asked again next time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from typing import Any

from rich.live import Live
from rich.text import Text

from chronoq.cli.common import (
    Connection,
    add_command,
    add_connection_arguments,
    connection_of,
    console,
    describe_error,
    run_remote,
)
from chronoq.client import AsyncAdmin
from chronoq.errors import ChronoqError
from chronoq.timefmt import duration, local_instant, relative

WIDTH = 80
"""Every line of the person view fits this many columns (a standard terminal)."""
DUE_LABELS = (("overdue", "overdue"), ("5s", "<5s"), ("1m", "<1m"), ("5m", "<5m"), ("15m", "<15m"), ("1h", "<1h"),
              ("4h", "<4h"), ("8h", "<8h"), ("24h", "<24h"), ("more", "later"))
"""`pending_by_due` keys (see `timer/metrics.py`: each bucket runs from the previous edge) and their headers."""
LATENCIES = (("delivery_error_ms", "delivery error"), ("fire_lag_ms", "fire lag"), ("enqueue_lag_ms", "enqueue lag"))
PERCENTILES = ("p50", "p90", "p99", "p999", "max")
KNOWN_TOP = frozenset({"now_ms", "topics", "commitlog", "timer", "clock", "disk", "trace", "groups"})
KNOWN_CLOCK = frozenset({"behind_wall_ms", "max_backward_step_ms", "rebases", "rebased_ms", "last_rebase_ms",
                         "last_rebase_at_ms"})
KNOWN_TRACE = frozenset({"enabled", "active", "stopped_reason", "stopped"})
KNOWN_TIMER = frozenset({"now_ms", "pending_total", "pending_by_topic", "pending_by_due", "next_deadline_ms",
                         "oldest_overdue_ms", "indexed_position", "latencies", "pending_by_delay_level", "damaged"})
KNOWN_COMMITLOG = frozenset({"start_position", "end_position", "segments", "fsyncs", "damaged_ranges", "damaged",
                             "reads_skipped_damaged"})
KNOWN_DISK = frozenset({"free_bytes", "min_free_bytes", "reserve_file_bytes", "held_back", "dispatch_blocked",
                        "dispatch_out_of_fds"})
LABEL = 12
"""Width of the section names in the left column."""
PULSAR_COPIES_PREFIX = "%PULSAR_NOW%"
"""`chronoq.pulsar.messages.IMMEDIATE_PREFIX` (not imported: the CLI stays light)."""


def count(n: Any, width: int = 6) -> str:
    """A count in at most `width` (5 or 6) columns: '12,345' (or '12k' in 5), '340k', '1.2M', '123M'."""
    if not isinstance(n, int | float):
        return "-"
    n = int(n)
    if abs(n) < (100_000 if width >= 6 else 10_000):
        return f"{n:,}"
    if abs(n) < 1_000_000:
        return f"{n // 1000}k"
    if abs(n) < 10_000_000:
        return f"{n / 1_000_000:.1f}M"
    return f"{n // 1_000_000}M"


def size(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _ms(value: Any) -> str:
    return duration(value) if isinstance(value, int | float) else "-"


def _clip(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 3] + "..."


def _named_counts(counts: Mapping[str, Any], width: int) -> str:
    """'orders 1,200 · billing 4 · and 3 more', largest first, cut to `width` columns."""
    items = sorted(counts.items(), key=lambda kv: (-int(kv[1]), str(kv[0])))
    parts: list[str] = []
    for i, (name, n) in enumerate(items):
        part = f"{name} {count(n)}"
        rest = len(items) - i - 1
        tail = f" · and {rest} more" if rest else ""
        if len(" · ".join([*parts, part]) + tail) > width and parts:
            return " · ".join(parts) + f" · and {len(items) - i} more"
        parts.append(part)
    return " · ".join(parts)


def _timer_lines(timer: Mapping[str, Any], now_ms: int) -> list[str]:
    pending = timer.get("pending_total", 0)
    deadline = timer.get("next_deadline_ms")
    overdue = timer.get("oldest_overdue_ms") or 0
    head = f"{'timers':<{LABEL}}{count(pending)} pending"
    if deadline is not None:
        head += f", next due {relative(int(deadline), now_ms)}"
    head += f", oldest overdue by {duration(overdue)}" if overdue else ", none overdue"
    if timer.get("damaged"):
        head += f", {count(timer['damaged'])} damaged"
    lines = [head]
    by_due = timer.get("pending_by_due") or {}
    # Ten columns of six (eight for "overdue") after the label: 74 columns, counts cut to five.
    keys = [(key, label) for key, label in DUE_LABELS if key in by_due]
    widths = [max(6, len(label) + 1) for _, label in keys]
    columns = list(zip(keys, widths, strict=True))
    lines.append(f"{'  by due':<{LABEL}}" + "".join(f"{label:>{w}}" for (_, label), w in columns))
    lines.append(" " * LABEL + "".join(f"{count(by_due[key], 5):>{w}}" for (key, _), w in columns))
    if timer.get("pending_by_topic"):
        lines.append(f"{'  by topic':<{LABEL}}" + _named_counts(timer["pending_by_topic"], WIDTH - LABEL))
    levels = timer.get("pending_by_delay_level") or {}
    if levels:
        text = " · ".join(f"level {k}: {count(v)}" for k, v in sorted(levels.items(), key=lambda kv: int(kv[0])))
        lines.append(f"{'  by level':<{LABEL}}" + text)
    return lines


def _latency_lines(latencies: Mapping[str, Any]) -> list[str]:
    name_width = 16
    lines = [f"{'latency':<{name_width}}{'count':>8}" + "".join(f"{p:>9}" for p in PERCENTILES)]
    for key, label in LATENCIES:
        h = latencies.get(key)
        if isinstance(h, Mapping):
            lines.append(f"{'  ' + label:<{name_width}}{count(h.get('count')):>8}"
                         + "".join(f"{_ms(h.get(p)):>9}" for p in PERCENTILES))
    return lines


def _commitlog_line(log: Mapping[str, Any]) -> str:
    start, end = log.get("start_position", 0), log.get("end_position", 0)
    segments = log.get("segments", 0)
    text = (f"{'commit log':<{LABEL}}{size(end - start)} in {count(segments)} segment{'s' if segments != 1 else ''}, "
            f"{count(log.get('fsyncs'))} fsyncs")
    damaged = log.get("damaged_ranges") or 0
    text += f", {count(damaged)} damaged ranges (run chronoq check)" if damaged else ", no damage"
    if log.get("reads_skipped_damaged"):
        text += f", {count(log['reads_skipped_damaged'])} reads skipped"
    return text


def _disk_line(disk: Mapping[str, Any]) -> str:
    text = f"{'disk':<{LABEL}}{size(disk.get('free_bytes'))} free"
    if disk.get("min_free_bytes"):
        text += f" (sends refused below {size(disk['min_free_bytes'])})"
    held = disk.get("held_back") or {}
    blocked = disk.get("dispatch_blocked")
    if held or blocked:
        text += "; FULL: " + "; ".join([*(f"{k} held back" for k in held), *([str(blocked)] if blocked else [])])
    return text


def _fds_line(disk: Mapping[str, Any]) -> str | None:
    """Dispatch held back for lack of file descriptors, on a line of its own below the disk's
    (the disk line is near 80 columns already); None (no line) when it is not."""
    if not disk.get("dispatch_out_of_fds"):
        return None
    return f"{'dispatch':<{LABEL}}HELD BACK: out of file descriptors, sends refused (ulimit -n)"


def _trace_line(trace: Mapping[str, Any]) -> str | None:
    """'recording', or 'STOPPED (disk_full): <error>'; None (no line) when the trace is off."""
    if not trace.get("enabled"):
        return None
    if trace.get("active"):
        return f"{'trace':<{LABEL}}recording"
    return f"{'trace':<{LABEL}}STOPPED for this run ({trace.get('stopped_reason')}): {trace.get('stopped')}"


def _clock_lines(clock: Mapping[str, Any], now_ms: int) -> list[str]:
    """The clock line, and a second one once broker time has been re-based (an ERROR in the log)."""
    behind = int(clock.get("behind_wall_ms") or 0)
    if behind == 0:
        state = "broker time = wall clock"
    elif behind > 0:
        state = f"broker time is {duration(behind)} behind the wall clock (a step forward; timers never fire early)"
    else:
        state = f"broker time is {duration(-behind)} ahead of the wall clock (paused after a step back)"
    lines = [f"{'clock':<{LABEL}}{state}"]
    rebases = int(clock.get("rebases") or 0)
    if rebases:
        last, at = clock.get("last_rebase_ms"), clock.get("last_rebase_at_ms")
        when = f", {relative(int(at), now_ms)}" if at is not None and now_ms else ""
        limit = clock.get("max_backward_step_ms")
        over = f" over {duration(int(limit))}" if limit else ""
        lines.append(f"{'':<{LABEL}}RE-BASED {rebases}x after steps back{over}: last by {duration(int(last or 0))}"
                     f"{when}")
    return lines


def _groups_line(groups: Any) -> str:
    """'billing on orders: lag 1,200, 3 in flight · audit on orders: lag 0 · and 2 more', the
    furthest behind first (at equal lag, a Pulsar subscription's row on its topic's immediate
    copies, `%PULSAR_NOW%<topic>`, after the others), cut to the line; 'none' before any group
    has received."""
    head = f"{'groups':<{LABEL}}"
    if not isinstance(groups, list) or not groups:
        return head + "none"
    rows = sorted((g for g in groups if isinstance(g, Mapping)),
                  key=lambda g: (-int(g.get("lag") or 0), -int(g.get("inflight") or 0),
                                 str(g.get("topic")).startswith(PULSAR_COPIES_PREFIX), str(g.get("group"))))
    parts: list[str] = []
    for i, g in enumerate(rows):
        part = f"{g.get('group')} on {g.get('topic')}: lag {count(g.get('lag'))}"
        if g.get("inflight"):
            part += f", {count(g['inflight'])} in flight"
        rest = len(rows) - i - 1
        tail = f" · and {rest} more" if rest else ""
        if parts and len(head + " · ".join([*parts, part]) + tail) > WIDTH:
            return head + " · ".join(parts) + f" · and {len(rows) - i} more"
        parts.append(part)
    return head + " · ".join(parts)


def _extra_lines(prefix: str, doc: Mapping[str, Any], known: frozenset[str]) -> list[str]:
    return [f"{prefix}{k}: {json.dumps(v, separators=(',', ':'))}" for k, v in doc.items() if k not in known]


def render(stats: Mapping[str, Any]) -> list[str]:
    """The person view of a `Stats` reply: lines of at most `WIDTH` columns."""
    now_ms = int(stats.get("now_ms") or 0)
    timer = stats.get("timer") or {}
    lines = _timer_lines(timer, now_ms)
    lines += _latency_lines(timer.get("latencies") or {})
    lines.append(_commitlog_line(stats.get("commitlog") or {}))
    lines.append(_disk_line(stats.get("disk") or {}))
    if (fds_line := _fds_line(stats.get("disk") or {})) is not None:
        lines.append(fds_line)
    if (trace_line := _trace_line(stats.get("trace") or {})) is not None:
        lines.append(trace_line)
    lines += _clock_lines(stats.get("clock") or {}, now_ms)
    lines.append(f"{'topics':<{LABEL}}{count(stats.get('topics'))}")
    if "groups" in stats:
        lines.append(_groups_line(stats["groups"]))
    lines += _extra_lines("", stats, KNOWN_TOP)
    lines += _extra_lines("timer.", timer, KNOWN_TIMER)
    lines += _extra_lines("commitlog.", stats.get("commitlog") or {}, KNOWN_COMMITLOG)
    lines += _extra_lines("disk.", stats.get("disk") or {}, KNOWN_DISK)
    lines += _extra_lines("trace.", stats.get("trace") or {}, KNOWN_TRACE)
    lines += _extra_lines("clock.", stats.get("clock") or {}, KNOWN_CLOCK)
    return [_clip(line) for line in lines]


def _title(conn: Connection, stats: Mapping[str, Any] | None, watch_s: float) -> str:
    when = local_instant(stats["now_ms"])[:19].replace("T", " ") if stats and stats.get("now_ms") else ""
    every = f"  every {duration(int(watch_s * 1000))}, Ctrl-C to stop" if watch_s else ""
    return _clip(f"chronoq stats  {conn.server}  {when}{every}")


def _frame(conn: Connection, stats: Mapping[str, Any] | None, watch_s: float, error: str | None = None) -> Text:
    text = Text()
    text.append(_title(conn, stats, watch_s), style="bold")
    if error is not None:
        text.append("\n" + _clip(error))
    elif stats is not None:
        text.append("\n" + "\n".join(render(stats)))
    return text


async def _watch(a: AsyncAdmin, conn: Connection, interval_s: float, *, as_json: bool = False) -> int:
    async def snapshot() -> tuple[dict[str, Any] | None, str | None]:
        try:
            return await a.stats(), None
        except ChronoqError as e:
            if not e.retriable:
                raise
            return None, describe_error(e)

    if as_json or not console.is_terminal:
        while True:
            stats, error = await snapshot()
            if as_json:  # one object per line (JSON Lines), for a program reading as it goes
                if stats is not None:
                    console.out(json.dumps(stats, separators=(",", ":")), highlight=False)
            else:
                console.print(_frame(conn, stats, interval_s, error))
                console.print()  # a blank line between snapshots
            sys.stdout.flush()
            await asyncio.sleep(interval_s)
    # The alternate screen: each frame replaces the last whole, and the terminal's own contents
    # come back on exit, as with `watch` and `top`.
    with Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            stats, error = await snapshot()
            live.update(_frame(conn, stats, interval_s, error), refresh=True)
            await asyncio.sleep(interval_s)


def _cmd_stats(args: argparse.Namespace) -> int:
    conn = connection_of(args)

    async def go() -> int:
        async with AsyncAdmin(**conn.client_kwargs()) as a:
            if args.watch:
                return await _watch(a, conn, args.watch, as_json=args.json)
            stats = await a.stats()
        if args.json:
            console.print_json(data=stats)
        else:
            console.print(_frame(conn, stats, 0))
        return 0

    return run_remote(go)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--watch takes seconds (e.g. 2 or 0.5), not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--watch takes a positive number of seconds, not {text!r}")
    return value


def register(subparsers: Any) -> None:
    stats = add_command(
        subparsers, "stats", "pending timers by due time, delivery error, log and disk",
        "Broker statistics in one screen: pending timers by due time, topic and delay level; latency "
        "percentiles (delivery error: how late timers fired, counted from their due time, or from their "
        "acceptance when they were due before it); the commit log, the disk and the clock.",
        ["chronoq stats", "chronoq stats --watch 2", "chronoq stats --json | jq .timer.pending_total"])
    stats.add_argument("--json", action="store_true",
                       help="print the server's whole JSON object (for programs); with --watch, one per line")
    stats.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS",
                       help="redraw the screen every SECONDS until Ctrl-C; piped, print a snapshot every SECONDS")
    add_connection_arguments(stats)
    stats.set_defaults(func=_cmd_stats)
