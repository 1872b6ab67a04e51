"""`python -m bench timer-engines` in miniature, so the engine comparison cannot rot.

Runs every workload but `steady` (real time: 40 s an engine whatever the counts) on both engines
with tiny counts (each engine in its own child process, as the real run does) and checks that
each child fired every timer it added (the bench asserts it) and reported the figures the table
prints; and that the `chronoq-wheel` system starts its server on the wheel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_timer_engines import ROWS, SCENARIOS
from bench.peers.base import load_peer
from tests.support.children import ROOT

RUN = [s for s in SCENARIOS if s != "steady"]


@pytest.mark.slow
def test_timer_engines_small_run_reports_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "engines.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "timer-engines", "--n", "3000", "--burst-n", "2000",
                           "--second-n", "3000", "--spread-n", "2000", "--spread-step-s", "86400",
                           "--scenarios", ",".join(RUN), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results["scenarios"]) == RUN
    for scenario, pair in results["scenarios"].items():
        assert set(pair) == {"rocksdb", "wheel"}
        for engine, figures in pair.items():
            missing = [key for _label, key, _fmt in ROWS[scenario] if key not in figures]
            assert not missing, (scenario, engine, missing)
    pending = results["scenarios"]["pending"]
    for figures in pending.values():
        assert figures["n"] == 3000 and figures["disk_per_timer_b"] > 0 and figures["open_s"] > 0
    for scenario, n in (("burst", 2000), ("second", 3000)):
        for figures in results["scenarios"][scenario].values():
            assert figures["n"] == n and 0 <= figures["within_1s"] <= figures["within_2s"] <= n
            assert figures["all_fired_ms"] >= figures["late_p99_ms"] >= figures["late_p50_ms"]
    assert "wheel / rocksdb" in proc.stdout


def test_unknown_scenario_is_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "timer-engines", "--scenarios", "pending,nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown scenario 'nope'" in proc.stderr


def test_chronoq_wheel_serves_on_the_wheel_and_chronoq_on_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHRONOQ_TIMER_ENGINE", "memory")  # a harness environment must not leak into a row
    wheel = load_peer("chronoq-wheel").server_env()  # type: ignore[attr-defined]
    default = load_peer("chronoq").server_env()  # type: ignore[attr-defined]
    assert wheel["CHRONOQ_TIMER_ENGINE"] == "wheel"
    assert "CHRONOQ_TIMER_ENGINE" not in default
