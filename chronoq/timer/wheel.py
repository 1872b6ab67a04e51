"""The file wheel: RocketMQ 5's timer store (RIP-43, TimerLog + TimerWheel) as a `TimerEngine`.

Theory of operation. The files are RocketMQ's (`timer/wheel_files.py` has them byte by byte):
an append-only **TimerLog** of 52-byte units, each linked back to the previous unit of its slot,
and a memory-mapped **TimerWheel** of `slots` slots of `slot_ms` each, a slot holding the first
and last unit of its chain and their count. Indexing a timer appends one unit to the chain of the
slot of its due time; in RocketMQ finding due timers walks the chains of the slots whose time has
come, from the read pointer (`read_slot_ms` here, RocketMQ's currReadTimeMs). The wheel covers
`slots * slot_ms` (its window) ahead of the read pointer; a timer further away is chained into
the window's last slot with the ROLL magic and linked again, nearer, when that slot comes up.

Where chronoq departs from RIP-43, and why (each a flaw the articles or RocketMQ's tracker name):
- **Precision inside a slot.** RocketMQ fires a whole slot at its time (precision = slot width,
  1 s by default). Here each unit carries its exact due time (slot time + delay), each slot's
  timers are also listed in memory as their units are chained, ordered by (due time, log
  position) when the slot is read, and `due(now)` hands out exactly those due by `now`. Slots stay
  1 s wide (the file stays 19 MB for 7 days) and firing is to the millisecond; and a crowded slot
  is ready when it comes up (walking its chain then took 2.8 s for 500,000 units).
- **The same-second burst.** RocketMQ reads a slot, then puts every message back into the commit
  log through a chain of bounded queues and services (500k due in one second: ~20k on time, the
  rest up to ~31 s late). Here firing is the broker's link record: one small record per fire step
  for up to thousands of timers, no message read or copied.
- **Rolls do not copy the message.** RocketMQ's ROLL re-puts the whole message into the commit
  log every roll window (write amplification, and retention can delete the original meanwhile).
  Here a roll is one new 52-byte unit in the TimerLog, and at most `_RELINK_CHUNK` are linked
  again per `due()` (a window's worth of far timers moves on over many steps, not one); the
  commit-log record is untouched (the broker's own roll before retention is `timer/service.py`'s).
- **Deletes find their timer.** RocketMQ's delete (TIMER_DEL_UNIQKEY) is a unit in the due slot
  matched by key when the slot is read, and it was not implemented for years; a delete whose
  timer is in another slot, or rolled, is lost. Here a cancel is resolved when it is indexed,
  by the engine's id map, to the exact timers it reaches (the contract of `timer/engine.py`),
  and a DELETE unit naming each is chained into its slot.
- **Fires are recorded.** RocketMQ's read pointer is the only record of what fired, so a crash
  inside a slot re-fires or skips it. chronoq's fires are the broker's link records, which can
  finish a slot in any order: each fired timer gets a DONE unit, and the read pointer passes a
  slot only when nothing in it is pending.
- **Facts kept beside the units.** RocketMQ reads each message back from the commit log to fire
  it (random reads of cold files, which RIP-75 names). The facts a fire needs (topic, id, keys,
  route: ~60 bytes) go once into this engine's own append-only facts journal; a unit's reserved
  field points at them.
- **Recovery.** RocketMQ replays the TimerLog from a checkpoint and trusts the wheel file. Here
  the checkpoint (`timercheck`) names the ends of the TimerLog and facts journal it covers and the
  commit-log position they were derived up to; at open both files are cut back to those ends,
  read whole (that is the restart cost of this design: O(units kept), ~31 µs a timer), and the
  wheel is written again from the units, so a wheel file torn by a crash cannot point past the
  log (it is never fsynced for that reason). Anything
  after the checkpoint is replayed by the broker from the commit log.

What the engine keeps in memory: one row per timer it knows (pending, or finished and not yet
pruned), the id and key maps for lookups, per-second and per-hour counters of pending due times,
the placement count and timer list of each slot, and a heap of due times. That makes lookups,
cancels and metrics as exact as the RocksDB index's, at ~1.1 KB of memory a pending timer
(measured: docs/performance.md); the RocksDB index holds the same in its own files and a
bounded cache.

A batch is applied atomically: its units and facts are computed first, written with one write
to each file (a failed write is cut back), and only then does memory change. A checkpoint is
taken when the files have grown by `checkpoint_bytes` since the last one, and at close.
"""

from __future__ import annotations

import heapq
import logging
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sortedcontainers import SortedDict, SortedList

from chronoq.errors import IndexPositionWentBack, TimerIndexClosed, TimerIndexCorrupt
from chronoq.model import TimerState, TimerStatus
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.store.fsync import make_dirs
from chronoq.timer import wheel_files as wf
from chronoq.timer.engine import DueTimers, IndexBatch, TimerEntry
from chronoq.timer.index_validate import check_batch
from chronoq.timer.metrics import TimerLatencies, TimerMetricsSnapshot, pending_by_due

log = logging.getLogger("chronoq.timer.wheel")
_MAX_ROLL_HOPS = 1024
_RELINK_CHUNK = 8192
"""Most ROLL placements one `due()` links again."""
_HOUR_S = 3600
DEFAULT_SLOT_MS = 1000
DEFAULT_SLOTS = 7 * 24 * 3600
"""RocketMQ's wheel: 7 days of 1-second slots (19 MB)."""
DEFAULT_CHECKPOINT_BYTES = 16 << 20
_STATE_CODE = {TimerState.DELIVERED: 2, TimerState.CANCELLED: 3, TimerState.DAMAGED: 4}
"""A finished timer's state in a kind-7 facts record (the RocksDB index's codes)."""
_CODE_STATE = {code: state for state, code in _STATE_CODE.items()}


@dataclass(slots=True)
class _Row:
    entry: TimerEntry
    state: TimerState | None = TimerState.PENDING
    """None: rolled away to `entry.position` (a redirect)."""
    done_ms: int | None = None
    slot_ms: int = -1
    """Pending: the slot whose chain holds its placement unit."""
    facts_at: int = -1
    """Where its facts record starts in the journal."""


