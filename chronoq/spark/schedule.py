"""Bulk scheduling: every row of a table becomes a timer message, or a reject with its reason.

Theory of operation. `run_schedule` reads the input (Parquet, CSV or JSON; a file or a
directory) on Spark, computes for each row its message id, delivery time and a `reason` (null
when the row is valid) with column expressions only, caches that, then writes the rejects as
Parquet and sends the valid rows through the `chronoq` data source writer. Every input row is
counted as scheduled or rejected; nothing is dropped silently.

Limits are checked here, before any message is sent, against the same defaults the broker
enforces (`timer_max_delay_ms` 30 days, `max_message_size_bytes` 4 MiB): a deadline too far
ahead, an unparseable time or one before the epoch, a negative delay, a missing or oversized body,
a bad id. "Too far"
is judged against one `now_ms` taken when the job starts (the broker judges again on arrival).

Message ids make a retried Spark task (or a rerun of the whole command) idempotent while the broker
remembers them (`dedupe_window_ms` and the last `dedupe_window_max_entries` ids: docs/spark.md):
the id column when given, otherwise a hash of (input file, row number in the file) for Parquet and
of (file, block start, row position in the split) for CSV/JSON, which a different split layout
changes (give CSV/JSON an id column).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronoq.config import Config
from chronoq.spark.datasource import SOURCE_NAME, register

MAX_MESSAGE_ID_LENGTH = Config().max_message_id_length
MAX_TAG_LENGTH = Config().max_tag_length
"""The broker's default limit, from its one declaration (a broker configured lower still refuses per row)."""
PROGRESS_INTERVAL_S = 2.0
ROWS_PER_WRITE_TASK = 50_000


class ScheduleInputError(ValueError):
    """The input or the column options are unusable (missing column, unknown format)."""


@dataclass(frozen=True)
class ScheduleOptions:
    input_path: str
    topic: str
    server: str
    deliver_at_column: str | None = None
    delay_column: str | None = None
    input_format: str | None = None
    body_column: str = "body"
    id_column: str | None = None
    tag_column: str | None = None
    keys_column: str | None = None
    rejects_path: str | None = None
    max_delay_ms: int = 30 * 24 * 3600 * 1000
    max_body_bytes: int = 4 * 1024 * 1024
    batch_size: int = 512


@dataclass
class ScheduleResult:
    total: int
    scheduled: int
    rejected: int
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    rejects_path: str | None = None
    elapsed_s: float = 0.0

    def summary(self) -> str:
        rate = self.total / self.elapsed_s if self.elapsed_s else 0.0
        lines = [f"rows {self.total}: scheduled {self.scheduled}, rejected {self.rejected} "
                 f"in {self.elapsed_s:.1f} s ({rate:,.0f} rows/s)"]
        for reason, count in sorted(self.rejects_by_reason.items(), key=lambda kv: -kv[1]):
            lines.append(f"  rejected {count}: {reason}")
        if self.rejected:
            lines.append(f"rejects written to {self.rejects_path}")
        return "\n".join(lines)


def _input_format(options: ScheduleOptions) -> str:
    if options.input_format:
        return options.input_format
    path = Path(options.input_path)
    candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                      and not p.name.startswith(("_", ".")))
    for p in candidates:
        for fmt, suffixes in (("parquet", (".parquet",)), ("csv", (".csv",)), ("json", (".json", ".jsonl"))):
            if any(p.name.endswith(s) or f"{s}." in p.name for s in suffixes):
                return fmt
    raise ScheduleInputError(f"cannot tell the format of {options.input_path}; pass --format parquet|csv|json")


def read_input(spark: Any, options: ScheduleOptions) -> Any:
    fmt = _input_format(options)
    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", "true")  # every column a string; we parse times ourselves
    df = reader.load(options.input_path)
    wanted = [c for c in (options.body_column, options.deliver_at_column, options.delay_column, options.id_column,
                          options.tag_column, options.keys_column) if c]
    missing = [c for c in wanted if c not in df.columns]
    if missing:
        raise ScheduleInputError(f"input {options.input_path} has no column(s) {missing}; it has {df.columns}")
    return df, fmt


def _row_identity(fmt: str) -> Any:
    """A string naming the row stably across reruns: file and row number (see module docstring)."""
    from pyspark.sql import functions as F

    if fmt == "parquet":
        return F.concat_ws(":", F.col("_metadata.file_path"), F.col("_metadata.row_index").cast("string"))
    local_index = F.monotonically_increasing_id().bitwiseAND((1 << 33) - 1)
    return F.concat_ws(":", F.col("_metadata.file_path"), F.col("_metadata.file_block_start").cast("string"),
                       local_index.cast("string"))


