"""The message store: commit log + consume queues + topic table + dispatch + recovery + retention.

Theory of operation: `append()` encodes records for the log's current end, assigns each its
queue and queue offset, and writes them (page cache) in one call; `wait_durable()` returns when
an fsync covers them. When the log reports new durable bytes, the store *dispatches* those
records through the one `Dispatch` it was handed (`chronoq/dispatch.py`, which names every
consumer: its own consume queues (`enter`), then the timer index, the trace and the long
polls), and only then are their senders released. So nothing is visible to a consumer before
it is durable. The read cache (`store/readcache.py`) keeps what was just dispatched, and
checkpoints are written by `store/checkpointing.py`.

Recovery (`open`) in order: lock the directory; read the topic table; open the log, truncating a
torn tail and quarantining damage (`store/damage.py`; a tail lost below the checkpoint, as a power
loss under `flush = "async"` leaves it, is cut and reported); load each consume queue, dropping
entries past the log's end (counted and logged) and marking damaged ones for rebuild; replay the
log from the checkpoint's dispatched position (idempotent: an entry is appended only where the
queue is missing it);
rebuild damaged queues from the whole log. A queue offset whose record was lost to damage gets a
*hole* entry (size 0) so the queue stays dense and readers step over it.
The store knows nothing of consumers or timers: the rooms dispatch reaches, and the broker, own
those meanings.

Retention (`expired_before`) deletes whole segments, oldest first, once the youngest store time
inside one is older than `retention_ms`: store times, never file times (a directory restored from
a backup has old mtimes). Records already in the log at open were stored before it, so a store
time later than the broker time at open (a clock that was wrong) counts as the open time
(`_stored_ms`), and such a segment cannot hold retention back past `retention_ms` after the open.
A re-base of broker time (`clock.py`) moves the store times kept for this (`clock_rebased`) back
with it, so no segment waits out the step.

A full disk (`store/diskspace.py`) is back-pressure. Dispatch that runs out of space writing
derived state (a consume-queue append, the timer index's RocksDB write) keeps the records it could not
finish in line and reports how far it got, so their senders stay unacknowledged; the log's
flusher retries it, sends are refused meanwhile (`check_room_for_send`), and it resumes when
space returns. A process out of file descriptors with no consume-queue file left to give up
(`OpenFiles.open_path`) holds dispatch back the same way: a written record is never reported as
refused (in async mode dispatch runs inside `append`), and new sends are refused (`Throttled`);
`disk_stats` shows it beside the disk-full hold (`dispatch_out_of_fds`, on `chronoq stats`' disk line).
A checkpoint that finds no space raises `DiskFull` and leaves the old one valid.
Recovery writes nothing that needs space: its checkpoint, or a topic table it had to rebuild,
waits for a later checkpoint when the disk is full (an old checkpoint past the log's end is
removed instead: it names no boundary of the records written past it next).

A checkpoint (the dispatched position, once every consume-queue write below it is fsynced, and
never past the log's fsynced end, which `flush = "async"` dispatch runs ahead of) runs
on the caller's thread at open, close and before retention deletes, and on the store's own
worker thread for the broker's periodic tick (`checkpoint_in_background`), so the loop does not
wait out its fsyncs: what it covers is decided on the loop first, and the next checkpoint, or
the close, takes its outcome. Records just dispatched stay decoded in a bounded read cache, in a
form the garbage collector stops tracking (`store/readcache.py`).

Reads (`read_at`) return None for a record retention removed or a hole, and raise
`CorruptRecord` for a damaged one, after quarantining it: each caller decides what a lost
record means to it (skip it, drop an in-flight entry, mark a timer damaged). `readable` is the
same read for callers to whom damage means "skip", and `readable_entry` the read of a queue
entry: a link's (`store/links.py`: a link record enters records already in the log into other
topics' queues, how timers fire) goes through its link record to the linked record, shown as
the message that queue holds (`linked_reads.view`, the link writer's say). A link record's
links are dispatched, replayed and rebuilt as queue entries by the rule every record's own
entry follows (`queue_entries`).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import resource
import shutil
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chronoq.config import Config
from chronoq.dispatch import Dispatch
from chronoq.errors import (
    ChronoqError,
    CorruptRecord,
    DataDirLocked,
    DiskFull,
    FlushFailed,
    FsyncFailed,
    InvalidQueueId,
    Throttled,
    TopicExists,
    TopicNotFound,
)
from chronoq.model import LINKS_TOPIC, MessageType, StoredMessage, TopicConfig
from chronoq.store import files, fsync
from chronoq.store.checkpointing import CheckpointWriter
from chronoq.store.commitlog import CommitLog, RecoveryReport, Segment
from chronoq.store.consumequeue import ConsumeQueue, OpenFiles, TakenFlush, tag_hash
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.store.links import LINKED, LinkBatch, Links, decode_links, encode_links, link_entries, queue_entries
from chronoq.store.meta import (
    CHECKPOINT_VERSION,
    decode_topics,
    encode_checkpoint,
    encode_topics,
    read_checkpoint_versioned,
    write_atomic,
)
from chronoq.store.readcache import CACHED_SIZE, ReadCache, from_cache
from chronoq.store.record import encode_record


class LinkedReads(Protocol):
    """What the writer of the links (the timer room, `timer/reads.py`) says about reading them."""

    def view(self, msg: StoredMessage, topic: str, queue_id: int, queue_offset: int,
             linked_ms: int) -> StoredMessage:
        """A linked record, read at `queue_offset` of queue (`topic`, `queue_id`), where it was
        linked at `linked_ms` (its link record's store time): the message it is there."""
        ...

    def link_copy(self, position: int) -> tuple[Links, int] | None:
        """A link record's links and store time from a copy kept elsewhere (None: no copy): read
        in its place when the record is damaged on disk."""
        ...

    def next_read_ms(self, msg: StoredMessage) -> int | None:
        """A record just dispatched -> the broker time before which nothing reads it by position
        (a timer's due time), `NEVER_READ`, or None: it may be read at once. The read cache asks it."""
        ...


NEVER_READ = -1
log = logging.getLogger("chronoq.store")

LINKS_CACHED = 64
"""Decoded link records kept (`MessageStore._links_cache`): ~30 bytes a link (~250 KB for a full
fire step of 8,192), so at most ~16 MB at the default step."""


def _out_of_fds(exc: BaseException) -> bool:
    """Whether `exc` says the process (EMFILE) or the system (ENFILE) had no descriptor for a
    consume-queue file. (Not the timer index's RocksDB "Too many open files": whether a RocksDB write
    recovers from that without a reopen is untested, so it still raises as before.)"""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def _warn_if_queue_files_exceed_the_fd_limit(max_open_queue_files: int) -> None:
    """Consume queues may hold twice `max_open_queue_files` descriptors (a checkpoint syncs
    duplicates); past half the process's soft RLIMIT_NOFILE that leaves too little for the log,
    RocksDB and connections. Said at open, not refused: the limit is the environment's."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and 2 * max_open_queue_files > soft // 2:
        log.warning("max_open_queue_files = %d: consume queues may hold %d descriptors, more than half the "
                    "process's open-file limit (ulimit -n) %d; lower it or raise the limit",
                    max_open_queue_files, 2 * max_open_queue_files, soft)


@dataclass(slots=True)
class PreparedMessage:
    """A validated message the broker asks the store to append."""

    topic: str
    message_id: str
    message_type: MessageType
    body: bytes
    born_ms: int
    tag: str = ""
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)
    system_properties: Mapping[str, str] = field(default_factory=dict)
    queue_id: int | None = None
    queue_key: str | None = None
    """FIFO: messages with the same key go to the same queue."""
    links: LinkBatch | None = None
    """Set on a link record (topic `LINKS_TOPIC`, empty body): the records it enters into other
    topics' queues; `append` chooses their queues and offsets and encodes the body."""


class PlainLinkedReads:
    """How links read in a store opened without the room that wrote them (`chronoq check`,
    tools): a linked record as a message of the queue it was read from, stored there when it was
    linked, nothing else changed; no copies of link records; every record may be read at once."""

    @staticmethod
    def view(msg: StoredMessage, topic: str, queue_id: int, queue_offset: int, linked_ms: int) -> StoredMessage:
        return StoredMessage(msg.message_id, topic, queue_id, queue_offset, msg.message_type, msg.tag, msg.keys,
                             msg.properties, msg.system_properties, msg.body, msg.born_ms, linked_ms, msg.position,
                             msg.size)

    @staticmethod
    def link_copy(position: int) -> tuple[Links, int] | None:
        return None

    @staticmethod
    def next_read_ms(msg: StoredMessage) -> int | None:
        return None


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


class MessageStore:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.dir = config.data_dir
        self.topics: dict[str, TopicConfig] = {}
        self._cqs: dict[tuple[str, int], ConsumeQueue] = {}
        self.queue_files = OpenFiles(config.max_open_queue_files, on_fsync_failed=self._queue_fsync_failed)
        """Every consume queue's open files, at most `max_open_queue_files` (least recently used
        closed first): the store's descriptors do not grow with the number of queues."""
        self._next_qoff: dict[tuple[str, int], int] = {}
        self._round_robin: dict[str, itertools.count[int]] = {}
        self._undispatched: deque[StoredMessage] = deque()
        self.dispatched_position = 0
        self._dispatch = Dispatch.queues_only(self)
        """Where durable records go (`chronoq/dispatch.py`): the queues only, until the broker
        hands over the dispatch it built with every consumer (`dispatch_through`)."""
        self.linked_reads: LinkedReads = PlainLinkedReads()
        """How a record read through a link looks in the queue it was linked into, where a
        damaged link record's links are read instead, and when a record is next read: the writer
        of the links says (the broker hands over the timer room's `timer/reads.py`)."""
        self.damaged_links_read: set[int] = set()
        """Positions of damaged link records whose links were read from their copy (for stats and
        a log line per record, not per read)."""
        self.skipped_damaged = 0
        self.read_cache = ReadCache(config.read_cache_bytes)
        """Records just dispatched, decoded, for the reads that usually follow (`store/readcache.py`)."""
        self._links_cache: OrderedDict[int, tuple[Links, int]] = OrderedDict()
        """Link record position -> its decoded links and its store time, the last `LINKS_CACHED`
        dispatched or read: a link's queue entry names its link record, which every read of it
        goes through."""
        self._checkpoints = CheckpointWriter(self.dir / files.CHECKPOINT, self._checkpoint_failed)
        """Writes checkpoints, on the caller's thread or its own (`store/checkpointing.py`)."""
        self.disk = DiskSpace(config.data_dir, min_free_bytes=config.disk_min_free_bytes,
                              reserve_file_bytes=config.disk_reserve_file_bytes)
        self._dispatch_blocked: str | None = None
        """What a full disk stopped dispatch from writing; the flusher retries until it is done."""
        self._dispatch_out_of_fds: str | None = None
        """Set instead when the process ran out of file descriptors (EMFILE, ENFILE) with no
        queue file left to give up: held back and retried the same way (the record is written,
        and in async mode may be fsynced already: its sender must not hear "refused")."""
        self._topics_unsaved = False
        """Recovery changed the topic table on a full disk; the next checkpoint saves it."""
        self._lock_fd: int | None = None
        self.log: CommitLog
        self.first_seen_ms: int | None = None
        """Broker time when this store was opened (`open(opened_ms=...)`, else the first
        retention check's): records already in the log were stored no later than this."""

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, config: Config, *, opened_ms: int | None = None) -> tuple[MessageStore, OpenReport]:
        """Open (recover) the store. `opened_ms`: the broker's time now, which retention gives to
        records that claim to be stored later (`_stored_ms`); tools that never run retention
        leave it out."""
        store = cls(config)
        store.first_seen_ms = opened_ms
        _warn_if_queue_files_exceed_the_fd_limit(config.max_open_queue_files)
        fsync.make_dirs(store.dir)
        store._lock()
        try:
            store.disk.open_reserve()  # before anything writes: RocksDB cannot open on a full disk
            report = store._recover()
        except OSError as e:
            store._unlock()
            if is_disk_full(e):  # replaying the log into a consume queue found no room
                raise store.disk.ran_out("recovery (replaying the log into the consume queues)") from e
            raise
        except BaseException:
            store._unlock()
            raise
        return store, report

    def dispatch_through(self, dispatch: Dispatch, linked_reads: LinkedReads) -> None:
        """Hand over what the rooms built on this store decide (the broker, once each exists):
        where durable records go from now on (`dispatch`, built with every consumer) and how
        linked records read (`linked_reads`). Recovery dispatched nothing to anyone: it wrote the
        queues itself, and each room replays the log for its own state."""
        self._dispatch = dispatch
        self.linked_reads = linked_reads

    def _queue_fsync_failed(self, reason: str) -> None:
        """A consume queue's fsync failed: the store fails as a whole, as for the log's."""
        self.log.fail(reason)

    def _lock(self) -> None:
        fd = os.open(self.dir / files.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirLocked(str(self.dir)) from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _recover(self) -> OpenReport:
        topics_damaged = self._load_topics()
        found = read_checkpoint_versioned(self.dir / files.CHECKPOINT)
        checkpoint = None if found is None else found[0]
        self.log, log_report = CommitLog.open(
            self.dir / files.COMMITLOG_DIR, segment_size_bytes=self.config.segment_size_bytes,
            flush=self.config.flush, flush_interval_ms=self.config.flush_interval_ms,
            scan_from=checkpoint or 0, verify_below=found is not None and found[1] < CHECKPOINT_VERSION,
            disk=self.disk, dispatch_retry_ms=self.config.disk_full_retry_ms,
        )
        report = OpenReport(log=log_report, checkpoint=checkpoint, topics_damaged=topics_damaged)
        damaged: set[tuple[str, int]] = set()
        queues_root = self.dir / files.QUEUES_DIR
        if queues_root.exists():
            for topic in sorted(os.listdir(queues_root)):
                for qid_name in sorted(os.listdir(queues_root / topic)):
                    if not qid_name.isdigit():
                        continue
                    key = (topic, int(qid_name))
                    cq, cq_report = ConsumeQueue.open(
                        queues_root / topic / qid_name, self.config.consume_queue_entries_per_file,
                        log_start=self.log.start_position, log_end=self.log.end_position,
                        open_files=self.queue_files)
                    report.truncated_cq_entries += cq_report.truncated_entries
                    if cq_report.damaged:
                        cq.destroy()
                        cq = ConsumeQueue(cq.directory, self.config.consume_queue_entries_per_file, self.queue_files)
                        damaged.add(key)
                    self._cqs[key] = cq
        if report.truncated_cq_entries:
            # Queue entries are written only for dispatched records, so acknowledged ones: with
            # flush = "async", what a power loss took before their fsync (those whose entries had
            # reached a durable queue file: a lower bound); with "sync", what the disk lost. The
            # timer index, ahead of the log's end too, is rebuilt by its owner.
            log.warning("recovery: %d consume-queue entries pointed past the commit log's end %d and were dropped: "
                        "acknowledged messages the log no longer holds", report.truncated_cq_entries,
                        self.log.end_position)
        for topic in self.topics.values():
            for qid in range(topic.queue_count):
                key = (topic.name, qid)
                if key not in damaged and self._cq(key).is_empty:
                    # No file at all: the queue was deleted (every queue gets a file when its
                    # topic is created), or it predates that rule. Either way, rebuild it.
                    damaged.add(key)
        start = min(checkpoint if checkpoint is not None else 0, self.log.end_position)
        for msg in self.log.scan(start):
            report.replayed_records += 1
            # A record's own entry, and a link record's links: each names its queue and offset.
            for topic, qid, qoff, position, size, th in queue_entries(msg):
                self._ensure_topic_for(topic, qid, msg.store_ms)
                key = (topic, qid)
                if key in damaged:
                    continue
                cq = self._cq(key)
                if qoff < cq.next_offset:
                    continue
                if qoff > cq.next_offset:
                    # Entries are missing below the checkpoint (a deleted or damaged queue, or
                    # records expired before the queue was first written): rebuild it from the log.
                    cq.destroy()
                    self._cqs[key] = ConsumeQueue(cq.directory, self.config.consume_queue_entries_per_file,
                                                  self.queue_files)
                    damaged.add(key)
                    continue
                cq.append(position, size, th)
        if damaged:
            report.hole_entries = self._rebuild(damaged)
            for key in damaged:
                self._cqs[key].ensure_file()
            report.rebuilt_queues = sorted(f"{t}/{q}" for t, q in damaged)
        for key, cq in self._cqs.items():
            self._next_qoff[key] = cq.next_offset
        self.dispatched_position = self.log.end_position
        self.log.on_durable = self._on_durable
        try:
            self.checkpoint()
        except DiskFull as e:  # the old checkpoint stays valid: replay starts there again
            self.disk.note_full("checkpoint", e)
            if checkpoint is not None and checkpoint > self.log.end_position:
                # Unless it is past the log's end (records below it were lost): new records will
                # run past it, and it names no boundary of theirs; a recovery walking from it would
                # take the record it lands in for a torn tail and cut it. Removed (no space
                # needed): the next recovery replays the log from its start.
                (self.dir / files.CHECKPOINT).unlink(missing_ok=True)
                fsync.fsync_dir(self.dir)
        return report

    def _load_topics(self) -> str | None:
        """Read the topic table. A damaged one is moved aside (`topics.damaged-<n>`) and rebuilt
        from what else says which topics exist: the queue directories (one per queue, made when
        the topic was created) here, the log's records during replay. What only the table knew
        is lost and said so: the accepted message types (all are accepted again) and the
        creation time (0). Returns the reason, or None when the table was sound."""
        path = self.dir / files.TOPICS
        if not path.exists():
            return None
        try:
            self.topics = {t.name: t for t in decode_topics(path.read_bytes())}
            return None
        except CorruptRecord as e:
            reason = e.reason
        aside = files.damaged_name(path)
        os.rename(path, aside)
        queues_root = self.dir / files.QUEUES_DIR
        for name in sorted(os.listdir(queues_root)) if queues_root.is_dir() else []:
            qids = [int(q) for q in os.listdir(queues_root / name) if q.isdigit()]
            if qids:
                self.topics[name] = TopicConfig(name, max(qids) + 1, frozenset(MessageType), 0)
        self._save_topics_in_recovery()
        message = (f"topic table {path} is damaged ({reason}); moved to {aside.name} and rebuilt from the queues: "
                   f"{len(self.topics)} topics, every message type accepted again")
        log.error("%s", message)
        return message

    def _rebuild(self, keys: set[tuple[str, int]]) -> int:
        """Rebuild the named consume queues from the whole retained log; returns the hole
        entries written (queue offsets whose records the scan stepped over as damaged)."""
        holes = 0
        for msg in self.log.scan(self.log.start_position):
            for topic, qid, qoff, position, size, th in queue_entries(msg):
                key = (topic, qid)
                if key not in keys:
                    continue
                cq = self._cqs[key]
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

    def _ensure_topic_for(self, name: str, queue_id: int, store_ms: int) -> None:
        topic = self.topics.get(name)
        if topic is None or topic.queue_count <= queue_id:
            self.topics[name] = TopicConfig(
                name, max(queue_id + 1, topic.queue_count if topic else 1),
                topic.message_types if topic else frozenset(MessageType), store_ms)
            self._save_topics_in_recovery()

    def _save_topics_in_recovery(self) -> None:
        """Save the topic table, or on a full disk leave it to the next checkpoint: until then a
        restart rebuilds the same table from the same log."""
        try:
            self._save_topics()
        except OSError as e:
            if not is_disk_full(e):
                raise
            self._topics_unsaved = True
            self.disk.note_full("saving the topic table", e)

    # -- topics -----------------------------------------------------------------------------

    def create_topic(self, name: str, queue_count: int, message_types: frozenset[MessageType],
                     now_ms: int, *, exist_ok: bool = False) -> TopicConfig:
        existing = self.topics.get(name)
        if existing is not None:
            if exist_ok:
                return existing
            raise TopicExists(name)
        topic = TopicConfig(name, queue_count, message_types, now_ms)
        self.topics[name] = topic
        try:
            for qid in range(queue_count):
                self._cq((name, qid)).ensure_file()
            self._save_topics()
        except OSError as e:
            # Not created: empty queue files made so far stay (recovery ignores queues of no
            # topic, and a later create reuses them).
            del self.topics[name]
            if is_disk_full(e):
                raise self.disk.ran_out(f"creating topic {name!r}") from e
            raise
        return topic

    def get_topic(self, name: str) -> TopicConfig:
        topic = self.topics.get(name)
        if topic is None:
            raise TopicNotFound(name)
        return topic

    def _save_topics(self) -> None:
        write_atomic(self.dir / files.TOPICS, encode_topics(list(self.topics.values())))

    # -- writing ----------------------------------------------------------------------------

    def _cq(self, key: tuple[str, int]) -> ConsumeQueue:
        cq = self._cqs.get(key)
        if cq is None:
            cq = ConsumeQueue(files.queue_dir(self.dir, *key), self.config.consume_queue_entries_per_file,
                              self.queue_files)
            self._cqs[key] = cq
        return cq

    def _pick_queue(self, topic: TopicConfig, msg: PreparedMessage) -> int:
        if msg.queue_id is not None and not 0 <= msg.queue_id < topic.queue_count:
            raise InvalidQueueId(topic.name, msg.queue_id, topic.queue_count)
        return self._queue_for(topic.name, topic.queue_count, msg.queue_id,
                               None if msg.queue_key is None else tag_hash(msg.queue_key))

    def _queue_for(self, name: str, count: int, queue_id: int | None, key_hash: int | None) -> int:
        """The queue a record joins, of the topic's `count`: the one named (in range), else its
        key's (a message group's hash), else the topic's next in round robin."""
        if queue_id is not None:
            return queue_id
        if key_hash is not None:
            return key_hash % count
        return next(self._round_robin.setdefault(name, itertools.count())) % count

    def append(self, msgs: list[PreparedMessage], store_ms: int) -> list[StoredMessage]:
        """Write `msgs` (validated, topics existing) to the log; return them as stored.
        Durable only after `wait_durable(result[-1].position + result[-1].size)`.

        All or nothing, so that a refusal changes nothing: every record is encoded before any is
        written (a bad queue id, a field too long to encode), and a write or roll that fails
        part-way takes back what the batch wrote (`CommitLog.undo_to`). A queue offset handed to a
        record that is never written would leave a hole in its queue, and recovery rebuilds a
        queue only up to its first hole."""
        out: list[StoredMessage] = []
        blobs: list[bytes] = []
        next_qoff: dict[tuple[str, int], int] = {}
        # Rolling never moves the end position (a new segment starts at the old end), so a record
        # encoded for `position` stays valid whichever segment receives it.
        position = self.log.end_position
        for msg in msgs:
            qid = self._pick_queue(self.get_topic(msg.topic), msg)
            key = (msg.topic, qid)
            qoff = next_qoff.get(key, self._next_qoff.get(key, 0))
            next_qoff[key] = qoff + 1
            if msg.links is not None:
                msg = PreparedMessage(msg.topic, msg.message_id, msg.message_type,
                                      self._links_body(msg.links, next_qoff), msg.born_ms, queue_id=qid)
            blob = self._encode(msg, qid, qoff, position, store_ms)
            blobs.append(blob)
            # Positional, in field order: keywords cost twice as much, and this runs per record.
            out.append(StoredMessage(msg.message_id, msg.topic, qid, qoff, msg.message_type, msg.tag, msg.keys,
                                     msg.properties, msg.system_properties, msg.body, msg.born_ms, store_ms,
                                     position, len(blob)))
            position += len(blob)
        start = self.log.end_position
        try:
            chunk_start = 0
            chunk_len = 0
            for i, blob in enumerate(blobs):
                if not self.log.fits_in_active(chunk_len + len(blob)):
                    if chunk_len:
                        self.log.write(b"".join(blobs[chunk_start:i]), store_ms)
                    self.log.roll_if_needed(len(blob))
                    chunk_start, chunk_len = i, 0
                chunk_len += len(blob)
            if chunk_len:
                self.log.write(b"".join(blobs[chunk_start:]), store_ms)
        except BaseException:
            # All or nothing: records written before a roll or write that failed (a batch that
            # spans segments) are taken back, or a refused batch would be stored and delivered
            # anyway, and its retry stored again. A failed log refuses everything already.
            if self.log.failure is None:
                self.log.undo_to(start)
            raise
        self._next_qoff.update(next_qoff)
        self._undispatched.extend(out)
        if self.config.flush == "async":
            self._on_durable(self.log.end_position)  # async mode: visible once written
        return out

    def _links_body(self, links: LinkBatch, next_qoff: dict[tuple[str, int], int]) -> bytes:
        """A link record's body: each link's queue chosen by the rule a record's own follows
        (`_pick_queue`: the producer's queue if the topic has it, else its message group's, else
        the round robin) and given the next offset there, counted in `next_qoff` with the batch's."""
        qids: list[int] = []
        qoffs: list[int] = []
        counts: dict[str, int] = {}  # (a fire step's thousands of links name a few topics)
        stored_next = self._next_qoff
        for name, qid, group_hash in zip(links.topics, links.queue_ids, links.group_hashes, strict=True):
            count = counts.get(name)
            if count is None:
                count = counts[name] = self.get_topic(name).queue_count
            # A queue named when the timer was sent that the topic no longer has is not refused
            # now (the send was acknowledged): the timer takes the next rule's queue.
            qid = self._queue_for(name, count, qid if qid is not None and 0 <= qid < count else None, group_hash)
            key = (name, qid)
            qoff = next_qoff.get(key)
            if qoff is None:
                qoff = stored_next.get(key, 0)
            next_qoff[key] = qoff + 1
            qids.append(qid)
            qoffs.append(qoff)
        return encode_links(links, qids, qoffs)

    @staticmethod
    def _encode(msg: PreparedMessage, qid: int, qoff: int, position: int, store_ms: int) -> bytes:
        return encode_record(
            position=position, message_id=msg.message_id, topic=msg.topic, queue_id=qid,
            queue_offset=qoff, message_type=msg.message_type, tag=msg.tag, keys=msg.keys,
            properties=msg.properties, system_properties=msg.system_properties, body=msg.body,
            born_ms=msg.born_ms, store_ms=store_ms)

    async def wait_durable(self, end: int) -> None:
        """Return once the records below `end` may be acknowledged: fsynced and dispatched with
        `flush = "sync"` (the default); with `flush = "async"`, written and dispatched (they are
        fsynced within `flush_interval_ms`; a power loss may take the last of them)."""
        if self.config.flush == "async" and end <= self.dispatched_position and self.log.failure is None:
            return
        await self.log.wait_durable(end)

    async def append_durable(self, msgs: list[PreparedMessage], store_ms: int) -> list[StoredMessage]:
        """`append`, then wait until the records are durable and dispatched: the appender the
        broker's own writers use (fired and rolled timers, tombstones, dead letters)."""
        stored = self.append(msgs, store_ms)
        if stored:
            await self.wait_durable(stored[-1].position + stored[-1].size)
        return stored

    def undispatched(self, topic: str) -> int:
        """Records of `topic` written and not yet dispatched (waiting for their fsync, or for room
        to write their derived state): for the timer topic, RocketMQ's timer enqueue lag."""
        start = self.dispatched_position
        return sum(1 for m in self._undispatched if m.topic == topic and m.position >= start)

    def check_room_for_send(self) -> None:
        """Refuse a producer send (DiskFull) below the send reserve, or while dispatch is held
        back by a full disk (a send now would only wait for it)."""
        self.disk.check_send()
        if self._dispatch_blocked is not None:
            raise self.disk.ran_out(self._dispatch_blocked)
        if self._dispatch_out_of_fds is not None:
            raise Throttled(f"{self._dispatch_out_of_fds}; sends are refused until it resumes (raise `ulimit -n`)")

    def disk_stats(self) -> dict[str, object]:
        """Free space, the limits, what a full disk is holding back now, and dispatch held back
        for lack of file descriptors (`dispatch_out_of_fds`, None when not) (for `stats`)."""
        return {"free_bytes": self.disk.free_bytes(), "min_free_bytes": self.disk.min_free_bytes,
                "reserve_file_bytes": self.disk.reserve_path.stat().st_size if self.disk.reserve_path.exists() else 0,
                "held_back": self.disk.held_back, "dispatch_blocked": self._dispatch_blocked,
                "dispatch_out_of_fds": self._dispatch_out_of_fds}

    def _on_durable(self, end: int) -> int | None:
        """Dispatch the records below `end` (durable ones; in async mode, written ones): the
        dispatch step (`chronoq/dispatch.py`) takes them to their queues and every room. Returns
        None when all are dispatched, else the position of the first one that is not: the disk
        ran out of space while writing its derived state, and the call is repeated later.
        Repeating is safe: consume queues skip entries they hold, the timer index ignores what
        it has applied (its write is one atomic batch), wake-ups are idempotent."""
        pending = self._undispatched
        batch: list[StoredMessage] = []
        stale = 0
        for msg in pending:
            if msg.position >= end:
                break
            if msg.position < self.dispatched_position:
                stale += 1  # dispatched already: a record is never dispatched twice
                continue
            batch.append(msg)
        if batch:
            try:
                self._dispatch(batch)
            except Exception as e:
                if is_disk_full(e):
                    self._dispatch_blocked = f"dispatching durable records from position {batch[0].position}"
                    self.disk.note_full("dispatch", e)
                elif _out_of_fds(e):
                    # No queue file was left to give up (`OpenFiles.open_path`). Raising would
                    # stop the flusher (sync mode) or tell an async sender its stored record was
                    # refused, and its retry would store it twice: held back instead.
                    if self._dispatch_out_of_fds is None:
                        log.warning("dispatch held back: the process is out of file descriptors; retrying every "
                                    "%d ms (raise `ulimit -n`): %s",
                                    self.log.dispatch_retry_ms, e)
                    self._dispatch_out_of_fds = (f"dispatching records from position {batch[0].position} held back: "
                                                 f"out of file descriptors ({e})")
                else:
                    raise
                return batch[0].position
            self.dispatched_position = batch[-1].position + batch[-1].size
            self.read_cache.put(batch, self.linked_reads.next_read_ms)
        for _ in range(stale + len(batch)):
            pending.popleft()
        if self._dispatch_blocked is not None:
            self._dispatch_blocked = None
            self.disk.note_ok("dispatch")
        if self._dispatch_out_of_fds is not None:
            self._dispatch_out_of_fds = None
            log.warning("dispatch resumed: file descriptors were freed")
        return None

    def enter(self, records: list[StoredMessage]) -> None:
        """The queues' step of dispatch: each record's consume-queue entry, and each link's of a
        link record (whose decoded links are kept for the rooms that read them next), appended
        per queue in one write."""
        per_queue: dict[tuple[str, int], tuple[int, list[tuple[int, int, int]]]] = {}
        for msg in records:
            key = (msg.topic, msg.queue_id)
            entries = per_queue.get(key)
            if entries is None:
                entries = per_queue[key] = (msg.queue_offset, [])
            entries[1].append((msg.position, msg.size, tag_hash(msg.tag)))
            if msg.topic == LINKS_TOPIC:
                links = decode_links(msg.body, msg.position)
                self._remember_links(msg.position, links, msg.store_ms)  # its consumers read it next
                for topic, qid, qoff, position, size, th in link_entries(msg.position, links):
                    entries = per_queue.get((topic, qid))
                    if entries is None:
                        entries = per_queue[(topic, qid)] = (qoff, [])
                    entries[1].append((position, size, th))
        for key, (first_offset, entries) in per_queue.items():
            self._cq(key).append_many(entries, first_offset)

    # -- reading ----------------------------------------------------------------------------

    @property
    def read_cache_hits(self) -> int:
        """Reads the read cache answered since start."""
        return self.read_cache.hits

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        return self._cq((topic, queue_id))

    def queue_keys(self) -> list[tuple[str, int]]:
        return list(self._cqs)

    def read_at(self, position: int, size: int) -> StoredMessage | None:
        """The record at `position`; None when retention has removed it or the queue entry is a
        hole (size 0: lost to damage). Raises CorruptRecord when the record is damaged, after
        quarantining the bytes (`CommitLog.quarantine`)."""
        if position < self.log.start_position or size == 0:
            return None
        cache = self.read_cache
        cached = cache.records.get(position)
        if cached is not None and cached[CACHED_SIZE] == size:
            cache.hits += 1
            return from_cache(cached)
        try:
            return self.log.read(position, size)
        except CorruptRecord as e:
            self._quarantine_if_damaged(position, e.reason)
            raise

    def readable(self, position: int, size: int) -> StoredMessage | None:
        """`read_at` for callers to whom a damaged record means "skip it" (it is quarantined and
        reported once; the reader goes on with the next record)."""
        try:
            return self.read_at(position, size)
        except CorruptRecord:
            self.skipped_damaged += 1
            return None

    def readable_entry(self, topic: str, queue_id: int, queue_offset: int, position: int,
                       size: int) -> StoredMessage | None:
        """The message at `queue_offset` of queue (`topic`, `queue_id`), whose entry says
        (`position`, `size`): `readable`'s answer for it (None: removed by retention, a hole, or
        damaged and skipped). A link entry (`LINKED` in `size`) is read through its link record,
        and the linked record (its own topic is another: a fired timer's) is shown as the message
        the queue holds, as its linker says (`linked_reads.view`)."""
        try:
            if not size & LINKED:
                return self.read_at(position, size)
            target = self._link_target(position, size & ~LINKED)
            if target is None:
                return None
            position, size, linked_ms = target
            msg = self.read_at(position, size)
        except CorruptRecord:
            self.skipped_damaged += 1
            return None
        return None if msg is None else self.linked_reads.view(msg, topic, queue_id, queue_offset, linked_ms)

    def links_in(self, msg: StoredMessage) -> Links:
        """The links of link record `msg` (decoded at its dispatch, so the rooms dispatch reaches read them
        from the cache)."""
        cached = self._links_cache.get(msg.position)
        return cached[0] if cached is not None else decode_links(msg.body, msg.position)

    def _link_target(self, position: int, index: int) -> tuple[int, int, int] | None:
        """(position, size) of the record link `index` of the link record at `position` names,
        and the link record's store time; None when retention removed the link record.
        A damaged link record (then quarantined) is read from its copy (`link_copy`: the timer
        index keeps one while the record is retained); CorruptRecord when there is none, or no
        such link."""
        cached = self._links_cache.get(position)
        if cached is None:
            if position < self.log.start_position:
                return None
            try:
                rec = self.log.read_unsized(position)
                cached = (decode_links(rec.body, position), rec.store_ms)
            except CorruptRecord as e:
                self._quarantine_if_damaged(position, e.reason)
                copy = self.linked_reads.link_copy(position)
                if copy is None:
                    raise
                cached = copy
                if position not in self.damaged_links_read:
                    self.damaged_links_read.add(position)
                    log.error("link record at position %d is damaged (%s); its %d links are read from the timer "
                              "index's copy of it, nothing is lost", position, e.reason, len(copy[0]))
            self._remember_links(position, *cached)
        else:
            self._links_cache.move_to_end(position)
        links, linked_ms = cached
        if index >= len(links):
            raise CorruptRecord(f"a queue entry names link {index} of a link record of {len(links)}", position)
        return links.positions[index], links.sizes[index], linked_ms

    def _remember_links(self, position: int, links: Links, store_ms: int) -> None:
        cache = self._links_cache
        cache[position] = (links, store_ms)
        while len(cache) > LINKS_CACHED:
            cache.popitem(last=False)

    def check_records(self, spans: list[tuple[int, int]]) -> dict[int, str]:
        """Check the records at these (position, size) spans without decoding them: length,
        magic, position and CRC32C, each run of adjacent records read in one `pread`. Returns
        {position: why} for those that fail (quarantined, as `read_at` does). A record in the
        read cache passed its checks when it was written and is not read again."""
        cache = self.read_cache.records
        todo = []
        for position, size in spans:
            cached = cache.get(position)
            if cached is None or cached[CACHED_SIZE] != size:
                todo.append((position, size))
        bad = self.log.check_records(todo) if todo else {}
        for position, reason in bad.items():
            self._quarantine_if_damaged(position, reason)
        return bad

    def _quarantine_if_damaged(self, position: int, reason: str) -> None:
        """A read at `position` failed: quarantine the record if it fails its own checks (not
        only the size an index gave for it), as damage found by any reader is."""
        if self.log.contains(position) and self.log.is_damaged(position):
            self.log.quarantine(position, reason)

    def scan(self, start: int, end: int | None = None) -> Iterator[StoredMessage]:
        return self.log.scan(start, end)

    # -- checkpoint and retention -----------------------------------------------------------

    def checkpoint(self) -> int:
        """Make consume queues durable and record how far they cover, all on the calling thread
        (open, close, retention before it deletes; tests). After any fsync error (here or in the
        log) it raises FlushFailed and writes nothing: the checkpoint on disk stays at the last
        point known durable, and a restart replays the log from there."""
        self._checkpoints.settle()
        position, taken = self._take_checkpoint()
        self._checkpoints.write_now(taken, encode_checkpoint(position, 0))
        return position

    async def checkpoint_in_background(self) -> int:
        """`checkpoint`, with its fsyncs and the checkpoint file's write on a worker thread: the
        event loop goes on serving meanwhile (a checkpoint every second made of several fsyncs
        on the loop held every message behind it for milliseconds). What it covers is decided
        on the loop, before the thread starts: the position dispatched so far and the queue
        files dirty up to it. Cancelled while waiting (the broker closing), the thread finishes
        regardless, and the next checkpoint waits for it and takes its outcome."""
        await self._checkpoints.wait_for_running()
        position, taken = self._take_checkpoint()
        await self._checkpoints.write_in_background(taken, encode_checkpoint(position, 0))
        return position

    def _take_checkpoint(self) -> tuple[int, list[TakenFlush]]:
        """On the loop: the position a checkpoint records and the fsyncs that must precede it."""
        if self.log.failure is not None:
            raise FlushFailed(self.log.failure)
        # Never past the log's fsynced end: with flush = "async" records are dispatched once
        # written, and a checkpoint past the fsynced end would point into what a power loss can
        # zero, where recovery's walk from the checkpoint could not see the loss. (With "sync",
        # dispatch follows the fsync and this is the dispatched position.)
        position = min(self.dispatched_position, self.log.flushed_position)
        try:
            if self._topics_unsaved:
                self._save_topics()
                self._topics_unsaved = False
        except BaseException as e:
            self._checkpoint_failed(e)
            raise
        # Only the queues written since their last take (all the store's queues share
        # `queue_files`): with tens of thousands of idle queues, visiting each held the loop.
        taken: list[TakenFlush] = []
        try:
            for cq in self.queue_files.dirty_queues():
                taken.append(cq.take_dirty())
        except BaseException:
            # (An EMFILE on a duplicate, say.) What was taken is given back, or the next
            # checkpoint would cover those queues' entries without syncing them.
            for t in taken:
                t.untake()
            raise
        return position, taken

    def _checkpoint_failed(self, e: BaseException) -> None:
        """What a failed checkpoint means: an fsync error fails the log for good (re-raised by
        the caller); a full disk raises DiskFull (the old checkpoint file is still whole)."""
        if isinstance(e, FsyncFailed):
            self.log.fail(e.message)
        elif isinstance(e, OSError) and is_disk_full(e):
            # write_atomic removed its temp file; the old checkpoint is still whole and valid.
            raise self.disk.ran_out("writing the checkpoint", self.dir / files.CHECKPOINT) from e

    async def expired_before(self, now_ms: int) -> int:
        """The position below which whole segments are older than the retention period, judged
        by the store times inside them (`_stored_ms`), never by file times."""
        if self.first_seen_ms is None:
            self.first_seen_ms = now_ms
        cutoff_ms = now_ms - self.config.retention_ms
        limit = self.log.start_position
        for seg in self.log.segments()[:-1]:
            if await self._stored_ms(seg) >= cutoff_ms:
                break
            limit = seg.end
        return min(limit, self.dispatched_position)

    async def active_segment_expired(self, now_ms: int) -> bool:
        """Whether every record of the segment being written is older than the retention period
        (nothing was written for that long). It is never deleted, but what its records pin is
        past retention too (`retention.py`: the link records in it)."""
        if self.first_seen_ms is None:
            self.first_seen_ms = now_ms
        return await self._stored_ms(self.log.segments()[-1]) < now_ms - self.config.retention_ms

    async def _stored_ms(self, seg: Segment) -> int:
        """When retention counts `seg` as stored: the store time of its youngest record. A
        record from an earlier run was stored before this run began, so a store time after
        `first_seen_ms` (in the future when the broker opened) was written by a wrong clock: it
        counts as `first_seen_ms`, so that segment expires `retention_ms` after the broker first
        saw it instead of blocking retention (which deletes a prefix) until its false date. A
        segment none of whose earlier-run records pass their checks counts as first seen too."""
        stored = seg.last_store_ms
        if seg.opened_size:
            assert self.first_seen_ms is not None
            opened = await self.log.opened_youngest_store_ms(seg)
            stored = max(stored, self.first_seen_ms if opened is None else min(opened, self.first_seen_ms))
        return stored

    def clock_rebased(self, step_ms: int) -> None:
        """Broker time was moved back by `step_ms` (a re-base, `clock.py`): the store times this
        run keeps for retention (each segment's youngest written, the open time) move back as
        far, so a segment keeps its real age instead of waiting out the step. The records keep
        the store times they were written with; one found at the next open later than that open
        counts as the open time (`_stored_ms`)."""
        for seg in self.log.segments():
            if seg.last_store_ms:
                seg.last_store_ms = max(1, seg.last_store_ms - step_ms)
        if self.first_seen_ms is not None:
            self.first_seen_ms -= step_ms

    def delete_before(self, position: int) -> int:
        removed = self.log.delete_segments_before(position)
        if removed:
            for cq in self._cqs.values():
                cq.delete_files_before(self.log.start_position)
        return len(removed)

    def close(self) -> None:
        try:
            if hasattr(self, "log"):
                try:
                    self._checkpoints.settle()
                except ChronoqError:
                    pass  # an fsync error is the log's failure now: no checkpoint below
                except Exception:
                    log.exception("the last background checkpoint failed; closing with a new one")
                self._checkpoints.shutdown()
                self.log.close()
                healthy = self.log.failure is None
                try:
                    if healthy:
                        self.checkpoint()
                except DiskFull as e:
                    log.warning("closing without a new checkpoint (the last one stays valid): %s", str(e))
                finally:
                    for cq in self._cqs.values():
                        cq.close(sync=healthy and self.log.failure is None)
        finally:
            self._unlock()

    @staticmethod
    def wipe_derived(data_dir: Path) -> None:
        """Remove consume queues and the checkpoint (tests of rebuild-from-log)."""
        shutil.rmtree(data_dir / files.QUEUES_DIR, ignore_errors=True)
        (data_dir / files.CHECKPOINT).unlink(missing_ok=True)
