"""The delivery trace: one row per timer message, the input of `chronoq spark report`.

Theory of operation: the broker knows, per timer message, when it accepted it, when it was due
and when its timer fired or was cancelled; per consumer group it knows when a consumer first
received it. The export keeps the earliest first-receive over all groups. This module owns the
file format only (a Parquet schema and a writer built on pyarrow); it does not import Spark, so
the broker can write a trace without a JVM. Times are int64 milliseconds since the epoch; a null
means "not yet" (pending, or fired but never received) or "never" (cancelled_ms of a timer not
cancelled). A trace written before `cancelled_ms` existed reads with it null (Spark fills a missing column).
What the rows cannot show (older events rotated away by `trace_retention_bytes`) rides in the
file's metadata as lines for people (`NOTES_KEY`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TRACE_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    # (name, arrow type, nullable)
    ("message_id", "string", False),
    ("topic", "string", False),
    ("accepted_ms", "int64", False),
    ("due_ms", "int64", False),
    ("fired_ms", "int64", True),
    ("first_received_ms", "int64", True),
    ("cancelled_ms", "int64", True),
)
"""The trace's columns, in file order."""

NOTES_KEY = b"chronoq.trace.notes"
"""Parquet key-value metadata: a JSON list of lines a reader of the rows must know."""

TRACE_ROW_GROUP_ROWS = 128 * 1024
"""Rows per Parquet row group: large enough for Spark to split work, small enough to stream."""


class TraceRowInvalid(ValueError):
    """A trace row lacks a required column or holds a value of the wrong kind."""

    def __init__(self, index: int, column: str, value: Any) -> None:
        super().__init__(f"trace row {index}: column {column!r} has invalid value {value!r}")
        self.index = index
        self.column = column
        self.value = value


def trace_schema() -> Any:
    """The pyarrow schema of a delivery trace."""
    import pyarrow as pa

    types = {"string": pa.string(), "int64": pa.int64()}
    return pa.schema([pa.field(name, types[kind], nullable=nullable) for name, kind, nullable in TRACE_COLUMNS])


def trace_spark_ddl() -> str:
    """The same schema as a Spark DDL string (for `spark.read.schema(...)`)."""
    spark_types = {"string": "STRING", "int64": "BIGINT"}
    return ", ".join(f"{name} {spark_types[kind]}" for name, kind, _ in TRACE_COLUMNS)


def _columns_from_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {name: [] for name, _, _ in TRACE_COLUMNS}
    for index, row in enumerate(rows):
        for name, kind, nullable in TRACE_COLUMNS:
            value = row.get(name)
            if value is None and not nullable:
                raise TraceRowInvalid(index, name, value)
            if value is not None:
                ok = isinstance(value, str) if kind == "string" else isinstance(value, int) and not isinstance(
                    value, bool)
                if not ok:
                    raise TraceRowInvalid(index, name, value)
            columns[name].append(value)
    return columns


def write_trace(rows: Iterable[Mapping[str, Any]], path: str | Path, *, notes: Iterable[str] = ()) -> int:
    """Write `rows` (mappings with the `TRACE_COLUMNS` keys) to one Parquet file at `path`, and
    `notes` (what the rows do not show) in its metadata.

    The file is written beside its final name and renamed into place, so a reader never sees a
    half-written trace. Returns the number of rows written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = _columns_from_rows(rows)
    table = pa.table(columns, schema=trace_schema().with_metadata({NOTES_KEY: json.dumps(list(notes))}))
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=TRACE_ROW_GROUP_ROWS)
    tmp.replace(path)
    return table.num_rows


def read_trace_notes(path: str | Path) -> list[str]:
    """The notes of the trace at `path` (a Parquet file, or a directory of them), each once."""
    import pyarrow.parquet as pq

    path = Path(path)
    parts = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    notes: list[str] = []
    for part in parts:
        meta = pq.read_schema(part).metadata or {}
        for note in json.loads(meta.get(NOTES_KEY, b"[]")):
            if note not in notes:
                notes.append(note)
    return notes
