"""The message store's reads: a record by its position, a queue entry through a link, damage.

Theory of operation: reads (`read_at`) return None for a record retention removed or a hole,
and raise `CorruptRecord` for a damaged one, after quarantining it: each caller decides what a
lost record means to it (skip it, drop an in-flight entry, mark a timer damaged). `readable` is
the same read for callers to whom damage means "skip", and `readable_entry` the read of a queue
entry: a link's (`store/links.py`: a link record enters records already in the log into other
topics' queues, how timers fire) goes through its link record to the linked record, shown as
the message that queue holds (`linked_reads.view`, the link writer's say). A damaged link
record is read from the copy its writer keeps (`linked_reads.link_copy`). The link records
dispatched or read last stay decoded (`LINKS_CACHED`), since every read of a link goes through
its link record; records just dispatched are answered from the read cache
(`store/readcache.py`).

Why apart from `store/messagestore.py`: reading never writes the log or a queue (it only
quarantines damage it finds), and what it needs of the store is the log, the read cache and
what the links' writer says. `StoreReads` is a base class of `MessageStore`, not an object it
holds: callers read through the store as before, each read costs no extra call, and its state
(the attributes annotated on the class) is set by `MessageStore.__init__`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from chronoq.errors import CorruptRecord
from chronoq.model import StoredMessage
from chronoq.store.commitlog import CommitLog
from chronoq.store.links import LINKED, Links, decode_links
from chronoq.store.readcache import CACHED_SIZE, ReadCache, from_cache


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


class StoreReads:
    """`MessageStore`'s reads (the module docstring). Its state, set by `MessageStore.__init__`
    (and `log` by recovery), is annotated here."""

    log: CommitLog
    read_cache: ReadCache
    linked_reads: LinkedReads
    skipped_damaged: int
    damaged_links_read: set[int]
    _links_cache: OrderedDict[int, tuple[Links, int]]

    @property
    def read_cache_hits(self) -> int:
        """Reads the read cache answered since start."""
        return self.read_cache.hits

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
