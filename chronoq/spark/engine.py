"""The Spark timer engine: a Structured Streaming job that holds the far timers and hands them over.

Theory of operation. With `timer_firer = "spark"` the broker appends timer messages (and
cancels, as tombstones) to its timer topic `rmq_sys_wheel_timer`; this job keeps the timers
that are far off (the wheel's far levels) and hands each to the broker as it enters the broker's
hand-off horizon (`timer_handoff_horizon_ms`, `timer/handoff.py`):

    chronoq source (timer topic, per-queue offsets)
      -> timer_entries(): (timer key, due_ms, position, tombstone) from the system properties
      (+ a heartbeat from Spark's rate source, so every trigger runs a batch; see with_heartbeat)
      -> groupBy(shard, bucket).transformWithStateInPandas(BucketTimerProcessor, ProcessingTime),
         releasing each timer `lead_ms` (the horizon) before its due time
      -> the `chronoq-fire` sink: each task calls ArmTimers {position, topic, id}, in (due,
         position) order; the broker's loop then fires each timer at its due time

So the firing precision is the broker's loop's (milliseconds), not the micro-batch's (a second
or two): the job only has to arm a timer within the horizon (minutes) of the time it enters it.
`mode = "fire"` is the older way, kept for comparison: the processor releases a timer at its due
time and the sink calls FireTimers {positions}, so the error is the micro-batch's.

State lives in Spark's RocksDB state store and the source offsets in the checkpoint, so a job
stopped and restarted from its checkpoint reloads every pending timer and re-reads only what the
last uncommitted batch read. Re-running that batch arms (or fires) its timers again: ArmTimers
and FireTimers are idempotent by commit-log position, so the broker writes each delivered copy
once. A job stopped for less than the horizon costs nothing: what fell into the horizon
meanwhile is armed by its first batch, before it is due. A broker restarted needs nothing from
the job: it arms every timer due within its horizon at its first step (`timer/handoff.py`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamWriter, WriterCommitMessage

from chronoq.model import SYS_REAL_TOPIC, SYS_TIMER_DEL_UNIQKEY, SYS_TIMER_OUT_MS, TIMER_TOPIC

FIRE_SINK_NAME = "chronoq-fire"
HEARTBEAT_ID = "__chronoq_heartbeat"
FIRE_CHUNK = 1024
"""Positions per FireTimers or ArmTimers call (the broker refuses more than max_send_batch, default 1024)."""
MODES = ("arm", "fire")


@dataclass(frozen=True)
class EngineOptions:
    server: str
    checkpoint: str
    connection: Mapping[str, str] | None = None
    """More connection options for every broker client (`BrokerAccess.options()`: TLS, keys)."""
    bucket_ms: int | None = None
    """The state key's time bucket (`bucket_ms_of`: None is an hour to arm, 5 s to fire)."""
    shards: int = 2
    trigger_ms: int | None = None
    """How often a micro-batch runs (`trigger_ms_of`: None is 5 s to arm, 200 ms to fire)."""
    max_records_per_batch: int = 200_000
    tombstone_grace_ms: int = 10 * 60_000
    query_name: str = "chronoq-timer-engine"
    mode: str = "arm"
    """"arm": hand each timer to the broker as it enters the horizon (ArmTimers); "fire": fire it
    at its due time (FireTimers, the micro-batch's precision)."""
    handoff_ms: int | None = None
    """With mode "arm": how long before its due time a timer is handed over. None: the broker's
    `timer_handoff_horizon_ms`, asked at start (the job must not arm earlier than the broker's
    horizon: a restarted broker arms only what is due within it)."""
    release_step_ms: int | None = None
    """With mode "arm": a key hands over once a step (`BucketTimerProcessor._wake`). None: a fifth
    of the lead, at most a minute (a 5-minute horizon: each timer armed 4 to 5 minutes ahead)."""


ARM_BUCKET_MS = 60 * 60_000
"""The bucket when handing over: the job arms minutes ahead, so a key may hold a wide span. Few
keys keep ingestion cheap: each key a micro-batch touches costs the stateful stage a few
milliseconds whatever it holds (100,000 timers over 30 days into 8,642 keys of 10 minutes took
the stage 49-56 s, into 1,442 keys of an hour 22-23 s, one core). A key's chunks are read and
rewritten once a release step while its hour is handed over, a cost per timer of microseconds."""
FIRE_BUCKET_MS = 5_000
"""The bucket when firing at the due time: a key's list is rewritten on every expiry, so small."""


