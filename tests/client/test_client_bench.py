"""`bench/bench_sdk.py` in miniature, so the SDK benchmark cannot rot.

Runs the script as a user would (its own process, which starts `chronoq serve` and, for the
official client's runs, another process) with tiny counts, and checks the JSON it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import chronoq

ROOT = Path(chronoq.__file__).resolve().parent.parent  # the repository, wherever this file sits

pytestmark = [pytest.mark.slow, pytest.mark.interop]


def test_bench_sdk_small_run(tmp_path: Path) -> None:
    # The server's CPU is read in clock ticks (10 ms here, psutil's cpu_times): a step must cost
    # several ticks to read above zero. 300 batched messages (~30 µs each) cost less than one.
    out = tmp_path / "sdk.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_sdk.py"), "--messages", "1500", "--single", "30",
         "--official", "30", "--delivery", "60", "--batch", "64", "--window", "8", "--lead-ms", "2000",
         "--spread-ms", "500", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for key in ("sdk_batch_grpc", "sdk_batch_admin", "sdk_single_sequential", "sdk_single_window",
                "official_sync", "official_async"):
        assert "error" not in doc[key], doc[key].get("error", "")[-2000:]
        assert doc[key]["per_second"] > 0
        assert doc[key]["server_cpu_us_per_message"] > 0, key
    delivery = doc["delivery"]
    assert delivery["received"] == delivery["messages"] == 60
    assert delivery["early"] == 0 and delivery["error_ms"]["min"] >= 0
    assert delivery["broker_fire_error_ms"]["count"] == 60
    assert "timer msgs/s" in proc.stdout
