"""`chronoq spark schedule` and the Spark timer engine on a real standalone cluster.

A master and two workers on this host (`chronoq.spark.cluster`, what `scripts/spark-cluster.sh`
runs), a real `chronoq serve` with timer_firer=spark, and the commands as a user types them with
`--master spark://...`: the schedule's tasks and the engine's stateful stage run in executors on
the workers (separate JVMs and Python workers), and every timer is delivered once, never early.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.long]

MESSAGES = 400
LEAD_MS = 300_000
HORIZON_MS = 10_000
"""The broker's hand-off horizon: the timers are due well beyond it when scheduled, however slowly
the cluster runs the schedule on a loaded host, so the engine on the cluster holds them and arms
each (the broker would arm those due within it at once, and the engine would not be needed)."""
BACKSTOP_MS = 900_000
"""The broker fires a timer the engine has not fired this long after due: long enough that every
timer here is the engine's to fire, however slowly the cluster starts on a loaded host."""
DELIVER_WAIT_S = 600


def _env() -> dict[str, str]:
    import chronoq

    root = str(Path(chronoq.__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_", "CHRONOQ_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def _apps(cluster) -> set[str]:
    """The applications that ran executors on the workers (a directory each in a worker's work dir)."""
    return {p.name for w in Path(cluster.directory).glob("worker-*") if w.is_dir() for p in w.iterdir()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from chronoq.spark.cluster import start

    c = start(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1)
    try:
        yield c
    finally:
        c.stop()


def test_schedule_and_engine_on_a_standalone_cluster(cluster, tmp_path):
    from chronoq.client import Admin
    from chronoq.client.testing import ServerProcess

    assert cluster.master_url.startswith("spark://127.0.0.1:") and len(cluster.alive()) == 3
    first_due = int(time.time() * 1000) + LEAD_MS
    due = [first_due + (i % 20) * 500 for i in range(MESSAGES)]
    table = pa.table({"rid": [f"c{i}" for i in range(MESSAGES)], "text": [f"b{i}" for i in range(MESSAGES)],
                      "at": pa.array([dt.datetime.fromtimestamp(d / 1000, dt.UTC) for d in due],
                                     pa.timestamp("ms", tz="UTC"))})
    pq.write_table(table, tmp_path / "in.parquet")
    conf = ["--conf", "spark.sql.shuffle.partitions=2", "--conf", "spark.executor.memory=1g"]
    with ServerProcess(tmp_path / "data", settings={"timer_firer": "spark", "timer_handoff_horizon_ms": HORIZON_MS,
                                                    "timer_spark_backstop_ms": BACKSTOP_MS}) as server:
        with Admin(server.address) as admin:
            admin.create_topic("clustered", queue_count=2)
        sched = subprocess.run(
            [sys.executable, "-m", "chronoq", "spark", "schedule", "--master", cluster.master_url, *conf,
             "--input", str(tmp_path / "in.parquet"), "--topic", "clustered", "--deliver-at-column", "at",
             "--body-column", "text", "--id-column", "rid", "--server", server.address],
            capture_output=True, text=True, env=_env(), timeout=300)
        assert sched.returncode == 0, sched.stderr
        assert f"rows {MESSAGES}: scheduled {MESSAGES}, rejected 0" in sched.stdout, sched.stdout
        apps = _apps(cluster)
        assert apps, "no application ran on the workers"

        engine = subprocess.Popen(
            [sys.executable, "-m", "chronoq", "spark", "engine", "--master", cluster.master_url, *conf,
             "--server", server.address, "--checkpoint", str(tmp_path / "ckpt"), "--bucket-ms", "5000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + DELIVER_WAIT_S
            with Admin(server.address) as admin:
                while True:
                    states = [admin.query(f"c{i}", "clustered")[0] for i in range(0, MESSAGES, 7)]
                    if all(s.state == "delivered" for s in states) and \
                            int(admin.stats()["timer"]["pending_by_topic"].get("clustered", 0)) == 0:
                        break
                    assert engine.poll() is None, engine.communicate()[1]
                    assert time.monotonic() < deadline, f"not all delivered: {[s.state for s in states]}"
                    time.sleep(1)
                every = [admin.query(f"c{i}", "clustered") for i in range(MESSAGES)]
                handoff = admin.stats()["timer"]["handoff"]
        finally:
            if engine.poll() is None:
                os.killpg(engine.pid, signal.SIGINT)
            _, err = engine.communicate(timeout=120)
        assert engine.returncode == 130, err
        assert "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith("chronoq spark engine: stopped;"), err
        assert all(len(rows) == 1 and rows[0].state == "delivered" for rows in every)
        # Fired by the engine (not the broker's backstop) and never early.
        errors = [rows[0].fired_ms - rows[0].deliver_at_ms for rows in every]
        assert min(errors) >= 0 and max(errors) < BACKSTOP_MS, (min(errors), max(errors))
        # Handed over by the engine (any scheduled late, already inside the horizon, by the broker).
        assert handoff["armed_by_call"] > 0 and handoff["fired_by_backstop"] == 0, handoff
        assert handoff["armed_by_call"] + handoff["armed_on_accept"] >= MESSAGES, handoff
        engine_apps = _apps(cluster) - apps
        assert engine_apps, "the engine ran no executors on the cluster"
