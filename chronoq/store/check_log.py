"""`chronoq check`'s commit log: every segment's header and chain, and every record's frame.

Theory of operation: the log is read the way recovery reads it (`store/commitlog_recovery.py`),
segment by segment in name order: a damaged segment header is a problem, but the records are
read by the base the file name gives; a base that does not follow the previous segment's end is
a broken chain (the broker refuses to start). A torn tail and damage are told apart as recovery
does (`store/damage.py`): by whether a valid record follows the bad one (`_bad_record`). Magic,
version and checksum failures are named apart, as bbolt's check does. A torn tail below the
checkpoint, or a log whose records end below it, is a problem, not a repair: those records were
dispatched, so acknowledged. Each record's consume-queue entry, and each link of a link record,
is compared as it is met (`check_queues.check_entry`), and damage is recorded for its costing
(`check_damage.py`).

Memory does not grow with the store: the log is read through a window of `SEGMENT_WINDOW_BYTES`
(`_Window`; a larger record is read whole; a size that runs past the segment's end is judged
from the header, as `check_frame` would, not read). Before, each segment was read whole (256 MiB
by default), and the next one before letting the last go. A segment a running broker's
retention removes after the directory was listed is noted, not called damage.
"""

from __future__ import annotations

import os
from pathlib import Path

from chronoq.errors import CorruptRecord
from chronoq.model import LINKS_TOPIC
from chronoq.store import files
from chronoq.store.check_queues import Queue, QueueEntries, check_entry
from chronoq.store.check_report import CheckReport, open_or_note
from chronoq.store.commitlog_segment import SEGMENT_HEADER_SIZE, check_frame, decode_segment_header
from chronoq.store.consumequeue import tag_hash
from chronoq.store.damage import DAMAGED, Pread, classify
from chronoq.store.links import decode_links, link_entries
from chronoq.store.record import HEADER, HEADER_SIZE, RECORD_MAGIC, RECORD_VERSION, decode_record
from chronoq.timer.index_codec import U32

SEGMENT_WINDOW_BYTES = 4 * 1024 * 1024
"""Commit-log bytes check reads (and holds) at a time; a larger record is read whole. Before, it
read each segment whole (256 MiB by default), and the next one before letting the last go."""


def check_log(data_dir: Path, report: CheckReport, queues: dict[tuple[str, int], Queue], entries: QueueEntries,
              checkpoint: int | None, *, walked_from: bool = False) -> None:
    """`walked_from`: the checkpoint is of version 2, where recovery starts its walk of the last
    segment (bytes below it that the segment still spans are not looked at: readers meet them)."""
    log_dir = data_dir / files.COMMITLOG_DIR
    if not log_dir.exists():
        report.notes.append(f"{log_dir}: missing (empty broker)")
        return
    names = sorted(n for n in os.listdir(log_dir) if files.parse_numbered(n, files.SEGMENT_SUFFIX) is not None)
    expected_base: int | None = None
    for i, name in enumerate(names):
        path = log_dir / name
        is_last = i == len(names) - 1
        if (fd := open_or_note(path, report)) is None:
            continue
        try:
            expected_base = _check_segment(report, queues, entries, path, fd, name, expected_base, is_last,
                                           checkpoint, walked_from)
        finally:
            os.close(fd)
    report.log_end = expected_base or 0
    if checkpoint is not None and report.log_end < checkpoint:
        # A torn tail (or a file cut short) below the checkpoint: a problem, not a repair.
        report.problems.append(
            f"{log_dir}: the log's valid records end at {report.log_end}, below the checkpoint {checkpoint}: "
            f"{checkpoint - report.log_end} bytes of records the consume queues were given (so acknowledged) are "
            f"gone. {_LOST_BELOW_CHECKPOINT}")


def _check_segment(report: CheckReport, queues: dict[tuple[str, int], Queue], entries: QueueEntries, path: Path,
                   fd: int, name: str, expected_base: int | None, is_last: bool, checkpoint: int | None,
                   walked_from: bool = False) -> int:
    """Check one segment's records (read through a `_Window`); return where it ends.
    `walked_from`: as `_bad_record`'s."""
    report.segments += 1
    base = files.parse_numbered(name, files.SEGMENT_SUFFIX) or 0
    try:
        if decode_segment_header(os.pread(fd, SEGMENT_HEADER_SIZE, 0)) != base:
            raise CorruptRecord("the base in the header differs from the file name")
    except CorruptRecord as e:
        report.problems.append(f"{path}: damaged segment header: {e.reason} (the records are read by the "
                               "base the file name gives)")
    if expected_base is None:
        report.log_start = base
    elif base != expected_base:
        report.problems.append(f"{path}: base {base}, but the previous segment ends at {expected_base}: "
                               "a segment is missing or misnamed; the broker refuses to start")
    end = base + max(0, os.fstat(fd).st_size - SEGMENT_HEADER_SIZE)
    window = _Window(fd, base, end)
    position = base
    while position < end:
        try:
            buf, offset = window.at(position, HEADER_SIZE)
            if len(buf) - offset >= HEADER_SIZE:
                total = U32.unpack_from(buf, offset)[0]  # a record's first field is its size
                if total > end - position > SEGMENT_WINDOW_BYTES:
                    raise _past_the_end(buf[offset:offset + HEADER_SIZE], position, total, end - position)
                if offset + total > len(buf):
                    buf, offset = window.at(position, total)
            size = check_frame(buf, offset, position)
            msg = decode_record(buf, offset, expected_position=position)
        except CorruptRecord as e:
            resume = _bad_record(report, path, window.pread, position, end, e.reason, is_last, checkpoint,
                                 walked_from)
            if resume is None:  # a torn tail: the log a restart keeps ends here
                end = position
                break
            position = resume
            continue
        report.records += 1
        try:
            # A record's own entry, and each link of a link record (`store/links.py`).
            check_entry(report, queues, entries, msg.topic, msg.queue_id, msg.queue_offset, position, size,
                        tag_hash(msg.tag), checkpoint)
            if msg.topic == LINKS_TOPIC:
                links = decode_links(msg.body, position)
                for topic, qid, qoff, at, entry_size, th in link_entries(position, links):
                    check_entry(report, queues, entries, topic, qid, qoff, at, entry_size, th, checkpoint)
                if report.damage.ranges:  # (links point back: damage they reach was met before)
                    for i, target in enumerate(links.positions):
                        report.damage.count_link(target, links.topics[links.topic_indexes[i]], links.queue_ids[i],
                                                 links.queue_offsets[i])
                low = min(links.positions, default=None)
                if low is not None and low < report.log_start and report.live_links_from is not None \
                        and position < report.live_links_from:
                    report.expired_links += 1  # past retention itself: what it names may go (retention.py)
                elif low is not None and low < report.log_start:
                    report.problems.append(
                        f"{path}: link record at position {position} names a record at {low}, below the log's "
                        f"start {report.log_start}: the message it fired is gone (retention must keep it)")
        except CorruptRecord as e:
            report.problems.append(f"{path}: link record at position {position} cannot be read: {e.reason}; "
                                   "the messages it fired are missing from their consume queues")
        position += size
    return end


