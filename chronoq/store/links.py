"""Link records: consume-queue entries for records that are already in the log.

Theory of operation: a record normally enters one consume queue, its own topic's, at the queue
offset written in it. A *link record* enters records already in the log into the queues of
other topics: each of its links names a record (position, size), the queue it joins (topic,
queue id), its offset there, and the tag hash the queue entry carries. Firing timers writes one
per fire step: the timer record stays where it was accepted and the link gives it its offset in
the real topic's queue, where RocketMQ 5 re-appends a full copy of every message it fires. A
fire step of 8,192 timers writes 64 records of ~3.9 KB instead of 8,192 re-encoded copies: at
most `timer_links_per_record` (128) links a record (`LinkBatch.split`), so that one damaged
sector costs few links, and those are read from the timer index's copy (`MessageStore`'s
`link_copy`).

A link record is an ordinary message record (`store/record.py`) of the system topic
`LINKS_TOPIC`, queue 0, whose body lists its links; its own queue entry is kept like any other,
so link records can be found in log order. Each link becomes a queue entry (`queue_entries`)
that points at the *link record*, not at the linked record: its position is the link record's,
and its size field, top bit set (`LINKED`), holds the link's index in it. So every queue's
entries stay in log order, whatever wrote them, and each rule that relies on it holds as it
did: recovery drops the entries of a link record a torn tail took (they point past the log's
end), retention drops queue files whose entries all lie below the log's start, and recovery
and rebuilds replay links by the one rule every record follows (an entry is appended only where
its queue lacks that offset). The offsets are handed out when the record is encoded
(`MessageStore.append`), in log order like a record's own.

A reader resolves a link entry through the link record to the linked record
(`MessageStore.readable_entry`), and shows it as a message of the queue it was read from: that
queue's topic, queue id and offset, and whatever else its linker says
(`MessageStore.linked_reads`: the timer room strips its bookkeeping, `timer/reads.py`). A link
never points forward: it names a record written before its link record. Retention keeps a
linked record as long as a link record within retention names it (design.md, "Retention of
fired timers"); a link past retention whose record is gone is skipped, as an entry retention
removed.

Pure functions and a column builder; no I/O. The body's byte layout is documented once, in
docs/disk-format.md ("Link record"); `tests/store/test_links.py` checks it and fuzzes the decoder,
which raises `CorruptRecord` and nothing else.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator

from chronoq.errors import CorruptRecord
from chronoq.model import LINKS_TOPIC, StoredMessage
from chronoq.store.consumequeue import LINKED, tag_hash
from chronoq.store.record import HEADER_SIZE

LINKS_VERSION = 1
LINKS_HEAD = struct.Struct(">BIH")
"""version u8, link count u32, topic count u16."""
_U16 = struct.Struct(">H")
LINK_BYTES = 8 + 4 + 8 + 4 + 4 + 2
"""One link's columns: position u64, size u32, queue offset u64, queue id u32, tag hash u32, topic index u16."""
MAX_LINK_TOPICS = 0xFFFF
_BIG_ENDIAN = sys.byteorder == "big"


def _column(code: str, values: array[int] | list[int]) -> bytes:
    col = array(code, values)
    if not _BIG_ENDIAN:
        col.byteswap()
    return col.tobytes()


def _read_column(code: str, body: bytes, start: int, count: int) -> tuple[array[int], int]:
    col = array(code)
    end = start + col.itemsize * count
    col.frombytes(body[start:end])
    if not _BIG_ENDIAN:
        col.byteswap()
    return col, end


class LinkBatch:
    """The links one link record will hold, as its writer names them: which record, which topic,
    and how its queue is chosen (a queue id the producer chose, else a message group's hash,
    else the topic's round robin: the rule a record's own queue follows, `MessageStore`'s
    `_pick_queue`). Columns, not an object per link: a fire step adds thousands."""

    __slots__ = ("group_hashes", "positions", "queue_ids", "sizes", "tag_hashes", "topics")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.sizes: list[int] = []
        self.topics: list[str] = []
        self.queue_ids: list[int | None] = []
        self.group_hashes: list[int | None] = []
        self.tag_hashes: list[int] = []

    def add(self, position: int, size: int, topic: str, queue_id: int | None, group_hash: int | None,
            tag_hash: int) -> None:
        self.positions.append(position)
        self.sizes.append(size)
        self.topics.append(topic)
        self.queue_ids.append(queue_id)
        self.group_hashes.append(group_hash)
        self.tag_hashes.append(tag_hash)

    def __len__(self) -> int:
        return len(self.positions)

    def split(self, max_record_bytes: int, max_links: int) -> list[LinkBatch]:
        """This batch as consecutive batches of at most `max_links` links whose link records each
        take at most `max_record_bytes` (the largest record the broker writes,
        `max_message_size_bytes`, so every one fits a segment), however many links a fire step
        takes (`timer_fire_batch`). A record is what one damaged sector costs, so it is kept
        small (`timer_links_per_record`)."""
        if not self.positions:
            return []
        if len(self.positions) > max_links:
            return [part for start in range(0, len(self.positions), max_links)
                    for part in self._slice(start, start + max_links).split(max_record_bytes, max_links)]
        # A record of one link always fits: the linked record, which named the same topic, did.
        fixed = HEADER_SIZE + len(LINKS_TOPIC.encode()) + LINKS_HEAD.size
        # The usual step fits one record whole: priced by its few distinct topics, not link by link.
        whole = fixed + len(self.positions) * LINK_BYTES + sum(2 + len(t.encode()) for t in set(self.topics))
        if whole <= max_record_bytes:
            return [self]
        out: list[LinkBatch] = []
        start, size, seen = 0, fixed, set[str]()
        for i, topic in enumerate(self.topics):
            more = LINK_BYTES + (0 if topic in seen else 2 + len(topic.encode()))
            if size + more > max_record_bytes and i > start:
                out.append(self._slice(start, i))
                start, size, seen = i, fixed, set()
                more = LINK_BYTES + 2 + len(topic.encode())
            size += more
            seen.add(topic)
        out.append(self._slice(start, len(self.topics)))
        return out

    def _slice(self, start: int, end: int) -> LinkBatch:
        part = LinkBatch()
        for name in self.__slots__:
            setattr(part, name, getattr(self, name)[start:end])
        return part


