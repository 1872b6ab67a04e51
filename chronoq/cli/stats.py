"""`chronoq stats`: pending timers by due-time bucket, consumer lags, delivery error percentiles.

Theory of operation: the server's `Stats` admin call returns `Broker.stats()` as JSON. The broker
owns that shape and may grow it, so this command does not hard-code it: it renders any JSON
object as tables (scalars in a summary; a mapping of scalars as a two-column table; a mapping of
mappings, or a list of mappings, as a table whose columns are the union of their keys). Values
whose key ends in `_ms` are shown as times (epoch values) or durations. `--json` prints the raw
object for scripts; `--watch N` redraws every N seconds for a person watching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from chronoq.cli.messages import add_server_argument, console, format_delta_ms, format_ms, run_remote, server_of
from chronoq.client import AsyncAdmin

EPOCH_THRESHOLD_MS = 1_000_000_000_000
"""A `_ms` value above this (2001-09-09) is a point in time, below it a duration."""
COUNT_KEYS = frozenset({"count", "n", "samples", "total"})
"""Keys that count things even inside a section named `..._ms`."""


def _cell(key: str, value: Any, in_ms: bool = False) -> str:
    """`in_ms`: the enclosing section's name ends in `_ms`, so its bare numbers are ms too."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float) and (key.endswith("_ms") or (in_ms and key not in COUNT_KEYS)):
        if value >= EPOCH_THRESHOLD_MS:
            return format_ms(int(value))
        return format_delta_ms(int(value)) if float(value).is_integer() else f"{value:.3f}ms"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, Mapping | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, Mapping | list)


def _rows_table(title: str, rows: list[tuple[str, Mapping[str, Any]]]) -> Table:
    in_ms = title.endswith("_ms")
    columns: list[str] = []
    for _, row in rows:
        columns.extend(k for k in row if k not in columns)
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for col in columns:
        table.add_column(col, justify="right")
    for name, row in rows:
        row_ms = in_ms or name.endswith("_ms")
        table.add_row(name, *(_cell(c, row[c], row_ms) if c in row else "" for c in columns))
    return table


def _section(title: str, value: Any) -> RenderableType:
    if isinstance(value, Mapping | list) and not value:
        return Text(f"{title}: none")
    if isinstance(value, Mapping):
        if all(_is_scalar(v) for v in value.values()):
            table = Table(title=title, title_justify="left")
            table.add_column("")
            table.add_column("value", justify="right")
            for k, v in value.items():
                table.add_row(str(k), _cell(str(k), v, title.endswith("_ms")))
            return table
        if all(isinstance(v, Mapping) for v in value.values()):
            return _rows_table(title, [(str(k), v) for k, v in value.items()])
        # Mixed: scalars first, then each nested part as its own section.
        parts: list[RenderableType] = []
        scalars = {k: v for k, v in value.items() if _is_scalar(v)}
        if scalars:
            parts.append(_section(title, scalars))
        parts.extend(_section(f"{title} / {k}", v) for k, v in value.items() if not _is_scalar(v))
        return Group(*parts)
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return _rows_table(title, [(str(i), v) for i, v in enumerate(value)])
    return Table(title=f"{title}: {_cell(title, value)}", title_justify="left", show_header=False)


def render_stats(stats: Mapping[str, Any]) -> RenderableType:
    scalars = {k: v for k, v in stats.items() if _is_scalar(v)}
    parts: list[RenderableType] = []
    if scalars:
        parts.append(_section("summary", scalars))
    parts.extend(_section(str(k), v) for k, v in stats.items() if not _is_scalar(v))
    return Group(*parts)


def _cmd_stats(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(server_of(args)) as a:
            stats = await a.stats()
            if args.json:
                console.print_json(data=stats)
                return 0
            if not args.watch:
                console.print(render_stats(stats))
                return 0
            with Live(render_stats(stats), console=console, refresh_per_second=4) as live:
                while True:
                    await asyncio.sleep(args.watch)
                    live.update(render_stats(await a.stats()))

    return run_remote(go)


def register(subparsers: Any) -> None:
    stats = subparsers.add_parser("stats", help="broker statistics: pending timers by due time, delivery errors")
    stats.add_argument("--json", action="store_true", help="print the raw JSON object")
    stats.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="redraw every SECONDS")
    add_server_argument(stats)
    stats.set_defaults(func=_cmd_stats)
