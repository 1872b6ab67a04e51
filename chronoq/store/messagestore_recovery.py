"""Opening the message store: the log replayed into the consume queues, damaged queues rebuilt.

Theory of operation: `recover` runs once, inside `MessageStore.open` (the directory locked, the
disk's reserve file in place), in order: read the topic table; open the log, truncating a torn
tail and quarantining damage (`store/damage.py`; a tail lost below the checkpoint, as a power
loss under `flush = "async"` leaves it, is cut and reported); load each consume queue, dropping
entries past the log's end (counted and logged) and marking damaged ones for rebuild; replay the
log from the checkpoint's dispatched position (idempotent: an entry is appended only where the
queue is missing it); rebuild damaged queues from the whole log. A queue offset whose record was
lost to damage gets a *hole* entry (size 0) so the queue stays dense and readers step over it.
A topic the log names that the table does not (or with fewer queues) is added to it; a damaged
table is moved aside and rebuilt from the queue directories and the log (`_load_topics`).
Recovery dispatches nothing to anyone: it writes the queues itself, and each room built on the
store replays the log for its own state.

Recovery writes nothing that needs space: its checkpoint, or a topic table it had to rebuild,
waits for a later checkpoint when the disk is full (an old checkpoint past the log's end is
removed instead: it names no boundary of the records written past it next).

Why apart from `store/messagestore.py`: recovery runs once, at open, and is the one place queues
are rebuilt and the topic table is repaired; the running store only appends, dispatches and
reads. It works on the `MessageStore` being opened, through its queues and topic table (a
friend, as `store/commitlog_recovery.py` is the log's), typed by `RecoveringStore`.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chronoq.config import Config
from chronoq.errors import CorruptRecord, DiskFull
from chronoq.model import MessageType, TopicConfig
from chronoq.store import files, fsync
from chronoq.store.commitlog import CommitLog, RecoveryReport
from chronoq.store.consumequeue import ConsumeQueue, OpenFiles
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.store.links import queue_entries
from chronoq.store.meta import CHECKPOINT_VERSION, decode_topics, read_checkpoint_versioned

log = logging.getLogger("chronoq.store")


class RecoveringStore(Protocol):
    """What recovery reads and changes of the store being opened. `MessageStore` is the one
    implementation; naming it here would make the store and its recovery import each other."""

    config: Config
    dir: Path
    topics: dict[str, TopicConfig]
    queue_files: OpenFiles
    disk: DiskSpace
    log: CommitLog
    dispatched_position: int
    _cqs: dict[tuple[str, int], ConsumeQueue]
    _next_qoff: dict[tuple[str, int], int]
    _topics_unsaved: bool

    def _cq(self, key: tuple[str, int]) -> ConsumeQueue: ...

    def _save_topics(self) -> None: ...

    def _on_durable(self, end: int) -> int | None: ...

    def checkpoint(self) -> int: ...


@dataclass
class OpenReport:
    log: RecoveryReport
    replayed_records: int = 0
    rebuilt_queues: list[str] = field(default_factory=list)
    truncated_cq_entries: int = 0
    checkpoint: int | None = None
    hole_entries: int = 0
    """Queue offsets whose records were lost to damage (hole entries written by a rebuild)."""
    groups_reset: str | None = None
    """Set (by the broker) when the consumer-group store was damaged and started empty."""
    topics_damaged: str | None = None
    """Set when the topic table was damaged and rebuilt (what was lost, and where the old one is)."""


def warn_if_queue_files_exceed_the_fd_limit(max_open_queue_files: int) -> None:
    """Consume queues may hold twice `max_open_queue_files` descriptors (a checkpoint syncs
    duplicates); past half the process's soft RLIMIT_NOFILE that leaves too little for the log,
    RocksDB and connections. Said at open, not refused: the limit is the environment's."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and 2 * max_open_queue_files > soft // 2:
        log.warning("max_open_queue_files = %d: consume queues may hold %d descriptors, more than half the "
                    "process's open-file limit (ulimit -n) %d; lower it or raise the limit",
                    max_open_queue_files, 2 * max_open_queue_files, soft)