def bucket_ms_of(options: EngineOptions) -> int:
    if options.bucket_ms is not None:
        if options.bucket_ms < 1:
            raise ValueError(f"bucket_ms {options.bucket_ms} must be at least 1")
        return options.bucket_ms
    return ARM_BUCKET_MS if options.mode == "arm" else FIRE_BUCKET_MS


def release_step_ms(options: EngineOptions, lead_ms: int) -> int:
    """How often a key hands over (0: at each timer's own release time); at most half the lead."""
    if options.release_step_ms is not None:
        if not 0 <= options.release_step_ms <= lead_ms // 2:
            raise ValueError(f"release_step_ms {options.release_step_ms} must be from 0 to half the lead "
                             f"({lead_ms} ms)")
        return options.release_step_ms
    return min(60_000, lead_ms // 5) if options.mode == "arm" else 0


FIRE_TRIGGER_MS = 200
"""The micro-batch interval when firing at the due time: it bounds the firing error."""
ARM_TRIGGER_MS = 5_000
"""The micro-batch interval when handing over: a timer only has to reach the broker before it is
due, minutes after it enters the horizon, so a batch every few seconds is early enough. Every
micro-batch costs the stateful stage's Python workers whether or not a key wakes (at 200 ms, a
core of two on an idle job holding 50,000 timers), so the interval is the idle job's CPU."""


def trigger_ms_of(options: EngineOptions, lead_ms: int) -> int:
    """The micro-batch interval: `options.trigger_ms`, else 200 ms to fire and, to arm, 5 s or a
    quarter of what the release step leaves of the lead (a short horizon), whichever is less. A
    timer is armed at the latest a step, a trigger and a batch's run after it enters the horizon."""
    step_ms = release_step_ms(options, lead_ms)
    if options.trigger_ms is not None:
        if options.trigger_ms < 1:
            raise ValueError(f"trigger_ms {options.trigger_ms} must be at least 1")
        if options.mode == "arm" and lead_ms and options.trigger_ms > (lead_ms - step_ms) // 2:
            raise ValueError(f"trigger_ms {options.trigger_ms} must be at most half of what the release step "
                             f"({step_ms} ms) leaves of the lead ({lead_ms} ms): {(lead_ms - step_ms) // 2} ms, "
                             f"or timers could be armed after they are due")
        return options.trigger_ms
    if options.mode != "arm" or not lead_ms:
        return FIRE_TRIGGER_MS
    return max(FIRE_TRIGGER_MS, min(ARM_TRIGGER_MS, (lead_ms - step_ms) // 4))


def release_lead_ms(options: EngineOptions) -> int:
    """How long before its due time the processor releases a timer: 0 to fire, the broker's
    hand-off horizon to arm (asked of the broker when `handoff_ms` is None)."""
    if options.mode not in MODES:
        raise ValueError(f"engine mode {options.mode!r} is not one of {', '.join(MODES)}")
    if options.mode == "fire":
        return 0
    if options.handoff_ms is not None:
        if options.handoff_ms < 0:
            raise ValueError(f"handoff_ms {options.handoff_ms} must not be negative")
        return options.handoff_ms
    if not options.server:
        return 0  # no broker to ask (a test's sink writes only its log)
    from chronoq.spark.datasource import BrokerAccess, admin_client

    access = BrokerAccess.from_options({**dict(options.connection or {}), "server": options.server})
    with admin_client(access) as admin:
        handoff = admin.stats()["timer"].get("handoff")
    if not handoff:
        raise ValueError(f"the broker at {options.server} does not take hand-overs: its timer_firer is not "
                         '"spark" (set it, or run the engine with mode "fire")')
    return int(handoff["horizon_ms"])


def timer_entries(records: Any, options: EngineOptions) -> Any:
    from chronoq.spark.timer_processor import TIMER_KEY_SEP

    """Timer-topic records (the chronoq source's columns) as processor entries plus the grouping key.

    A tombstone names the id it cancels in TIMER_DEL_UNIQKEY and carries that timer's due time
    (TIMER_OUT_MS), so it lands in the same (shard, bucket) state key as the timer. The
    `message_id` column holds the timer's key within its bucket, `TIMER_KEY_SEP.join((real
    topic, id))` (`timer_processor.timer_key`): a cancel reaches only timers of its own topic, as
    the broker's does (before, it also dropped another topic's timer of the same id and due time
    from the job's state, which then fired late, by the broker's backstop). A record without a
    topic (none the broker writes) keys by the id alone.
    """
    from pyspark.sql import functions as F

    props = F.col("system_properties")
    cancelled_id = props.getItem(SYS_TIMER_DEL_UNIQKEY)
    message_id = F.concat_ws(TIMER_KEY_SEP, props.getItem(SYS_REAL_TOPIC),
                             F.coalesce(cancelled_id, F.col("message_id")))  # a null topic is left out
    # A tombstone without a due time cannot find its state key; it is dropped here, which is safe
    # because the broker refuses to fire a cancelled timer (FireTimers skips it). A timer record
    # without a due time fails the batch loudly rather than being skipped.
    records = records.filter(cancelled_id.isNull() | props.getItem(SYS_TIMER_OUT_MS).isNotNull())
    due_ms = F.coalesce(props.getItem(SYS_TIMER_OUT_MS).cast("bigint"), F.raise_error(F.format_string(
        f"timer record %s has no {SYS_TIMER_OUT_MS} system property", F.col("message_id"))).cast("bigint"))
    position = F.coalesce(F.col("position").cast("bigint"), F.raise_error(F.format_string(
        "timer record %s has no commit-log position (ReadMessages must report `position`)",
        F.col("message_id"))).cast("bigint"))
    return records.select(
        message_id.alias("message_id"),
        due_ms.alias("due_ms"),
        position.alias("position"),
        cancelled_id.isNotNull().alias("tombstone"),
    ).select(
        "*",
        # Shard by due second, not by id: timers due in the same millisecond share a state key, hence
        # a task, which fires them in position order; a bucket still spreads over `shards` keys.
        F.pmod(F.floor(F.col("due_ms") / 1000), F.lit(options.shards)).cast("int").alias("shard"),
        F.floor(F.col("due_ms") / bucket_ms_of(options)).cast("bigint").alias("bucket"),
    )


def with_heartbeat(spark: Any, entries: Any, options: EngineOptions) -> Any:
    """Union one row a second from Spark's `rate` source into the entries.

    Spark runs a micro-batch only when a source has new data, or when the previous batch says its
    stateful operator needs another one; after a restart there is no previous batch, so a job with
    pending timers but a quiet timer topic would sit idle and fire nothing. The heartbeat keeps the
    stream moving. Its rows carry position -1, key (-1, -1), and the processor drops them."""
    from pyspark.sql import functions as F

    # One row a second suffices: once a batch has run, the stateful operator asks for the next.
    beat = spark.readStream.format("rate").option("rowsPerSecond", 1).load()
    beat = beat.select(
        F.lit(HEARTBEAT_ID).alias("message_id"), F.lit(-1).cast("bigint").alias("due_ms"),
        F.lit(-1).cast("bigint").alias("position"), F.lit(False).alias("tombstone"),
        F.lit(-1).cast("int").alias("shard"), F.lit(-1).cast("bigint").alias("bucket"),
    )
    return entries.unionByName(beat)


def fired_stream(entries: Any, options: EngineOptions, lead_ms: int = 0) -> Any:
    """Apply the bucketed processor: a stream of (message_id, position, due_ms, fired_ms, topic),
    each timer released `lead_ms` before its due time."""
    from chronoq.spark.timer_processor import OUTPUT_SCHEMA, BucketTimerProcessor

    return entries.groupBy("shard", "bucket").transformWithStateInPandas(
        statefulProcessor=BucketTimerProcessor(tombstone_grace_ms=options.tombstone_grace_ms, lead_ms=lead_ms,
                                               step_ms=release_step_ms(options, lead_ms)),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Append",
        timeMode="ProcessingTime",
    )


def _in_chunks(server: Any, items: Sequence[Any], call: Any) -> None:
    """`call(admin, chunk)` over `items` in chunks of at most `FIRE_CHUNK`. A broker whose
    `max_send_batch` is below it refuses a chunk with the limit it keeps: the chunks shrink to it
    (before, every batch firing more than it failed, and its replays too, so the engine stopped
    for good)."""
    from chronoq.errors import InvalidBatchSize
    from chronoq.spark.datasource import admin_client

    chunk = FIRE_CHUNK
    with admin_client(server) as admin:
        start = 0
        while start < len(items):
            try:
                call(admin, items[start:start + chunk])
            except InvalidBatchSize as e:
                limit = (e.details or {}).get("max_batch_size")
                if not isinstance(limit, int) or not 1 <= limit < chunk:
                    raise
                chunk = limit
                continue
            start += chunk


def fire_positions(server: Any, positions: Sequence[int]) -> int:
    """FireTimers on the broker, in chunks; returns how many it fired (repeats are skipped)."""
    fired = [0]

    def call(admin: Any, chunk: Sequence[int]) -> None:
        fired[0] += admin.fire_timers([int(p) for p in chunk]).fired

    _in_chunks(server, positions, call)
    return fired[0]


def arm_timers(server: Any, timers: Sequence[tuple[int, str, str]]) -> Counter[str]:
    """ArmTimers on the broker, in chunks, for (position, topic, message id); returns how many of
    each result ("armed", "already_armed", "fired", "cancelled", "damaged", "unknown"). A refusal
    is no error here: a cancelled or fired timer needs nothing more, and an unknown position is a
    timer a roll moved (its new record comes through the timer topic and is armed in turn)."""
    counts: Counter[str] = Counter()

    def call(admin: Any, chunk: Sequence[tuple[int, str, str]]) -> None:
        counts.update(r.result for r in admin.arm_timers(chunk).results)

    _in_chunks(server, timers, call)
    return counts


class FireSinkWriter(DataSourceStreamWriter):
    """Runs on executors: each task arms (option `mode` "arm", the default) or fires ("fire") its
    partition's rows in (due, position) order and, when option `firedLog` is set, appends them as
    JSON lines to that file (an audit log; tests read it)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        from chronoq.spark.datasource import BrokerAccess

        self.server = BrokerAccess.from_options(options) if options.get("server") else None
        self.fired_log = options.get("firedLog") or None
        self.mode = options.get("mode") or "arm"

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        rows = sorted(((r["message_id"], r["position"], r["due_ms"], r["fired_ms"], r["topic"]) for r in iterator),
                      key=lambda r: (r[2], r[1]))
        if rows and self.server:
            if self.mode == "fire":
                fire_positions(self.server, [r[1] for r in rows])
            else:
                # A key without a topic (none the broker writes) cannot be named: the backstop has it.
                arm_timers(self.server, [(int(r[1]), r[4], r[0]) for r in rows if r[4]])
        if rows and self.fired_log:
            append_fired_log(self.fired_log, [r[:4] for r in rows])
        return FireCommit(len(rows))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        return None

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Positions already fired stay fired; the batch re-runs and FireTimers ignores repeats.
        return None


@dataclass
class FireCommit(WriterCommitMessage):
    fired: int


def append_fired_log(path: str, rows: Sequence[tuple]) -> None:
    """Append (message_id, position, due_ms, fired_ms, logged_ms) lines under an exclusive lock."""
    import fcntl
    import time

    now_ms = int(time.time() * 1000)
    text = "".join(json.dumps({"message_id": m, "position": p, "due_ms": d, "fired_ms": f, "logged_ms": now_ms})
                   + "\n" for m, p, d, f in rows)
    with open(path, "a", encoding="utf-8") as out:
        fcntl.flock(out, fcntl.LOCK_EX)
        out.write(text)
        out.flush()
        fcntl.flock(out, fcntl.LOCK_UN)


class FireSink(DataSource):
    """The engine's sink, format `chronoq-fire` (write-only, streaming)."""

    @classmethod
    def name(cls) -> str:
        return FIRE_SINK_NAME

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
        return FireSinkWriter(self.options)


def run_engine(spark: Any, options: EngineOptions, *, records: Any | None = None,
               fired_log: str | None = None) -> Any:
    """Start the engine; returns the StreamingQuery. `records` defaults to the chronoq source on
    the timer topic. Released timers go to ArmTimers (or FireTimers, `options.mode`) on
    `options.server` (unless it is empty) and, with `fired_log`, to that JSON-lines file."""
    from chronoq.spark.datasource import SOURCE_NAME, register

    if records is None:
        register(spark)
        records = (spark.readStream.format(SOURCE_NAME).options(**dict(options.connection or {}))
                   .option("server", options.server).option("topic", TIMER_TOPIC).option("startingOffsets", "earliest")
                   .option("maxRecordsPerBatch", str(options.max_records_per_batch)).load())
    spark.dataSource.register(FireSink)
    lead_ms = release_lead_ms(options)
    fired = fired_stream(with_heartbeat(spark, timer_entries(records, options), options), options, lead_ms)
    writer = (fired.writeStream.queryName(options.query_name).format(FIRE_SINK_NAME)
              .options(**dict(options.connection or {})).option("server", options.server)
              .option("mode", options.mode)
              .option("checkpointLocation", options.checkpoint)
              .trigger(processingTime=f"{trigger_ms_of(options, lead_ms)} milliseconds"))
    if fired_log:
        writer = writer.option("firedLog", fired_log)
    return writer.start()
