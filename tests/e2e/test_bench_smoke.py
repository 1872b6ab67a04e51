"""The benchmark harness's smoke mode, so `python -m bench` cannot rot.

`python -m bench --smoke` runs the floor (the stub server of the protocol) and chronoq through
every default phase (accept, precision, burst, crash, backlog; the floor skips crash and backlog)
with tiny counts: a real `chronoq serve` child and a real floor server, real producer and
consumer processes, a real SIGKILL. These tests check that the harness produced every artefact
and that its figures are consistent with each other; the peers (Redis, NATS, RabbitMQ,
beanstalkd) are not run here. The fast tests at the end check the scoring and the report on
hand-made values.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.harness import report
from bench.harness.runner import _rate_series, sweep_verdict
from bench.harness.workload import decode_body, delivery_figures, encode_body, percentile
from tests.support.children import ROOT
from tests.support.extras import need_module

PHASES = ("accept", "precision", "burst", "crash", "backlog")

@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    need_module("matplotlib", "peers")  # the harness draws its chart
    out = tmp_path_factory.mktemp("bench-smoke")
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc, out


def _system(out: Path, name: str) -> dict[str, Any]:
    results = json.loads((out / "results.json").read_text())
    assert list(results["systems"]) == ["floor", "chronoq"]
    system: dict[str, Any] = results["systems"][name]
    return system


def _chronoq(out: Path) -> dict[str, Any]:
    return _system(out, "chronoq")


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
    assert "| chronoq/floor |" in md and "## Burst" in md and "| server CPU µs per accepted, batched |" in md
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
    # 300 one-message requests cost the server well over a 10 ms CPU tick; 300 batched may not.
    assert system["accept"]["sync"]["cpu_us_per_msg"] > 0 and system["accept"]["batch"]["cpu_us_per_msg"] >= 0
    assert prec["cpu_us_per_msg"] > 0 and prec["consumer_stats"]["received"] >= prec["delivered"]
    # The consumer's own CPU, from the moment its client was open: 200 streamed messages cost a
    # Python gRPC client far more than one 10 ms CPU tick.
    assert prec["consumer_stats"]["cpu_s"] > 0 and prec["consumer_cpu_us_per_msg"] > 0
    # The busiest server thread per 1 s window: some work, and never more than one core (plus a
    # tick of /proc's rounding).
    res = prec["resources"]
    assert 0 < res["busiest_thread_p90_pct"] <= res["busiest_thread_max_pct"] <= 102


@pytest.mark.slow
def test_smoke_floor_runs_accept_precision_and_burst(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """The floor is served by its stub and driven by chronoq's clients; it skips crash and backlog."""
    _proc, out = smoke
    floor = _system(out, "floor")
    assert floor["installable"] is True
    assert set(floor["crash"]) == {"skipped"} and set(floor["backlog"]) == {"skipped"}
    for mode in ("sync", "batch"):
        acc = floor["accept"][mode]
        assert acc["errors"] == [] and acc["sent"] == 300 and acc["cpu_us_per_msg"] >= 0
    assert floor["accept"]["sync"]["cpu_us_per_msg"] > 0
    prec = floor["precision"]
    assert (prec["accepted"], prec["delivered"], prec["lost"], prec["early"], prec["duplicates"]) == (200, 200, 0, 0, 0)
    assert prec["server_stats"]["calls"]["ReceiveMessage items"] == 200


