"""Waiting on a running Spark timer-engine query, shared by the engine tests.

Not processAllAvailable(): a processing-time transformWithState keeps Spark running no-data
batches, and processAllAvailable() was seen never to return on this query; progress is read
from `query.recentProgress` instead.
"""

from __future__ import annotations

import time
from typing import Any

WAIT_S = 240.0  # generous: on a loaded 2-core machine a first micro-batch has taken over a minute


def ingested(query: Any) -> int:
    """Records read from the timer source (not the engine's rate-source heartbeat)."""
    return sum(src["numInputRows"] for p in query.recentProgress for src in p["sources"]
               if not src["description"].startswith("RateStream"))


def wait_ingested(query: Any, rows: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while ingested(query) < rows:
        assert time.monotonic() < deadline, "timed out waiting for the engine to ingest"
        query.awaitTermination(0.2)