def recover(store: RecoveringStore) -> OpenReport:
    """Recover the (new, empty) `store` from its directory, as the module docstring says: its log
    opened (`store.log`), its queues and topic table made whole, then a checkpoint."""
    topics_damaged = _load_topics(store)
    found = read_checkpoint_versioned(store.dir / files.CHECKPOINT)
    checkpoint = None if found is None else found[0]
    store.log, log_report = CommitLog.open(
        store.dir / files.COMMITLOG_DIR, segment_size_bytes=store.config.segment_size_bytes,
        flush=store.config.flush, flush_interval_ms=store.config.flush_interval_ms,
        scan_from=checkpoint or 0, verify_below=found is not None and found[1] < CHECKPOINT_VERSION,
        disk=store.disk, dispatch_retry_ms=store.config.disk_full_retry_ms,
    )
    report = OpenReport(log=log_report, checkpoint=checkpoint, topics_damaged=topics_damaged)
    damaged: set[tuple[str, int]] = set()
    queues_root = store.dir / files.QUEUES_DIR
    if queues_root.exists():
        for topic in sorted(os.listdir(queues_root)):
            for qid_name in sorted(os.listdir(queues_root / topic)):
                if not qid_name.isdigit():
                    continue
                key = (topic, int(qid_name))
                cq, cq_report = ConsumeQueue.open(
                    queues_root / topic / qid_name, store.config.consume_queue_entries_per_file,
                    log_start=store.log.start_position, log_end=store.log.end_position,
                    open_files=store.queue_files)
                report.truncated_cq_entries += cq_report.truncated_entries
                if cq_report.damaged:
                    cq.destroy()
                    cq = ConsumeQueue(cq.directory, store.config.consume_queue_entries_per_file, store.queue_files)
                    damaged.add(key)
                store._cqs[key] = cq
    if report.truncated_cq_entries:
        # Queue entries are written only for dispatched records, so acknowledged ones: with
        # flush = "async", what a power loss took before their fsync (those whose entries had
        # reached a durable queue file: a lower bound); with "sync", what the disk lost. The
        # timer index, ahead of the log's end too, is rebuilt by its owner.
        log.warning("recovery: %d consume-queue entries pointed past the commit log's end %d and were dropped: "
                    "acknowledged messages the log no longer holds", report.truncated_cq_entries,
                    store.log.end_position)
    for topic in store.topics.values():
        for qid in range(topic.queue_count):
            key = (topic.name, qid)
            if key not in damaged and store._cq(key).is_empty:
                # No file at all: the queue was deleted (every queue gets a file when its
                # topic is created), or it predates that rule. Either way, rebuild it.
                damaged.add(key)
    start = min(checkpoint if checkpoint is not None else 0, store.log.end_position)
    for msg in store.log.scan(start):
        report.replayed_records += 1
        # A record's own entry, and a link record's links: each names its queue and offset.
        for topic, qid, qoff, position, size, th in queue_entries(msg):
            _ensure_topic_for(store, topic, qid, msg.store_ms)
            key = (topic, qid)
            if key in damaged:
                continue
            cq = store._cq(key)
            if qoff < cq.next_offset:
                continue
            if qoff > cq.next_offset:
                # Entries are missing below the checkpoint (a deleted or damaged queue, or
                # records expired before the queue was first written): rebuild it from the log.
                cq.destroy()
                store._cqs[key] = ConsumeQueue(cq.directory, store.config.consume_queue_entries_per_file,
                                              store.queue_files)
                damaged.add(key)
                continue
            cq.append(position, size, th)
    if damaged:
        report.hole_entries = _rebuild(store, damaged)
        for key in damaged:
            store._cqs[key].ensure_file()
        report.rebuilt_queues = sorted(f"{t}/{q}" for t, q in damaged)
    for key, cq in store._cqs.items():
        store._next_qoff[key] = cq.next_offset
    store.dispatched_position = store.log.end_position
    store.log.on_durable = store._on_durable
    try:
        store.checkpoint()
    except DiskFull as e:  # the old checkpoint stays valid: replay starts there again
        store.disk.note_full("checkpoint", e)
        if checkpoint is not None and checkpoint > store.log.end_position:
            # Unless it is past the log's end (records below it were lost): new records will
            # run past it, and it names no boundary of theirs; a recovery walking from it would
            # take the record it lands in for a torn tail and cut it. Removed (no space
            # needed): the next recovery replays the log from its start.
            (store.dir / files.CHECKPOINT).unlink(missing_ok=True)
            fsync.fsync_dir(store.dir)
    return report


