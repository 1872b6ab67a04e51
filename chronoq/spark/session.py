"""Starting a SparkSession that can run chronoq's jobs.

Theory of operation: every chronoq Spark job (report, schedule, the timer engine) needs the same
few things, measured on this machine kind (docs/spark.md): Python workers must run this
interpreter and find the `chronoq` package; transformWithState needs the RocksDB state store
provider; the loopback address avoids a DNS query and a warning. On a cluster, `spark-submit`
supplies the master and the executors' environment, so `build_session` only fills in what the
caller left unset (`getOrCreate` keeps the settings of a session that already exists).
pyspark is imported inside the function, so importing this module costs nothing without Spark.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

BASE_CONF: dict[str, str] = {
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
}
"""Settings every chronoq job needs, whatever the cluster."""

LOCAL_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
}
"""Settings for a small local run (tests, a laptop): small shuffles, no web UI, loopback only."""


def package_root() -> str:
    """The directory that holds the `chronoq` package, for the workers' PYTHONPATH."""
    return str(Path(__file__).resolve().parents[2])


def prepare_environment() -> None:
    """Make Python workers run this interpreter and import chronoq; keep Spark on loopback.

    Must run before the JVM starts: the JVM passes its environment on to the workers.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = package_root()
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def build_session(app_name: str, *, master: str | None = None, conf: Mapping[str, str] | None = None,
                  quiet: bool = True) -> Any:
    """A SparkSession for `app_name`. `master=None` keeps the one spark-submit gave, else `local[2]`."""
    prepare_environment()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    # Under spark-submit the JVM already exists (PYSPARK_GATEWAY_PORT) and holds --master.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    chosen = master or (None if submitted else "local[2]")
    if chosen is not None:
        builder = builder.master(chosen)
    settings = dict(BASE_CONF)
    if chosen is not None and chosen.startswith("local"):
        settings.update(LOCAL_CONF)
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    return spark

