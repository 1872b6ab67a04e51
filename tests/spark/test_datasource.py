"""The `chronoq` data source against a real `chronoq serve` in its own process.

Batch write and read, timer rows, an idempotent rewrite (a retried write sends the same ids),
a streaming read stopped and restarted from its checkpoint (no loss, no duplicate), and a
streaming write. Pure helpers (offset limits, partitioning, row conversion) are tested first.
"""

from __future__ import annotations

import datetime as dt

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark; the imports below need it too

from chronoq.spark.datasource import (  # noqa: E402
    ChronoqSourceError,
    QueueRange,
    derived_message_id,
    limit_offsets,
    row_to_message,
    split_ranges,
)

pytestmark = pytest.mark.spark


# -- pure helpers ---------------------------------------------------------------------------


def test_limit_offsets_shares_the_budget_and_never_passes_latest():
    assert limit_offsets({0: 0, 1: 5}, {0: 10, 1: 8}, None) == {0: 10, 1: 8}
    assert limit_offsets({0: 0, 1: 5}, {0: 10, 1: 8}, 6) == {0: 3, 1: 8}
    assert limit_offsets({0: 0, 1: 0}, {0: 100, 1: 1}, 10) == {0: 9, 1: 1}
    assert limit_offsets({0: 4}, {0: 4, 2: 3}, 100) == {0: 4, 2: 3}  # a queue new since the start
    assert limit_offsets({0: 7}, {0: 3}, None) == {0: 7}  # never move backwards


def test_split_ranges_cuts_each_queue():
    parts = split_ranges({0: 0, 1: 10}, {0: 5, 1: 10, 2: 3}, per_partition=2)
    assert [(p.queue_id, p.start, p.end) for p in parts] == [(0, 0, 2), (0, 2, 4), (0, 4, 5), (2, 0, 2), (2, 2, 3)]
    assert QueueRange(1, 2, 3) == QueueRange(1, 2, 3)


def test_row_to_message_and_derived_ids():
    assert derived_message_id("w", 3, 7) == derived_message_id("w", 3, 7) != derived_message_id("w", 3, 8)
    when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    msg = row_to_message({"body": "hi", "deliver_at": when, "keys": "k1", "tag": "t"}, "topic", "fallback")
    assert msg.body == b"hi" and msg.deliver_at_ms == int(when.timestamp() * 1000)
    assert msg.message_id == "fallback" and msg.keys == ("k1",) and msg.topic == "topic"
    assert row_to_message({"body": b"x", "delay_ms": 5, "message_id": "m"}, "t", "f").delay_ms == 5
    with pytest.raises(ChronoqSourceError, match="more than one"):
        row_to_message({"body": b"x", "delay_ms": 5, "delay_level": 2}, "t", "f")
    with pytest.raises(ChronoqSourceError, match="null 'body'"):
        row_to_message({"body": None}, "t", "f")
    with pytest.raises(ChronoqSourceError, match="no 'topic'"):
        row_to_message({"body": b"x"}, None, "f")


# -- against a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(chronoq_server):
    from chronoq.client import Admin

    with Admin(chronoq_server) as admin:
        admin.create_topic("ds", queue_count=2)
        admin.create_topic("stream", queue_count=2)
        admin.create_topic("sink", queue_count=1)
    return chronoq_server


def _read(spark, server, topic):
    return spark.read.format("chronoq").option("server", server).option("topic", topic).load()


