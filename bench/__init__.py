"""Side-by-side benchmark: chronoq against the delay queues people use today, in one run.

Theory of operation: `bench.harness` owns the workload, the server processes, the producer and
consumer worker processes, the phases (accept, precision, crash, backlog) and the report;
`bench.peers` holds one module per system, each knowing only how to check, start, feed and drain
its own server. The harness never imports chronoq's internals: chronoq is measured the way a user
runs it (`chronoq serve` plus the SDK), exactly like the peers, so the comparison is fair.
Run it with `python -m bench` (see `python -m bench --help`). Every benchmark here writes where
its `--out` says; without one, under `results_dir()`: `$BENCH_RESULTS_DIR` if set, else
`bench/results/`, which git ignores, so a run never adds files to the work tree's history.
"""

from __future__ import annotations

import os
from pathlib import Path

RESULTS_ENV = "BENCH_RESULTS_DIR"


def results_dir() -> Path:
    """Where a benchmark writes when not given `--out`: `$BENCH_RESULTS_DIR`, else `bench/results/`."""
    chosen = os.environ.get(RESULTS_ENV)
    return Path(chosen) if chosen else Path(__file__).resolve().parent / "results"
