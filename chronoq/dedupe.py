"""The broker's message-id dedupe window: (topic, message id) -> the original send's result.

Theory of operation: a producer that retries a send (same message id, same topic) within the
window gets the first send's result back, marked `duplicate`, and nothing new is stored. The
window is bounded twice: by age (`dedupe_window_ms`) and by count (`dedupe_window_max_entries`,
oldest evicted first), so its memory does not grow with the send rate or the timer backlog.
RocketMQ itself keeps no such window (a retried send is stored twice; consumers dedupe); past
either bound chronoq behaves the same way, at-least-once, and never loses a message.

Memory is the point of this shape. An entry is one `str` key ("topic NUL id": topic names
cannot hold NUL, so the join is unambiguous), one 35-byte packed `bytes` value, a dict slot and
a deque slot: about 190 bytes for a short id, against about 570 for the `(topic, id) ->
(time, SendResult)` it replaces (the result's ints, its recall-handle string, two tuples and an
OrderedDict node). The recall handle is not stored: it is a pure function of (topic, due time,
id), rebuilt when a duplicate is answered. Insertion order is expiry order, so the deque of
keys is consumed from the left; the dict alone could not pop its oldest entry cheaply.

A cancelled timer's id is forgotten (`discard`): sent again, it is a new timer to store, not a
retry to answer with the cancelled one's result (unless the id remembered is a later timer's,
due at another time: an id reused after the window). Its deque slot stays, counted in `_stale`, and
is skipped when it reaches the left end (the older slots of a key are always the stale ones);
the deque is compacted once stale slots outnumber the bound, so it stays within twice the bound.

Owned by the broker's event loop (no locks); it never reads the clock (`now_ms` is passed in).
A re-base of broker time (`clock.py`) moves every remembered time back by the step
(`clock_rebased`): otherwise the window would last the step longer, and an id reused after the
window would be answered with the old result and stored nowhere. Order is kept (all move alike).
"""

from __future__ import annotations

import struct
from collections import Counter, deque

from chronoq.model import SendResult
from chronoq.timer.recall import encode_recall_handle

_ENTRY = struct.Struct("<qqqqIB")
"""at_ms, position, queue_offset, deliver_at_ms (-1: none), queue_id (u32, as in the record), flags."""
_AT = struct.Struct("<q")
"""The entry's first field, at_ms, alone."""
_HAS_HANDLE = 1
_NO_DELIVER_AT = -1


class DedupeWindow:
    def __init__(self, window_ms: int, max_entries: int) -> None:
        self.window_ms = window_ms
        self.max_entries = max_entries
        self._entries: dict[str, bytes] = {}
        self._order: deque[str] = deque()
        self._stale: Counter[str] = Counter()
        """Deque slots of discarded keys not yet consumed, per key."""
        self._stale_slots = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return f"{key[0]}\x00{key[1]}" in self._entries

    def get(self, key: tuple[str, str]) -> SendResult | None:
        """The original result for `key` = (topic, message id), marked duplicate; None if unknown."""
        packed = self._entries.get(f"{key[0]}\x00{key[1]}")
        if packed is None:
            return None
        _at_ms, position, queue_offset, deliver_at_ms, queue_id, flags = _ENTRY.unpack(packed)
        topic, message_id = key
        if deliver_at_ms == _NO_DELIVER_AT:
            return SendResult(message_id, topic, queue_id, queue_offset, position, duplicate=True)
        handle = encode_recall_handle(topic, deliver_at_ms, message_id) if flags & _HAS_HANDLE else None
        return SendResult(message_id, topic, queue_id, queue_offset, position, deliver_at_ms, handle, True)

    def add(self, key: tuple[str, str], now_ms: int, result: SendResult) -> None:
        """Remember `result` for `key`; evicts the oldest entries past `max_entries`."""
        name = f"{key[0]}\x00{key[1]}"
        if name in self._entries:
            # Never reached from send_batch (a known key is answered, not stored again); kept
            # correct anyway: the old slot becomes stale, as after a discard.
            self._stale[name] += 1
            self._stale_slots += 1
        deliver_at_ms = _NO_DELIVER_AT if result.deliver_at_ms is None else result.deliver_at_ms
        flags = _HAS_HANDLE if result.recall_handle is not None else 0
        self._entries[name] = _ENTRY.pack(now_ms, result.position, result.queue_offset, deliver_at_ms,
                                          result.queue_id, flags)
        self._order.append(name)
        while len(self._entries) > self.max_entries:
            del self._entries[self._pop_oldest()]

    def _pop_oldest(self) -> str:
        """The oldest live key, taken off the deque (stale slots before it are dropped)."""
        while True:
            name = self._order.popleft()
            if not self._skip_stale(name):
                return name

    def _skip_stale(self, name: str) -> bool:
        count = self._stale.get(name)
        if not count:
            return False
        self._stale_slots -= 1
        if count == 1:
            del self._stale[name]
        else:
            self._stale[name] = count - 1
        return True

    def discard(self, key: tuple[str, str], deliver_at_ms: int | None = None) -> None:
        """Forget `key` (its timer was cancelled: a new send of the id must be stored); with
        `deliver_at_ms`, only if the send remembered is the timer due then (the id may have been
        reused since the cancelled one, and a retry of that later send must still be answered)."""
        name = f"{key[0]}\x00{key[1]}"
        packed = self._entries.get(name)
        if packed is None or (deliver_at_ms is not None and _ENTRY.unpack(packed)[3] != deliver_at_ms):
            return
        del self._entries[name]
        self._stale[name] += 1
        self._stale_slots += 1
        if self._stale_slots > self.max_entries:
            stale = self._stale
            self._order = deque(n for n in self._order if not self._skip_stale(n))
            assert not stale, "every stale count is matched by a deque slot"

    def clock_rebased(self, step_ms: int) -> None:
        """Broker time moved back by `step_ms`: so does each remembered send's time, so it is
        forgotten `window_ms` after it was made, in real time, not the step later."""
        entries = self._entries
        for name, packed in entries.items():
            entries[name] = _AT.pack(_AT.unpack_from(packed)[0] - step_ms) + packed[_AT.size:]

    def expire(self, now_ms: int) -> None:
        """Forget entries added before `now_ms - window_ms`."""
        horizon = now_ms - self.window_ms
        order, entries = self._order, self._entries
        while order:
            name = order[0]
            if self._stale and self._skip_stale(name):
                order.popleft()
                continue
            if _ENTRY.unpack_from(entries[name])[0] >= horizon:
                break
            order.popleft()
            del entries[name]
