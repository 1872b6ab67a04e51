"""The read cache: records just dispatched, kept decoded for the reads that usually follow.

Theory of operation: a consumer keeping up reads a record moments after its dispatch, and a
short timer's fire checks its record soon after; both would otherwise read the page cache and
decode again. The store puts each dispatched run here (`put`), first in, first out, within
`read_cache_bytes`, and `MessageStore.read_at` answers from it when position and size match
(records never change once written, so a cached one is the record). Once full, the cache holds
what was dispatched over its last span of store time, so a record that will not be read before
it would be evicted (a timer due later, a tombstone: the linker's `next_read_ms` says) is left
out. Entries are plain tuples of strings, ints and bytes (`CachedRecord`), which the garbage
collector stops tracking, instead of StoredMessage instances it would walk at every full
collection; a hit builds the StoredMessage again (`from_cache`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from chronoq.model import LINKS_TOPIC, MessageType, StoredMessage

NextRead = Callable[[StoredMessage], int | None]
"""A record just dispatched -> the broker time before which nothing reads it by position (a
timer's due time), a negative number (never), or None: it may be read at once."""

CACHED_OBJECT_BYTES = 400
"""What a decoded record costs in memory beyond its bytes (the StoredMessage, its strings, dicts
and the cache's slot), roughly, for a small message: what `read_cache_bytes` counts per record."""

CachedRecord = tuple[Any, ...]
"""A cached record: StoredMessage's fields in order, the message type as a plain int and each
properties dict as a flat tuple (k1, v1, k2, v2, ...). A tuple holding only strings, ints, bytes
and such tuples is one the garbage collector stops tracking (most in the first young collection
they survive, the rest in the first full one that sees them; a dict inside would keep an entry
tracked for good), where each StoredMessage (a class instance) is tracked for life: with tens of
thousands of records cached, every full collection walked all of them, a pause of up to 150 ms
on the event loop under load (the delivery-error tail). Building the StoredMessage again on a
hit costs ~1 µs, and gives the caller its own copy."""
CACHED_SIZE = 13
"""The index of `size` in a `CachedRecord`."""
CACHED_STORE_MS = 11
"""The index of `store_ms` in a `CachedRecord`."""


def _cached(m: StoredMessage) -> CachedRecord:
    # Fresh inner tuples (the keys too): made just before the entry, the collection that first
    # sees the entry has untracked them when it reaches it.
    return (m.message_id, m.topic, m.queue_id, m.queue_offset, int(m.message_type), m.tag, (*m.keys,),
            _flat(m.properties), _flat(m.system_properties), m.body, m.born_ms, m.store_ms, m.position, m.size)


def _flat(d: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(itertools.chain.from_iterable(d.items())) if d else ()


def _unflat(t: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(t[::2], t[1::2], strict=True)) if t else {}


_MESSAGE_TYPE_OF = {int(t): t for t in MessageType}
"""A cached record's type number -> its MessageType: a dict lookup, not the enum's ~1.5 µs call."""


def from_cache(c: CachedRecord) -> StoredMessage:
    return StoredMessage(c[0], c[1], c[2], c[3], _MESSAGE_TYPE_OF[c[4]], c[5], c[6], _unflat(c[7]), _unflat(c[8]),
                         c[9], c[10], c[11], c[12], c[13])


class ReadCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        """`read_cache_bytes`: what the entries may cost (0: nothing is cached)."""
        self.records: OrderedDict[int, CachedRecord] = OrderedDict()
        """position -> record, in dispatch order (`put`). An OrderedDict, not a dict: evicting
        the oldest of a plain dict (`next(iter(d))`) walks over every slot freed since its last
        resize, which made each eviction cost more the longer the cache ran."""
        self.held_bytes = 0
        """What the entries cost now (`CACHED_OBJECT_BYTES` beyond each record's size)."""
        self.hits = 0
        """Reads answered from the cache since start."""

    def put(self, batch: list[StoredMessage], next_read_ms: NextRead) -> None:
        """Keep the records just dispatched, decoded, for the reads that usually follow at once
        (a consumer keeping up, a short timer firing): first in, first out, within
        `read_cache_bytes`. Records never change once written, so a cached one is the record.

        Once the cache is full, it holds what was dispatched over its last `span` ms (the oldest
        entry's store time to now): a record not read before then (`next_read_ms`: a timer due
        later, a tombstone) would be evicted unread, so it is left out, and costs neither the
        entry's building (a few µs a timer accepted) nor the room of a record read sooner."""
        budget = self.budget_bytes
        if not budget:
            return
        cache = self.records
        held = self.held_bytes
        horizon_ms = None  # until the cache is full: everything is kept
        for msg in batch:
            if msg.topic == LINKS_TOPIC:
                continue  # read by the index and queues at dispatch, never again by position
            cost = msg.size + CACHED_OBJECT_BYTES
            if horizon_ms is None and held + cost > budget and cache:
                now_ms = msg.store_ms  # (a clock stepped back reads as a span of 0)
                horizon_ms = now_ms + max(0, now_ms - next(iter(cache.values()))[CACHED_STORE_MS])
            if horizon_ms is not None:
                read_ms = next_read_ms(msg)
                if read_ms is not None and (read_ms < 0 or read_ms > horizon_ms):
                    continue
            cache[msg.position] = _cached(msg)
            held += cost
        while held > budget and cache:
            held -= cache.popitem(last=False)[1][CACHED_SIZE] + CACHED_OBJECT_BYTES
        self.held_bytes = held
