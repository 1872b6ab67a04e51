"""Commit-log recovery: opening a log directory after any stop, a crash or a power loss included.

Theory of operation:
- The segments are chained by their names: each must start where the previous one ends. A
  segment whose header is damaged is read by the base its name gives (records name their own
  positions, so the header is only a label); only a broken chain (a segment missing or
  misnamed) refuses to open (`LogDamaged`). A last segment without a whole header is a roll
  interrupted before its header reached the disk: it holds nothing and is removed.
- Before rolling, the log fsyncs the old segment, so only the last segment can hold a torn tail.
  `recover` walks the last segment from the checkpoint (or its start); at a record that fails
  its checks it asks `store/damage.py` whether that is a torn tail (truncated: nothing fsynced is
  in it) or damage (quarantined: the bad bytes are skipped and reported, every valid record after
  them is kept). The checkpoint is never past the fsynced end (version 2); after a version-1 one,
  which `flush = "async"` could write past it, the walk starts at the segment's start. A torn tail
  below the checkpoint is cut too, and said out loud: it held acknowledged records
  (`_lost_below_checkpoint`).

Why apart from `store/commitlog.py`: recovery runs once, at open, and is the one place the log
truncates; the running log (appends, reads, retention) never does. It works on the `CommitLog`
being opened, through its segment list (a friend, as `timer/index_txn.py` is the index's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chronoq.errors import CorruptRecord, LogDamaged
from chronoq.store import files, fsync
from chronoq.store.commitlog_segment import (
    SEGMENT_HEADER_SIZE,
    Segment,
    check_frame,
    decode_segment_header,
    record_buffers,
)
from chronoq.store.damage import DAMAGED, Damage, DamageRegistry, classify


class RecoveringLog(Protocol):
    """What recovery reads and changes of the log being opened. `CommitLog` is the one
    implementation; naming it here would make the log and its recovery import each other."""

    directory: Path
    flush_mode: str
    damage: DamageRegistry
    _segments: list[Segment]

    def _add_segment(self, seg: Segment) -> None: ...

    def _new_segment(self, base: int) -> Segment: ...

log = logging.getLogger("chronoq.store")


@dataclass
class RecoveryReport:
    truncated_bytes: int = 0
    truncated_at: int | None = None
    reason: str = ""
    removed_files: list[str] = field(default_factory=list)
    damaged: list[Damage] = field(default_factory=list)
    """Quarantined ranges found in the last segment (kept, not truncated)."""
    damaged_headers: list[str] = field(default_factory=list)
    """Segments whose header failed its checks; read by the base their name gives."""
    lost_below_checkpoint: int = 0
    """Bytes below the checkpoint the log no longer holds (its records end there): records the
    consume queues were given, so acknowledged. With flush = "async", a power loss's price."""
    checkpoint_past_end: int | None = None
    """The checkpoint those bytes were lost below, when `lost_below_checkpoint` is set."""


def recover(commit_log: RecoveringLog, scan_from: int, verify_below: bool) -> RecoveryReport:
    """Load the segments of `commit_log.directory` into the (new, empty) `commit_log` and recover
    its tail: `scan_from` and `verify_below` as `CommitLog.open` says."""
    report = RecoveryReport()
    names = sorted(
        (base, name) for name in os.listdir(commit_log.directory)
        if (base := files.parse_numbered(name, files.SEGMENT_SUFFIX)) is not None
    )
    for i, (base_from_name, name) in enumerate(names):
        path = commit_log.directory / name
        is_last = i == len(names) - 1
        with open(path, "rb") as f:
            head = f.read(SEGMENT_HEADER_SIZE)
        base = base_from_name
        try:
            if decode_segment_header(head) != base_from_name:
                raise CorruptRecord("the base in the header differs from the file name")
        except CorruptRecord as e:
            if is_last and len(head) < SEGMENT_HEADER_SIZE:
                # A roll interrupted before its header reached the disk: nothing in it.
                path.unlink()
                report.removed_files.append(name)
                continue
            # Records name their own positions, so the name's base is checked record by
            # record; the header is only a label. Reported, not fatal.
            report.damaged_headers.append(f"{path}: {e.reason}")
            log.error("commit-log segment %s: damaged header (%s); reading it by its name's base %d",
                      path, e.reason, base)
        size = max(0, path.stat().st_size - SEGMENT_HEADER_SIZE)
        if commit_log._segments and commit_log._segments[-1].end != base:
            raise LogDamaged(str(path), f"base {base} does not follow the previous segment's end "
                                        f"{commit_log._segments[-1].end}")
        fd = os.open(path, os.O_RDWR)
        commit_log._add_segment(Segment(base, path, fd, size))
    if not commit_log._segments:
        commit_log._new_segment(0)
        return report
    _recover_tail(commit_log, scan_from, report, verify_below=verify_below)
    for seg in commit_log._segments:
        seg.opened_size = seg.data_size  # after the tail's truncation
    return report


