"""`chronoq spark ...`: the data pipeline on Apache Spark (report, bulk schedule, timer engine).

Theory of operation: argument parsing only; each command builds a SparkSession through
`chronoq.spark.session` and calls the job in `chronoq.spark`. pyspark is imported inside the
command functions, so `chronoq --help` works on a machine without Spark or Java; each command
first checks for the Spark extra and Java (`require_spark`), so a set-up that lacks them is told
`scripts/setup.sh --spark` rather than shown a ModuleNotFoundError.
"""

from __future__ import annotations

import argparse
import sys

from chronoq.cli.common import require_spark
from chronoq.config import DAY_MS, MiB


def register(subparsers: argparse._SubParsersAction) -> None:
    spark = subparsers.add_parser(
        "spark", help="data pipeline on Apache Spark (needs `scripts/setup.sh --spark`)",
        description="chronoq's data pipeline on Apache Spark: the delivery report, bulk scheduling and the Spark "
                    "timer engine (docs/spark.md). Needs the Spark extra (pyspark, pyarrow, pandas, matplotlib) "
                    "and Java 17: `scripts/setup.sh --spark` installs them.")
    sub = spark.add_subparsers(dest="spark_command", required=True, metavar="SPARK_COMMAND")

    report = sub.add_parser("report", help="delivery-accuracy report of a trace (Parquet)")
    report.add_argument("trace", help="trace Parquet file or directory (`chronoq trace export` writes one)")
    report.add_argument("--out", default="chronoq-report", help="output directory (report.md/.json/.png)")
    report.add_argument("--approx", action="store_true", help="approximate percentiles (very large traces)")
    report.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[2])")
    report.set_defaults(func=cmd_report)

    schedule = sub.add_parser("schedule", help="schedule every row of a table as a timer message")
    schedule.add_argument("--input", required=True, help="file or directory (parquet, csv or json)")
    schedule.add_argument("--format", choices=["parquet", "csv", "json"], default=None,
                          help="input format (default: from the file extension)")
    schedule.add_argument("--topic", required=True)
    when = schedule.add_mutually_exclusive_group(required=True)
    when.add_argument("--deliver-at-column", help="column with the delivery time (timestamp, ISO text or epoch ms)")
    when.add_argument("--delay-column", help="column with the delay in ms")
    schedule.add_argument("--body-column", default="body")
    schedule.add_argument("--id-column", default=None, help="message id column (default: derived from file+row)")
    schedule.add_argument("--tag-column", default=None)
    schedule.add_argument("--keys-column", default=None)
    schedule.add_argument("--rejects", default=None, help="Parquet directory for rejected rows (with `reason`)")
    schedule.add_argument("--server", required=True, help="chronoq server host:port (plaintext: the Spark "
                          "pipeline does not speak TLS yet)")
    schedule.add_argument("--max-delay-ms", type=int, default=30 * DAY_MS)
    schedule.add_argument("--max-body-bytes", type=int, default=4 * MiB)
    schedule.add_argument("--batch-size", type=int, default=512, help="messages per SendBatch call")
    schedule.add_argument("--master", default=None)
    schedule.set_defaults(func=cmd_schedule)

    engine = sub.add_parser("engine", help="run the Spark timer engine (a Structured Streaming job)")
    engine.add_argument("--server", required=True, help="chronoq server host:port (plaintext: the Spark "
                        "pipeline does not speak TLS yet)")
    engine.add_argument("--checkpoint", required=True, help="checkpoint directory (shared storage on a cluster)")
    engine.add_argument("--bucket-ms", type=int, default=5_000,
                        help="state key time bucket (smaller: cheaper firing, slower ingest)")
    engine.add_argument("--shards", type=int, default=2, help="state keys per bucket (spread over executors)")
    engine.add_argument("--trigger-ms", type=int, default=200)
    engine.add_argument("--max-records-per-batch", type=int, default=200_000)
    engine.add_argument("--master", default=None)
    engine.set_defaults(func=cmd_engine)

    measure = sub.add_parser("measure-engine", help="measure the Spark engine's firing error end to end "
                             "(starts its own server in --work-dir)")
    measure.add_argument("--work-dir", required=True, help="empty directory for the server data and checkpoint")
    measure.add_argument("--messages", type=int, default=10_000)
    measure.add_argument("--spread-ms", type=int, default=60_000, help="due times spread over this span")
    measure.add_argument("--lead-ms", type=int, default=20_000, help="first due time after sending starts")
    measure.add_argument("--bucket-ms", type=int, default=5_000)
    measure.add_argument("--shards", type=int, default=2)
    measure.add_argument("--out", default=None, help="also write report.md/.json/.png here")
    measure.add_argument("--master", default=None)
    measure.set_defaults(func=cmd_measure)


def cmd_report(args: argparse.Namespace) -> int:
    require_spark("spark report")
    from chronoq.spark.report import compute_report, render_markdown, write_report
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-report", master=args.master)
    report = compute_report(spark, args.trace, approx=args.approx)
    paths = write_report(report, args.out)
    sys.stdout.write(render_markdown(report))
    sys.stdout.write("\n" + "\n".join(f"wrote {kind}: {path}" for kind, path in paths.items()) + "\n")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    require_spark("spark schedule")
    from chronoq.spark.datasource import ChronoqSourceError
    from chronoq.spark.schedule import ScheduleInputError, ScheduleOptions, run_schedule
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-schedule", master=args.master)
    options = ScheduleOptions(
        input_path=args.input, input_format=args.format, topic=args.topic,
        deliver_at_column=args.deliver_at_column, delay_column=args.delay_column,
        body_column=args.body_column, id_column=args.id_column, tag_column=args.tag_column,
        keys_column=args.keys_column, rejects_path=args.rejects, server=args.server,
        max_delay_ms=args.max_delay_ms, max_body_bytes=args.max_body_bytes, batch_size=args.batch_size,
    )
    try:
        result = run_schedule(spark, options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ScheduleInputError, ChronoqSourceError) as e:
        print(f"chronoq spark schedule: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    require_spark("spark engine")
    from chronoq.spark.engine import EngineOptions, run_engine
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-timer-engine", master=args.master)
    options = EngineOptions(server=args.server, checkpoint=args.checkpoint, bucket_ms=args.bucket_ms,
                            shards=args.shards, trigger_ms=args.trigger_ms,
                            max_records_per_batch=args.max_records_per_batch)
    query = run_engine(spark, options)
    query.awaitTermination()
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    require_spark("spark measure-engine")
    from chronoq.spark.measure import MeasureOptions, run_measurement
    from chronoq.spark.report import write_report
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-measure-engine", master=args.master)
    options = MeasureOptions(work_dir=args.work_dir, messages=args.messages, spread_ms=args.spread_ms,
                             lead_ms=args.lead_ms, bucket_ms=args.bucket_ms, shards=args.shards)
    report = run_measurement(spark, options, log=lambda line: print(line, flush=True))
    if args.out:
        write_report(report, args.out)
    return 0
