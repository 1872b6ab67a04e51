"""The benchmark harness's smoke mode, so `python -m bench` cannot rot.

`python -m bench --smoke` runs chronoq alone through every phase (accept, precision, crash,
backlog) with tiny counts: a real `chronoq serve` child, real producer and consumer processes,
a real SIGKILL. These tests check that the harness produced every artefact and that its figures
are consistent with each other; the peers (Redis, NATS, RabbitMQ, beanstalkd) are not run here.
The fast tests at the end check the scoring and the report on hand-made values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a source-tree tool, not part of the installed package

from bench.harness import report  # noqa: E402
from bench.harness.runner import _rate_series  # noqa: E402
from bench.harness.workload import decode_body, delivery_figures, encode_body, percentile  # noqa: E402

PHASES = ("accept", "precision", "crash", "backlog")

@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("bench-smoke")
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc, out


def _chronoq(out: Path) -> dict[str, Any]:
    results = json.loads((out / "results.json").read_text())
    assert list(results["systems"]) == ["chronoq"]
    system: dict[str, Any] = results["systems"]["chronoq"]
    return system


@pytest.mark.slow
def test_smoke_writes_json_markdown_and_chart(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    system = _chronoq(out)
    assert system["installable"] is True
    for phase in PHASES:
        assert "failed" not in system[phase], system[phase]
    md = (out / "results.md").read_text()
    assert "| accepted/s one-at-a-time |" in md and "## Crash run" in md and "## Backlog run" in md
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_smoke_figures_are_consistent(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _proc, out = smoke
    system = _chronoq(out)
    for mode in ("sync", "batch"):
        acc = system["accept"][mode]
        assert acc["errors"] == [] and acc["sent"] == 300 and acc["per_s"] > 0
    prec = system["precision"]
    assert prec["accepted"] == 200
    assert prec["delivered"] + prec["lost"] == prec["accepted"]
    assert prec["lost"] == 0 and prec["early"] == 0 and prec["duplicates"] == 0
    assert 0 <= prec["error_p50_ms"] <= prec["error_p99_ms"] <= prec["error_max_ms"]
    assert prec["resources"]["rss_peak_mb"] > 0 and prec["resources"]["cpu_s"] > 0
    backlog = system["backlog"]
    assert backlog["pending"] == 1000 and backlog["pending_after_restart"] == 1000
    assert backlog["disk_mb"] > 0 and backlog["restart_ready_s"] > 0 and backlog["rate_over_time"]
    crash = system["crash"]
    assert crash["accepted"] == 100 and crash["pending_at_kill"] > 0
    assert crash["delivered"] + crash["lost"] == crash["accepted"]


@pytest.mark.slow
def test_smoke_crash_loses_nothing_and_is_never_early(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _proc, out = smoke
    crash = _chronoq(out)["crash"]
    assert crash["early"] == 0
    assert crash["lost"] == 0, crash.get("consumer_errors")


def test_delivery_figures_count_early_duplicates_lost_and_strays() -> None:
    received = [("a", 1000, 1010.0), ("b", 1000, 999.5), ("a", 1000, 1500.0), ("zz", 1000, 1001.0)]
    f = delivery_figures(["a", "b", "c"], received)
    assert (f["accepted"], f["delivered"], f["lost"]) == (3, 3, 1)  # a, b and the stray zz; c never came
    assert f["duplicates"] == 1 and f["early"] == 1 and f["unexpected"] == 1
    # The first delivery of each id is scored: errors 10, -0.5, 1 ms.
    assert (f["error_min_ms"], f["error_p50_ms"], f["error_max_ms"]) == (-0.5, 1.0, 10.0)


def test_percentile_is_nearest_rank_and_body_round_trips() -> None:
    values = list(range(1, 1001))
    assert [percentile(values, p) for p in (50, 99, 99.9, 100)] == [500, 990, 999, 1000]
    assert percentile([], 50) is None
    assert decode_body(encode_body("p-0-7", 1_700_000_000_123)) == ("p-0-7", 1_700_000_000_123)


def test_rate_series_sums_producers_and_scales_a_short_last_window() -> None:
    series = _rate_series([[(1.0, 100), (2.0, 200)], [(1.0, 50), (2.0, 100)]], points=2)
    assert series == [(1.0, 150.0), (2.0, 150.0)]
    assert _rate_series([[(0.1, 1000)]]) == [(0.2, 10000.0)]


def test_rate_series_never_divides_by_a_sliver_of_a_window() -> None:
    """Runs of every length: no window is narrower than a quarter step, so no rate can exceed
    all the messages over a quarter step (a float-summed loop once reported 4.5e15 msg/s)."""
    for centis in range(100, 20_000, 7):
        end = centis / 100
        series = _rate_series([[(end / 3, 300), (end, 1000)]])
        step = max(0.2, end / 100)
        assert 1 <= len(series) <= 100, (end, len(series))
        assert all(rate <= 1000 / (step / 4) for _, rate in series), (end, max(r for _, r in series))


def test_report_names_the_uninstallable_and_gives_ratios(tmp_path: Path) -> None:
    results = {
        "started": "t", "machine": "m", "command": "c",
        "systems": {
            "chronoq": {"installable": True, "version": "1", "design": "d", "durability": "x",
                        "accept": {"sync": {"per_s": 200.0}, "batch": {"per_s": 4000.0}},
                        "precision": {"error_p99_ms": 10.0, "early": 0}},
            "redis": {"installable": True, "version": "7", "design": "d", "durability": "x",
                      "accept": {"sync": {"per_s": 100.0}, "batch": {"per_s": 8000.0}},
                      "precision": {"error_p99_ms": 20.0, "early": 0}},
            "nats": {"installable": False, "reason": "not installable: nats-server 2.9.10 is too old"},
        },
    }
    paths = report.write(results, tmp_path)
    md = paths["markdown"].read_text()
    assert "not installable: nats-server 2.9.10 is too old" in md
    assert "| accepted/s one-at-a-time | 2.00 | - |" in md  # chronoq/redis, chronoq/nats
    assert "| error P99 ms | 0.50 | - |" in md
    assert paths["chart"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths["json"].read_text())["systems"]["nats"]["installable"] is False
