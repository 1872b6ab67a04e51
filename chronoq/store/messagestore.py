"""The message store: commit log + consume queues + topic table + dispatch.

Theory of operation: `append()` encodes records for the log's current end, assigns each its
queue and queue offset, and writes them (page cache) in one call; `wait_durable()` returns when
an fsync covers them. When the log reports new durable bytes, the store *dispatches* those
records through the one `Dispatch` it was handed (`chronoq/dispatch.py`, which names every
consumer: its own consume queues (`enter`), then the timer index, the trace and the long
polls), and only then are their senders released. So nothing is visible to a consumer before
it is durable. A link record's links are dispatched, replayed and rebuilt as queue entries by
the rule every record's own entry follows (`queue_entries`). The store knows nothing of
consumers or timers: the rooms dispatch reaches, and the broker, own those meanings.

The store is one class made of four modules, each a concept of its own:
- here: the topic table and queues, appends, dispatch, opening and closing;
- `store/messagestore_recovery.py`: what `open` does to make the directory whole (replaying the
  log into the queues, holes, rebuilding damaged queues and a damaged topic table);
- `store/messagestore_reads.py` (`StoreReads`, a base class): reads by position, through links,
  and the damage a read finds;
- `store/messagestore_upkeep.py` (`StoreUpkeep`, a base class): checkpoints and retention.
The read cache (`store/readcache.py`) keeps what was just dispatched, and checkpoints are
written by `store/checkpointing.py`.

A full disk (`store/diskspace.py`) is back-pressure. Dispatch that runs out of space writing
derived state (a consume-queue append, the timer index's RocksDB write) keeps the records it could not
finish in line and reports how far it got, so their senders stay unacknowledged; the log's
flusher retries it, sends are refused meanwhile (`check_room_for_send`), and it resumes when
space returns. A process out of file descriptors with no consume-queue file left to give up
(`OpenFiles.open_path`) holds dispatch back the same way: a written record is never reported as
refused (in async mode dispatch runs inside `append`), and new sends are refused (`Throttled`);
`disk_stats` shows it beside the disk-full hold (`dispatch_out_of_fds`, on `chronoq stats`' disk line).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import shutil
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chronoq.config import Config
from chronoq.dispatch import Dispatch
from chronoq.errors import (
    ChronoqError,
    DataDirLocked,
    DiskFull,
    InvalidQueueId,
    Throttled,
    TopicExists,
    TopicNotFound,
)
from chronoq.model import LINKS_TOPIC, MessageType, StoredMessage, TopicConfig
from chronoq.store import files, fsync
from chronoq.store.checkpointing import CheckpointWriter
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ConsumeQueue, OpenFiles, tag_hash
from chronoq.store.diskspace import DiskSpace, is_disk_full
from chronoq.store.links import LinkBatch, Links, decode_links, encode_links, link_entries
from chronoq.store.messagestore_reads import NEVER_READ, LinkedReads, PlainLinkedReads, StoreReads
from chronoq.store.messagestore_recovery import OpenReport, recover, warn_if_queue_files_exceed_the_fd_limit
from chronoq.store.messagestore_upkeep import StoreUpkeep
from chronoq.store.meta import encode_topics, write_atomic
from chronoq.store.readcache import ReadCache
from chronoq.store.record import encode_record

__all__ = ["NEVER_READ", "LinkedReads", "MessageStore", "OpenReport", "PlainLinkedReads", "PreparedMessage"]
"""What callers import from here; `NEVER_READ`, `LinkedReads`, `PlainLinkedReads` and `OpenReport`
live beside it (`messagestore_reads.py`, `messagestore_recovery.py`)."""

log = logging.getLogger("chronoq.store")


def _out_of_fds(exc: BaseException) -> bool:
    """Whether `exc` says the process (EMFILE) or the system (ENFILE) had no descriptor for a
    consume-queue file. (Not the timer index's RocksDB "Too many open files": whether a RocksDB write
    recovers from that without a reopen is untested, so it still raises as before.)"""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


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


class MessageStore(StoreReads, StoreUpkeep):
    """The store (the module docstring); its reads and its upkeep are defined by its base classes."""

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
        warn_if_queue_files_exceed_the_fd_limit(config.max_open_queue_files)
        fsync.make_dirs(store.dir)
        store._lock()
        try:
            store.disk.open_reserve()  # before anything writes: RocksDB cannot open on a full disk
            report = recover(store)
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

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        return self._cq((topic, queue_id))

    def queue_keys(self) -> list[tuple[str, int]]:
        return list(self._cqs)

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

    # -- closing ----------------------------------------------------------------------------

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
