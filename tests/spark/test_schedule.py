"""`chronoq spark schedule`: every row scheduled or rejected with its reason; reruns add nothing."""

from __future__ import annotations

import argparse
import datetime as dt
import time

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark; the imports below need it too

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

pytestmark = pytest.mark.spark

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def _pending(server: str, topic: str) -> int:
    from chronoq.client import Admin

    with Admin(server) as admin:
        return int(admin.stats()["timer"]["pending_by_topic"].get(topic, 0))


def _cli(*argv: str) -> int:
    from chronoq.cli import spark as spark_cli

    parser = argparse.ArgumentParser()
    spark_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["spark", "schedule", *argv])
    return args.func(args)


def test_schedule_parquet_sorts_every_row(spark, chronoq_server, tmp_path, capsys):
    from chronoq.client import Admin

    with Admin(chronoq_server) as admin:
        admin.create_topic("remind", queue_count=2)
    now = dt.datetime.now(dt.UTC)
    good = [(f"r{i}", f"hello {i}", now + dt.timedelta(hours=1, seconds=i)) for i in range(120)]
    too_far = [(f"far{i}", "x", now + dt.timedelta(days=40)) for i in range(7)]
    no_body = [(f"nb{i}", None, now + dt.timedelta(hours=1)) for i in range(5)]
    big = [(f"big{i}", "y" * 300, now + dt.timedelta(hours=1)) for i in range(3)]
    no_time = [("nt0", "z", None)]
    rows = good + too_far + no_body + big + no_time
    table = pa.table({"rid": [r[0] for r in rows], "text": [r[1] for r in rows],
                      "at": pa.array([r[2] for r in rows], pa.timestamp("ms", tz="UTC"))})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    rejects = tmp_path / "rejects"

    argv = ("--input", str(src), "--topic", "remind", "--deliver-at-column", "at", "--body-column", "text",
            "--id-column", "rid", "--rejects", str(rejects), "--server", chronoq_server, "--max-body-bytes", "200")
    assert _cli(*argv) == 0
    out = capsys.readouterr().out
    assert "rows 136: scheduled 120, rejected 16" in out
    assert "rejected 7: too_far" in out and "rejected 5: body_missing" in out
    assert "rejected 3: body_too_large" in out and "rejected 1: unparseable_time" in out
    assert _pending(chronoq_server, "remind") == 120

    rej = pq.read_table(rejects).to_pylist()
    assert len(rej) == 16
    by_id = {r["rid"]: r for r in rej}
    assert "the limit (--max-delay-ms) is 2592000000" in by_id["far3"]["reason"]
    assert by_id["big0"]["reason"] == "body is 300 bytes; the limit (--max-body-bytes) is 200"
    assert by_id["nt0"]["reason_code"] == "unparseable_time"

    with Admin(chronoq_server) as admin:
        [status] = admin.query("r7", "remind")
    assert status.deliver_at_ms == int(good[7][2].timestamp() * 1000) and status.state == "pending"

    # A rerun (or retried tasks) sends the same ids: nothing new is scheduled.
    assert _cli(*argv) == 0
    assert _pending(chronoq_server, "remind") == 120


