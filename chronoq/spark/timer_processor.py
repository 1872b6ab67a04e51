"""The Spark timer engine's stateful processor: pending timers by time bucket, fired never early.

Theory of operation. The stream of timer-topic records is grouped by `(shard, bucket)` where
`bucket = due_ms // bucket_ms` and `shard = (due_ms // 1000) % shards`. One state key per bucket
(not per message) matters: every state call is an RPC from the Python worker to the JVM, and the
measured ingest rate was ~1.4k msg/s with a key per message against ~29k msg/s with 60 s buckets.
A cancel (tombstone) carries the id and due time of the timer it cancels, so it lands in the
same key as that timer, and cancels only timers of that topic and id due then (the broker's
rule: one id may name several timers, on several topics); timers due in the same millisecond
share a key, so one task fires them. An entry's `message_id` is its timer key, topic and id
(`timer_key`); the output gives the id alone.

Per key the processor keeps one ListState of *chunks* and its processing-time timers: the
earliest is the key's next wake-up (its earliest live due time, less the lead, `_wake`), and any
later one, registered by a batch that brought later entries, is dropped when the key next runs.
A chunk is one binary value holding many entries `(message_id, due_ms, position, tombstone)`
(`pack_entries`): what one micro-batch brought the key, or what an expiry put back. PySpark
sends list-state values to the JVM one pickled value at a time, and the JVM writes each as its
own RocksDB merge: with an entry per value that per-value cost was most of the job's ingestion
(the Python workers waited on the JVM's state calls); with a chunk per value it is paid once per
key per batch, whatever the number of timers.
- new entries, timers and tombstones alike: `appendList` of one chunk and `registerTimer` at
  their earliest wake-up; neither the list nor the timers are read, which keeps ingestion at two
  state calls per key per batch, a cancel included (a tombstone meets the timers of its own batch
  at once);
- new entries already due (`due_ms <= batch time`) are emitted at once, never stored;
- on expiry the list is read, tombstones applied (a cancelled timer and its tombstone dropped),
  entries with `due_ms <= batch time` emitted in (due, position) order, the rest put back and
  the timer re-armed at their minimum.
So a cancelled timer's entry stays in its key until the key next runs on expiry (at the latest
when the cancelled timer would have been released); a cancel never reads the bucket's list. A
timer that arrives already due after its tombstone (another queue, read later) is emitted: the
broker refuses to arm or fire a cancelled timer, so the job's cancel only saves that work.
A call with nothing to emit yields no frame at all: PySpark turns every frame yielded into an
Arrow batch, an empty one included, and that conversion per key was most of the ingest's work.

Never early: an entry is emitted only when `due_ms - lead_ms <=` the batch timestamp
(`timerValues.getCurrentProcessingTimeInMs()`), which Spark takes before the batch runs. A
tombstone whose timer has not been seen (it may sit in another queue, read in a later batch) is
kept until `tombstone_grace_ms` after its due time, then dropped. The output row says which
commit-log position to fire; the broker's FireTimers is idempotent by position, so re-running
the last uncommitted batch after a restart fires nothing twice.

The lead. With `lead_ms` 0 an output row is a timer to fire now (FireTimers). With `lead_ms` the
broker's hand-off horizon (`timer_handoff_horizon_ms`) a row is a timer to hand over (ArmTimers)
as it enters the horizon, and the broker's loop fires it at its due time: every comparison above
is against `batch time + lead_ms`, and a key's processing-time timer is set `lead_ms` before its
earliest due time. A handed-over timer leaves the job's state, so the state holds the far timers
only (beyond the horizon) and the broker's memory the near ones. ArmTimers is idempotent too.
With a lead a key wakes only on multiples of `step_ms` (a fraction of the lead): it hands over
together every timer that entered the horizon during the step, each between `lead` and
`lead - step` before it is due, and its list is read and rewritten once a step, not once a
micro-batch; that is what lets a key (a bucket) hold many timers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import pandas as pd
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

ENTRY_SCHEMA = "message_id STRING, due_ms LONG, position LONG, tombstone BOOLEAN"
"""A row of the processor's input (and of the `entries` ListState of earlier versions, one entry
a value, still read and emptied on expiry). `message_id` is the timer's key, `timer_key(topic,
id)`: the column keeps its name so that state written before topics were part of the key still
loads (an old entry and a new tombstone then do not match, and the timer is handed to
FireTimers, which skips a cancelled one: the broker judges)."""
CHUNK_SCHEMA = "chunk BINARY"
"""A value of the `chunks` ListState: entries packed by `pack_entries`."""
_ENTRY_HEAD = struct.Struct("<qq?H")
"""A packed entry: due_ms, position, tombstone, the key's UTF-8 length; then the key."""
TIMER_KEY_SEP = "\x00"
"""Between topic and id in a timer key: no topic name can hold it (names are [%|a-zA-Z0-9_-])."""
OUTPUT_SCHEMA = "message_id STRING, position LONG, due_ms LONG, fired_ms LONG, topic STRING"
"""A released timer: `fired_ms` is the batch timestamp that released it (>= due_ms - lead_ms);
`topic` its real topic (null for a key without one), which ArmTimers names with the id."""
ENTRY_COLUMNS = ("message_id", "due_ms", "position", "tombstone")
OUTPUT_COLUMNS = ("message_id", "position", "due_ms", "fired_ms", "topic")
DEFAULT_TOMBSTONE_GRACE_MS = 10 * 60_000


def timer_key(topic: str, message_id: str) -> str:
    return f"{topic}{TIMER_KEY_SEP}{message_id}"


def message_id_of(key: str) -> str:
    """The message id in a timer key (the key itself when it has no topic)."""
    return key.split(TIMER_KEY_SEP, 1)[-1]


def topic_of(key: str) -> str | None:
    """The topic in a timer key (None when it has none)."""
    return key.split(TIMER_KEY_SEP, 1)[0] if TIMER_KEY_SEP in key else None


def _to_output(entries: list[tuple], fired_ms: int) -> pd.DataFrame:
    entries.sort(key=lambda e: (e[1], e[2]))  # due, then commit-log position: same-ms order is send order
    return pd.DataFrame({
        "message_id": [message_id_of(e[0]) for e in entries],
        "position": pd.Series([e[2] for e in entries], dtype="int64"),
        "due_ms": pd.Series([e[1] for e in entries], dtype="int64"),
        "fired_ms": pd.Series([fired_ms] * len(entries), dtype="int64"),
        "topic": pd.Series([topic_of(e[0]) for e in entries], dtype=object),
    })


def pack_entries(entries: Iterable[tuple]) -> bytes:
    """Entries as one chunk: each `_ENTRY_HEAD` then its key (a timer key is a topic name and a
    message id, both bounded far below 64 KiB by the broker's rules)."""
    head = _ENTRY_HEAD.pack
    parts: list[bytes] = []
    for message_id, due_ms, position, tombstone in entries:
        key = message_id.encode()
        parts.append(head(due_ms, position, tombstone, len(key)))
        parts.append(key)
    return b"".join(parts)


def unpack_entries(chunk: bytes) -> list[tuple]:
    """The entries of a chunk, in the order packed."""
    out: list[tuple] = []
    unpack, size, i, n = _ENTRY_HEAD.unpack_from, _ENTRY_HEAD.size, 0, len(chunk)
    while i < n:
        due_ms, position, tombstone, length = unpack(chunk, i)
        i += size
        out.append((chunk[i:i + length].decode(), due_ms, position, tombstone))
        i += length
    return out


def _entries(frame: pd.DataFrame) -> list[tuple]:
    return [(str(m), int(d), int(p), bool(t)) for m, d, p, t in
            zip(frame["message_id"], frame["due_ms"], frame["position"], frame["tombstone"], strict=True)]


def split_due(entries: list[tuple], now_ms: int, grace_ms: int) -> tuple[list[tuple], list[tuple]]:
    """Apply tombstones, then split into (due now, still pending). Pure; the processor's core.

    A tombstone cancels the timers with its message id *and due time* recorded before it in the
    log (a lower position), as the broker's index does: a timer sent again under the id after
    the cancel (the same due time puts it in the same key, often in the same micro-batch) is a
    new timer, and so is one of the id due at another time (an id reused after the dedupe
    window; a bucket holds several milliseconds). Tombstones that matched are dropped; unmatched
    ones are kept (their timer may arrive later) until `due + grace_ms` has passed.
    """
    cancelled_before: dict[tuple[str, int], int] = {}
    for e in entries:
        if e[3]:
            cancelled_before[(e[0], e[1])] = max(cancelled_before.get((e[0], e[1]), -1), e[2])
    matched: set[tuple[str, int]] = set()
    due: list[tuple] = []
    pending: list[tuple] = []
    for entry in entries:
        message_id, due_ms, position, tombstone = entry
        if tombstone:
            continue
        if position < cancelled_before.get((message_id, due_ms), -1):
            matched.add((message_id, due_ms))
        elif due_ms <= now_ms:
            due.append(entry)
        else:
            pending.append(entry)
    for entry in entries:
        if entry[3] and (entry[0], entry[1]) not in matched and entry[1] + grace_ms > now_ms:
            pending.append(entry)
    return due, pending


def next_wakeup_ms(pending: list[tuple], grace_ms: int) -> int | None:
    """When the key must run next: the earliest live due time, or a tombstone's expiry."""
    times = [e[1] + grace_ms if e[3] else e[1] for e in pending]
    return min(times) if times else None


class BucketTimerProcessor(StatefulProcessor):
    """transformWithStateInPandas processor; see the module docstring."""

    def __init__(self, tombstone_grace_ms: int = DEFAULT_TOMBSTONE_GRACE_MS, lead_ms: int = 0,
                 step_ms: int = 0) -> None:
        if not 0 <= step_ms <= max(0, lead_ms // 2):
            raise ValueError(f"release step {step_ms} ms must be from 0 to half the lead ({lead_ms} ms)")
        self.tombstone_grace_ms = tombstone_grace_ms
        self.lead_ms = lead_ms
        """Release each timer this long before its due time (the hand-off horizon; 0: at it)."""
        self.step_ms = step_ms
        """A key wakes only on multiples of this (0: at its earliest release time): see `_wake`."""

    def _wake(self, release_ms: int | None) -> int | None:
        """When a key whose earliest entry is released at `release_ms` runs: that time, rounded up
        to a multiple of `step_ms`. With a lead, a key then runs once a step and hands over all it
        holds that entered the horizon meanwhile, not once a micro-batch rewriting its list each
        time; each timer is still released at or after `due - lead` (never early) and at most a
        step later, so at least `lead - step` before it is due."""
        if release_ms is None or self.step_ms <= 0:
            return release_ms
        return -(-release_ms // self.step_ms) * self.step_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.chunks = handle.getListState("chunks", CHUNK_SCHEMA)
        self.entries = handle.getListState("entries", ENTRY_SCHEMA)
        """Earlier versions' one-entry values: read with the chunks on expiry, then emptied."""

    def _load(self) -> tuple[list[tuple], bool]:
        """Every entry the current key holds, in both layouts, and whether it held the old one."""
        out = [e for (chunk,) in self.chunks.get() for e in unpack_entries(chunk)]
        legacy = self.entries.exists()
        if legacy:
            out += [tuple(e) for e in self.entries.get()]
        return out, legacy

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        now_ms = timerValues.getCurrentProcessingTimeInMs()
        release_ms = now_ms + self.lead_ms
        # Heartbeat rows (position < 0, see engine.with_heartbeat) only make Spark run the batch.
        incoming = [e for e in _entries(pd.concat(list(rows), ignore_index=True)) if e[2] >= 0]
        if not incoming:
            return
        # Tombstones meet the timers of this batch now; those of the key's list when the key next
        # runs on expiry (it reads its list then anyway): a cancel costs an append, not a read and
        # rewrite of a bucket that may hold tens of thousands of timers.
        due, later = split_due(incoming, release_ms, self.tombstone_grace_ms)
        if later:
            self.chunks.appendList([(pack_entries(later),)])
            # Registered without listing the key's timers first (a state call saved per key a batch):
            # a later one it may already hold is dropped when the key next runs (`_store`).
            wake = self._wake(next_wakeup_ms(later, self.tombstone_grace_ms) - self.lead_ms)
            assert wake is not None
            self.handle.registerTimer(wake)
        if due:
            yield _to_output(due, now_ms)

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        now_ms = timerValues.getCurrentProcessingTimeInMs()
        stored, legacy = self._load()
        due, pending = split_due(stored, now_ms + self.lead_ms, self.tombstone_grace_ms)
        self._store(pending, expiredTimerInfo.getExpiryTimeInMs(), clear_legacy=legacy)
        if due:
            yield _to_output(due, now_ms)

    def _store(self, pending: list[tuple], expired_ms: int, *, clear_legacy: bool) -> None:
        if pending:
            self.chunks.put([(pack_entries(pending),)])
        else:
            self.chunks.clear()
        if clear_legacy:
            self.entries.clear()
        wakeup = next_wakeup_ms(pending, self.tombstone_grace_ms)
        if wakeup is not None:
            wakeup = self._wake(wakeup - self.lead_ms)
        current = [t for t in self.handle.listTimers() if t != expired_ms]
        for t in current:
            if t != wakeup:
                self.handle.deleteTimer(t)  # a later one an input batch registered, or one now needless
        if wakeup is not None and wakeup not in current:
            self.handle.registerTimer(wakeup)

    def close(self) -> None:
        pass
