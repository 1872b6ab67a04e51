"""The workload's messages and the figures computed from what the consumer saw.

Theory of operation: every message body is a small JSON object holding its unique id and its due
time in ms since the epoch, so the consumer can score a delivery from the body alone, whatever the
system did to headers. Delays come from a seeded generator so every system gets the same delays in
the same order. Figures are computed once, here, for every system alike: delivery error is the
consumer's receive time minus the due time (negative means early), percentiles are nearest-rank.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9))
BODY_PAD = "x" * 8
"""Pads the body to about 48 B, the size of the peers-measured runs."""


def encode_body(msg_id: str, due_ms: int) -> bytes:
    return json.dumps({"id": msg_id, "due_ms": due_ms, "pad": BODY_PAD}, separators=(",", ":")).encode()


def decode_body(body: bytes) -> tuple[str, int]:
    doc = json.loads(body)
    return str(doc["id"]), int(doc["due_ms"])


def delay_spec(n: int, low_ms: int, high_ms: int, seed: int) -> dict[str, int]:
    """The delays of a phase as a small picklable value; each producer draws its share lazily
    (a 10 M message backlog must not be a 10 M element list in every process)."""
    return {"n": n, "low_ms": low_ms, "high_ms": high_ms, "seed": seed}


def producer_share(spec: dict[str, int], producer: int, producers: int) -> int:
    return len(range(producer, spec["n"], producers))


def iter_delays_ms(spec: dict[str, int], producer: int, producers: int) -> Iterator[int]:
    """Delays of messages producer, producer + producers, ...: the same sequence for every system."""
    rng = random.Random(spec["seed"])
    low, span = spec["low_ms"], spec["high_ms"] - spec["low_ms"] + 1
    for i in range(spec["n"]):
        d = low + int(rng.random() * span)
        if i % producers == producer:
            yield d


def message_id(tag: str, producer: int, index: int) -> str:
    return f"{tag}-{producer}-{index}"


def percentile(sorted_values: Sequence[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    # round() first: 99.9 / 100 * 1000 is 999.0000000000001 in floating point, not 999.
    rank = max(1, math.ceil(round(pct / 100.0 * len(sorted_values), 9)))
    return sorted_values[rank - 1]


def delivery_figures(accepted_ids: Iterable[str], received: Sequence[tuple[str, float, float]]) -> dict[str, Any]:
    """Score deliveries. `received` holds (id, due_ms, receive_ms) for every delivery, repeats included."""
    accepted = set(accepted_ids)
    first_seen: dict[str, float] = {}
    duplicates = 0
    early = 0
    unexpected = 0
    for msg_id, due_ms, recv_ms in received:
        if recv_ms < due_ms:
            early += 1
        if msg_id not in accepted:
            unexpected += 1
        if msg_id in first_seen:
            duplicates += 1
        else:
            first_seen[msg_id] = recv_ms - due_ms
    errors = sorted(first_seen.values())
    figures: dict[str, Any] = {
        "accepted": len(accepted),
        "delivered": len(first_seen),
        "lost": len(accepted - first_seen.keys()),
        "duplicates": duplicates,
        "early": early,
        "unexpected": unexpected,
    }
    for name, pct in PERCENTILES:
        figures[f"error_{name}_ms"] = _round(percentile(errors, pct))
    figures["error_max_ms"] = _round(errors[-1]) if errors else None
    figures["error_min_ms"] = _round(errors[0]) if errors else None
    return figures


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)