def test_schedule_csv_derived_ids_delay_and_text_times(spark, chronoq_server, tmp_path, capsys):
    from chronoq.client import Admin
    from chronoq.spark.schedule import ScheduleOptions, run_schedule

    with Admin(chronoq_server) as admin:
        admin.create_topic("csvt", queue_count=1)
    now_ms = int(time.time() * 1000)
    iso = dt.datetime.fromtimestamp((now_ms + HOUR_MS) / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = ["body,when"] + [f"b{i},{now_ms + HOUR_MS + i}" for i in range(30)] + [
        f"iso,{iso}", "bad,garbage", "neg,-5", f"far,{now_ms + 31 * DAY_MS}", f"past,{now_ms - HOUR_MS}"]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part.csv").write_text("\n".join(lines) + "\n")
    options = ScheduleOptions(input_path=str(tmp_path / "in"), topic="csvt", server=chronoq_server,
                              deliver_at_column="when", rejects_path=str(tmp_path / "rej"))
    result = run_schedule(spark, options, now_ms=now_ms)
    # A time in the past is valid (the broker delivers it at once); one before the epoch is not.
    assert (result.total, result.scheduled, result.rejected) == (35, 32, 3)
    assert result.rejects_by_reason == {"unparseable_time": 1, "too_far": 1, "before_epoch": 1}
    rej = {r["body"]: r["reason"] for r in pq.read_table(tmp_path / "rej").to_pylist()}
    assert rej["bad"] == "unparseable delivery time 'garbage'"
    assert _pending(chronoq_server, "csvt") == 31
    again = run_schedule(spark, options, now_ms=now_ms)
    assert again.scheduled == 32 and _pending(chronoq_server, "csvt") == 31  # derived ids are stable

    delays = tmp_path / "delays.json"
    delays.write_text('{"body": "d1", "ms": 3600000}\n{"body": "d2", "ms": -1}\n{"body": "d3", "ms": "soon"}\n')
    result = run_schedule(spark, ScheduleOptions(input_path=str(delays), topic="csvt", server=chronoq_server,
                                                 delay_column="ms", rejects_path=str(tmp_path / "rej2")))
    assert result.scheduled == 1
    assert result.rejects_by_reason == {"negative_delay": 1, "unparseable_delay": 1}


def test_a_numeric_time_out_of_range_is_that_rows_reject(spark, chronoq_server, tmp_path, capsys):
    """A double deliver-at column holding 1e30: the plain cast overflowed under Spark 4's ANSI
    mode and failed the whole job (CAST_OVERFLOW, a traceback, nothing scheduled or rejected)."""
    from chronoq.client import Admin

    with Admin(chronoq_server) as admin:
        admin.create_topic("overflow", queue_count=1)
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).timestamp() * 1000
    table = pa.table({"rid": ["ok0", "ok1", "huge"], "text": ["a", "b", "c"],
                      "at": pa.array([soon, soon + 1, 1e30], pa.float64())})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    rejects = tmp_path / "rejects"
    assert _cli("--input", str(src), "--topic", "overflow", "--deliver-at-column", "at", "--body-column", "text",
                "--id-column", "rid", "--rejects", str(rejects), "--server", chronoq_server) == 0
    assert "rows 3: scheduled 2, rejected 1" in capsys.readouterr().out
    assert [r["rid"] for r in pq.read_table(rejects).to_pylist()] == ["huge"]
    assert _pending(chronoq_server, "overflow") == 2


def test_rows_the_broker_would_refuse_are_rejects_not_a_failed_job(spark, chronoq_server, tmp_path):
    """An id with a space, a tag with '|' or blank, an empty key: the broker refuses them, and
    that refusal inside a task failed the whole job with a traceback, no rejects written, while
    the other rows of the same requests were stored. They are rejects now, like other bad rows."""
    from chronoq.client import Admin
    from chronoq.spark.schedule import ScheduleOptions, run_schedule

    with Admin(chronoq_server) as admin:
        admin.create_topic("refusals", queue_count=1)
    now_ms = int(time.time() * 1000)
    due = now_ms + HOUR_MS
    lines = ["rid,body,when,tag,keys"] + [f"ok{i},b{i},{due},t,k{i}" for i in range(20)] + [
        f"has space,b,{due},t,k", f"bar,b,{due},a|b,k", f"blank,b,{due},  ,k", f"emptykey,b,{due},t,\"a,,b\""]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part.csv").write_text("\n".join(lines) + "\n")
    options = ScheduleOptions(input_path=str(tmp_path / "in"), topic="refusals", server=chronoq_server,
                              deliver_at_column="when", id_column="rid", tag_column="tag", keys_column="keys",
                              rejects_path=str(tmp_path / "rej"))
    result = run_schedule(spark, options, now_ms=now_ms)
    assert (result.total, result.scheduled, result.rejected) == (24, 20, 4)
    assert result.rejects_by_reason == {"id_bad_characters": 1, "bad_tag": 2, "bad_keys": 1}
    assert _pending(chronoq_server, "refusals") == 20


