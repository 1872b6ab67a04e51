"""The soak's smoke run, so `python -m bench.soak` cannot rot.

A real `chronoq serve` with a short retention and small segments, timers crossing segment
boundaries, SIGKILLed twice under load: the soak itself checks that nothing acknowledged is lost
and nothing arrives early (its exit status), and reports the bytes on disk part by part. A
long soak (20 minutes and more) is run by hand: `python -m bench.soak --minutes 25 --retention-s
60 --segment-kib 256 --body-bytes 1024`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import chronoq

ROOT = Path(chronoq.__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_short_soak_with_retention_and_kills_loses_nothing_and_reports_the_disk(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "1", "--kill-every-min", "0.4",
                           "--retention-s", "10", "--segment-kib", "64", "--body-bytes", "512",
                           "--max-delay-s", "20", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "soak.json").read_text())["summary"]
    assert summary["kills"] == 2 and summary["lost"] == 0 and summary["early"] == 0
    assert summary["owed"] > 1000 and summary["arrived_owed"] == summary["owed"]
    # Retention deleted segments: the log no longer starts at 0.
    samples = json.loads((out / "soak.json").read_text())["samples"]
    assert all({"log_bytes", "segments", "timer_bytes", "groups_bytes", "disk_bytes"} <= set(s) for s in samples)
    assert samples[-1]["log_start"] > 0, samples[-1]
    assert summary["disk_at_min"]["1"]["segments"] >= 1
    markdown = (out / "soak.md").read_text()
    assert "on disk at 1 min" in markdown and "**lost** | 0" in markdown
    assert (out / "soak.png").stat().st_size > 0
