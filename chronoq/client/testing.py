"""Run a real `chronoq serve` in a child process, for tests, benchmarks and demos.

Theory of operation: `ServerProcess` picks a free loopback port, starts `python -m chronoq serve
--data-dir DIR --port PORT` with extra settings passed as `CHRONOQ_<FIELD>` environment
variables (the way `Config.load` reads them), and waits until the child has said it serves
("chronoq serving on", `chronoq serve`'s ready line) and an admin call succeeds: an answer alone
could come from another server already on a port the caller chose. It owns
the child: `stop()` sends SIGTERM (the server's clean shutdown), waits, and kills only if the
child does not exit in time. Its stderr goes to a file in the data directory, shown in the
error when the server fails to come up.
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
from collections.abc import Mapping
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
                 port: int | None = None, tls_root_certificates: bytes | None = None) -> None:
        """`tls_root_certificates`: the server runs TLS (certificate and key given in `settings`
        as `tls_cert_file`/`tls_key_file`); the readiness check trusts these roots."""
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.settings = dict(settings or {})
        self.tls_root_certificates = tls_root_certificates
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.data_dir.parent / f"chronoq-serve-{self.port}.log"

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.pop("CHRONOQ_SERVER", None)
        # The child imports this same chronoq, installed or not.
        root = str(Path(chronoq.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        for key, value in self.settings.items():
            env[f"CHRONOQ_{key.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        cmd = [sys.executable, "-m", *serve_module(), "--data-dir", str(self.data_dir), "--port", str(self.port)]
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            asyncio.run(self._wait_ready())
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        tls = self.tls_root_certificates is not None
        async with AsyncAdmin(self.address, timeout_ms=2000, tls=tls,
                              root_certificates=self.tls_root_certificates) as admin:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise ServerFailedToStart(f"chronoq serve exited with {self._proc.returncode}:\n{self.log()}")
                if self._said_ready():
                    with contextlib.suppress(ServerUnavailable):
                        await admin.ping()
                        return
                if time.monotonic() > deadline:
                    raise ServerFailedToStart(f"no answer on {self.address} after {START_TIMEOUT_S} s:\n{self.log()}")
                await asyncio.sleep(0.1)

    def _said_ready(self) -> bool:
        try:
            with open(self._log_path, "rb") as log:
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

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