def test_a_repeated_id_is_a_reject_and_the_counts_say_what_was_stored(spark, chronoq_server, tmp_path, capsys,
                                                                      monkeypatch):
    """Two rows with one --id-column value: the broker stores the id once (its dedupe window answers
    the repeat as a duplicate), so one row was never stored, was not in the rejects, and was counted
    as scheduled. Now the first in input order is sent and the others are `duplicate_id` rejects;
    a row whose id repeats an invalid row's is still sent. A rerun says its ids were already stored.
    --server is not given: $CHRONOQ_SERVER names the broker, as for every other command."""
    from chronoq.client import Admin

    with Admin(chronoq_server) as admin:
        admin.create_topic("dups", queue_count=2)
    now = dt.datetime.now(dt.UTC)
    rows = [(f"d{i}", f"body {i}", now + dt.timedelta(hours=1, seconds=i)) for i in range(10)]
    rows += [("d3", "second d3", now + dt.timedelta(hours=2)), ("d3", "third d3", now + dt.timedelta(hours=3)),
             ("x", None, now + dt.timedelta(hours=1)), ("x", "valid x", now + dt.timedelta(hours=4))]
    table = pa.table({"rid": [r[0] for r in rows], "text": [r[1] for r in rows],
                      "at": pa.array([r[2] for r in rows], pa.timestamp("ms", tz="UTC"))})
    src = tmp_path / "in.parquet"
    pq.write_table(table, src, row_group_size=4)
    rejects = tmp_path / "rejects"
    monkeypatch.setenv("CHRONOQ_SERVER", chronoq_server)
    argv = ("--input", str(src), "--topic", "dups", "--deliver-at-column", "at", "--body-column", "text",
            "--id-column", "rid", "--rejects", str(rejects))
    assert _cli(*argv) == 0
    out = capsys.readouterr().out
    assert "rows 14: scheduled 11, rejected 3" in out, out
    assert "rejected 2: duplicate_id" in out and "rejected 1: body_missing" in out
    assert "already stored" not in out
    assert _pending(chronoq_server, "dups") == 11
    rej = pq.read_table(rejects).to_pylist()
    assert sorted((r["rid"], r["text"], r["reason_code"]) for r in rej) == [
        ("d3", "second d3", "duplicate_id"), ("d3", "third d3", "duplicate_id"), ("x", None, "body_missing")]
    dup = next(r for r in rej if r["text"] == "second d3")
    assert dup["reason"].startswith("message id 'd3' is on 3 valid rows; only the first in input order is sent")
    with Admin(chronoq_server) as admin:
        [d3] = admin.query("d3", "dups")
        [x] = admin.query("x", "dups")
    assert d3.deliver_at_ms == int(rows[3][2].timestamp() * 1000)  # the first d3 row's, not a later one's
    assert x.deliver_at_ms == int(rows[13][2].timestamp() * 1000)

    assert _cli(*argv) == 0  # a rerun: every id is already stored, and the summary says so
    out = capsys.readouterr().out
    assert "rows 14: scheduled 11, rejected 3" in out
    assert "of the scheduled, 11 ids were already stored" in out and "0 stored now" in out, out
    assert _pending(chronoq_server, "dups") == 11


def test_rejects_say_times_as_people_read_them_beside_the_ms(spark, chronoq_server, tmp_path):
    from chronoq.client import Admin
    from chronoq.spark.schedule import ScheduleOptions, run_schedule
    from chronoq.timefmt import instant

    with Admin(chronoq_server) as admin:
        admin.create_topic("human", queue_count=1)
    now_ms = int(time.time() * 1000)  # the broker judges the valid row's time by its own clock
    far = now_ms + 40 * DAY_MS + 5_000
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part.csv").write_text(f"rid,body,when\nfar,a,{far}\nneg,b,-5\nok,c,{now_ms + HOUR_MS}\n")
    options = ScheduleOptions(input_path=str(tmp_path / "in"), topic="human", server=chronoq_server,
                              deliver_at_column="when", id_column="rid", rejects_path=str(tmp_path / "rej"))
    result = run_schedule(spark, options, now_ms=now_ms)
    assert (result.scheduled, result.rejected) == (1, 2)
    rej = {r["rid"]: r for r in pq.read_table(tmp_path / "rej").to_pylist()}
    assert rej["far"]["reason"] == (
        f"delivery time {instant(far)} ({far} ms) is 40 days ({40 * DAY_MS + 5000} ms) ahead of the job's start "
        f"{instant(now_ms)}; the limit (--max-delay-ms) is 2592000000 ms (30 days)")
    assert rej["far"]["deliver_at_utc"] == instant(far) and rej["far"]["deliver_at_ms"] == far
    assert rej["neg"]["reason"] == "delivery time -5 ms (1969-12-31T23:59:59.995Z) is before the epoch"

    delays = tmp_path / "delays.json"
    delays.write_text('{"body": "d1", "ms": 3000000000}\n{"body": "d2", "ms": -90000}\n')
    result = run_schedule(spark, ScheduleOptions(input_path=str(delays), topic="human", server=chronoq_server,
                                                 delay_column="ms", rejects_path=str(tmp_path / "rej2")))
    rej = {r["body"]: r["reason"] for r in pq.read_table(tmp_path / "rej2").to_pylist()}
    assert rej == {"d1": "delay 3000000000 ms (34 days) exceeds the limit (--max-delay-ms) 2592000000 ms (30 days)",
                   "d2": "delay -90000 ms (-1m30s) is negative"}
