"""Bulk scheduling: every row of a table becomes a timer message, or a reject with its reason.

Theory of operation. `run_schedule` reads the input (Parquet, CSV or JSON; a file or a
directory) on Spark, computes for each row its message id, delivery time and a `reason` (null
when the row is valid) with column expressions only, caches that, then writes the rejects as
Parquet and sends the valid rows through the `chronoq` data source writer in its bulk mode
(Arrow batches to the broker's SendColumns, thousands of rows a request, the bodies taken from
their Arrow buffers; each write task its own connection). Every input row is counted as scheduled
or rejected; nothing is dropped silently.

Limits are checked here, before any message is sent, against the same defaults the broker
enforces (`timer_max_delay_ms` 30 days, `max_message_size_bytes` 4 MiB): a deadline too far
ahead, an unparseable time or one before the epoch, a negative delay, a missing or oversized body,
a bad id, an id already carried by an earlier valid row. "Too far"
is judged against one `now_ms` taken when the job starts (the broker judges again on arrival).
A reason that names a time or a duration says it as a person reads it (`chronoq.timefmt`) beside
the milliseconds; that text is made in Python for the rejected rows only, so valid rows never
pay for a Python UDF. The rejects also carry `deliver_at_utc` (ISO 8601) beside `deliver_at_ms`.

Repeated ids. The broker answers a message id it has seen on the topic within its dedupe window
with the first send's result and stores nothing (`chronoq/dedupe.py`), so of several valid rows
with one `--id-column` value only one can be stored: the first in input order (file, then row) is
sent and the others are rejects (`duplicate_id`), rather than rows counted as scheduled that were
never stored. The write's commit report (`ChronoqBatchWriter`, option `commitReport`) gives back
how many sent ids the broker already held (`already_stored`: a rerun, or a retried task).

Message ids make a retried Spark task (or a rerun of the whole command) idempotent while the broker
remembers them (`dedupe_window_ms` and the last `dedupe_window_max_entries` ids: docs/spark.md):
the id column when given, otherwise a hash of (input file, row number in the file) for Parquet and
of (file, block start, row position in the split) for CSV/JSON, which a different split layout
changes (give CSV/JSON an id column).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronoq.config import Config
from chronoq.spark.datasource import SOURCE_NAME, register
from chronoq.timefmt import duration, duration_against, instant

MAX_MESSAGE_ID_LENGTH = Config().max_message_id_length
MAX_TAG_LENGTH = Config().max_tag_length
"""The broker's default limit, from its one declaration (a broker configured lower still refuses per row)."""
PROGRESS_INTERVAL_S = 2.0
ROWS_PER_WRITE_TASK = 50_000


class ScheduleInputError(ValueError):
    """The input or the column options are unusable (missing column, unknown format)."""