def _load_topics(store: RecoveringStore) -> str | None:
    """Read the topic table. A damaged one is moved aside (`topics.damaged-<n>`) and rebuilt
    from what else says which topics exist: the queue directories (one per queue, made when
    the topic was created) here, the log's records during replay. What only the table knew
    is lost and said so: the accepted message types (all are accepted again) and the
    creation time (0). Returns the reason, or None when the table was sound."""
    path = store.dir / files.TOPICS
    if not path.exists():
        return None
    try:
        store.topics = {t.name: t for t in decode_topics(path.read_bytes())}
        return None
    except CorruptRecord as e:
        reason = e.reason
    aside = files.damaged_name(path)
    os.rename(path, aside)
    queues_root = store.dir / files.QUEUES_DIR
    for name in sorted(os.listdir(queues_root)) if queues_root.is_dir() else []:
        qids = [int(q) for q in os.listdir(queues_root / name) if q.isdigit()]
        if qids:
            store.topics[name] = TopicConfig(name, max(qids) + 1, frozenset(MessageType), 0)
    _save_topics_in_recovery(store)
    message = (f"topic table {path} is damaged ({reason}); moved to {aside.name} and rebuilt from the queues: "
               f"{len(store.topics)} topics, every message type accepted again")
    log.error("%s", message)
    return message


def _rebuild(store: RecoveringStore, keys: set[tuple[str, int]]) -> int:
    """Rebuild the named consume queues from the whole retained log; returns the hole
    entries written (queue offsets whose records the scan stepped over as damaged)."""
    holes = 0
    for msg in store.log.scan(store.log.start_position):
        for topic, qid, qoff, position, size, th in queue_entries(msg):
            key = (topic, qid)
            if key not in keys:
                continue
            cq = store._cqs[key]
            if cq.is_empty and qoff > cq.next_offset:
                cq.set_start(qoff)  # earlier records were removed by retention
            while qoff > cq.next_offset:
                # A gap inside the retained log: those records were lost to damage. A hole
                # keeps the queue dense (entry i is offset i) and tells readers to step over it.
                cq.append(position, 0, 0)
                holes += 1
            if qoff == cq.next_offset:
                cq.append(position, size, th)
    return holes


def _ensure_topic_for(store: RecoveringStore, name: str, queue_id: int, store_ms: int) -> None:
    topic = store.topics.get(name)
    if topic is None or topic.queue_count <= queue_id:
        store.topics[name] = TopicConfig(
            name, max(queue_id + 1, topic.queue_count if topic else 1),
            topic.message_types if topic else frozenset(MessageType), store_ms)
        _save_topics_in_recovery(store)


def _save_topics_in_recovery(store: RecoveringStore) -> None:
    """Save the topic table, or on a full disk leave it to the next checkpoint: until then a
    restart rebuilds the same table from the same log."""
    try:
        store._save_topics()
    except OSError as e:
        if not is_disk_full(e):
            raise
        store._topics_unsaved = True
        store.disk.note_full("saving the topic table", e)
