"""Run a real `chronoq serve` in a child process, for tests, benchmarks and demos.

Theory of operation: `ServerProcess` picks a free loopback port, starts `python -m chronoq serve
--data-dir DIR --port PORT` with extra settings passed as `CHRONOQ_<FIELD>` environment
variables (the way `Config.load` reads them), and waits until the child has said it serves
("chronoq serving on", `chronoq serve`'s ready line) and an admin call succeeds: an answer alone
could come from another server already on a port the caller chose. It owns
the child: `stop()` sends SIGTERM (the server's clean shutdown), waits, and kills only if the
child does not exit in time; `kill()` is SIGKILL (a crash). Its output goes to a log file (beside
the data directory unless `log_path` names one), appended to, shown in the error when the server
fails to come up. `start()` may be called again after `stop()` or `kill()`: the same port, data
directory and log, and readiness judged only by what this start wrote to the log, so a
benchmark or soak can crash and restart one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import chronoq
from chronoq.client.aio import AsyncAdmin
from chronoq.client.errors import ServerUnavailable

START_TIMEOUT_S = 60.0
READY_LINE = b"chronoq serving on "
"""What `chronoq serve` prints once it accepts calls (`chronoq.cli.serve`)."""
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_module() -> list[str]:
    """`chronoq serve` as `python -m` arguments: through the `chronoq` command once `serve` is
    registered there, else through `chronoq.cli.serve`'s own entry point (the same code)."""
    from chronoq.cli import COMMAND_MODULES

    if "chronoq.cli.serve" in COMMAND_MODULES:
        return ["chronoq", "serve"]
    return ["chronoq.cli.serve", "serve"]


class ServerFailedToStart(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, data_dir: str | Path, *, settings: Mapping[str, Any] | None = None,
                 port: int | None = None, tls_root_certificates: bytes | None = None,
                 log_path: str | Path | None = None, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 own_session: bool = False, access_key: str | None = None, secret_key: str | None = None) -> None:
        """`tls_root_certificates`: the server runs TLS (certificate and key given in `settings`
        as `tls_cert_file`/`tls_key_file`); the readiness check trusts these roots. `args`: more
        `chronoq serve` flags (`--log-level WARNING`). `env`: the environment the child starts
        from (default: this process's), before `settings` are added. `own_session`: the child
        runs in a session of its own, so a Ctrl-C meant for the caller does not reach it before
        the caller stops it. `access_key`/`secret_key`: a user of the server's `[auth]` table
        (given in `args` as `--config`), for the readiness check's admin call."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.settings = dict(settings or {})
        self.tls_root_certificates = tls_root_certificates
        self.args = list(args)
        self.env = dict(env) if env is not None else None
        self.start_timeout_s = start_timeout_s
        self.own_session = own_session
        self.access_key, self.secret_key = access_key, secret_key
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = Path(log_path) if log_path is not None else \
            self.data_dir.parent / f"chronoq-serve-{self.port}.log"
        self._log_offset = 0
        """Where this start's output begins in the log: an earlier start's ready line is not this one's."""

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The running child, None before `start()` and after `stop()` or `kill()`."""
        return self._proc

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ) if self.env is None else dict(self.env)
        env.pop("CHRONOQ_SERVER", None)
        # The child imports this same chronoq, installed or not.
        root = str(Path(chronoq.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        for key, value in self.settings.items():
            env[f"CHRONOQ_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        cmd = [sys.executable, "-m", *serve_module(), "--data-dir", str(self.data_dir), "--port", str(self.port),
               *self.args]
        with open(self._log_path, "ab") as log:
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=self.own_session)
        try:
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        tls = self.tls_root_certificates is not None
        async with AsyncAdmin(self.address, timeout_ms=2000, tls=tls, root_certificates=self.tls_root_certificates,
                              access_key=self.access_key, secret_key=self.secret_key) as admin:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise ServerFailedToStart(f"chronoq serve exited with {self._proc.returncode}:\n{self.log()}")
                if self._said_ready():
                    with contextlib.suppress(ServerUnavailable):
                        await admin.ping()
                        return
                if time.monotonic() > deadline:
                    raise ServerFailedToStart(
                        f"no answer on {self.address} after {self.start_timeout_s} s:\n{self.log()}")
                await asyncio.sleep(0.1)

    def _said_ready(self) -> bool:
        try:
            with open(self._log_path, "rb") as log:
                log.seek(self._log_offset)
                return READY_LINE in log.read()
        except OSError:
            return False

    def log(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self) -> int | None:
        """SIGTERM, wait; SIGKILL only if it hangs. Returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self) -> int | None:
        """SIGKILL (a crash: nothing flushed, nothing closed), and wait. Returns the exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
