"""A schedule as the broker holds it, and the commit-log records that keep it (pure codec).

Theory of operation: schedules live in the commit log, in the system topic `chronoq.schedules`
(`SCHEDULES_TOPIC`, one queue), so a schedule is durable once its create is acknowledged, and the
broker's live table is rebuilt at open by replaying that queue in log order (`replay`). A record's
body is UTF-8 JSON, its message id the schedule's name; three kinds:

- `put`: the whole schedule, definition and progress (a create, an update, a pause, a resume,
  and retention's roll, which re-appends each live schedule before its records' segment goes);
- `progress`: what has been issued (`after_ms`: every occurrence up to it was issued or passed
  over; `count`: occurrences issued; `pending`: the last one issued, as nominal due time, due
  time after jitter and the definition version it was issued under), one per schedule a step
  issued for;
- `delete`: the schedule is gone (with its last pending occurrence, for the start-up check).

The last `put` of a name sets everything, a later `progress` moves it on, a `delete` ends it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chronoq.recurring.spec import Recurrence

RECORD_VERSION = 1
"""The `v` every record carries; a broker refuses to guess at a record of a later version."""

Pending = tuple[int, int, int]
"""The last occurrence issued: (nominal due time, due time after jitter, definition version)."""


@dataclass(slots=True)
class Schedule:
    name: str
    topic: str
    body: bytes
    recurrence: Recurrence
    catch_up: str = "skip"
    jitter_ms: int = 0
    limit: int | None = None
    tag: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    paused: bool = False
    version: int = 1
    """Raised by every update, pause and resume: an occurrence id names it, so one issued under an older
    definition is told apart (and withdrawn) after a crash in the middle of an update."""
    created_ms: int = 0
    updated_ms: int = 0
    after_ms: int = 0
    """Every occurrence up to this instant was issued or passed over (skipped, or before the
    create); the next is the recurrence's first after it."""
    count: int = 0
    pending: Pending | None = None
    last_error: str | None = None
    """Why the last issue failed (the topic was deleted, the disk is full); cleared by a success."""

    @property
    def finished(self) -> bool:
        """No occurrence is left to issue (its end passed, or its limit reached)."""
        if self.limit is not None and self.count >= self.limit:
            return True
        return self.recurrence.next_after(self.after_ms) is None

    def occurrence_id(self, nominal_ms: int, version: int | None = None) -> str:
        """The message id of one occurrence: the same for the same (schedule, definition,
        occurrence), so a repeat after a crash is recognised (`Schedules` looks it up first)."""
        return f"{self.name}@{nominal_ms}.v{self.version if version is None else version}"


@dataclass(slots=True)
class ScheduleChange:
    """What an update changes (None: kept)."""

    body: bytes | None = None
    every_ms: int | None = None
    cron: str | None = None
    zone: str | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    catch_up: str | None = None
    jitter_ms: int | None = None
    limit: int | None = None
    tag: str | None = None
    properties: Mapping[str, str] | None = None


def _recurrence_json(r: Recurrence) -> dict[str, Any]:
    return {"every_ms": r.every_ms, "cron": r.cron, "zone": r.zone, "start_ms": r.start_ms, "end_ms": r.end_ms,
            "anchor_ms": r.anchor_ms}


def schedule_json(s: Schedule) -> dict[str, Any]:
    return {"name": s.name, "topic": s.topic, "body_b64": base64.b64encode(s.body).decode(),
            "recurrence": _recurrence_json(s.recurrence), "catch_up": s.catch_up, "jitter_ms": s.jitter_ms,
            "limit": s.limit, "tag": s.tag, "properties": dict(s.properties), "paused": s.paused,
            "version": s.version, "created_ms": s.created_ms, "updated_ms": s.updated_ms,
            **progress_json(s)}


def progress_json(s: Schedule) -> dict[str, Any]:
    return {"after_ms": s.after_ms, "count": s.count, "pending": list(s.pending) if s.pending else None}


def schedule_from_json(d: dict[str, Any]) -> Schedule:
    r = d["recurrence"]
    s = Schedule(name=d["name"], topic=d["topic"], body=base64.b64decode(d["body_b64"]),
                 recurrence=Recurrence(every_ms=r["every_ms"], cron=r["cron"], zone=r["zone"],
                                       start_ms=r["start_ms"], end_ms=r["end_ms"], anchor_ms=r["anchor_ms"]),
                 catch_up=d["catch_up"], jitter_ms=d["jitter_ms"], limit=d["limit"], tag=d["tag"],
                 properties=dict(d["properties"]), paused=d["paused"], version=d["version"],
                 created_ms=d["created_ms"], updated_ms=d["updated_ms"])
    apply_progress(s, d)
    return s


def apply_progress(s: Schedule, d: dict[str, Any]) -> None:
    s.after_ms, s.count = d["after_ms"], d["count"]
    p = d["pending"]
    s.pending = (p[0], p[1], p[2]) if p else None


PUT_PREFIX = b'{"op":"put",'
"""How a `put` record's body begins (keys sorted): what retention's roll looks for."""


def put_record(s: Schedule) -> bytes:
    return _encode({"op": "put", "schedule": schedule_json(s), "v": RECORD_VERSION})


def progress_record(s: Schedule) -> bytes:
    return _encode({"v": RECORD_VERSION, "op": "progress", "name": s.name, **progress_json(s)})


def delete_record(s: Schedule) -> bytes:
    return _encode({"v": RECORD_VERSION, "op": "delete", "name": s.name,
                    "pending": list(s.pending) if s.pending else None, "version": s.version})


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


@dataclass(slots=True)
class Replayed:
    """The table a replay rebuilt, and the deleted schedules whose last occurrence may still be
    pending (a crash between the delete's record and its cancel): the start-up check withdraws it."""

    schedules: dict[str, Schedule] = field(default_factory=dict)
    deleted: dict[str, tuple[str, Pending]] = field(default_factory=dict)
    """name -> (topic, pending occurrence)."""
    positions: dict[str, int] = field(default_factory=dict)
    """name -> position of its latest `put` (retention's roll re-appends those it would drop)."""


def replay(records: list[tuple[int, bytes]], into: Replayed | None = None) -> Replayed:
    """Apply (position, body) records in log order."""
    out = into or Replayed()
    for position, body in records:
        doc = json.loads(body)
        if doc.get("v") != RECORD_VERSION:
            raise ValueError(f"schedule record at position {position} has version {doc.get('v')!r}; "
                             f"this broker reads version {RECORD_VERSION}")
        op = doc["op"]
        if op == "put":
            s = schedule_from_json(doc["schedule"])
            out.schedules[s.name] = s
            out.deleted.pop(s.name, None)
            out.positions[s.name] = position
        elif op == "progress":
            s = out.schedules.get(doc["name"])
            if s is not None:
                apply_progress(s, doc)
        elif op == "delete":
            gone = out.schedules.pop(doc["name"], None)
            out.positions.pop(doc["name"], None)
            p = doc.get("pending")
            if gone is not None and p:
                out.deleted[gone.name] = (gone.topic, (p[0], p[1], p[2]))
        else:
            raise ValueError(f"schedule record at position {position} has an unknown kind {op!r}")
    return out