def _deliver_at_ms(df: Any, column: str) -> tuple[Any, Any]:
    """(epoch-ms column or null, the raw value as text for the reject reason)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType, StringType, TimestampNTZType, TimestampType

    dtype = df.schema[column].dataType
    c = F.col(f"`{column}`")
    if isinstance(dtype, TimestampType | TimestampNTZType):
        return F.unix_millis(c.cast("timestamp")), c.cast("string")
    if isinstance(dtype, NumericType):
        # try_cast: out of BIGINT's range (1e30 in a double column) is that row's reject, not a
        # CAST_OVERFLOW that fails the whole job under Spark 4's ANSI mode.
        return F.expr(f"try_cast(`{column}` AS BIGINT)"), c.cast("string")
    if isinstance(dtype, StringType):
        text = F.trim(c)
        as_ms = F.when(text.rlike(r"^-?[0-9]+$"), F.expr(f"try_cast(trim(`{column}`) AS BIGINT)"))
        as_ts = F.unix_millis(F.expr(f"try_to_timestamp(trim(`{column}`))"))
        return F.coalesce(as_ms, as_ts), c
    raise ScheduleInputError(f"column {column!r} has type {dtype.simpleString()}; use a timestamp, epoch ms or text")


def _delay_ms(df: Any, column: str) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    return F.expr(f"try_cast(`{column}` AS BIGINT)"), F.col(f"`{column}`").cast("string")


def validate(df: Any, fmt: str, options: ScheduleOptions, now_ms: int) -> Any:
    """The input plus `message_id`, `deliver_at_ms`/`delay_ms`, `body_bin`, and `reason` (text naming
    the value and the limit) with `reason_code` (for counting); both null for a valid row."""
    from pyspark.sql import functions as F

    body = F.col(f"`{options.body_column}`")
    body_bin = F.when(body.isNull(), F.lit(None).cast("binary")).otherwise(body.cast("binary"))
    if options.id_column:
        message_id = F.col(f"`{options.id_column}`").cast("string")
    else:
        message_id = F.concat(F.lit("SQ"), F.upper(F.substring(F.sha2(_row_identity(fmt), 256), 1, 32)))
    out = df.withColumn("message_id", message_id).withColumn("body_bin", body_bin)
    size = F.octet_length(F.col("body_bin"))
    checks = [
        (F.col("body_bin").isNull(), "body_missing",
         F.lit(f"body is missing (column {options.body_column!r} is null)")),
        (size > options.max_body_bytes, "body_too_large",
         F.format_string(f"body is %d bytes; the limit (--max-body-bytes) is {options.max_body_bytes}", size)),
        (F.col("message_id").isNull() | (F.length("message_id") == 0), "id_missing", F.lit("message id is missing")),
        (F.length("message_id") > MAX_MESSAGE_ID_LENGTH, "id_too_long",
         F.lit(f"message id is longer than {MAX_MESSAGE_ID_LENGTH} characters")),
        # The broker's rules (chronoq/validate.py), so a row it would refuse is a reject here: a
        # refusal inside a task failed the whole job with a traceback and wrote no rejects.
        (~F.col("message_id").rlike(r"^[\x21-\x7e]+$"), "id_bad_characters",
         F.lit("message id must be printable ASCII without spaces")),
    ]
    if options.tag_column:
        tag = F.col(f"`{options.tag_column}`").cast("string")
        blank = (F.length(tag) > 0) & (F.length(F.trim(tag)) == 0)
        checks.append((tag.isNotNull() & ((F.length(tag) > MAX_TAG_LENGTH) | tag.contains("|")
                                          | tag.rlike(r"[\x00-\x1f]") | blank),
                       "bad_tag", F.lit(f"tag must be 1..{MAX_TAG_LENGTH} characters, not blank, "
                                        "without '|' or control characters")))
    if options.keys_column and "array" not in df.schema[options.keys_column].dataType.simpleString():
        keys = F.col(f"`{options.keys_column}`").cast("string")
        checks.append((keys.isNotNull() & (keys.rlike(r"(^|,)(,|$)") | keys.rlike(r"[\x00-\x1f]")), "bad_keys",
                       F.lit("keys must be non-empty, comma-separated, without control characters")))
    if options.deliver_at_column:
        ms, raw = _deliver_at_ms(df, options.deliver_at_column)
        out = out.withColumn("deliver_at_ms", ms)
        ahead = F.col("deliver_at_ms") - F.lit(now_ms)
        checks += [
            (F.col("deliver_at_ms").isNull(), "unparseable_time",
             F.format_string("unparseable delivery time '%s'", raw)),
            (F.col("deliver_at_ms") < 0, "before_epoch",
             F.format_string("delivery time %d ms is before the epoch", F.col("deliver_at_ms"))),
            (ahead > options.max_delay_ms, "too_far",
             F.format_string(f"delivery time is %d ms ahead; the limit (--max-delay-ms) is {options.max_delay_ms}",
                             ahead)),
        ]
    else:
        assert options.delay_column
        ms, raw = _delay_ms(df, options.delay_column)
        out = out.withColumn("delay_ms", ms)
        checks += [
            (F.col("delay_ms").isNull(), "unparseable_delay", F.format_string("unparseable delay '%s'", raw)),
            (F.col("delay_ms") < 0, "negative_delay", F.format_string("delay %d ms is negative", F.col("delay_ms"))),
            (F.col("delay_ms") > options.max_delay_ms, "too_far",
             F.format_string(f"delay %d ms exceeds the limit (--max-delay-ms) {options.max_delay_ms}",
                             F.col("delay_ms"))),
        ]
    reason = F.lit(None).cast("string")
    code = F.lit(None).cast("string")
    for condition, kind, text in reversed(checks):  # the first failing check names the row's reason
        reason = F.when(condition, text).otherwise(reason)
        code = F.when(condition, F.lit(kind)).otherwise(code)
    return out.withColumn("reason", reason).withColumn("reason_code", code)


def _messages(valid: Any, options: ScheduleOptions) -> Any:
    from pyspark.sql import functions as F

    cols = [F.col("body_bin").alias("body"), F.col("message_id")]
    cols.append(F.col("deliver_at_ms").alias("deliver_at") if options.deliver_at_column else F.col("delay_ms"))
    if options.tag_column:
        cols.append(F.col(f"`{options.tag_column}`").cast("string").alias("tag"))
    if options.keys_column:
        keys = F.col(f"`{options.keys_column}`")
        cols.append(F.split(keys.cast("string"), ",").alias("keys") if "array" not in
                    valid.schema[options.keys_column].dataType.simpleString() else keys.alias("keys"))
    return valid.select(*cols)


class _Progress:
    """Prints finished/total tasks of the running stages every couple of seconds."""

    def __init__(self, spark: Any, report: Callable[[str], None]) -> None:
        self.tracker = spark.sparkContext.statusTracker()
        self.report = report
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chronoq-schedule-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop_event.wait(PROGRESS_INTERVAL_S):
            for stage_id in self.tracker.getActiveStageIds():
                info = self.tracker.getStageInfo(stage_id)
                if info is not None:
                    self.report(f"progress: stage {stage_id} {info.name[:40]!r}: "
                                f"{info.numCompletedTasks}/{info.numTasks} tasks done, {info.numActiveTasks} running")


def run_schedule(spark: Any, options: ScheduleOptions, *, now_ms: int | None = None,
                 progress: Callable[[str], None] = lambda line: None) -> ScheduleResult:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    started = time.monotonic()
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    register(spark)
    df, fmt = read_input(spark, options)
    checked = validate(df, fmt, options, now_ms).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with _Progress(spark, progress):
            progress(f"validating {options.input_path} ({fmt})")
            counts = {row["reason_code"]: row["count"] for row in checked.groupBy("reason_code").count().collect()}
            total = sum(counts.values())
            valid_count = counts.pop(None, 0)
            rejects_path = options.rejects_path or f"chronoq-rejects-{options.topic}"
            if counts:
                progress(f"writing {sum(counts.values())} rejects to {rejects_path}")
                rejected = checked.filter(F.col("reason").isNotNull()).drop("body_bin")
                rejected.write.mode("overwrite").parquet(rejects_path)
            if valid_count:
                progress(f"sending {valid_count} messages to {options.server} topic {options.topic}")
                # Small write tasks: progress moves every ROWS_PER_WRITE_TASK rows and a retried task
                # resends little (ids come from the input, so a reshuffle cannot change them).
                tasks = max(spark.sparkContext.defaultParallelism, -(-valid_count // ROWS_PER_WRITE_TASK))
                valid = checked.filter(F.col("reason").isNull()).repartition(tasks)
                (_messages(valid, options).write.format(SOURCE_NAME).mode("append")
                 .option("server", options.server).option("topic", options.topic)
                 .option("sendBatchSize", str(options.batch_size)).save())
    finally:
        checked.unpersist()
    return ScheduleResult(total=total, scheduled=valid_count, rejected=sum(counts.values()),
                          rejects_by_reason=counts, rejects_path=rejects_path if counts else None,
                          elapsed_s=time.monotonic() - started)
