"""A Spark standalone cluster on this host: a master and workers, real `spark://` URLs.

Theory of operation: Spark's standalone cluster manager is a master process that workers
register with; an application (`--master spark://HOST:PORT`) asks the master for executors,
and each worker starts them as JVMs of their own, which run the Python workers. The pip
install of pyspark carries the classes but not the `sbin/start-master.sh` scripts, so the
processes are started here through `bin/spark-class` (what those scripts call):
`org.apache.spark.deploy.master.Master` and `org.apache.spark.deploy.worker.Worker`, on
127.0.0.1, each logging to a file in the cluster's directory. Web UIs take free ports (a
worker's default, 8081, is chronoq's port). The cluster is ready when every worker's log says
it registered with the master. `state.json` in the directory records the URL and the process
ids, so `stop` (another process, later: `scripts/spark-cluster.sh stop`) ends exactly the
processes `start` began; each runs in a session of its own, so a Ctrl-C in the terminal that
started the cluster does not end it.

This is for running chronoq's Spark jobs on a real cluster manager (executors in their own
JVMs, tasks sent over the network, a shuffle between machines' block managers) without a
second machine: tests, a demo, a check of the set-up before pointing the same commands at a
real cluster (docs/spark.md, "On a cluster").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
DEFAULT_PORT = 7077
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
REGISTERED = "Successfully registered with master"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


class ClusterError(RuntimeError):
    """The cluster did not start (the message names the log to read) or its state is unusable."""


@dataclass
class Cluster:
    directory: str
    master_url: str
    master_pid: int
    worker_pids: list[int] = field(default_factory=list)

    @property
    def state_path(self) -> Path:
        return Path(self.directory) / "state.json"

    def save(self) -> None:
        self.state_path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> Cluster:
        path = Path(directory) / "state.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise ClusterError(f"no cluster state in {directory} (start one with `start --dir {directory}`)") from None

    def alive(self) -> list[int]:
        return [pid for pid in [self.master_pid, *self.worker_pids] if _alive(pid)]

    def stop(self) -> None:
        """SIGTERM every process `start` began (workers first), wait; SIGKILL what hangs."""
        pids = [*self.worker_pids, self.master_pid]
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.state_path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child and has exited
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of another parent counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def spark_class() -> Path:
    """`bin/spark-class` of the pyspark this Python imports."""
    try:
        import pyspark
    except ImportError:
        raise ClusterError(f"pyspark is not installed in {sys.executable}; `scripts/setup.sh --spark` installs "
                           "it (and Java 17)") from None
    path = Path(pyspark.__file__).resolve().parent / "bin" / "spark-class"
    if not path.exists():
        raise ClusterError(f"{path} is missing: this pyspark install has no launcher scripts")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["SPARK_LOCAL_IP"] = HOST
    return env


def _launch(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([str(spark_class()), *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_env(), start_new_session=True)


def start(directory: str | Path, *, workers: int = 2, cores: int = 1, memory: str = "1536m",
          port: int | None = None) -> Cluster:
    """Start a master and `workers` workers (each `cores` cores, `memory` for executors); return
    once every worker has registered. On failure everything started is stopped again."""
    base = Path(directory).resolve()
    base.mkdir(parents=True, exist_ok=True)
    if (base / "state.json").exists():
        old = Cluster.load(base)
        if old.alive():
            raise ClusterError(f"a cluster from {base} is running already at {old.master_url} "
                               f"(pids {old.alive()}); stop it first")
    port = port or _free_port()
    url = f"spark://{HOST}:{port}"
    master = _launch([MASTER_CLASS, "--host", HOST, "--port", str(port), "--webui-port", str(_free_port())],
                     base / "master.log")
    cluster = Cluster(str(base), url, master.pid)
    try:
        for i in range(workers):
            work = base / f"worker-{i}"
            work.mkdir(exist_ok=True)
            proc = _launch([WORKER_CLASS, "--host", HOST, "--cores", str(cores), "--memory", memory,
                            "--work-dir", str(work), "--webui-port", str(_free_port()), url],
                           base / f"worker-{i}.log")
            cluster.worker_pids.append(proc.pid)
        cluster.save()
        _wait_registered(cluster, base, workers)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_registered(cluster: Cluster, base: Path, workers: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    logs = [base / f"worker-{i}.log" for i in range(workers)]
    while True:
        gone = [pid for pid in [cluster.master_pid, *cluster.worker_pids] if not _alive(pid)]
        if gone:
            raise ClusterError(f"a cluster process exited at start (pids {gone}); see the logs in {base}")
        if all(REGISTERED in log.read_text(errors="replace") for log in logs if log.exists()) \
                and all(log.exists() for log in logs):
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"the workers did not register with {cluster.master_url} within "
                               f"{START_TIMEOUT_S:.0f} s; see the logs in {base}")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spark-cluster", description="A Spark standalone cluster on this host.")
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--dir", default=".spark-cluster", help="logs, worker directories and state.json")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cores", type=int, default=1, help="cores each worker offers")
    parser.add_argument("--memory", default="1536m", help="memory each worker offers its executors")
    parser.add_argument("--port", type=int, default=None, help=f"master port (default: a free one; Spark's is "
                                                                 f"{DEFAULT_PORT})")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            cluster = start(args.dir, workers=args.workers, cores=args.cores, memory=args.memory, port=args.port)
            print(cluster.master_url)
            return 0
        cluster = Cluster.load(args.dir)
        if args.action == "stop":
            cluster.stop()
            print(f"stopped {cluster.master_url}")
            return 0
        alive = cluster.alive()
        print(f"{cluster.master_url}: {len(alive)} of {1 + len(cluster.worker_pids)} processes running")
        return 0 if len(alive) == 1 + len(cluster.worker_pids) else 1
    except ClusterError as e:
        print(f"spark-cluster: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