class WheelTimerEngine:
    """RIP-43's TimerLog + TimerWheel behind the `TimerEngine` protocol (module docstring)."""

    def __init__(self, path: Path, *, slot_ms: int = DEFAULT_SLOT_MS, slots: int = DEFAULT_SLOTS,
                 checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES, rewrite_ratio: float = 3.0,
                 disk: DiskSpace | None = None) -> None:
        self.path = Path(path)
        self.rewrite_ratio = rewrite_ratio
        """Rewrite the files when they are this many times what a rewrite would keep (0: at
        every checkpoint, which the tests use)."""
        self.slot_ms = slot_ms
        self.slots = slots
        self.window_ms = slot_ms * slots
        self.checkpoint_bytes = checkpoint_bytes
        self._disk = disk
        self._closed = False
        self._latencies = TimerLatencies()
        self._handed: set[int] = set()
        self.rows: dict[int, _Row] = {}
        self.by_id: dict[str, list[int]] = {}
        self.by_key: dict[str, list[int]] = {}
        self.pending_positions: SortedList = SortedList()
        self.pending_by_topic: Counter[str] = Counter()
        self.per_second: Counter[int] = Counter()
        self.per_hour: Counter[int] = Counter()
        self.placed: SortedDict = SortedDict()
        """Slot time -> pending timers placed in it."""
        self._deadlines: list[tuple[int, int]] = []
        """(due, position) heap of pending timers; entries no longer pending are skipped lazily."""
        self._slot_lists: dict[int, list[tuple[int, int]]] = {}
        """Slot time -> its placed timers' (due, position) (`_slot_list`)."""
        self._unsorted: set[int] = set()
        """Slots whose list had an entry added out of order since it was last read."""
        self.history: list[tuple[int, int]] = []
        self.levels: dict[int, int] = {}
        self.link_floors: dict[int, int] = {}
        self.link_copies: dict[int, int] = {}
        """Link record position -> where its facts-journal record starts."""
        self._live_links_from: int | None = None
        self.read_slot_ms = -1
        self.generation = 0
        self._indexed_position = 0
        self._checkpointed_bytes = 0
        self._scratch: Path | None = None
        """A copy opened by `open_copy`: removed at close."""
        self.timerlog: wf.AppendFile
        self.facts: wf.AppendFile
        self.wheel: wf.WheelFile

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, slot_ms: int = DEFAULT_SLOT_MS, slots: int = DEFAULT_SLOTS,
             checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES, rewrite_ratio: float = 3.0,
             disk: DiskSpace | None = None) -> WheelTimerEngine:
        """Open (or create) the wheel at `path`. `TimerIndexCorrupt` when its files cannot be used
        (the broker then destroys it and rebuilds it from the commit log)."""
        engine = cls(Path(path), slot_ms=slot_ms, slots=slots, checkpoint_bytes=checkpoint_bytes,
                     rewrite_ratio=rewrite_ratio, disk=disk)
        make_dirs(engine.path)
        check_path = engine.path / "timercheck"
        if check_path.exists():
            try:
                check = wf.Checkpoint.decode(check_path.read_bytes())
            except ValueError as e:
                raise TimerIndexCorrupt(engine.path, str(e)) from e
            if (check.slot_ms, check.slots) != (slot_ms, slots):
                raise TimerIndexCorrupt(engine.path, f"its wheel has {check.slots} slots of {check.slot_ms} ms; "
                                                     f"the settings ask for {slots} of {slot_ms} ms")
        elif any(p.name.startswith(("timerlog", "timerfacts")) for p in engine.path.iterdir()):
            raise TimerIndexCorrupt(engine.path, "its files are there but its checkpoint is missing")
        else:
            check = wf.Checkpoint(0, 0, 0, 0, -1, slot_ms, slots)
            wf.write_checkpoint(engine.path, check)
        for name, end in (("timerlog", check.timerlog_end), ("timerfacts", check.facts_end)):
            p = engine.path / f"{name}.{check.generation}"
            size = p.stat().st_size if p.exists() else 0
            if size < end:
                raise TimerIndexCorrupt(engine.path, f"{p.name} holds {size} bytes, its checkpoint covers {end}")
        engine.generation = check.generation
        for stray in engine.path.iterdir():  # a rewrite a crash interrupted, or one it finished
            suffix = stray.name.rpartition(".")[2]
            if stray.name.startswith(("timerlog.", "timerfacts.", "timerwheel.")) and suffix != str(check.generation):
                stray.unlink()
        engine._indexed_position = check.indexed_position
        engine.read_slot_ms = check.read_slot_ms
        engine.timerlog = wf.AppendFile(engine._file("timerlog"), check.timerlog_end)
        engine.facts = wf.AppendFile(engine._file("timerfacts"), check.facts_end)
        try:
            engine.wheel = wf.WheelFile(engine._file("timerwheel"), slots)
        except OSError as exc:
            engine.timerlog.close()
            engine.facts.close()
            raise engine._io_error(exc, "allocating the timer wheel's slot table") from exc
        try:
            engine._load()
        except (wf.FactsDamaged, ValueError, KeyError, UnicodeDecodeError) as e:
            engine.close()
            raise TimerIndexCorrupt(engine.path, f"its files do not read back: {e}") from e
        except BaseException:
            engine.close()
            raise
        engine._checkpointed_bytes = engine.timerlog.end + engine.facts.end
        return engine

    @staticmethod
    def open_copy(path: str | Path) -> tuple[WheelTimerEngine | None, str | None]:
        """The wheel at `path` opened from a copy of what its checkpoint covers (in a temporary
        directory removed at its `close`), so that nothing at `path` is written: what `chronoq
        check` reads, a running broker's wheel included. (None, why) when it cannot be used (the
        broker would rebuild it from the log)."""
        path = Path(path)
        try:
            check = wf.Checkpoint.decode((path / "timercheck").read_bytes())
        except (OSError, ValueError) as e:
            return None, f"its checkpoint cannot be read ({e})"
        scratch = Path(tempfile.mkdtemp(prefix="chronoq-check-wheel-"))
        try:
            for name, end in (("timerlog", check.timerlog_end), ("timerfacts", check.facts_end)):
                source = path / f"{name}.{check.generation}"
                size = source.stat().st_size if source.exists() else 0
                if size < end:
                    return None, f"{source.name} holds {size} bytes, its checkpoint covers {end}"
                with open(source, "rb") as src, open(scratch / source.name, "wb") as dst:
                    dst.write(src.read(end))
            (scratch / "timercheck").write_bytes(check.encode())
            try:
                engine = WheelTimerEngine.open(scratch, slot_ms=check.slot_ms, slots=check.slots)
            except TimerIndexCorrupt as e:
                return None, str(e.details.get("reason", e.message))
            engine._scratch = scratch
            scratch = None  # type: ignore[assignment]
            return engine, None
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    @staticmethod
    def verify(path: str | Path, *, slot_ms: int, slots: int) -> str | None:
        """Why the wheel at `path` cannot be used as it is by a broker whose settings ask for
        `slots` slots of `slot_ms` (None: it can), read without writing anything."""
        try:
            check = wf.Checkpoint.decode((Path(path) / "timercheck").read_bytes())
        except (OSError, ValueError) as e:
            return f"its checkpoint cannot be read ({e})"
        if (check.slot_ms, check.slots) != (slot_ms, slots):
            return (f"its wheel has {check.slots} slots of {check.slot_ms} ms; the settings ask for {slots} of "
                    f"{slot_ms} ms")
        engine, reason = WheelTimerEngine.open_copy(path)
        if engine is not None:
            engine.close()
        return reason

    @staticmethod
    def destroy(path: str | Path) -> None:
        path = Path(path)
        if path.exists():
            shutil.rmtree(path)

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.{self.generation}"

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.checkpoint()
        finally:
            self._closed = True
            self.timerlog.close()
            self.facts.close()
            self.wheel.close()
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise TimerIndexClosed(self.path)

    def checkpoint(self) -> None:
        """Make the files durable up to their ends and record those ends (`timercheck`)."""
        self._check_open()
        # The wheel file is not made durable: every open writes it again from the TimerLog.
        self.timerlog.sync()
        self.facts.sync()
        wf.write_checkpoint(self.path, wf.Checkpoint(
            self.generation, self._indexed_position, self.timerlog.end, self.facts.end, self.read_slot_ms,
            self.slot_ms, self.slots))
        self._checkpointed_bytes = self.timerlog.end + self.facts.end

    def _worth_rewriting(self) -> bool:
        """The files hold mostly what no longer matters: units and facts of timers finished and
        pruned. A rewrite keeps ~2 units' worth per known timer; it is worth it past 3 times that
        (and past the checkpoint interval, so a small wheel is never rewritten)."""
        kept = len(self.rows) * (2 * wf.UNIT_SIZE + 100) + len(self.link_copies) * 1024
        return self.timerlog.end + self.facts.end > max(self.rewrite_ratio * kept, self.checkpoint_bytes)

    def rewrite(self) -> None:
        """Write what the engine knows into a new generation of files, then switch to it: the
        TimerLog and facts journal otherwise grow with every timer ever indexed. Pending timers
        get a facts record and a placement unit in the slot they are in; finished ones (until
        pruned) a facts record with their state; roll redirects a record each; link copies,
        link floors and delay-level progress are carried over. The new files are made durable,
        then the checkpoint naming them replaces the old one (atomic), then the old files go; a
        crash before the checkpoint leaves the old generation in force (the new files are
        removed at the next open). Takes time in O(timers known), during one `apply`."""
        self._check_open()
        gen = self.generation + 1
        log = wf.AppendFile(self.path / f"timerlog.{gen}", 0)
        facts = wf.AppendFile(self.path / f"timerfacts.{gen}", 0)
        wheel = wf.WheelFile(self.path / f"timerwheel.{gen}", self.slots)
        try:
            wheel.clear()
            facts_parts: list[bytes] = []
            units: list[bytes] = []
            chains: dict[int, tuple[int, int, int, int]] = {}
            facts_at = 0
            moved: list[tuple[int, _Row]] = []
            for position in sorted(self.rows):
                row = self.rows[position]
                e = row.entry
                if row.state is None:
                    record = wf.redirect_record(position, e.position, e.deliver_at_ms)
                else:
                    record = wf.timer_record(e.position, e.size, e.deliver_at_ms, e.accepted_ms, e.tag_hash,
                                             e.queue_id, e.group_hash, None, e.topic, e.message_id, e.keys)
                    if row.state is not TimerState.PENDING:
                        record = wf.finished_record(_STATE_CODE[row.state], row.done_ms or 0, record)
                    else:
                        at = len(units) * wf.UNIT_SIZE
                        index = (row.slot_ms // self.slot_ms) % self.slots
                        t, first, last, count = chains.get(index, (-1, -1, -1, 0))
                        if t != row.slot_ms:
                            first, last, count = -1, -1, 0
                        magic = wf.MAGIC_ROLL if e.deliver_at_ms >= row.slot_ms + self.slot_ms else wf.MAGIC_DEFAULT
                        units.append(wf.pack_unit(last, magic, row.slot_ms, e.deliver_at_ms - row.slot_ms,
                                                  e.position, e.size, wf.topic_hash(e.topic), facts_at))
                        chains[index] = (row.slot_ms, first if first >= 0 else at, at, count + 1)
                    moved.append((position, _Row(e, row.state, row.done_ms, row.slot_ms, facts_at)))
                facts_parts.append(record)
                facts_at += len(record)
            for level, offset in sorted(self.levels.items()):
                facts_parts.append(wf.level_record(level, offset))
            for base, floor in sorted(self.link_floors.items()):
                facts_parts.append(wf.floor_record(base, floor))
            copies: dict[int, int] = {}
            for position in sorted(self.link_copies):
                copy = self.link_copy(position)
                if copy is not None:
                    copies[position] = facts_at
                    record = wf.link_copy_record(position, copy[1], copy[0])
                    facts_parts.append(record)
                    facts_at += len(record)
            if self._live_links_from is not None:
                facts_parts.append(wf.forget_links_record(0, self._live_links_from))
            facts.append(b"".join(facts_parts))
            log.append(b"".join(units))
            for index, (slot_ms, first, last, count) in chains.items():
                wheel.put(index, slot_ms, first, last, count)
            log.sync()
            facts.sync()
            wf.write_checkpoint(self.path, wf.Checkpoint(gen, self._indexed_position, log.end, facts.end,
                                                         self.read_slot_ms, self.slot_ms, self.slots))
        except BaseException:
            log.close()
            facts.close()
            wheel.close()
            for name in ("timerlog", "timerfacts", "timerwheel"):
                (self.path / f"{name}.{gen}").unlink(missing_ok=True)
            raise
        old = (self.timerlog, self.facts, self.wheel, self.generation)
        self.timerlog, self.facts, self.wheel, self.generation = log, facts, wheel, gen
        for f in old[:3]:
            f.close()
        for name in ("timerlog", "timerfacts", "timerwheel"):
            (self.path / f"{name}.{old[3]}").unlink(missing_ok=True)
        for position, row in moved:
            self.rows[position] = row
        self.link_copies = copies
        self._checkpointed_bytes = log.end + facts.end

    @property
    def indexed_position(self) -> int:
        return self._indexed_position

    @property
    def pending_total(self) -> int:
        return len(self.pending_positions)

    @property
    def latencies(self) -> TimerLatencies:
        return self._latencies

    # -- load (open) -------------------------------------------------------------------------

    def _load(self) -> None:
        """Rebuild memory from the facts journal and the TimerLog; write the wheel again."""
        facts: dict[int, wf.TimerFacts] = {}
        prune_before = -1
        for at, kind, payload in wf.iter_records(self.facts.view(), 0, self.facts.end):
            if kind == wf.F_TIMER:
                facts[at] = wf.decode_timer(payload)
            elif kind == wf.F_LEVEL:
                level, offset = wf.decode_level(payload)
                self.levels[level] = max(offset, self.levels.get(level, -1))
            elif kind == wf.F_FLOOR:
                base, floor = wf.decode_floor(payload)
                self.link_floors[base] = min(floor, self.link_floors.get(base, floor))
            elif kind == wf.F_LINK_COPY:
                self.link_copies[wf.decode_link_copy(payload)[0]] = at
            elif kind == wf.F_FORGET_LINKS:
                below, live_from = wf.decode_forget(payload)
                self._forget_links(below, live_from)
            elif kind == wf.F_PRUNE:
                prune_before = max(prune_before, wf.decode_prune(payload))
            elif kind == wf.F_FINISHED:
                state, done_ms, f = wf.decode_finished(payload)
                self._set(f.position, _Row(_entry_of(f), _CODE_STATE[state], done_ms, -1, at))
                self.history.append((done_ms, f.position))
            elif kind == wf.F_REDIRECT:
                old, new, due_ms = wf.decode_redirect(payload)
                self._set(old, _Row(TimerEntry(due_ms, new, 0, "", "", 0), None))
                self.history.append((due_ms, old))
            else:
                raise ValueError(f"facts record at {at} of unknown kind {kind}")
        self.wheel.clear()
        slots: dict[int, tuple[int, int, int, int]] = {}
        view = self.timerlog.view()
        if self.timerlog.end % wf.UNIT_SIZE:
            raise ValueError(f"the TimerLog's end {self.timerlog.end} is not a whole number of "
                             f"{wf.UNIT_SIZE}-byte units")
        for at in range(0, self.timerlog.end, wf.UNIT_SIZE):
            size, prev, magic, slot_ms, delay, position, rsize, topic_h, reserved = wf.UNIT.unpack_from(view, at)
            # RIP-43's units carry no checksum; each is checked against what it must agree with
            # (its chain, its facts record, its timer), so a damaged one makes the wheel unusable
            # (rebuilt from the commit log) instead of quietly wrong.
            if size != wf.UNIT_SIZE or not (prev == -1 or (0 <= prev < at and prev % wf.UNIT_SIZE == 0)):
                raise ValueError(f"TimerLog unit at {at} gives size {size} and previous unit {prev}")
            if slot_ms % self.slot_ms or slot_ms < 0:
                raise ValueError(f"TimerLog unit at {at} names slot time {slot_ms}, not a slot of {self.slot_ms} ms")
            if magic & (wf.MAGIC_DEFAULT | wf.MAGIC_ROLL):
                f = facts.get(reserved)
                if (f is None or f.position != position or f.size != rsize or wf.topic_hash(f.topic) != topic_h
                        or delay != wf.clamp_i32(f.deliver_at_ms - slot_ms)):
                    raise ValueError(f"TimerLog unit at {at} (position {position}, facts at {reserved}) disagrees "
                                     "with its facts record")
            elif magic & wf.FINISHING and (position not in self.rows or reserved < 0):
                raise ValueError(f"TimerLog unit at {at} finishes a timer at {position} it never placed")
            index = (slot_ms // self.slot_ms) % self.slots
            t, first, _last, count = slots.get(index, (-1, -1, -1, 0))
            slots[index] = (slot_ms, first, at, count + 1) if t == slot_ms else (slot_ms, at, at, 1)
            if magic & (wf.MAGIC_DEFAULT | wf.MAGIC_ROLL):
                self._load_placement(facts[reserved], reserved, slot_ms)
            elif magic & wf.FINISHING:
                row = self.rows.get(position)
                if row is not None and row.state is TimerState.PENDING:
                    state = (TimerState.DELIVERED if magic & wf.MAGIC_DONE else
                             TimerState.CANCELLED if magic & wf.MAGIC_DELETE else TimerState.DAMAGED)
                    self._set(position, _Row(row.entry, state, reserved, -1, row.facts_at))
                    self.history.append((reserved, position))
            else:
                raise ValueError(f"TimerLog unit at {at} has magic {magic}")
        for index, (slot_ms, first, last, count) in slots.items():
            self.wheel.put(index, slot_ms, first, last, count)
        del view
        if prune_before >= 0:
            self._prune(prune_before)

    def _load_placement(self, facts: wf.TimerFacts, facts_at: int, slot_ms: int) -> None:
        position = facts.position
        row = self.rows.get(position)
        if row is not None:  # linked again (a roll inside the wheel): only its slot changes
            if row.state is TimerState.PENDING:
                self._set(position, _Row(row.entry, row.state, None, slot_ms, row.facts_at))
            return
        entry = _entry_of(facts)
        if facts.rolled_from is not None:
            old = self.rows.get(facts.rolled_from)
            if old is None or old.state is TimerState.PENDING:
                self._set(facts.rolled_from, _Row(entry, None))
                self.history.append((entry.deliver_at_ms, facts.rolled_from))
        self._set(position, _Row(entry, TimerState.PENDING, None, slot_ms, facts_at))

    # -- the in-memory indexes ---------------------------------------------------------------

    def _set(self, position: int, new: _Row) -> None:
        """Replace the row at `position`, keeping every index true."""
        old = self.rows.get(position)
        if old is not None:
            if old.state is TimerState.PENDING:
                self._unpend(position, old)
            if old.state is not None and (new.state is None or new.entry.message_id != old.entry.message_id):
                self._unmap(position, old.entry)
        if new.state is TimerState.PENDING:
            e = new.entry
            self.pending_positions.add(position)
            self.pending_by_topic[e.topic] += 1
            second = e.deliver_at_ms // 1000
            self.per_second[second] += 1
            self.per_hour[second // _HOUR_S] += 1
            self.placed[new.slot_ms] = self.placed.get(new.slot_ms, 0) + 1
            heapq.heappush(self._deadlines, (e.deliver_at_ms, position))
            self._list_in(new.slot_ms, (e.deliver_at_ms, position))
        if new.state is not None and (old is None or old.state is None or old.entry.message_id != new.entry.message_id):
            self.by_id.setdefault(new.entry.message_id, []).append(position)
            for key in new.entry.keys:
                self.by_key.setdefault(key, []).append(position)
        self.rows[position] = new

    def _unpend(self, position: int, row: _Row) -> None:
        e = row.entry
        self.pending_positions.remove(position)
        _dec(self.pending_by_topic, e.topic)
        second = e.deliver_at_ms // 1000
        _dec(self.per_second, second)
        _dec(self.per_hour, second // _HOUR_S)
        self._unplace(row.slot_ms)

    def _unplace(self, slot_ms: int) -> None:
        """One pending timer fewer placed in `slot_ms` (its list goes with the last one)."""
        left = self.placed[slot_ms] - 1
        if left:
            self.placed[slot_ms] = left
        else:
            del self.placed[slot_ms]
            self._slot_lists.pop(slot_ms, None)
            self._unsorted.discard(slot_ms)

    def _list_in(self, slot_ms: int, item: tuple[int, int]) -> None:
        """Add a timer placed in `slot_ms` to that slot's list (sorted when next read)."""
        lst = self._slot_lists.get(slot_ms)
        if lst is None:
            self._slot_lists[slot_ms] = [item]
            return
        if lst and item < lst[-1]:
            self._unsorted.add(slot_ms)
        lst.append(item)

    def _move(self, position: int, row: _Row, slot_ms: int) -> None:
        """A pending timer linked again into `slot_ms` (a roll): only its slot changes."""
        self._unplace(row.slot_ms)
        self.placed[slot_ms] = self.placed.get(slot_ms, 0) + 1
        self.rows[position] = _Row(row.entry, row.state, None, slot_ms, row.facts_at)
        self._list_in(slot_ms, (row.entry.deliver_at_ms, position))

    def _unmap(self, position: int, entry: TimerEntry) -> None:
        for table, names in ((self.by_id, (entry.message_id,)), (self.by_key, entry.keys)):
            for name in names:
                positions = table.get(name)
                if positions is not None and position in positions:
                    positions.remove(position)
                    if not positions:
                        del table[name]

    def _drop(self, position: int) -> None:
        row = self.rows.pop(position)
        if row.state is TimerState.PENDING:
            self._unpend(position, row)
        if row.state is not None:
            self._unmap(position, row.entry)

    # -- apply -------------------------------------------------------------------------------

    def apply(self, batch: IndexBatch) -> None:
        self._check_open()
        check_batch(batch, self._indexed_position)
        if batch.indexed_position < self._indexed_position:
            raise IndexPositionWentBack(self._indexed_position, batch.indexed_position)
        overlay: dict[int, _Row] = {}

        def get(p: int) -> _Row | None:
            return overlay[p] if p in overlay else self.rows.get(p)

        def follow(p: int) -> int:
            for _ in range(_MAX_ROLL_HOPS):
                row = get(p)
                if row is None or row.state is not None:
                    return p
                p = row.entry.position
            return p

        placed_new: list[tuple[int, int | None]] = []  # (position, rolled from)
        finished: list[tuple[int, int, int]] = []  # (position, magic, when)
        rolled_from: dict[int, int] = {}
        fired_times: list[tuple[int, int]] = []
        added: list[TimerEntry] = []
        for e in batch.adds:
            if get(e.position) is None:
                overlay[e.position] = _Row(e)
                placed_new.append((e.position, None))
                added.append(e)
        for old_position, e in batch.rolled:
            if get(e.position) is not None:
                continue
            rolled_from[e.position] = rolled_from.get(old_position, old_position)
            old = get(old_position)
            if old is not None and old.state is not TimerState.PENDING:
                continue
            overlay[old_position] = _Row(e, None)
            overlay[e.position] = _Row(e)
            placed_new.append((e.position, old_position))

        def finish(p: int, state: TimerState, magic: int, when: int) -> None:
            row = get(p)
            assert row is not None
            overlay[p] = _Row(row.entry, state, when, row.slot_ms, row.facts_at)
            finished.append((p, magic, when))

        for position, fired_ms in batch.fired:
            position = follow(position)
            row = get(position)
            if row is not None and row.state is TimerState.PENDING:
                finish(position, TimerState.DELIVERED, wf.MAGIC_DONE, fired_ms)
                fired_times.append((max(row.entry.deliver_at_ms, row.entry.accepted_ms), fired_ms))
        for topic, message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
            candidates = set(self.by_id.get(message_id, ()))
            candidates.update(p for p, r in overlay.items() if r.state is not None and r.entry.message_id == message_id)
            for position in sorted(candidates):
                row = get(position)
                if (row is not None and row.state is TimerState.PENDING and row.entry.topic == topic
                        and (due_ms is None or row.entry.deliver_at_ms == due_ms)
                        and rolled_from.get(position, position) < tombstone_position):
                    finish(position, TimerState.CANCELLED, wf.MAGIC_DELETE, cancelled_ms)
        for position, damaged_ms in batch.damaged:
            position = follow(position)
            row = get(position)
            if row is not None and row.state is TimerState.PENDING:
                finish(position, TimerState.DAMAGED, wf.MAGIC_DAMAGED, damaged_ms)

        # What goes to disk: facts records, then the units, each file with one write.
        facts_parts: list[bytes] = []
        facts_at = self.facts.end
        for position, rolled in placed_new:
            e = overlay[position].entry
            record = wf.timer_record(e.position, e.size, e.deliver_at_ms, e.accepted_ms, e.tag_hash, e.queue_id,
                                     e.group_hash, rolled, e.topic, e.message_id, e.keys)
            row = overlay[position]
            overlay[position] = _Row(row.entry, row.state, row.done_ms, -1, facts_at)
            facts_parts.append(record)
            facts_at += len(record)
        levels = {lv: off for lv, off in batch.level_progress.items() if off > self.levels.get(lv, -1)}
        for level, offset in levels.items():
            facts_parts.append(wf.level_record(level, offset))
        for base, floor in batch.link_floors:
            facts_parts.append(wf.floor_record(base, floor))
        copies: dict[int, int] = {}
        for position, linked_ms, body in batch.link_copies:
            record = wf.link_copy_record(position, linked_ms, body)
            copies[position] = self.facts.end + sum(map(len, facts_parts))
            facts_parts.append(record)
        units = _Units(self, self.timerlog.end)
        for position, _rolled in placed_new:
            row = overlay[position]
            if row.state is TimerState.PENDING:
                overlay[position] = _Row(row.entry, row.state, None, units.place(row.entry, row.facts_at), row.facts_at)
            else:  # finished in this very batch: placed where it would be, then finished
                slot = units.place(row.entry, row.facts_at)
                overlay[position] = _Row(row.entry, row.state, row.done_ms, slot, row.facts_at)
        for position, magic, when in finished:
            row = overlay[position]
            units.finish(row.entry, row.slot_ms, magic, when)
        facts_bytes = b"".join(facts_parts)
        start = self.facts.end
        try:
            if facts_bytes:
                self.facts.append(facts_bytes)
            if units.data:
                self.timerlog.append(b"".join(units.data))
        except OSError as exc:
            os.ftruncate(self.facts.fd, start)
            self.facts.end = start
            raise self._io_error(exc, "a timer wheel write") from exc

        # Memory follows the disk.
        units.commit()
        for position, row in overlay.items():
            self._set(position, row)
        for position, rolled in placed_new:
            if rolled is not None:
                self.history.append((overlay[position].entry.deliver_at_ms, rolled))
        for position, _magic, when in finished:
            self.history.append((when, position))
            self._handed.discard(position)
        for position, _rolled in placed_new:
            if rolled_from.get(position) is not None:
                self._handed.discard(rolled_from[position])
        self.levels.update(levels)
        for base, floor in batch.link_floors:
            self.link_floors[base] = min(floor, self.link_floors.get(base, floor))
        self.link_copies.update(copies)
        self._indexed_position = batch.indexed_position
        self._latencies.delivery_error_ms.record_many([fired - base for base, fired in fired_times])
        if batch.applied_ms is not None and added:
            self._latencies.enqueue_lag_ms.record_many([batch.applied_ms - e.accepted_ms for e in added])
        if self.timerlog.end + self.facts.end - self._checkpointed_bytes >= self.checkpoint_bytes:
            rewritten = False
            if self._worth_rewriting():
                try:
                    self.rewrite()
                    rewritten = True
                except OSError as exc:  # no room for a new generation: the old one goes on
                    log.warning("timer wheel at %s: not rewritten (%s); its files keep growing until it can be",
                                self.path, exc)
            if not rewritten:
                self.checkpoint()

    def _io_error(self, exc: OSError, during: str) -> Exception:
        if self._disk is not None and is_disk_full(exc):
            return self._disk.ran_out(during, self.path)
        return exc

    # -- due ---------------------------------------------------------------------------------

    def _slot_list(self, slot_ms: int) -> list[tuple[int, int]]:
        """The (due, position) of the timers placed in `slot_ms`, in order. Kept in memory as
        units are chained (entries of timers gone since are skipped as they are met): RocketMQ
        walks the slot's chain in the TimerLog when the slot comes up, ~5.5 µs a unit here, which
        held a crowded slot's first timers back by 2.8 s for 500,000 units."""
        lst = self._slot_lists.get(slot_ms)
        if lst is None:
            return []
        if slot_ms in self._unsorted:
            lst.sort()
            self._unsorted.discard(slot_ms)
        return lst

    def _relink(self, slot_ms: int, rolls: list[int]) -> set[int]:
        """Link timers placed in `slot_ms` with ROLL, due after it, into a nearer slot; return
        those that cannot move yet (the window cannot move on until an earlier slot's timers
        have fired)."""
        units = _Units(self, self.timerlog.end)
        moved = []
        stuck: set[int] = set()
        for position in rolls:
            row = self.rows[position]
            where = units.target(row.entry, after=slot_ms)
            if where[0] <= slot_ms:
                stuck.add(position)
                continue
            moved.append((position, row, units.place(row.entry, row.facts_at, after=slot_ms, where=where)))
        if not moved:
            return stuck
        try:
            self.timerlog.append(b"".join(units.data))
        except OSError as exc:
            raise self._io_error(exc, "a timer wheel roll") from exc
        units.commit()
        for position, row, slot in moved:
            self._move(position, row, slot)
        return stuck

    def _placed_here(self, item: tuple[int, int], slot_ms: int) -> bool:
        row = self.rows.get(item[1])
        return (row is not None and row.state is TimerState.PENDING and row.slot_ms == slot_ms
                and row.entry.deliver_at_ms == item[0])

    def _move_read_pointer(self, now_slot: int) -> None:
        """To the earliest slot holding a pending timer, or to now if that is earlier; back only
        when every pending timer's slot stays inside the window from there (a clock stepped
        back: timers indexed meanwhile then go to their own slots, not to a later one)."""
        target = min(self.placed.keys()[0], now_slot) if self.placed else now_slot
        if target > self.read_slot_ms or (
                target < self.read_slot_ms and (not self.placed or self.placed.keys()[-1] < target + self.window_ms)):
            self.read_slot_ms = target

    def due(self, now_ms: int, limit: int) -> list[TimerEntry]:
        self._check_open()
        out: list[TimerEntry] = []
        if limit <= 0:
            return out
        now_slot = now_ms - now_ms % self.slot_ms
        self._move_read_pointer(now_slot)
        slot_ms = -1
        taken: set[int] = set()
        while len(out) < limit:
            following = self.placed.irange(minimum=slot_ms, maximum=now_ms, inclusive=(False, True))
            slot_ms = next(iter(following), None)
            if slot_ms is None:
                break
            items = self._slot_list(slot_ms)
            end = slot_ms + self.slot_ms
            rolls_left = False
            if items and items[-1][0] >= end:
                # ROLL placements (due after this slot) are at the list's tail: linked again
                # nearer, at most `_RELINK_CHUNK` a call, so a window's worth of far timers
                # (hundreds of thousands) moves on over many steps, not in one.
                rolls: list[tuple[int, int]] = []
                while items and items[-1][0] >= end and len(rolls) < _RELINK_CHUNK:
                    item = items.pop()
                    if self._placed_here(item, slot_ms):
                        rolls.append(item)
                if rolls:
                    self._move_read_pointer(now_slot)
                    stuck = self._relink(slot_ms, [p for _, p in rolls])
                    if stuck:
                        items.extend(sorted(item for item in rolls if item[1] in stuck))
                if slot_ms not in self.placed:
                    continue
                items = self._slot_list(slot_ms)
                rolls_left = bool(items) and items[-1][0] >= end
            dead = 0  # fired, cancelled or moved: dropped from the list's head as it is read
            while dead < len(items) and not self._placed_here(items[dead], slot_ms):
                dead += 1
            if dead:
                del items[:dead]
            stop = False
            for item in items:
                if item[0] > now_ms:
                    stop = True
                    break
                if item[1] in taken or not self._placed_here(item, slot_ms):
                    continue  # (an item is listed twice when its timer left the slot and came back)
                taken.add(item[1])
                out.append(self.rows[item[1]].entry)
                if len(out) >= limit:
                    break
            if stop or rolls_left:
                break  # (rolls left here: what lies in later slots may be due after them)
        self._move_read_pointer(now_slot)
        lags = [now_ms - max(e.deliver_at_ms, e.accepted_ms) for e in out if e.position not in self._handed]
        self._handed.update(e.position for e in out)
        self._latencies.fire_lag_ms.record_many(lags)
        return out

    def due_timers(self, now_ms: int, limit: int) -> DueTimers:
        return DueTimers.of(self.due(now_ms, limit))

    def next_deadline_ms(self) -> int | None:
        heap = self._deadlines
        while heap:
            due_ms, position = heap[0]
            row = self.rows.get(position)
            if row is not None and row.state is TimerState.PENDING and row.entry.deliver_at_ms == due_ms:
                return due_ms
            heapq.heappop(heap)
        return None

    # -- queries -----------------------------------------------------------------------------

    def _statuses(self, positions: list[int]) -> list[TimerStatus]:
        out = []
        for p in positions:
            r = self.rows[p]
            out.append(TimerStatus(message_id=r.entry.message_id, topic=r.entry.topic, state=r.state,  # type: ignore[arg-type]
                                   deliver_at_ms=r.entry.deliver_at_ms, accepted_ms=r.entry.accepted_ms, position=p,
                                   fired_ms=r.done_ms if r.state is TimerState.DELIVERED else None,
                                   cancelled_ms=r.done_ms if r.state is TimerState.CANCELLED else None))
        return out

    def lookup(self, topic: str, message_id: str) -> TimerStatus | None:
        self._check_open()
        positions = sorted(p for p in self.by_id.get(message_id, ()) if self.rows[p].entry.topic == topic)
        return self._statuses(positions[-1:])[0] if positions else None

    def lookup_id(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        self._check_open()
        positions = [p for p in self.by_id.get(message_id, ()) if topic is None or self.rows[p].entry.topic == topic]
        return sorted(self._statuses(positions), key=lambda s: (s.topic, s.position))

    def lookup_key(self, key: str) -> list[TimerStatus]:
        self._check_open()
        return self._statuses(sorted(self.by_key.get(key, ())))

    def slot_count(self, slot_s: int) -> int:
        self._check_open()
        return self.per_second.get(slot_s, 0)

    def pending_in(self, start_position: int, end_position: int, limit: int | None = None) -> list[TimerEntry]:
        self._check_open()
        if limit is not None and limit <= 0:
            return []
        out = []
        for position in self.pending_positions.irange(start_position, end_position, inclusive=(True, False)):
            out.append(self.rows[position].entry)
            if limit is not None and len(out) >= limit:
                break
        return out

    def pending_due_before_s(self, slot_s: int) -> int:
        self._check_open()
        hour = slot_s // _HOUR_S
        total = sum(n for h, n in self.per_hour.items() if h < hour)
        if hour in self.per_hour:
            total += sum(self.per_second.get(s, 0) for s in range(hour * _HOUR_S, slot_s))
        return total

    def pending_between(self, from_ms: int, to_ms: int, topic: str | None, limit: int,
                        max_scanned: int) -> tuple[list[TimerEntry], bool]:
        self._check_open()
        if to_ms <= from_ms or limit <= 0:
            return [], False
        # The wheel orders by due time only inside its window; the console's search reads the
        # pending rows instead (a scan of them: this engine's lookups are by id, key and slot).
        in_range = sorted((r.entry.deliver_at_ms, p) for p in self.pending_positions
                          if from_ms <= (r := self.rows[p]).entry.deliver_at_ms < to_ms)
        out: list[TimerEntry] = []
        for scanned, (_due, position) in enumerate(in_range):
            if len(out) >= limit or scanned >= max_scanned:
                return out, True
            entry = self.rows[position].entry
            if topic is None or entry.topic == topic:
                out.append(entry)
        return out, False

    def level_progress(self, level: int) -> int | None:
        return self.levels.get(level)

    def metrics(self, now_ms: int) -> TimerMetricsSnapshot:
        self._check_open()
        deadline = self.next_deadline_ms()
        return TimerMetricsSnapshot(
            now_ms=now_ms, pending_total=self.pending_total, pending_by_topic=dict(self.pending_by_topic),
            pending_by_due=pending_by_due(now_ms, self.pending_total, self.pending_due_before_s),
            next_deadline_ms=deadline, oldest_overdue_ms=max(0, now_ms - deadline) if deadline is not None else 0,
            indexed_position=self._indexed_position, latencies=self._latencies.summaries())

    # -- links and history -------------------------------------------------------------------

    def linked_floor(self, segment_base: int) -> int | None:
        return min((f for b, f in self.link_floors.items() if b >= segment_base), default=None)

    def _forget_links(self, position: int, live_from: int | None) -> None:
        self.link_floors = {b: f for b, f in self.link_floors.items() if b >= position}
        self.link_copies = {p: at for p, at in self.link_copies.items() if p >= position}
        if live_from is not None:
            self._live_links_from = live_from

    def forget_links_below(self, position: int, live_from: int | None = None) -> None:
        self._check_open()
        self._append_facts(wf.forget_links_record(position, live_from))
        self._forget_links(position, live_from)

    def _append_facts(self, record: bytes) -> None:
        try:
            self.facts.append(record)
        except OSError as exc:
            raise self._io_error(exc, "a timer wheel write") from exc

    def link_copy(self, position: int) -> tuple[bytes, int] | None:
        self._check_open()
        at = self.link_copies.get(position)
        if at is None:
            return None
        for _at, _kind, payload in wf.iter_records(self.facts.view(), at, self.facts.end):
            _position, linked_ms, body = wf.decode_link_copy(payload)
            return body, linked_ms
        return None

    def link_copies_in(self, start: int, end: int) -> list[int]:
        self._check_open()
        return sorted(p for p in self.link_copies if start <= p < end)

    def live_links_from(self) -> int | None:
        return self._live_links_from

    def prune_history(self, before_ms: int) -> int:
        self._check_open()
        self._append_facts(wf.prune_record(before_ms))
        return self._prune(before_ms)

    def _prune(self, before_ms: int) -> int:
        forgotten = 0
        keep = []
        for done_ms, position in self.history:
            if done_ms >= before_ms:
                keep.append((done_ms, position))
                continue
            row = self.rows.get(position)
            if row is None or row.state is TimerState.PENDING:
                continue
            forgotten += row.state is not None
            self._drop(position)
        self.history = keep
        return forgotten


class _Units:
    """The units one batch (or one roll) appends, and the slot changes they make, kept apart
    from the wheel until `commit` (after the write succeeded)."""

    def __init__(self, engine: WheelTimerEngine, start: int) -> None:
        self.engine = engine
        self.at = start
        self.data: list[bytes] = []
        self.slots: dict[int, tuple[int, int, int, int]] = {}
        self.lo: int | None = None
        self.hi: int | None = None
        """The earliest and latest slot this batch placed a timer in."""
        keys = engine.placed.keys()
        self.placed_lo: int | None = keys[0] if keys else None
        self.placed_hi: int | None = keys[-1] if keys else None
        """The same of the engine's pending timers (they do not change until `commit`)."""

    def _slot(self, slot_ms: int) -> tuple[int, tuple[int, int, int, int]]:
        index = (slot_ms // self.engine.slot_ms) % self.engine.slots
        if index in self.slots:
            current = self.slots[index]
        else:
            t, first, last, count, _magic = self.engine.wheel.get(index)
            current = (t, first, last, count)
        if current[0] != slot_ms or current[3] == 0:
            current = (slot_ms, -1, -1, 0)
        return index, current

    def _link(self, slot_ms: int, magic: int, delay_ms: int, entry: TimerEntry, reserved: int) -> None:
        index, (_t, first, last, count) = self._slot(slot_ms)
        self.data.append(wf.pack_unit(last, magic, slot_ms, delay_ms, entry.position, entry.size,
                                      wf.topic_hash(entry.topic), reserved))
        self.slots[index] = (slot_ms, first if first >= 0 else self.at, self.at, count + 1)
        self.at += wf.UNIT_SIZE

    def place(self, entry: TimerEntry, facts_at: int, after: int | None = None,
              where: tuple[int, int] | None = None) -> int:
        """Chain a placement unit for `entry`; return its slot.

        The slot of its due time (for a roll linked again from slot `after`: no earlier than the
        next slot), within the rule that makes reusing the file's slots safe: every slot holding
        pending timers lies inside one window, which starts at the read pointer (or at the
        earliest such slot, if earlier). Due beyond the window: the window's last slot, with
        ROLL. Due before the read pointer: its own slot when no pending timer lies a window or
        more after it, else the earliest slot the window allows, at or before every other
        pending timer's (so the order of due times holds; on a clock that never goes back that
        slot's time has come, since the window started at or before the read pointer: it fires
        at once, and after a clock stepped back it fires late, never early)."""
        slot_ms, magic = where if where is not None else self.target(entry, after)
        self.lo = slot_ms if self.lo is None else min(self.lo, slot_ms)
        self.hi = slot_ms if self.hi is None else max(self.hi, slot_ms)
        self._link(slot_ms, magic, entry.deliver_at_ms - slot_ms, entry, facts_at)
        return slot_ms

    def target(self, entry: TimerEntry, after: int | None = None) -> tuple[int, int]:
        """The slot and magic `place` would chain `entry` with (the rule in its docstring)."""
        e = self.engine
        due_slot = entry.deliver_at_ms - entry.deliver_at_ms % e.slot_ms
        slot_ms = due_slot if after is None else max(due_slot, after + e.slot_ms)
        if e.read_slot_ms < 0:  # a new wheel: it starts where its first timer was accepted
            first = min(entry.accepted_ms, entry.deliver_at_ms)
            e.read_slot_ms = max(0, first - first % e.slot_ms)
        lo, hi = self.placed_lo, self.placed_hi
        if self.lo is not None:
            lo = self.lo if lo is None else min(lo, self.lo)
            hi = self.hi if hi is None else max(hi, self.hi)
        start = e.read_slot_ms if lo is None else min(lo, e.read_slot_ms)
        magic = wf.MAGIC_DEFAULT
        if slot_ms < start and hi is not None and hi - slot_ms >= e.window_ms:
            slot_ms = hi - e.window_ms + e.slot_ms  # at or before every other pending timer's slot
        else:
            start = min(start, slot_ms)
            if slot_ms > start + e.window_ms - e.slot_ms:
                slot_ms, magic = start + e.window_ms - e.slot_ms, wf.MAGIC_ROLL
        return slot_ms, magic

    def finish(self, entry: TimerEntry, slot_ms: int, magic: int, when: int) -> None:
        self._link(slot_ms, magic, 0, entry, when)

    def commit(self) -> None:
        for index, (slot_ms, first, last, count) in self.slots.items():
            self.engine.wheel.put(index, slot_ms, first, last, count)


def _entry_of(facts: wf.TimerFacts) -> TimerEntry:
    return TimerEntry(facts.deliver_at_ms, facts.position, facts.size, facts.message_id, facts.topic,
                      facts.accepted_ms, facts.keys, facts.tag_hash, facts.queue_id, facts.group_hash)


def _dec(counter: Counter, key: object) -> None:  # type: ignore[type-arg]
    left = counter[key] - 1
    if left:
        counter[key] = left
    else:
        del counter[key]


