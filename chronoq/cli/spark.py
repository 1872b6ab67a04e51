"""`chronoq spark ...`: the data pipeline on Apache Spark (report, bulk schedule, timer engine).

Theory of operation: argument parsing only; each command builds a SparkSession through
`chronoq.spark.session` and calls the job in `chronoq.spark`. pyspark is imported inside the
command functions, so `chronoq --help` works on a machine without Spark or Java; each command
first checks for the Spark extra and Java (`require_spark`), so a set-up that lacks them is told
`scripts/setup.sh --spark` rather than shown a ModuleNotFoundError.

The broker connection is the CLI's everywhere (`add_connection_arguments`: --server, --tls,
--ca-cert, --tls-server-name, --access-key, --secret-key, each defaulting to its `CHRONOQ_*`
variable) and is handed to the executors' clients as data source options (`BrokerAccess`).
`spark schedule` ends in one line whatever stops it: a failed send (the cause out of Spark's
report, what was stored, whether a rerun is safe), a Ctrl-C (what was done, whether a rerun is
safe), exit statuses 1 and 130 as every command's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from chronoq.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Connection,
    add_connection_arguments,
    connection_of,
    require_spark,
)
from chronoq.config import DAY_MS, Config, MiB

MASTER_HELP = ("Spark master: local[N], spark://HOST:7077 (scripts/spark-cluster.sh starts one here), yarn, "
               "k8s://... (default: spark-submit's, else local[2])")


def add_spark_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("spark", "where the job runs (docs/spark.md, \"On a cluster\")")
    group.add_argument("--master", default=None, help=MASTER_HELP)
    group.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                       help="a Spark setting, as spark-submit's --conf (repeatable), e.g. "
                            "spark.sql.shuffle.partitions=8")


def spark_conf(args: argparse.Namespace) -> dict[str, str]:
    """`--conf KEY=VALUE` flags as a dict (a flag without '=' is a usage error)."""
    from chronoq.cli.common import UsageError

    conf = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--conf takes KEY=VALUE (a Spark setting), not {item!r}")
        conf[key.strip()] = value
    return conf


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
    add_spark_arguments(report)
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
    schedule.add_argument("--max-delay-ms", type=int, default=30 * DAY_MS)
    schedule.add_argument("--max-body-bytes", type=int, default=4 * MiB)
    schedule.add_argument("--batch-size", type=int, default=4096,
                          help="rows per bulk send request (SendColumns; the broker's limit: max_bulk_send_rows)")
    schedule.add_argument("--skip-stored", action="store_true",
                          help="ask the broker for each id first and send only the ones it does not hold (a rerun "
                               "after the broker restarted, or past its dedupe window; one lookup per row)")
    add_spark_arguments(schedule)
    add_connection_arguments(schedule)
    schedule.set_defaults(func=cmd_schedule)

    engine = sub.add_parser("engine", help="run the Spark timer engine (a Structured Streaming job)")
    engine.add_argument("--checkpoint", required=True, help="checkpoint directory (shared storage on a cluster)")
    engine.add_argument("--bucket-ms", type=int, default=None,
                        help="state key time bucket (default: an hour with --mode arm, 5 s with --mode fire; "
                             "larger: fewer keys, cheaper ingest)")
    engine.add_argument("--shards", type=int, default=2, help="state keys per bucket (spread over executors)")
    engine.add_argument("--trigger-ms", type=int, default=None,
                        help="micro-batch interval (default: 5 s with --mode arm, at most a quarter of what the "
                             "release step leaves of the horizon; 200 ms with --mode fire, where it bounds the error)")
    engine.add_argument("--max-records-per-batch", type=int, default=200_000)
    engine.add_argument("--mode", choices=["arm", "fire"], default="arm",
                        help="arm: hand each timer to the broker as it enters its hand-off horizon, the broker fires "
                             "it on time (default); fire: FireTimers at the due time (a micro-batch's precision)")
    engine.add_argument("--handoff-ms", type=int, default=None,
                        help="with --mode arm: hand timers over this long before they are due (default: the "
                             "broker's timer_handoff_horizon_ms, asked at start; never more than it)")
    engine.add_argument("--release-step-ms", type=int, default=None,
                        help="with --mode arm: a state key hands over its timers once a step, each between the "
                             "horizon and the horizon less a step ahead (default: a fifth of the horizon, at "
                             "most 60000; at most half of it)")
    add_spark_arguments(engine)
    add_connection_arguments(engine)
    engine.set_defaults(func=cmd_engine)

    measure = sub.add_parser("measure-engine", help="measure the Spark engine's firing error end to end "
                             "(starts its own server in --work-dir)")
    measure.add_argument("--work-dir", required=True, help="empty directory for the server data and checkpoint")
    measure.add_argument("--messages", type=int, default=10_000)
    measure.add_argument("--spread-ms", type=int, default=60_000, help="due times spread over this span")
    measure.add_argument("--lead-ms", type=int, default=20_000, help="first due time after sending starts")
    measure.add_argument("--bucket-ms", type=int, default=None, help="the engine's (default: its mode's)")
    measure.add_argument("--shards", type=int, default=2)
    measure.add_argument("--trigger-ms", type=int, default=None, help="the engine's (default: its mode's)")
    measure.add_argument("--mode", choices=["arm", "fire"], default="arm", help="the engine's mode (see `engine`)")
    measure.add_argument("--horizon-ms", type=int, default=5 * 60_000,
                         help="the broker's timer_handoff_horizon_ms")
    measure.add_argument("--backstop-ms", type=int, default=60_000, help="the broker's timer_spark_backstop_ms")
    measure.add_argument("--kill-job-at", type=float, default=None, metavar="FRACTION",
                         help="stop the engine at this fraction of the due-time window, restart it --job-down-s later")
    measure.add_argument("--job-down-s", type=float, default=10.0)
    measure.add_argument("--kill-broker-at", type=float, default=None, metavar="FRACTION",
                         help="SIGKILL the broker at this fraction of the due-time window and start it again")
    measure.add_argument("--out", default=None, help="also write report.md/.json/.png here")
    add_spark_arguments(measure)
    measure.set_defaults(func=cmd_measure)


def cmd_report(args: argparse.Namespace) -> int:
    require_spark("spark report")
    from chronoq.spark.report import compute_report, render_markdown, write_report
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-report", master=args.master, conf=spark_conf(args))
    report = compute_report(spark, args.trace, approx=args.approx)
    paths = write_report(report, args.out)
    sys.stdout.write(render_markdown(report))
    sys.stdout.write("\n" + "\n".join(f"wrote {kind}: {path}" for kind, path in paths.items()) + "\n")
    return 0


def access_options(connection: Connection) -> dict[str, str]:
    """The CLI's connection as the data source's options (`BrokerAccess`), for the executors."""
    from chronoq.spark.datasource import BrokerAccess

    return BrokerAccess(connection.server, tls=connection.tls,
                        ca_cert=connection.root_certificates.decode() if connection.root_certificates else None,
                        tls_server_name=connection.tls_server_name, access_key=connection.access_key or None,
                        secret_key=connection.secret_key or None).options()


def rerun_advice(server: str) -> str:
    """Whether running the same command again is safe, and what holds beyond the broker's memory."""
    config = Config()
    from chronoq.timefmt import duration

    return (f"Rerunning the same command is safe while {server} remembers the ids: it stores each id once, for "
            f"{duration(config.dedupe_window_ms)} (dedupe_window_ms) among its last "
            f"{config.dedupe_window_max_entries:,} ids (dedupe_window_max_entries); that memory does not survive "
            "a broker restart, so after one, or later, rerun with --skip-stored (it asks the broker for each id "
            "first and sends only the missing ones)")


