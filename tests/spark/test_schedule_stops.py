"""`chronoq spark schedule` stopped part way, as a user meets it: a Ctrl-C, a broker that stops.

Each runs the real command in a child process (its own Spark), as a terminal would: Ctrl-C is a
SIGINT to the command's process group. What must hold: one line saying what was done and whether a
rerun is safe (no tracebacks: before, 4 of them and 55 lines for a Ctrl-C, 379 lines for a stopped
broker), and the rerun it advises stores every row exactly once.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.extras import need_module

need_module("pyspark", "spark")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROWS = 60_000
CHILD_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    import chronoq

    root = str(Path(chronoq.__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "SPARK_", "CHRONOQ_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def _input(path: Path, rows: int = ROWS) -> Path:
    due = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    table = pa.table({"rid": [f"s{i:06d}" for i in range(rows)], "text": [f"body {i}" for i in range(rows)],
                      "at": pa.array([due + dt.timedelta(milliseconds=i) for i in range(rows)],
                                     pa.timestamp("ms", tz="UTC"))})
    pq.write_table(table, path)
    return path


def _schedule_cmd(src: Path, server: str, topic: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "chronoq", "spark", "schedule", "--input", str(src), "--topic", topic,
            "--deliver-at-column", "at", "--body-column", "text", "--id-column", "rid", "--server", server,
            "--batch-size", "256", *extra]


def _pending(server: str, topic: str) -> int:
    from chronoq.client import Admin

    with Admin(server, timeout_ms=2000, attempts=1) as admin:
        return int(admin.stats()["timer"]["pending_by_topic"].get(topic, 0))


def _after_sending_starts(proc: subprocess.Popen[str], lines: list[str], act) -> None:
    """Read the child's stderr into `lines`; call `act()` once it says it is sending."""
    assert proc.stderr is not None
    acted = False
    for line in proc.stderr:
        lines.append(line)
        if not acted and line.startswith("sending "):
            acted = True
            act()


def test_ctrl_c_while_sending_says_what_was_done_in_one_line(tmp_path):
    from chronoq.client.testing import ServerProcess

    src = _input(tmp_path / "in.parquet")
    with ServerProcess(tmp_path / "data") as server:
        proc = subprocess.Popen(_schedule_cmd(src, server.address, "cc"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        lines: list[str] = []

        def interrupt() -> None:
            deadline = time.monotonic() + 60
            while _pending(server.address, "cc") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C

        _after_sending_starts(proc, lines, lambda: threading.Thread(target=interrupt, daemon=True).start())
        assert proc.wait(CHILD_TIMEOUT_S) == 130, "".join(lines)
        stored = _pending(server.address, "cc")
        text = "".join(lines)
        assert "Traceback" not in text and "Exception" not in text, text
        after = lines[next(i for i, line in enumerate(lines) if line.startswith("sending ")) + 1:]
        after = [line for line in after if not line.startswith("progress: ")]
        assert len(after) == 1, text
        assert after[0].startswith(f"chronoq spark schedule: interrupted while sending {ROWS:,} messages to "
                                   f"{server.address} topic cc (no rejects written): some may be stored. "
                                   "Rerunning the same command is safe while"), after[0]
        # Interrupted in the sending phase: some rows stored, or all of them when the write tasks
        # (in the JVM's session, not the driver's) finished before the cancel reached them.
        assert 0 < stored <= ROWS, stored

        # The rerun it advises (the broker kept running): every row stored once.
        rerun = subprocess.run(_schedule_cmd(src, server.address, "cc"), capture_output=True, text=True,
                               env=_env(), timeout=CHILD_TIMEOUT_S)
        assert rerun.returncode == 0, rerun.stderr
        assert _pending(server.address, "cc") == ROWS
        assert f"of the scheduled, {stored} ids were already stored" in rerun.stdout, rerun.stdout


@pytest.mark.long
def test_a_broker_that_stops_mid_send_gives_one_error_and_a_safe_rerun(tmp_path):
    from chronoq.client.testing import ServerProcess

    src = _input(tmp_path / "in.parquet")
    server = ServerProcess(tmp_path / "data").start()
    try:
        proc = subprocess.Popen(_schedule_cmd(src, server.address, "bs"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env())
        lines: list[str] = []

        def stop_broker() -> None:
            deadline = time.monotonic() + 60
            while _pending(server.address, "bs") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.stop()

        _after_sending_starts(proc, lines, lambda: threading.Thread(target=stop_broker, daemon=True).start())
        assert proc.wait(CHILD_TIMEOUT_S) == 1, "".join(lines)
        text = "".join(lines)
        assert "Traceback" not in text, text
        errors = [line for line in lines if line.startswith("chronoq spark schedule:")]
        others = [line for line in lines if not line.startswith(("progress: ", "validating ", "sending "))]
        assert len(errors) == 1 and others == errors, text
        error = errors[0]
        assert "the send failed" in error and f"sending to {server.address} failed" in error, error
        assert "ServerUnavailable" in error and "rerun with --skip-stored" in error, error

        server.start()  # same data directory: what was stored is kept; the dedupe window is not
        stored = _pending(server.address, "bs")
        # Interrupted in the sending phase: some rows stored, or all of them when the write tasks
        # (in the JVM's session, not the driver's) finished before the cancel reached them.
        assert 0 < stored <= ROWS, stored
        rerun = subprocess.run(_schedule_cmd(src, server.address, "bs", "--skip-stored"), capture_output=True,
                               text=True, env=_env(), timeout=CHILD_TIMEOUT_S)
        assert rerun.returncode == 0, rerun.stderr
        assert _pending(server.address, "bs") == ROWS  # each row once: none stored twice, none lost
        assert f"of the scheduled, {stored} were not sent: the broker already holds their ids" in rerun.stdout, \
            rerun.stdout
    finally:
        server.stop()
