"""The Spark timer engine on a real Spark stream: never early, cancel, same-ms order, restart.

The records come from a directory of JSON files shaped like the chronoq source's columns (so the
test needs no broker); the `chronoq-fire` sink runs with no server and writes its fired log,
which the test reads. Processing-time timers run on the wall clock, so due times are set a few
seconds ahead of "now"; the test polls the log with `awaitTermination(timeout)`, which also
surfaces a failed query at once.
"""

from __future__ import annotations

import json
import time

import pytest

from chronoq.model import SYS_REAL_TOPIC, SYS_TIMER_DEL_UNIQKEY, SYS_TIMER_OUT_MS
from tests.spark.engine_waits import WAIT_S, wait_ingested
from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark

pytestmark = pytest.mark.spark

RECORD_SCHEMA = "message_id STRING, system_properties MAP<STRING, STRING>, position BIGINT"
H_MARGIN_MS = 20_000  # "h" must outlive the stop; ingesting it and stopping took 7 s under heavy load


def _write(directory, name: str, records: list[dict]) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(directory / f"{name}.json")


def _timer(mid: str, due_ms: int, position: int, topic: str | None = None) -> dict:
    props = {SYS_TIMER_OUT_MS: str(due_ms), **({SYS_REAL_TOPIC: topic} if topic else {})}
    return {"message_id": mid, "system_properties": props, "position": position}


def _tombstone(mid: str, due_ms: int, position: int, topic: str | None = None) -> dict:
    props = {SYS_TIMER_OUT_MS: str(due_ms), SYS_TIMER_DEL_UNIQKEY: mid, **({SYS_REAL_TOPIC: topic} if topic else {})}
    return {"message_id": f"del-{mid}", "position": position, "system_properties": props}


def _fired(log) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


def _wait_for(query, log, ids: set[str]) -> list[dict]:
    deadline = time.monotonic() + WAIT_S
    while True:
        fired = _fired(log)
        if ids <= {f["message_id"] for f in fired}:
            return fired
        assert time.monotonic() < deadline, f"timed out waiting for {ids - {f['message_id'] for f in fired}}"
        query.awaitTermination(0.2)


def _never_early(fired: list[dict]) -> None:
    for f in fired:
        assert f["fired_ms"] >= f["due_ms"], f"{f['message_id']} released {f['due_ms'] - f['fired_ms']} ms early"
        assert f["logged_ms"] >= f["due_ms"], f"{f['message_id']} fired {f['due_ms'] - f['logged_ms']} ms early"


def test_engine_fires_on_time_cancels_orders_and_restarts(spark, tmp_path):
    from chronoq.spark.engine import EngineOptions, run_engine

    source = tmp_path / "records"
    source.mkdir()
    log = tmp_path / "fired.jsonl"
    options = EngineOptions(server="", checkpoint=str(tmp_path / "ckpt"), bucket_ms=1_000, shards=2, trigger_ms=200)

    def start():
        records = spark.readStream.schema(RECORD_SCHEMA).json(str(source))
        return run_engine(spark, options, records=records, fired_log=str(log))

    _write(source, "0-warmup", [_timer("warm", 0, 1)])  # already due: fires in the first batch
    query = start()
    try:
        _wait_for(query, log, {"warm"})
        now = int(time.time() * 1000)
        _write(source, "1", [
            _timer("a", now + 1500, 100), _timer("b", now + 2000, 101),
            _timer("c", now + 2500, 120), _timer("d", now + 2500, 110),  # same ms: position order d, c
            _timer("e", now + 2500, 130), _tombstone("e", now + 2500, 131),
            # One id, one due time, two topics: the cancel names "orders", so "refunds"' timer
            # fires (before, the tombstone dropped both from the job's state).
            _timer("x", now + 2000, 160, "orders"), _timer("x", now + 2000, 161, "refunds"),
            _tombstone("x", now + 2000, 162, "orders"),
        ])
        _wait_for(query, log, {"a", "b", "c", "d", "x"})
        # "h" is still pending when the job stops; it must come back from the checkpointed state.
        _write(source, "2", [_timer("h", int(time.time() * 1000) + H_MARGIN_MS, 140)])
        wait_ingested(query, 11)  # warm, the 9 records of "1", h
    finally:
        query.stop()
    fired = _fired(log)
    _never_early(fired)
    ids = [f["message_id"] for f in fired]
    assert "e" not in ids, "a cancelled timer fired"
    assert "h" not in ids, f"h fired before the stop: the machine is too slow for the {H_MARGIN_MS} ms margin"
    assert [i for i in ids if i in ("c", "d")] == ["d", "c"]
    assert [f["position"] for f in fired if f["message_id"] == "x"] == [161], "the cancel reached another topic"

    _write(source, "3", [_timer("g", int(time.time() * 1000) + 1000, 150)])
    query = start()
    try:
        fired = _wait_for(query, log, {"g", "h"})
    finally:
        query.stop()
    _never_early(fired)
    ids = [f["message_id"] for f in fired]
    assert sorted(ids) == sorted(set(ids)), f"fired twice: {ids}"
    assert set(ids) == {"warm", "a", "b", "c", "d", "g", "h", "x"}
