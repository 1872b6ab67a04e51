"""`chronoq-pulsar` in `python -m bench` (bench/bench_pulsar.py), so the Pulsar door's benchmark rows cannot rot.

A real `chronoq serve --pulsar-port`, the official Pulsar client in the harness's producer and
consumer worker processes, tiny counts: the accept and precision phases run, every accepted
message is delivered, none early, and the report names the system.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.children import ROOT
from tests.support.extras import need_module

pytestmark = [pytest.mark.slow, pytest.mark.interop]


@pytest.mark.timeout(300)
def test_the_pulsar_door_runs_the_accept_and_precision_phases(tmp_path: Path) -> None:
    need_module("pulsar", "test")
    need_module("matplotlib", "peers")  # the harness draws its chart
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench", "--systems", "chronoq-pulsar", "--phases", "accept,precision",
                           "--accept-n", "300", "--accept-seconds", "10", "--n", "200", "--rate", "200",
                           "--delay-min-s", "1", "--delay-max-s", "2", "--grace-s", "5", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    system = json.loads((out / "results.json").read_text())["systems"]["chronoq-pulsar"]
    assert system["installable"] is True and "pulsar-client 3.13.0" in system["version"]
    for mode in ("sync", "batch"):
        acc = system["accept"][mode]
        assert acc["errors"] == [] and acc["sent"] == 300 and acc["per_s"] > 0
    prec = system["precision"]
    assert prec["accepted"] == 200 and prec["delivered"] == 200
    assert prec["lost"] == 0 and prec["early"] == 0 and prec["duplicates"] == 0
    assert prec["cpu_us_per_msg"] > 0
    assert "chronoq-pulsar" in (out / "results.md").read_text()
