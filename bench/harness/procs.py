"""Server processes of the benchmark: ports, start, readiness, stop by pid, and resource sampling.

Theory of operation: every server the harness runs is a child it starts itself, bound to 127.0.0.1
on a port found free just before, with stdout and stderr going to a log file, never a pipe (an
orphaned server holding a pipe open hangs whoever reads it). A `Server` is the handful of such
children one system needs (RabbitMQ needs epmd beside it), each a `ChildProcess`; `chronoq serve`
itself is started by `chronoq.client.testing.ServerProcess`, the one way the tests start it too,
and its child handed to the `Server` (`ChildProcess.adopt`). Stopping is by pid only: SIGTERM, wait,
then SIGKILL; a crash is SIGKILL to every pid of the process tree at once. `TreeSampler` polls the
tree with psutil (RSS summed over the tree, CPU seconds per pid so a child that exits keeps its
share) because servers such as RabbitMQ spread their work over several processes; `cpu_s()` reads
the CPU seconds so far mid-run, so one sampler can split a phase into parts (accept's two modes).
CPU times come from /proc in clock ticks (10 ms on Linux by default): a part must run for seconds, not
milliseconds, for its CPU per message to mean anything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from chronoq.client.testing import free_port as free_port  # one definition, shared with the tests (re-exported)

LOOPBACK = "127.0.0.1"
SAMPLE_INTERVAL_S = 0.25
THREAD_WINDOW_S = 1.0
STOP_TIMEOUT_S = 30.0


class ServerFailed(RuntimeError):
    """A server exited or did not become ready; the message carries the tail of its log."""


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def dir_size_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


class ChildProcess:
    """One child process: started with its output in `log_path`, stopped by its pid."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    pid: int

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # A new session keeps a Ctrl-C on the harness from reaching the server before we stop it.
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(env) if env is not None else None, cwd=cwd,
                                          start_new_session=True)
        self.pid = self.popen.pid

    @classmethod
    def adopt(cls, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> ChildProcess:
        """A child someone else started (`chronoq serve`, by `chronoq.client.testing.ServerProcess`),
        sampled, stopped and killed like the harness's own."""
        child = cls.__new__(cls)
        child.name, child.argv, child.log_path = name, [str(a) for a in popen.args], log_path  # type: ignore[union-attr]
        child.popen, child.pid = popen, popen.pid
        return child

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise ServerFailed(f"{self.name} exited with {self.popen.returncode}; log {self.log_path}:\n"
                               f"{log_tail(self.log_path)}")

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if not self.alive():
            return
        self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL this process and every descendant, each by its pid."""
        for proc in reversed(self.tree()):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


@dataclass
class Server:
    """The processes of one running system and the address its clients use."""

    procs: list[ChildProcess]
    addr: dict[str, Any]
    data_dir: Path
    ready_s: float = 0.0
    """Seconds from the first process start until the server answered its readiness probe."""
    stop_signal: int = signal.SIGTERM
    extra: dict[str, Any] = field(default_factory=dict)

    def tree(self) -> list[psutil.Process]:
        return [p for sp in self.procs for p in sp.tree()]

    def check_alive(self) -> None:
        for sp in self.procs:
            sp.check_alive()

    def stop(self) -> None:
        # Reverse start order: the broker goes before the helpers it registered with (epmd).
        for sp in reversed(self.procs):
            sp.terminate(self.stop_signal)

    def kill(self) -> None:
        victims = self.tree()
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        for sp in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sp.popen.wait(10)


def wait_ready(server: Server, probe: Callable[[], bool], timeout_s: float, started_at: float) -> None:
    """Poll `probe` until it returns True; fail early if a process exits. Sets `server.ready_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        server.check_alive()
        try:
            if probe():
                server.ready_s = time.monotonic() - started_at
                return
        except Exception:  # the probe's client failing is exactly "not ready yet"
            pass
        if time.monotonic() > deadline:
            server.kill()
            logs = "\n".join(f"--- {sp.log_path}\n{log_tail(sp.log_path)}" for sp in server.procs)
            raise ServerFailed(f"not ready within {timeout_s:.0f} s\n{logs}")
        time.sleep(0.05)


def tcp_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class TreeSampler:
    """Samples a server's process tree on a thread: peak RSS and CPU seconds since `start()`,
    and how busy its busiest thread was in each window of `THREAD_WINDOW_S` (a server with one
    event loop, or Redis's one main thread, queues work once that thread is near 100 %, whatever
    the other threads and cores do): reported as the 90th percentile and the maximum over the
    windows, in percent of one core."""

    def __init__(self, server: Server, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.server = server
        self.interval_s = interval_s
        self.rss_peak_bytes = 0
        self._cpu_base: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """The sampling thread and `cpu_s()` callers both sample."""
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._window_start: tuple[float, dict[tuple[int, int], float]] | None = None
        self.busiest_thread_pct: list[float] = []
        """Per window: the CPU of the tree's busiest thread in it, percent of one core."""

    def start(self) -> TreeSampler:
        self._sample(baseline=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        out: dict[str, float] = {"rss_peak_mb": round(self.rss_peak_bytes / 2**20, 1), "cpu_s": round(self.cpu_s(), 2)}
        busy = sorted(self.busiest_thread_pct)
        if busy:
            out["busiest_thread_p90_pct"] = round(busy[min(len(busy) - 1, int(0.9 * len(busy)))], 1)
            out["busiest_thread_max_pct"] = round(busy[-1], 1)
        return out

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the tree has used since `start()`, sampled now."""
        self._sample()
        with self._lock:
            return sum(last - self._cpu_base.get(pid, 0.0) for pid, last in self._cpu_last.items())

    def current_rss_bytes(self) -> int:
        total = 0
        for proc in self.server.tree():
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, baseline: bool = False) -> None:
        with self._lock:
            self._sample_locked(baseline)

    def _sample_locked(self, baseline: bool) -> None:
        rss = 0
        threads: dict[tuple[int, int], float] = {}
        for proc in self.server.tree():
            try:
                with proc.oneshot():
                    rss += proc.memory_info().rss
                    t = proc.cpu_times()
                    cpu = t.user + t.system
                    for th in proc.threads():
                        threads[(proc.pid, th.id)] = th.user_time + th.system_time
            except psutil.Error:
                continue
            key = proc.pid
            if baseline:
                self._cpu_base[key] = cpu
            self._cpu_last[key] = cpu
        self.rss_peak_bytes = max(self.rss_peak_bytes, rss)
        now = time.monotonic()
        if self._window_start is None or baseline:
            self._window_start = (now, threads)
        elif now - self._window_start[0] >= THREAD_WINDOW_S:
            started, before = self._window_start
            busiest = max((cpu - before.get(key, cpu) for key, cpu in threads.items()), default=0.0)
            self.busiest_thread_pct.append(100 * busiest / (now - started))
            self._window_start = (now, threads)
