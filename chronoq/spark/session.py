"""Starting a SparkSession that can run chronoq's jobs.

Theory of operation: every chronoq Spark job (report, schedule, the timer engine) needs the same
few things (docs/spark.md): Python workers must run this
interpreter and find the `chronoq` package; transformWithState needs the RocksDB state store
provider; the loopback address avoids a DNS query and a warning. On a cluster, `spark-submit`
supplies the master and the executors' environment, so `build_session` only fills in what the
caller left unset (`getOrCreate` keeps the settings of a session that already exists).
pyspark is imported inside the function, so importing this module costs nothing without Spark.

Masters. `local[N]` (the default) runs everything in the driver's JVM. Any other master
(`spark://host:7077`, `yarn`, `k8s://...`) runs executors elsewhere, with their own environment:
the Python workers still run the driver's interpreter path (PySpark sends it with every Python
function), and `spark.executorEnv.PYTHONPATH` is set to the directory holding `chronoq` unless the
caller set it, which suits executors that see the same paths (a cluster on one machine, a shared
install); `docs/spark.md` says what a remote cluster needs. The driver stays on loopback
(`SPARK_LOCAL_IP`) only for a local master or one on a loopback address: executors elsewhere must
reach it.

`quiet=True` (the CLI's way) keeps Spark's start-up noise off the terminal: log4j gets a
configuration of errors only (`log4j2-quiet.properties`, given to the driver JVM at launch, the only
time it reads one), and the JVM's own warning about the incubator module the Spark 4 launcher
always adds is dropped from its stderr, which is otherwise passed through line by line. The JVM
then runs in a session of its own, so a Ctrl-C at the terminal reaches only the command's own
process (PySpark's workers, which the JVM forks, restore Python's SIGINT handler, and each printed
a KeyboardInterrupt traceback); the command stops its jobs, calls `silence_jvm()` so the
cancellations' noise is not shown, and says in one line what was done.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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

QUIET_LOG4J = Path(__file__).with_name("log4j2-quiet.properties")
JVM_NOISE = (b"WARNING: Using incubator modules:", b"Starting Streaming TransformWithStateInPandas Python worker",
             b"Streaming TransformWithStateInPandas Python worker")
"""Lines the JVM prints that say nothing to a chronoq user: at every start (Spark's launcher adds
`--add-modules=jdk.incubator.vector`, and the JVM warns about it), and at every start of a
stateful query (its driver-side Python worker prints each step of its set-up, a blank line after
each, which the JVM passes on). A blank line right after a dropped one is dropped too."""
_SILENCED = threading.Event()
"""Set by `silence_jvm`: the JVM's stderr is no longer passed on."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_local_master(master: str | None) -> bool:
    """True for `local`, `local[N]`, `local[*]`, `local-cluster[...]` and no master at all."""
    return master is None or master.startswith("local")


def on_loopback(master: str) -> bool:
    """A `spark://` master on this machine's loopback address (as `scripts/spark-cluster.sh` starts one)."""
    hosts = [urlsplit(part if "://" in part else f"spark://{part}").hostname
             for part in master.removeprefix("spark://").split(",")]
    return master.startswith("spark://") and all(h in LOOPBACK_HOSTS for h in hosts)


def silence_jvm() -> None:
    """Stop passing the driver JVM's stderr on (a command that is stopping says what happened itself)."""
    _SILENCED.set()


def package_root() -> str:
    """The directory that holds the `chronoq` package, for the workers' PYTHONPATH."""
    return str(Path(__file__).resolve().parents[2])


def prepare_environment(master: str | None = None) -> None:
    """Make Python workers run this interpreter and import chronoq; keep a local Spark on loopback.

    Must run before the JVM starts: the JVM passes its environment on to the workers.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if is_local_master(master) or on_loopback(master or ""):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = package_root()
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def build_session(app_name: str, *, master: str | None = None, conf: Mapping[str, str] | None = None,
                  quiet: bool = True) -> Any:
    """A SparkSession for `app_name`. `master=None` keeps the one spark-submit gave, else `local[2]`."""
    # Under spark-submit the JVM already exists (PYSPARK_GATEWAY_PORT) and holds --master.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    chosen = master or (None if submitted else "local[2]")
    prepare_environment(chosen)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if chosen is not None:
        builder = builder.master(chosen)
    settings = dict(BASE_CONF)
    if chosen is not None and chosen.startswith("local"):
        settings.update(LOCAL_CONF)
    elif chosen is not None:
        # Executors in their own JVMs: they find chronoq where this driver does (same paths).
        settings["spark.executorEnv.PYTHONPATH"] = package_root()
    if quiet and "spark.driver.extraJavaOptions" not in (conf or {}) and not submitted:
        settings["spark.driver.extraJavaOptions"] = f"-Dlog4j.configurationFile=file:{QUIET_LOG4J}"
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    if quiet and not submitted:
        _launch_filtered_gateway({**settings, "spark.app.name": app_name,
                                  **({"spark.master": chosen} if chosen else {})})
    spark = builder.getOrCreate()
    if quiet:
        spark.sparkContext.setLogLevel("ERROR")
    return spark


def _launch_filtered_gateway(settings: Mapping[str, str]) -> None:
    """Start the driver JVM ourselves, its stderr through a pipe that drops `JVM_NOISE` and passes
    everything else on (executors' and Python workers' errors included), unless a JVM runs already."""
    from pyspark import SparkConf
    from pyspark.core.context import SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False).setAll(list(settings.items()))
    gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE, "start_new_session": True})
    threading.Thread(target=_pass_stderr, args=(gateway.proc.stderr,), name="spark-jvm-stderr", daemon=True).start()
    SparkContext._ensure_initialized(gateway=gateway, conf=conf)


def _pass_stderr(pipe: Any) -> None:
    out = sys.stderr.buffer
    dropped = False
    for line in iter(pipe.readline, b""):
        if line.startswith(JVM_NOISE) or (dropped and not line.strip()):
            dropped = True
            continue
        dropped = False
        if not _SILENCED.is_set():
            out.write(line)
            out.flush()