def _quiet_interrupts() -> None:
    """Make Ctrl-C silence the JVM's stderr before anything else, then raise KeyboardInterrupt.

    PySpark's own SIGINT handler cancels the jobs first, and the cancellations' log lines reached
    the terminal before the command could close the pipe; `_stop_quietly` cancels them instead."""
    import signal

    from chronoq.spark.session import silence_jvm

    def on_interrupt(signum: int, frame: Any) -> None:
        silence_jvm()
        # py4j logs the interrupted call's traceback through the root logger ("KeyboardInterrupt
        # while sending command."); the command says what happened in its own line instead.
        logging.disable(logging.CRITICAL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)


@contextlib.contextmanager
def _keeping_sigint_handler() -> Iterator[None]:
    """Within: attempts to replace the SIGINT handler (the SparkContext's, as it starts) are ignored."""
    import signal

    install = signal.signal

    def keep_sigint(signum: int, handler: Any) -> Any:
        return signal.getsignal(signum) if signum == signal.SIGINT else install(signum, handler)

    signal.signal = keep_sigint  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = install


def _stop_quietly(spark: Any) -> None:
    """Stop Spark after an interrupt without its noise: the JVM's stderr and Python's logging are closed first."""
    from chronoq.spark.session import silence_jvm

    silence_jvm()
    logging.disable(logging.CRITICAL)
    with contextlib.suppress(BaseException):
        spark.sparkContext.cancelAllJobs()
    with contextlib.suppress(BaseException):
        spark.stop()


