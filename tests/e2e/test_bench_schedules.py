"""`python -m bench schedules` in miniature, so the schedules benchmark cannot rot.

A few hundred schedules every 2 s (and the same due times as one-shot timers), two occurrences
each, on real `chronoq serve` children as the full run has them: every owed occurrence arrives
once and none early (the bench's exit status says so too), and the figures the table prints
are there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.children import ROOT


@pytest.mark.slow
def test_schedules_small_run_delivers_every_occurrence_once_and_none_early(tmp_path: Path) -> None:
    out = tmp_path / "schedules.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "schedules", "--schedules", "300", "--minutes", "2",
                           "--every-s", "2", "--grace-s", "10", "--creators", "8", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["schedules", "timers"]
    for r in runs:
        assert r["owed"] == 600 and r["received"] >= 600, r
        assert (r["early"], r["missed"], r["duplicated"]) == (0, 0, 0), r
        errors = r["delivery_error_ms"]
        assert 0 <= errors["p50"] <= errors["p99"] <= errors["p999"] <= errors["max"], r
        assert r["create_per_s"] > 0 and r["rss_peak_mb"] >= r["rss_idle_mb"] > 0, r
    assert runs[0]["server_schedules"]["schedules"] == 300
    assert "| delivery error P50 / P99 / P99.9 / max, ms |" in proc.stdout


def test_unknown_mode_is_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "schedules", "--modes", "schedules,nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not 'schedules,nope'" in proc.stderr, proc.stderr
