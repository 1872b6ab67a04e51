"""One local SparkSession for the whole Spark test run, tuned for speed (see docs/spark.md).

A session costs 6-7 s to start here, so every Spark test shares this one (session scope).
Settings measured to cut a small suite's time by about a quarter: no UI, two shuffle partitions,
adaptive execution off, C1-only JIT and the serial GC (tests only; long streams want the defaults).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from tests.support.extras import need_module

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def spark():
    need_module("pyspark", "spark")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    warnings.filterwarnings("ignore", category=FutureWarning)
    from chronoq.spark.session import build_session

    java_opts = (f"-Dlog4j.configurationFile=file:{HERE / 'log4j2.properties'} "
                 "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    session = build_session(
        "chronoq-tests",
        master="local[2]",
        conf={
            "spark.driver.extraJavaOptions": java_opts,
            "spark.sql.codegen.wholeStage": "false",
            "spark.sql.streaming.numRecentProgressUpdates": "1000",
            "spark.sql.streaming.stateStore.providerClass":
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        },
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def chronoq_server(tmp_path_factory):
    """A real `chronoq serve` in its own process, shared by the Spark tests (topics per test)."""
    from chronoq.client.testing import ServerProcess

    proc = ServerProcess(tmp_path_factory.mktemp("chronoq") / "data").start()
    try:
        yield proc.address
    finally:
        proc.stop()
