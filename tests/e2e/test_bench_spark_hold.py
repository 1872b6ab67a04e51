"""`python -m bench spark-hold` in miniature, so the benchmark of the engine holding far timers cannot rot.

A thousand timers due from an hour to a day ahead, on a real `chronoq serve` child and the engine
on local Spark, as the full run has them: the engine reads every one, the broker arms none (all
are beyond its horizon), and the figures the run reports are there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.children import ROOT
from tests.support.extras import need_module

need_module("pyspark", "spark")

@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.long
def test_spark_hold_small_run_reads_every_timer_and_arms_none(tmp_path: Path) -> None:
    out = tmp_path / "spark-hold.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "spark-hold", "--timers", "1000", "--days", "1",
                           "--wait-s", "600", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["timers"] == 1000 and result["broker_pending"] == 1000, result
    assert result["broker_handoff"]["armed"] == 0 and result["broker_handoff"]["armed_by_call"] == 0, result
    assert result["state_rows"] > 0 and result["state_on_disk_mb"] > 0, result
    # The last version's files, read from the checkpoint's own list (None if it could not be read);
    # a thousand timers' state is a few kilobytes, so the MB figure may round to 0.0.
    assert result["state_last_version_mb"] is not None, result
    assert 0 <= result["state_last_version_mb"] <= result["state_on_disk_mb"], result
    assert result["broker_rss_mb"] >= result["broker_rss_idle_mb"] > 0, result


def test_bad_arguments_are_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "spark-hold", "--timers", "10", "--days", "1",
                           "--from-s", "90000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--from-s between 0 and --days" in proc.stderr, proc.stderr
