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

Owned by the broker's event loop (no locks); it never reads the clock (`now_ms` is passed in).
"""

from __future__ import annotations

import struct
from collections import deque

from chronoq.model import SendResult
from chronoq.timer.service import encode_recall_handle

_ENTRY = struct.Struct("<qqqqHB")
"""at_ms, position, queue_offset, deliver_at_ms (-1: none), queue_id, flags."""
_HAS_HANDLE = 1
_NO_DELIVER_AT = -1


class DedupeWindow:
    def __init__(self, window_ms: int, max_entries: int) -> None:
        self.window_ms = window_ms
        self.max_entries = max_entries
        self._entries: dict[str, bytes] = {}
        self._order: deque[str] = deque()

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
            # correct anyway: the deque must hold each key once, in insertion order.
            self._order.remove(name)
        deliver_at_ms = _NO_DELIVER_AT if result.deliver_at_ms is None else result.deliver_at_ms
        flags = _HAS_HANDLE if result.recall_handle is not None else 0
        self._entries[name] = _ENTRY.pack(now_ms, result.position, result.queue_offset, deliver_at_ms,
                                          result.queue_id, flags)
        self._order.append(name)
        while len(self._order) > self.max_entries:
            del self._entries[self._order.popleft()]

    def expire(self, now_ms: int) -> None:
        """Forget entries added before `now_ms - window_ms`."""
        horizon = now_ms - self.window_ms
        order, entries = self._order, self._entries
        while order:
            name = order[0]
            if _ENTRY.unpack_from(entries[name])[0] >= horizon:
                break
            order.popleft()
            del entries[name]