class _Window:
    """A segment's records from position `base` to `end` (its size when opened), read
    `SEGMENT_WINDOW_BYTES` at a time, or one record whole when it is larger."""

    def __init__(self, fd: int, base: int, end: int) -> None:
        self.fd, self.base, self.end = fd, base, end
        self.start = base
        self.buf = b""

    def pread(self, at: int, size: int) -> bytes:
        """Up to `size` bytes from position `at`, none past `end`."""
        return os.pread(self.fd, max(0, min(size, self.end - at)), at - self.base + SEGMENT_HEADER_SIZE)

    def at(self, position: int, need: int) -> tuple[bytes, int]:
        """A buffer that holds the `need` bytes from `position` (up to `end`) and reaches `end` or
        beyond them, and the offset of `position` in it."""
        if not self.start <= position or position + min(need, self.end - position) > self.start + len(self.buf):
            self.buf = b""  # let it go before reading the next
            self.start = position
            self.buf = self.pread(position, max(need, SEGMENT_WINDOW_BYTES))
        return self.buf, position - self.start


def _past_the_end(head: bytes, position: int, total: int, avail: int) -> CorruptRecord:
    """What `check_frame` finds in a record whose size runs past the segment's end, from its
    header alone (not reading the bytes the size claims): its magic and version, then the size."""
    magic, version = HEADER.unpack_from(head)[2:4]
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        check_frame(head, 0, position)  # raises, in its own words
    return CorruptRecord(f"record size {total} does not fit the {avail} bytes available", position)


_LOST_BELOW_CHECKPOINT = ('With flush = "async" and a checkpoint of version 1 a power loss took them before '
                          "their fsync, the price of that option; otherwise the disk lost fsynced records. A "
                          "restart cuts the tail, says how much was lost, and brings the consume queues and the "
                          "timer index back to the log's end")


def _bad_record(report: CheckReport, path: Path, pread: Pread, position: int, end: int, reason: str,
                is_last: bool, checkpoint: int | None, walked_from: bool = False) -> int | None:
    """Report the record at `position` that failed its checks; return where to read on (None:
    a torn tail, where the log ends once a restart has truncated it). A torn tail below the
    checkpoint is a problem, not a repair: the records there had been dispatched, so
    acknowledged, in either flush mode (recovery: `commitlog_recovery._lost_below_checkpoint`). Below a
    version-2 checkpoint the segment still spans (`walked_from`), recovery's walk never meets
    it: a restart keeps those bytes, and readers quarantine them, as any damage."""
    verdict, resume = classify(pread, check_frame, position, end)
    if verdict == DAMAGED:
        after = "valid records follow and are kept" if resume < end else "it is whole, so it may have been acknowledged"
        report.problems.append(f"{path}: damaged bytes at positions [{position}, {resume}) "
                               f"({resume - position} bytes): {reason}; {after}. A restart quarantines them "
                               "(skips and reports them), it does not cut anything after them")
        report.damage.add(position, resume, len(report.problems) - 1)
        return resume
    if is_last and checkpoint is not None and position < checkpoint:
        if walked_from and checkpoint <= end:
            report.problems.append(f"{path}: damaged bytes at positions [{position}, {checkpoint}) "
                                   f"({checkpoint - position} bytes), below the checkpoint: {reason}; records the "
                                   "consume queues were given (so acknowledged) are lost. A restart keeps them; "
                                   "readers quarantine them (skip and report them)")
            report.damage.add(position, checkpoint, len(report.problems) - 1)
            return checkpoint  # where recovery's walk starts
        return None  # the log's end is below the checkpoint: `check_log` reports it, once
    if is_last:
        report.repairs.append(f"{path}: torn tail at position {position} ({end - position} bytes): {reason}; no valid "
                              "record follows, so nothing fsynced is in it (with flush = \"sync\", nothing "
                              "acknowledged). A restart truncates it")
        return None
    else:
        report.problems.append(f"{path}: damaged bytes at positions [{position}, {end}) to the segment's end: {reason}")
        report.damage.add(position, end, len(report.problems) - 1)
    return end