def encode_links(batch: LinkBatch, queue_ids: list[int], queue_offsets: list[int]) -> bytes:
    """The body of a link record for `batch`, each link in the queue and at the offset the store
    chose for it (`queue_ids`, `queue_offsets`, in the batch's order)."""
    topic_index: dict[str, int] = {}
    indexes = [topic_index.setdefault(t, len(topic_index)) for t in batch.topics]
    if len(topic_index) > MAX_LINK_TOPICS:
        raise ValueError(f"a link record names at most {MAX_LINK_TOPICS} topics, not {len(topic_index)}")
    names = b"".join(_U16.pack(len(raw)) + raw for raw in (t.encode() for t in topic_index))
    return b"".join((
        LINKS_HEAD.pack(LINKS_VERSION, len(batch), len(topic_index)), names,
        _column("Q", batch.positions), _column("I", batch.sizes), _column("Q", queue_offsets),
        _column("I", queue_ids), _column("I", batch.tag_hashes), _column("H", indexes),
    ))


class Links:
    """A decoded link record body: link i is record (positions[i], sizes[i]) at offset
    queue_offsets[i] of queue (topics[topic_indexes[i]], queue_ids[i])."""

    __slots__ = ("positions", "queue_ids", "queue_offsets", "sizes", "tag_hashes", "topic_indexes", "topics")

    def __init__(self, topics: list[str], positions: array[int], sizes: array[int], queue_offsets: array[int],
                 queue_ids: array[int], tag_hashes: array[int], topic_indexes: array[int]) -> None:
        self.topics = topics
        self.positions = positions
        self.sizes = sizes
        self.queue_offsets = queue_offsets
        self.queue_ids = queue_ids
        self.tag_hashes = tag_hashes
        self.topic_indexes = topic_indexes

    def __len__(self) -> int:
        return len(self.positions)

    def target(self, index: int) -> tuple[int, int]:
        """(position, size) of the record link `index` names; IndexError past the last."""
        return self.positions[index], self.sizes[index]


def decode_links(body: bytes, record_position: int | None = None) -> Links:
    """The links in a link record's body. Raises CorruptRecord on any mismatch (a body the
    record's CRC vouched for but this version cannot read, or a link that points forward)."""
    if len(body) < LINKS_HEAD.size:
        raise CorruptRecord(f"link record body of {len(body)} bytes is shorter than its {LINKS_HEAD.size}-byte head")
    version, count, topic_count = LINKS_HEAD.unpack_from(body)
    if version != LINKS_VERSION:
        raise CorruptRecord(f"link record version {version}, this chronoq reads {LINKS_VERSION}")
    offset = LINKS_HEAD.size
    topics: list[str] = []
    try:
        for _ in range(topic_count):
            if offset + 2 > len(body):
                raise CorruptRecord("link record body ends inside a topic length")
            end = offset + 2 + _U16.unpack_from(body, offset)[0]
            if end > len(body):
                raise CorruptRecord("link record body ends inside a topic name")
            topics.append(body[offset + 2:end].decode())
            offset = end
    except UnicodeDecodeError as e:
        raise CorruptRecord(f"link record topic is not UTF-8: {e}") from None
    if len(body) - offset != count * LINK_BYTES:
        raise CorruptRecord(f"link record of {count} links has {len(body) - offset} bytes of links, "
                            f"expected {count * LINK_BYTES}")
    positions, offset = _read_column("Q", body, offset, count)
    sizes, offset = _read_column("I", body, offset, count)
    queue_offsets, offset = _read_column("Q", body, offset, count)
    queue_ids, offset = _read_column("I", body, offset, count)
    tag_hashes, offset = _read_column("I", body, offset, count)
    topic_indexes, offset = _read_column("H", body, offset, count)
    if count and max(topic_indexes) >= topic_count:
        raise CorruptRecord(f"a link names topic {max(topic_indexes)} of a record that lists {topic_count}")
    if record_position is not None and count and max(positions) >= record_position:
        raise CorruptRecord(f"a link at position {record_position} points forward, to {max(positions)}")
    return Links(topics, positions, sizes, queue_offsets, queue_ids, tag_hashes, topic_indexes)


def queue_entries(msg: StoredMessage) -> Iterator[tuple[str, int, int, int, int, int]]:
    """Every consume-queue entry a record makes, as (topic, queue id, queue offset, position,
    size, tag hash): its own, then, for a link record, one per link (`link_entries`)."""
    yield msg.topic, msg.queue_id, msg.queue_offset, msg.position, msg.size, tag_hash(msg.tag)
    if msg.topic == LINKS_TOPIC:
        yield from link_entries(msg.position, decode_links(msg.body, msg.position))


def link_entries(record_position: int, links: Links) -> Iterator[tuple[str, int, int, int, int, int]]:
    """The queue entries of the links of the link record at `record_position`: (topic, queue id,
    queue offset, the link record's position, `LINKED` | the link's index, tag hash)."""
    topics = links.topics
    for i, (ti, qid, qoff, th) in enumerate(zip(links.topic_indexes, links.queue_ids, links.queue_offsets,
                                                links.tag_hashes, strict=True)):
        yield topics[ti], qid, qoff, record_position, LINKED | i, th