def interrupted_line(status: Any, server: str, topic: str) -> str:
    """What a Ctrl-C left done, by the phase the job was in, and whether a rerun is safe."""
    if status.phase in ("starting", "validating"):
        return "interrupted while reading and checking the input: nothing was sent or written; rerunning is safe"
    rejects = (f"{status.rejected:,} rejects written to {status.rejects_path}" if status.rejects_path
               and status.phase != "writing rejects" else "no rejects written")
    if status.phase == "writing rejects":
        return (f"interrupted while writing {status.rejected:,} rejects to {status.rejects_path} (left incomplete): "
                "nothing was sent; rerunning is safe (it writes the rejects again)")
    if status.phase == "sending":
        return (f"interrupted while sending {status.to_send:,} messages to {server} topic {topic} ({rejects}): some "
                f"may be stored. {rerun_advice(server)}")
    return "interrupted after the job finished its work"


def cmd_schedule(args: argparse.Namespace) -> int:
    require_spark("spark schedule")
    connection = connection_of(args)
    from chronoq.spark.datasource import ChronoqSourceError
    from chronoq.spark.schedule import (
        ScheduleInputError,
        ScheduleOptions,
        ScheduleSendError,
        ScheduleStatus,
        run_schedule,
    )
    from chronoq.spark.session import build_session

    options = ScheduleOptions(
        input_path=args.input, input_format=args.format, topic=args.topic,
        deliver_at_column=args.deliver_at_column, delay_column=args.delay_column,
        body_column=args.body_column, id_column=args.id_column, tag_column=args.tag_column,
        keys_column=args.keys_column, rejects_path=args.rejects, server=connection.server,
        max_delay_ms=args.max_delay_ms, max_body_bytes=args.max_body_bytes, batch_size=args.batch_size,
        connection=access_options(connection), skip_stored=args.skip_stored,
    )
    status = ScheduleStatus()
    spark = None
    try:
        spark = build_session("chronoq-schedule", master=args.master, conf=spark_conf(args))
        _quiet_interrupts()
        result = run_schedule(spark, options, progress=lambda line: print(line, file=sys.stderr, flush=True),
                              status=status)
    except (ScheduleInputError, ChronoqSourceError) as e:
        print(f"chronoq spark schedule: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ScheduleSendError as e:
        stored = ("no write task finished" if e.stored_by_finished_tasks is None
                  else f"the write tasks that finished stored {e.stored_by_finished_tasks:,} of {e.to_send:,}")
        print(f"chronoq spark schedule: the send failed ({stored}; the failed task may have stored some of its "
              f"rows): {e.cause}. {rerun_advice(connection.server)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if spark is not None:
            _stop_quietly(spark)
        print(f"chronoq spark schedule: {interrupted_line(status, connection.server, args.topic)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        from pyspark.errors import PySparkException

        if not isinstance(e, PySparkException):
            raise
        # Spark refused the input (a path that does not exist, a file it cannot read): its first line says why.
        print(f"chronoq spark schedule: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
    print(result.summary())
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    require_spark("spark engine")
    connection = connection_of(args)
    from chronoq.spark.engine import EngineOptions, run_engine
    from chronoq.spark.session import build_session

    options = EngineOptions(server=connection.server, checkpoint=args.checkpoint, bucket_ms=args.bucket_ms,
                            shards=args.shards, trigger_ms=args.trigger_ms,
                            max_records_per_batch=args.max_records_per_batch,
                            connection=access_options(connection), mode=args.mode, handoff_ms=args.handoff_ms,
                            release_step_ms=args.release_step_ms)
    spark = None
    # Ctrl-C while Spark starts is as quiet as later: the SparkContext's own SIGINT handler (which
    # cancels jobs, loudly, and raises) is not installed; `_stop_quietly` cancels them instead.
    _quiet_interrupts()
    try:
        with _keeping_sigint_handler():
            spark = build_session("chronoq-timer-engine", master=args.master, conf=spark_conf(args))
        query = run_engine(spark, options)
        query.awaitTermination()
    except KeyboardInterrupt:
        if spark is not None:
            _stop_quietly(spark)
        print("chronoq spark engine: stopped; pending timers are kept in the checkpoint, and the same command "
              f"with --checkpoint {args.checkpoint} resumes them", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    require_spark("spark measure-engine")
    from chronoq.spark.measure import MeasureOptions, run_measurement
    from chronoq.spark.report import write_report
    from chronoq.spark.session import build_session

    spark = build_session("chronoq-measure-engine", master=args.master, conf=spark_conf(args))
    options = MeasureOptions(work_dir=args.work_dir, messages=args.messages, spread_ms=args.spread_ms,
                             lead_ms=args.lead_ms, bucket_ms=args.bucket_ms, shards=args.shards,
                             trigger_ms=args.trigger_ms, mode=args.mode, horizon_ms=args.horizon_ms,
                             backstop_ms=args.backstop_ms, kill_job_at=args.kill_job_at,
                             job_down_s=args.job_down_s, kill_broker_at=args.kill_broker_at)
    report = run_measurement(spark, options, log=lambda line: print(line, flush=True))
    if args.out:
        write_report(report, args.out)
    return 0