@pytest.mark.slow
def test_smoke_burst_delivers_every_timer_after_the_common_due_time(
        smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _proc, out = smoke
    for name in ("floor", "chronoq"):
        burst = _system(out, name)["burst"]
        assert burst["valid"] is True and burst["pending_before_due"] == 500, (name, burst)
        assert (burst["accepted"], burst["delivered"], burst["lost"], burst["early"]) == (500, 500, 0, 0), name
        assert 0 <= burst["first_received_after_due_ms"] <= burst["last_received_after_due_ms"]
        assert burst["fired_after_due_ms"] is not None and burst["fired_after_due_ms"] >= 0


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
    # A run shorter than a quarter window (the smoke backlog on a fast hour: CI once got []).
    assert _rate_series([[(0.02, 600)], [(0.04, 400)]]) == [(0.04, 25000.0)]


@pytest.mark.slow
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
    need_module("matplotlib", "peers")  # the report draws its chart
    paths = report.write(results, tmp_path)
    md = paths["markdown"].read_text()
    assert "not installable: nats-server 2.9.10 is too old" in md
    assert "| accepted/s one-at-a-time | 2.00 | - |" in md  # chronoq/redis, chronoq/nats
    assert "| error P99 ms | 0.50 | - |" in md
    assert paths["chart"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths["json"].read_text())["systems"]["nats"]["installable"] is False
    assert "/floor" not in md and "## Burst" not in md and "sweep:" not in md  # nobody ran them


def test_report_ratios_to_the_floor_burst_and_sweep(tmp_path: Path) -> None:
    def system(cpu_batch: float, burst_ms: float, valid: bool, sweep: list[dict[str, Any]]) -> dict[str, Any]:
        return {"installable": True, "version": "1", "design": "d", "durability": "x",
                "accept": {"batch": {"per_s": 1000.0, "cpu_us_per_msg": cpu_batch}},
                "burst": {"valid": valid, "n": 10, "lead_s": 1.0, "sends_ended_before_due_ms": 5.0 if valid else -250.0,
                          "fired_after_due_ms": burst_ms, "last_received_after_due_ms": burst_ms},
                "sweep": {"p99_limit_ms": 20.0, "seconds_per_rate": 1.0, "delays_s": [1.0, 2.0], "runs": sweep,
                          "best_rate": max((r["rate"] for r in sweep if r["ok"]), default=None)}}

    ok = {"ok": True, "why": None, "p99_ms": 5.0, "cpu_us_per_msg": 100.0}
    results = {"started": "t", "machine": "m", "command": "c", "load_at_end": [1.0, 2.0, 3.0], "systems": {
        "floor": system(10.0, 50.0, True, [{"rate": 100.0, **ok}, {"rate": 200.0, **ok}]),
        "chronoq": system(40.0, 100.0, True, [{"rate": 100.0, **ok}, {"rate": 200.0, "ok": False,
                                                                      "why": "P99 30.0 ms > 20 ms", "p99_ms": 30.0}]),
        "redis": system(5.0, 999.0, False, [{"rate": 100.0, "ok": False, "why": "P99 25 ms > 20 ms", "p99_ms": 25.0},
                                            {"rate": 200.0, "ok": None, "why": "not run"}]),
    }}
    md = report.markdown(results)
    assert "| server CPU µs per accepted, batched | 10.0 | 40.0 | 5.00 |" in md
    assert "| chronoq/floor | redis/floor |" in md and "| server CPU µs per accepted, batched | 4.00 | 0.50 |" in md
    assert "| chronoq/redis |" in md and "chronoq/floor | redis/floor | chronoq/" not in md
    # A burst whose sends ended after the due time is shown with its reason, never scored.
    assert "| burst: last received, ms after due | 50.0 | 100 | - |" in md
    assert "not scored: the sends ended 250 ms after the due time" in md
    assert "| sweep: highest rate/s with P99 within the limit | 200 | 100 | - |" in md
    assert "| chronoq | 5.00 (100) | 30.0 (-) x | 100 |" in md and "- chronoq at 200/s: P99 30.0 ms > 20 ms" in md
    assert "| redis | 25.0 (-) x | - | - |" in md
    assert "Load average at the end (1, 5, 15 min): 1.00, 2.00, 3.00" in md


def test_sweep_verdict_needs_the_rate_nothing_lost_or_early_and_the_p99() -> None:
    good = {"produce": {"per_s": 990.0, "errors": []}, "lost": 0, "early": 0, "error_p99_ms": 12.0}
    assert sweep_verdict(good, 1000.0, 20.0) is None
    assert sweep_verdict({**good, "error_p99_ms": 21.0}, 1000.0, 20.0) == "P99 21.0 ms > 20 ms"
    assert sweep_verdict({**good, "produce": {"per_s": 900.0, "errors": []}}, 1000.0, 20.0) == "sent 900/s of 1,000/s"
    assert sweep_verdict({**good, "lost": 3}, 1000.0, 20.0) == "lost 3, early 0"
    assert sweep_verdict({"failed": "ServerFailed: gone\ntrace"}, 1000.0, 20.0) == "ServerFailed: gone"
    assert sweep_verdict({**good, "consumer_error": "Traceback\nServerUnavailable: x"}, 1000.0, 20.0) == (
        "client error: ServerUnavailable: x")
