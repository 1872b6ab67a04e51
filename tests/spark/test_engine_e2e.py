"""The Spark timer engine end to end: a real `chronoq serve` with timer_firer=spark, the engine
reading its timer topic through the chronoq source and handing each timer over through ArmTimers
as it enters the broker's hand-off horizon (a second here, so that every timer below is the job's
to hand over), the broker firing it.

Timer semantics as the embedded engine's tests state them: never early, a cancel wins, timers due
in the same millisecond are delivered in send order, and after a stop and a restart from the
checkpoint a pending timer is delivered once (nothing lost, nothing twice).
"""

from __future__ import annotations

import time

import pytest

from tests.spark.engine_waits import WAIT_S, wait_ingested
from tests.support.extras import need_module

need_module("pyspark", "spark")  # every test here runs on Spark

pytestmark = pytest.mark.spark

RESTART_MARGIN_MS = 20_000
HORIZON_MS = 1000


@pytest.fixture(scope="module")
def spark_engine_server(tmp_path_factory):
    from chronoq.client.testing import ServerProcess

    proc = ServerProcess(tmp_path_factory.mktemp("spark-engine") / "data",
                         settings={"timer_firer": "spark", "timer_handoff_horizon_ms": HORIZON_MS}).start()
    try:
        yield proc.address
    finally:
        proc.stop()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _states(admin, topic: str, ids) -> dict:
    return {mid: admin.query(mid, topic)[0] for mid in ids}


def _wait_delivered(query, admin, topic: str, ids: set[str]) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        states = _states(admin, topic, ids)
        if all(s.state == "delivered" for s in states.values()):
            return states
        assert time.monotonic() < deadline, f"not delivered: {[m for m, s in states.items() if s.state != 'delivered']}"
        query.awaitTermination(0.2)


def test_spark_engine_end_to_end(spark, spark_engine_server, tmp_path):
    from chronoq.client import Admin, Producer
    from chronoq.spark.engine import EngineOptions, run_engine

    server = spark_engine_server
    options = EngineOptions(server=server, checkpoint=str(tmp_path / "ckpt"), bucket_ms=10_000, trigger_ms=200)
    with Admin(server) as admin, Producer(server) as producer:
        admin.create_topic("e2e", queue_count=1)
        producer.send("e2e", b"warm", deliver_at=_now_ms(), message_id="warm")
        query = run_engine(spark, options)
        try:
            _wait_delivered(query, admin, "e2e", {"warm"})
            now = _now_ms()
            same_ms = now + 3000
            producer.send("e2e", b"a", deliver_at=now + 2000, message_id="a")
            for mid in ("s1", "s2", "s3"):  # the same millisecond: delivered in send order
                producer.send("e2e", mid.encode(), deliver_at=same_ms, message_id=mid)
            producer.send("e2e", b"x", deliver_at=now + 2500, message_id="x")
            admin.cancel("e2e", "x")
            states = _wait_delivered(query, admin, "e2e", {"a", "s1", "s2", "s3"})
            assert admin.query("x", "e2e")[0].state == "cancelled"
            for mid, s in states.items():
                assert s.fired_ms >= s.deliver_at_ms, f"{mid} fired {s.deliver_at_ms - s.fired_ms} ms early"
            producer.send("e2e", b"h", deliver_at=_now_ms() + RESTART_MARGIN_MS, message_id="h")
            wait_ingested(query, 8)  # warm, a, s1-s3, x and its tombstone, h
        finally:
            query.stop()
        assert admin.query("h", "e2e")[0].state == "pending", "h fired before the stop (machine too slow)"

        query = run_engine(spark, options)  # the same checkpoint: h comes back from the state store
        try:
            states = _wait_delivered(query, admin, "e2e", {"h"})
        finally:
            query.stop()
        assert states["h"].fired_ms >= states["h"].deliver_at_ms
        # Each was handed over by the job (none was due within the horizon when accepted), and the
        # broker's loop fired it: none waited for the backstop.
        handoff = admin.stats()["timer"]["handoff"]
        assert handoff["armed_by_call"] >= 5 and handoff["fired_by_backstop"] == 0, handoff

        delivered = admin.read("e2e", 0, 0, 100).messages
    ids = [m.message_id for m in delivered]
    assert sorted(ids) == sorted(["warm", "a", "s1", "s2", "s3", "h"]), ids  # each once, x never
    assert [i for i in ids if i.startswith("s")] == ["s1", "s2", "s3"]


def test_fire_chunks_shrink_to_a_brokers_smaller_batch_limit(tmp_path):
    """A broker with `max_send_batch` below the engine's 1,024 positions per call refused every
    bigger chunk, and each replay of the batch the same way: the engine stopped for good."""
    from chronoq.client import Admin, Producer
    from chronoq.client.testing import ServerProcess
    from chronoq.client.wire import outgoing
    from chronoq.model import TIMER_TOPIC
    from chronoq.spark.engine import arm_timers, fire_positions

    # Due beyond the broker's hand-off horizon and not handed over: only FireTimers fires them.
    server = ServerProcess(tmp_path / "data", settings={"timer_firer": "spark", "max_send_batch": 256,
                                                         "timer_handoff_horizon_ms": 1000}).start()
    try:
        with Admin(server.address) as admin, Producer(server.address) as producer:
            admin.create_topic("small", queue_count=1)
            for start in range(0, 300, 100):
                producer.send_batch([outgoing("small", b"t", message_id=f"t{i}", delay=1500)
                                     for i in range(start, start + 100)])
            positions: list[int] = []
            while len(positions) < 300:  # the timer records, as the engine reads them
                page = admin.read(TIMER_TOPIC, 0, len(positions), 256)
                assert page.messages
                positions += [m.position for m in page.messages]
        time.sleep(1.6)  # all due
        assert fire_positions(server.address, positions) == 300
        assert fire_positions(server.address, positions) == 0  # a replay fires nothing twice
        # ArmTimers' chunks shrink the same way; every one of them has fired.
        timers = [(p, "small", f"t{i}") for i, p in enumerate(positions)]
        assert arm_timers(server.address, timers) == {"fired": 300}
    finally:
        server.stop()