class ScheduleSendError(RuntimeError):
    """The send failed part way (the broker stopped, refused a call, could not be reached).

    `stored_by_finished_tasks` counts what the write tasks that finished had sent (None when the
    write reported nothing); the failed task may have stored some of its rows too."""

    def __init__(self, cause: str, to_send: int, stored_by_finished_tasks: int | None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.to_send = to_send
        self.stored_by_finished_tasks = stored_by_finished_tasks


_TASK_ERROR = re.compile(r"(?:^|[\s.])(?:ChronoqSourceError|chronoq\.errors\.\w+|chronoq\.client\.errors\.\w+): (.+)$",
                         re.MULTILINE)


def task_failure_line(text: str) -> str:
    """The line that says why a write task failed, out of Spark's report of the failed job (a
    Python traceback inside a Java one, hundreds of lines): the last chronoq error's message, or
    else the report's first line."""
    found = _TASK_ERROR.findall(text)
    if found:
        return found[-1].strip()
    first = text.strip().splitlines()[0] if text.strip() else "the Spark job failed"
    return first[:500]


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
    batch_size: int = 4096
    """Rows per bulk send request (admin SendColumns)."""
    connection: Mapping[str, str] | None = None
    """More options for the executors' broker clients (`BrokerAccess.options()`: TLS, keys)."""
    skip_stored: bool = False
    """Ask the broker for each id first and send only those it does not hold (`stored_ids`)."""


@dataclass
class ScheduleStatus:
    """Where a running job is, for a caller that must say what was done when it stops early."""

    phase: str = "starting"
    """starting, validating, writing rejects, sending, done."""
    total: int | None = None
    to_send: int | None = None
    rejected: int | None = None
    rejects_path: str | None = None


@dataclass
class ScheduleResult:
    total: int
    scheduled: int
    rejected: int
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    rejects_path: str | None = None
    elapsed_s: float = 0.0
    already_stored: int | None = None
    """Of `scheduled`, the ids the broker already held (a rerun); None when the write did not say."""
    skipped_stored: int = 0
    """Of `scheduled`, the ids not sent because the broker held them (`skip_stored`)."""

    def summary(self) -> str:
        rate = self.total / self.elapsed_s if self.elapsed_s else 0.0
        lines = [f"rows {self.total}: scheduled {self.scheduled}, rejected {self.rejected} "
                 f"in {self.elapsed_s:.1f} s ({rate:,.0f} rows/s)"]
        if self.already_stored:
            lines.append(f"  of the scheduled, {self.already_stored} ids were already stored (sent before, within "
                         f"the broker's dedupe window): stored once, not again; {self.scheduled - self.already_stored}"
                         " stored now")
        if self.skipped_stored:
            lines.append(f"  of the scheduled, {self.skipped_stored} were not sent: the broker already holds their ids "
                         "(--skip-stored)")
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


TIME_REASONS = frozenset({"before_epoch", "too_far", "negative_delay"})
"""Reason codes whose text names a time or duration: written by `time_reason` on the rejects."""


def time_reason(code: str, value_ms: int, now_ms: int, max_delay_ms: int, by_delay: bool) -> str:
    """The reason for a reject of `TIME_REASONS`: milliseconds with the time a person reads beside them."""
    if code == "before_epoch":
        return f"delivery time {value_ms} ms ({instant(value_ms)}) is before the epoch"
    if code == "negative_delay":
        return f"delay {value_ms} ms ({duration(value_ms)}) is negative"
    # duration_against: a value just over the limit reads exactly, not as the limit does ("30 days").
    if by_delay:
        value, limit = duration_against(value_ms, max_delay_ms)
        return f"delay {value_ms} ms ({value}) exceeds the limit (--max-delay-ms) {max_delay_ms} ms ({limit})"
    ahead = value_ms - now_ms
    value, limit = duration_against(ahead, max_delay_ms)
    return (f"delivery time {instant(value_ms)} ({value_ms} ms) is {value} ({ahead} ms) ahead of the "
            f"job's start {instant(now_ms)}; the limit (--max-delay-ms) is {max_delay_ms} ms ({limit})")


def with_human_times(rejected: Any, options: ScheduleOptions, now_ms: int) -> Any:
    """The rejects with `TIME_REASONS` texts filled in and `deliver_at_utc` (ISO 8601) beside
    `deliver_at_ms` (Python UDFs: run over the rejected rows only)."""
    from pyspark.sql import functions as F

    by_delay = options.deliver_at_column is None
    value_col = "delay_ms" if by_delay else "deliver_at_ms"
    max_delay_ms = options.max_delay_ms

    def reason_text(code: str | None, value: int | None, reason: str | None) -> str | None:
        if code in TIME_REASONS and value is not None:
            return time_reason(code, int(value), now_ms, max_delay_ms, by_delay)
        return reason

    # Through a lambda: PySpark reads a function's type hints as a request for a pandas UDF and warns.
    reason_udf = F.udf(lambda code, value, reason: reason_text(code, value, reason), "string")
    out = rejected.withColumn("reason", reason_udf(F.col("reason_code"), F.col(value_col), F.col("reason")))
    if not by_delay:
        at_udf = F.udf(lambda ms: None if ms is None else instant(ms), "string")
        out = out.withColumn("deliver_at_utc", at_udf(F.col("deliver_at_ms")))
    return out


def _input_order(fmt: str) -> list[Any]:
    """Columns ordering rows as the input holds them (file, then row), for "the first" of a repeated id."""
    from pyspark.sql import functions as F

    if fmt == "parquet":
        return [F.col("_metadata.file_path"), F.col("_metadata.row_index")]
    return [F.col("_metadata.file_path"), F.col("_metadata.file_block_start"), F.monotonically_increasing_id()]


INPUT_ORDER = "_chronoq_input_order"


def _mark_repeated_ids(out: Any, partitions: int) -> Any:
    """Valid rows whose id an earlier valid row already carries become `duplicate_id` rejects.

    The rows are hashed by id into `partitions` (the write's task count) for the window that
    finds repeats, which needs every row of an id in one partition; the window takes that
    partitioning as it is, and so does the send: one shuffle, not the window's (sized by
    `spark.sql.shuffle.partitions`, 200 unless set: 200 small tasks on a small cluster) and then
    the write's."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    out = out.repartition(partitions, "message_id")
    valid = F.col("reason_code").isNull()
    group = Window.partitionBy("message_id", valid)
    ordered = group.orderBy(INPUT_ORDER)
    out = out.withColumns({"_rank": F.row_number().over(ordered), "_copies": F.count(F.lit(1)).over(group)})
    repeat = valid & (F.col("_rank") > 1)
    text = F.format_string("message id '%s' is on %d valid rows; only the first in input order is sent: the "
                           "broker stores a repeated id once (its dedupe window answers the others as "
                           "duplicates)", F.col("message_id"), F.col("_copies"))
    return (out.withColumns({"reason": F.when(repeat, text).otherwise(F.col("reason")),
                             "reason_code": F.when(repeat, F.lit("duplicate_id")).otherwise(F.col("reason_code"))})
            .drop("_rank", "_copies", INPUT_ORDER))


def validate(df: Any, fmt: str, options: ScheduleOptions, now_ms: int, partitions: int) -> Any:
    """The input plus `message_id`, `deliver_at_ms`/`delay_ms`, `body_bin`, `reason_code` (for
    counting; null for a valid row) and `reason` (text naming the value and the limit; for
    `TIME_REASONS`, written by `with_human_times` on the rejects). Built as two projections
    (`withColumns`: the derived values, then the checks over them), not a `withColumn` a column:
    Spark analyses the whole plan again at each call. With an id column the result is in
    `partitions` partitions by id (`_mark_repeated_ids`)."""
    from pyspark.sql import functions as F

    body = F.col(f"`{options.body_column}`")
    body_bin = F.when(body.isNull(), F.lit(None).cast("binary")).otherwise(body.cast("binary"))
    if options.id_column:
        message_id = F.col(f"`{options.id_column}`").cast("string")
    else:
        message_id = F.concat(F.lit("SQ"), F.upper(F.substring(F.sha2(_row_identity(fmt), 256), 1, 32)))
    derived = {"message_id": message_id, "body_bin": body_bin}
    if options.id_column:  # taken beside the file's own columns, where `_metadata` is at hand
        derived[INPUT_ORDER] = F.struct(*_input_order(fmt))
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
        derived["deliver_at_ms"] = ms
        ahead = F.col("deliver_at_ms") - F.lit(now_ms)
        checks += [
            (F.col("deliver_at_ms").isNull(), "unparseable_time",
             F.format_string("unparseable delivery time '%s'", raw)),
            (F.col("deliver_at_ms") < 0, "before_epoch", F.lit(None).cast("string")),
            (ahead > options.max_delay_ms, "too_far", F.lit(None).cast("string")),
        ]
    else:
        assert options.delay_column
        ms, raw = _delay_ms(df, options.delay_column)
        derived["delay_ms"] = ms
        checks += [
            (F.col("delay_ms").isNull(), "unparseable_delay", F.format_string("unparseable delay '%s'", raw)),
            (F.col("delay_ms") < 0, "negative_delay", F.lit(None).cast("string")),
            (F.col("delay_ms") > options.max_delay_ms, "too_far", F.lit(None).cast("string")),
        ]
    reason = F.lit(None).cast("string")
    code = F.lit(None).cast("string")
    for condition, kind, text in reversed(checks):  # the first failing check names the row's reason
        reason = F.when(condition, text).otherwise(reason)
        code = F.when(condition, F.lit(kind)).otherwise(code)
    out = df.withColumns(derived).withColumns({"reason": reason, "reason_code": code})
    return _mark_repeated_ids(out, partitions) if options.id_column else out


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
            try:
                for stage_id in self.tracker.getActiveStageIds():
                    info = self.tracker.getStageInfo(stage_id)
                    if info is not None:
                        self.report(f"progress: stage {stage_id} {info.name[:40]!r}: {info.numCompletedTasks}/"
                                    f"{info.numTasks} tasks done, {info.numActiveTasks} running")
            except Exception:
                return  # the JVM is going away (a failed or interrupted job): progress ends with it


def run_schedule(spark: Any, options: ScheduleOptions, *, now_ms: int | None = None,
                 progress: Callable[[str], None] = lambda line: None,
                 status: ScheduleStatus | None = None) -> ScheduleResult:
    import json
    import tempfile

    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    status = ScheduleStatus() if status is None else status
    started = time.monotonic()
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    register(spark)
    df, fmt = read_input(spark, options)
    # Small write tasks: progress moves every ROWS_PER_WRITE_TASK rows and a retried task resends
    # little (ids come from the input, so a reshuffle cannot change them). With an id column the
    # rows are put in that many partitions once, for the repeated-id check and the send alike,
    # so the input is counted first (Parquet from its files' footers; CSV and JSON by one more read).
    parallelism = spark.sparkContext.defaultParallelism

    def write_tasks(rows: int) -> int:
        return max(parallelism, -(-rows // ROWS_PER_WRITE_TASK))

    tasks = write_tasks(df.count()) if options.id_column else parallelism
    checked = validate(df, fmt, options, now_ms, tasks).persist(StorageLevel.MEMORY_AND_DISK)
    already_stored = None
    skipped_stored = 0
    try:
        with _Progress(spark, progress), tempfile.TemporaryDirectory(prefix="chronoq-schedule-") as scratch:
            status.phase = "validating"
            progress(f"validating {options.input_path} ({fmt})")
            counts = {row["reason_code"]: row["count"] for row in checked.groupBy("reason_code").count().collect()}
            total = sum(counts.values())
            valid_count = counts.pop(None, 0)
            rejects_path = options.rejects_path or f"chronoq-rejects-{options.topic}"
            status.total, status.to_send, status.rejected = total, valid_count, sum(counts.values())
            if counts:
                status.phase, status.rejects_path = "writing rejects", rejects_path
                progress(f"writing {sum(counts.values())} rejects to {rejects_path}")
                rejected = with_human_times(checked.filter(F.col("reason_code").isNotNull()).drop("body_bin"),
                                            options, now_ms)
                rejected.write.mode("overwrite").parquet(rejects_path)
            if valid_count:
                status.phase = "sending"
                progress(f"sending {valid_count} messages to {options.server} topic {options.topic}")
                valid = checked.filter(F.col("reason_code").isNull())
                if not options.id_column:  # (with one, `checked` is already in `tasks` partitions)
                    valid = valid.repartition(write_tasks(valid_count))
                report_path = Path(scratch) / "commit.json"
                writer = (_messages(valid, options).write.format(SOURCE_NAME).mode("append")
                          .options(**dict(options.connection or {}))
                          .option("server", options.server).option("topic", options.topic)
                          .option("bulk", "true").option("sendBatchSize", str(options.batch_size))
                          .option("skipStored", str(options.skip_stored).lower())
                          .option("commitReport", str(report_path)))
                try:
                    writer.save()
                except Exception as e:  # Spark's report of a failed job: a Py4J/captured exception
                    report = json.loads(report_path.read_text()) if report_path.exists() else None
                    raise ScheduleSendError(task_failure_line(str(e)), valid_count,
                                            report["sent"] if report else None) from None
                if report_path.exists():
                    report = json.loads(report_path.read_text())
                    already_stored = int(report["duplicates"])
                    skipped_stored = int(report.get("skipped", 0))
            status.phase = "done"
    finally:
        # Best effort: after a Ctrl-C the JVM may not answer, and the session's end frees the cache anyway.
        with contextlib.suppress(Exception):
            checked.unpersist()
    return ScheduleResult(total=total, scheduled=valid_count, rejected=sum(counts.values()),
                          rejects_by_reason=counts, rejects_path=rejects_path if counts else None,
                          elapsed_s=time.monotonic() - started, already_stored=already_stored,
                          skipped_stored=skipped_stored)