def test_batch_write_read_timers_and_idempotent_retry(spark, server):
    from chronoq.client import Admin
    from chronoq.spark.datasource import register

    register(spark)
    rows = [(f"id-{i:03d}", f"body {i}".encode(), f"tag{i % 3}", [f"k{i}"]) for i in range(40)]
    df = spark.createDataFrame(rows, "message_id STRING, body BINARY, tag STRING, keys ARRAY<STRING>")
    df.write.format("chronoq").mode("append").option("server", server).option("topic", "ds").save()

    got = _read(spark, server, "ds").orderBy("message_id").collect()
    assert [r["message_id"] for r in got] == [r[0] for r in rows]
    assert [bytes(r["body"]) for r in got] == [r[1] for r in rows]
    assert got[5]["tag"] == "tag2" and got[5]["keys"] == ["k5"] and got[5]["topic"] == "ds"
    assert {r["queue_id"] for r in got} <= {0, 1}
    assert all(r["position"] is not None and r["store_ts"] is not None for r in got)
    assert all(r["deliver_at_ts"] is None for r in got)

    # The same rows with the same ids again (what a retried task sends): stored once.
    df.write.format("chronoq").mode("append").option("server", server).option("topic", "ds").save()
    assert _read(spark, server, "ds").count() == 40

    # Rows without ids: derived from (writeId, partition, index), so the same writeId dedupes too.
    anon = spark.createDataFrame([(f"anon {i}",) for i in range(10)], "body STRING").repartition(2)
    for _ in range(2):
        anon.write.format("chronoq").mode("append").option("server", server).option("topic", "ds") \
            .option("writeId", "retry-1").save()
    assert _read(spark, server, "ds").count() == 50

    # Timer rows: deliver_at as a timestamp and delay_ms; they wait in the timer topic.
    due = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    timers = spark.createDataFrame([("t-at", b"later", due, None), ("t-delay", b"later", None, 3_600_000)],
                                   "message_id STRING, body BINARY, deliver_at TIMESTAMP, delay_ms BIGINT")
    timers.write.format("chronoq").mode("append").option("server", server).option("topic", "ds").save()
    with Admin(server) as admin:
        [status] = admin.query("t-at", "ds")
        assert status.state == "pending" and status.deliver_at_ms == int(due.timestamp() * 1000)
        assert admin.query("t-delay", "ds")[0].state == "pending"
    assert _read(spark, server, "ds").count() == 50  # not delivered yet

    with pytest.raises(Exception, match="body"):
        spark.createDataFrame([("x",)], "nobody STRING").write.format("chronoq").mode("append") \
            .option("server", server).option("topic", "ds").save()

    # The bulk write (option bulk: Arrow batches through SendColumns) stores the same rows the
    # same way: the 40 rows again are duplicates, new rows (text bodies, tags, keys) are stored,
    # derived ids dedupe per writeId, and timer rows wait in the timer topic.
    def bulk(frame, write_id=None):
        w = frame.write.format("chronoq").mode("append").option("server", server).option("topic", "ds") \
            .option("bulk", "true").option("sendBatchSize", "7")
        (w.option("writeId", write_id) if write_id else w).save()

    bulk(df)
    assert _read(spark, server, "ds").count() == 50
    more = spark.createDataFrame([(f"bulk-{i:02d}", f"bulk body {i}", "bt", [f"bk{i}", "all"]) for i in range(30)],
                                 "message_id STRING, body STRING, tag STRING, keys ARRAY<STRING>").repartition(3)
    bulk(more)
    got = {r["message_id"]: r for r in _read(spark, server, "ds").collect()}
    assert len(got) == 80 and bytes(got["bulk-07"]["body"]) == b"bulk body 7"
    assert got["bulk-07"]["tag"] == "bt" and got["bulk-07"]["keys"] == ["bk7", "all"]
    for _ in range(2):
        bulk(anon, "retry-2")
    assert _read(spark, server, "ds").count() == 90
    bulk(spark.createDataFrame([("b-at", b"later", due)], "message_id STRING, body BINARY, deliver_at TIMESTAMP"))
    with Admin(server) as admin:
        [status] = admin.query("b-at", "ds")
        assert status.state == "pending" and status.deliver_at_ms == int(due.timestamp() * 1000)
    with pytest.raises(Exception, match="properties"):
        spark.createDataFrame([("x", {"a": "b"})], "body STRING, properties MAP<STRING, STRING>").write \
            .format("chronoq").mode("append").option("server", server).option("topic", "ds") \
            .option("bulk", "true").save()


def test_stream_read_restarts_from_checkpoint_without_loss_or_duplicate(spark, server, tmp_path):
    from chronoq.client import Producer, outgoing
    from chronoq.spark.datasource import register

    register(spark)
    with Producer(server) as p:
        p.send_batch([outgoing("stream", f"first {i}", message_id=f"s1-{i}") for i in range(30)])

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def run_once():
        q = (spark.readStream.format("chronoq").option("server", server).option("topic", "stream")
             .option("startingOffsets", "earliest").option("maxRecordsPerBatch", "16").load()
             .select("message_id", "queue_id", "queue_offset", "body")
             .writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(ckpt))
             .start())
        try:
            q.processAllAvailable()
            return q.recentProgress
        finally:
            q.stop()

    progress = run_once()
    assert sum(p["numInputRows"] for p in progress) == 30
    assert max(p["numInputRows"] for p in progress) <= 16  # maxRecordsPerBatch held
    with Producer(server) as p:
        p.send_batch([outgoing("stream", f"second {i}", message_id=f"s2-{i}") for i in range(20)])
    progress = run_once()
    assert sum(p["numInputRows"] for p in progress) == 20  # only the new records after the restart

    ids = [r["message_id"] for r in spark.read.parquet(str(out)).collect()]
    assert len(ids) == 50 and set(ids) == {f"s1-{i}" for i in range(30)} | {f"s2-{i}" for i in range(20)}


def test_stream_write_is_idempotent_per_batch(spark, server, tmp_path):
    from chronoq.spark.datasource import register

    register(spark)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text("".join(f'{{"body": "row {i}", "tag": "s"}}\n' for i in range(12)))
    ckpt = tmp_path / "ckpt"
    q = (spark.readStream.schema("body STRING, tag STRING").json(str(src))
         .writeStream.format("chronoq").option("server", server).option("topic", "sink")
         .option("checkpointLocation", str(ckpt)).start())
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    got = _read(spark, server, "sink").collect()
    assert sorted(bytes(r["body"]).decode() for r in got) == sorted(f"row {i}" for i in range(12))
    assert all(r["message_id"].startswith("SP") and r["tag"] == "s" for r in got)

    # Replaying the committed batch (its commit marker lost, as after a crash) resends the same ids.
    for name in ("0", ".0.crc"):
        (ckpt / "commits" / name).unlink(missing_ok=True)
    q = (spark.readStream.schema("body STRING, tag STRING").json(str(src))
         .writeStream.format("chronoq").option("server", server).option("topic", "sink")
         .option("checkpointLocation", str(ckpt)).start())
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    assert _read(spark, server, "sink").count() == 12


def test_a_time_past_the_year_9999_reads_as_null():
    """A born time stored in the wrong unit (microseconds: the year 58869) failed every read of
    its topic with "year out of range", for good: the Spark timer engine stopped on it."""
    from chronoq.spark.datasource import _ts
    from chronoq.timefmt import MAX_EPOCH_MS

    assert _ts(1_795_560_000_000_000) is None
    assert _ts(MAX_EPOCH_MS) is not None and _ts(MAX_EPOCH_MS).year == 9999
    assert _ts(None) is None
