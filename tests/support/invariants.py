"""Store invariants checked from the raw readers, independently of `chronoq check`.

Theory of operation: `assert_queues_match_log` rebuilds what every consume queue must hold by
scanning the retained commit log itself, then compares the consume queues entry by entry in both
directions. It shares no code with `chronoq.store.check`, so when the two disagree a test says so
loudly instead of both being wrong the same way.
"""

from __future__ import annotations

from typing import Any


def assert_queues_match_log(store: Any) -> int:
    """Every record of the retained log sits at its (topic, queue, offset) in a consume queue,
    and every consume-queue entry from the log's start points at exactly that record.
    `store` is an open `MessageStore`. Returns the number of records checked."""
    by_queue: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}
    count = 0
    for msg in store.log.scan(store.log.start_position):
        slot = by_queue.setdefault((msg.topic, msg.queue_id), {})
        assert msg.queue_offset not in slot, f"queue offset {msg.queue_offset} of {msg.topic}/{msg.queue_id} twice"
        slot[msg.queue_offset] = (msg.position, msg.size)
        count += 1
    for key, records in by_queue.items():
        cq = store.queue(*key)
        first = min(records)
        assert cq.next_offset == max(records) + 1, f"{key}: queue ends at {cq.next_offset}, log at {max(records) + 1}"
        for offset in range(first, cq.next_offset):
            entry = cq.get(offset)
            assert entry is not None and entry[:2] == records.get(offset), f"{key} offset {offset}: {entry}"
    for key in store.queue_keys():
        cq = store.queue(*key)
        for offset in range(cq.min_offset, cq.next_offset):
            entry = cq.get(offset)
            assert entry is not None, f"{key} offset {offset} missing"
            if entry[0] >= store.log.start_position:
                assert by_queue.get(key, {}).get(offset) == entry[:2], f"{key} offset {offset} -> {entry} not in log"
    return count