def _recover_tail(commit_log: RecoveringLog, scan_from: int, report: RecoveryReport, *, verify_below: bool) -> None:
    """Walk the last segment from `scan_from` (the checkpoint): quarantine damage, truncate a
    torn tail. With `verify_below` (a version-1 checkpoint, which flush = "async" could write
    past the fsynced end) the walk starts at the segment's start, so a torn tail below the
    checkpoint is found; so it does when the segment ends before it. Such a loss is reported
    (`_lost_below_checkpoint`)."""
    seg = commit_log._segments[-1]
    position = scan_from if seg.base <= scan_from <= seg.end and not verify_below else seg.base
    while True:
        bad = _first_bad(seg, position)
        if bad is None:
            if seg.end < scan_from:
                _lost_below_checkpoint(commit_log, seg, seg.end, scan_from, "the segment ends there",
                                   report, legacy=verify_below)
            return
        verdict, resume = classify(seg.pread, check_frame, bad[0], seg.end)
        if verdict == DAMAGED:
            damage = Damage(bad[0], resume, bad[1], str(seg.path))
            commit_log.damage.add(damage)
            report.damaged.append(damage)
            log.error("commit log: quarantined damaged bytes [%d, %d) in %s (%s); the %s after them are kept",
                      damage.start, damage.end, seg.path, bad[1],
                      "records" if resume < seg.end else "bytes")
            position = resume
            continue
        if bad[0] < scan_from:
            _lost_below_checkpoint(commit_log, seg, bad[0], scan_from, bad[1], report, legacy=verify_below)
        _truncate_tail(commit_log, seg, bad[0], bad[1], report)
        return


def _first_bad(seg: Segment, start: int) -> tuple[int, str] | None:
    """(position, reason) of the first record of `seg` from `start` that fails its checks."""
    for frame_position, _size, err in _frames(seg, start):
        if err is not None:
            return frame_position, err
    return None


def _truncate_tail(commit_log: RecoveringLog, seg: Segment, at: int, reason: str, report: RecoveryReport) -> None:
    report.truncated_at = at
    report.reason = reason
    report.truncated_bytes = seg.end - at
    if commit_log.flush_mode == "async":
        # Said out loud: with "async" a cut tail may hold records acknowledged before their
        # fsync (the option's price after a power loss); with "sync" it holds none.
        log.warning("commit log: torn tail of %d bytes cut at position %d in %s (%s); with flush = \"async\" "
                    "it may hold records acknowledged before their fsync", seg.end - at, at, seg.path, reason)
    else:
        log.info("commit log: torn tail of %d bytes cut at position %d in %s (%s); nothing in it was "
                 "acknowledged", seg.end - at, at, seg.path, reason)
    os.ftruncate(seg.fd, at - seg.base + SEGMENT_HEADER_SIZE)
    fsync.fsync(seg.fd, seg.path)
    seg.data_size = at - seg.base


def _lost_below_checkpoint(commit_log: RecoveringLog, seg: Segment, at: int, checkpoint: int, reason: str,
                           report: RecoveryReport, *, legacy: bool) -> None:
    """Say that the log's records end at `at`, below the checkpoint: `checkpoint - at` bytes
    of records that were dispatched, so visible and acknowledged in either flush mode, are
    gone (a torn tail there is still cut: nothing valid follows it, so cutting it loses
    nothing more, and new records must not follow garbage). With `flush = "async"` and a
    version-1 checkpoint, which could be past the fsynced end, that is the option's
    documented price after a power loss: a warning. Otherwise those records were fsynced
    before anyone saw them, so the disk lost them: an error. Either way the store drops
    their consume-queue entries, the timer index (covering positions past the end) is
    rebuilt, and `chronoq check` calls it a problem."""
    report.lost_below_checkpoint = checkpoint - at
    report.checkpoint_past_end = checkpoint
    if commit_log.flush_mode == "async" and legacy:
        log.warning("commit log: %s ends its records at %d (%s), below the checkpoint %d: a power loss took "
                    "%d bytes of records acknowledged before their fsync (flush = \"async\"); they are gone",
                    seg.path, at, reason, checkpoint, checkpoint - at)
    else:
        log.error("commit log: %s ends its records at %d (%s), below the checkpoint %d: %d bytes of records "
                  "fsynced and acknowledged are gone: the disk lost them",
                  seg.path, at, reason, checkpoint, checkpoint - at)


def _frames(seg: Segment, start: int) -> Iterator[tuple[int, int, str | None]]:
    """(position, size, error) for each record of `seg` from `start`; stops after an error."""
    for position, buf, offset in record_buffers(seg, start, seg.end):
        try:
            size = check_frame(buf, offset, position)
        except CorruptRecord as e:
            yield position, 0, e.reason
            return
        yield position, size, None
