"""What the timer index refuses: an `IndexBatch` checked whole before anything of it is written.

Theory of operation: every number the layout stores as a fixed-width integer (`index_codec.py`)
must be an int in its range, every position inside the batch's log range, every string within
`MAX_STR_BYTES` UTF-8 bytes, and `indexed_position` must not go back. `check_batch` checks all
of that for a batch before `RocksTimerIndex.apply` builds its WriteBatch, so a bad value is a
`ValueError` (or `IndexPositionWentBack`) naming it, and nothing of the batch is written.

`type(x) is int` keeps bools and floats out; it is also the cheapest test, and this runs for
every timer of every batch. Apart from `timer/index.py` because it is the index's contract with
its callers, not its storage.
"""

from __future__ import annotations

from chronoq.errors import IndexPositionWentBack
from chronoq.timer.engine import IndexBatch, TimerEntry, check_route
from chronoq.timer.index_codec import MAX_STR_BYTES, id_prefix

_LIMIT_63 = 1 << 63
_LIMIT_32 = 1 << 32
_SHORT_STR = MAX_STR_BYTES // 4


def check_u63(what: str, value: int) -> None:
    if type(value) is not int or not 0 <= value < _LIMIT_63:
        raise ValueError(f"{what} must be an int in [0, 2**63), not {value!r}")


def _check_entry(entry: TimerEntry, batch_end: int) -> None:
    """Refuse an entry the layout cannot hold, before anything of its batch is written.
    (`type(x) is int` keeps bools and floats out; it is also the cheapest test, and this runs
    for every timer.)"""
    check_route(entry)
    d, p, s, a = entry.deliver_at_ms, entry.position, entry.size, entry.accepted_ms
    if (type(d) is int and type(p) is int and type(s) is int and type(a) is int
            and 0 <= d < _LIMIT_63 and 0 <= p < batch_end and 0 <= s < _LIMIT_32 and -_LIMIT_63 <= a < _LIMIT_63):
        # A str of <= 16383 characters is <= 65535 UTF-8 bytes, so the usual case costs a len().
        if len(entry.message_id) > _SHORT_STR or len(entry.topic) > _SHORT_STR or entry.keys:
            for text in (entry.message_id, entry.topic, *entry.keys):
                if len(text) > _SHORT_STR and len(text.encode()) > MAX_STR_BYTES:
                    raise ValueError(f"a TimerEntry string of {len(text.encode())} UTF-8 bytes does not fit "
                                     f"the index (limit {MAX_STR_BYTES})")
            if len(entry.keys) > MAX_STR_BYTES:
                raise ValueError(f"{len(entry.keys)} keys do not fit the index (limit {MAX_STR_BYTES})")
        return
    if type(p) is int and p >= batch_end:
        raise ValueError(f"TimerEntry.position {p} is not inside the batch's log range (it ends at {batch_end})")
    raise ValueError(f"TimerEntry fields out of range or not int: deliver_at_ms={d!r} position={p!r} "
                     f"size={s!r} accepted_ms={a!r}")


def check_batch(batch: IndexBatch, indexed_position: int) -> None:
    """Refuse `batch` (`ValueError`, `IndexPositionWentBack`) if anything in it does not fit the
    layout, or its `indexed_position` is below the index's `indexed_position`."""
    check_u63("indexed_position", batch.indexed_position)
    if batch.indexed_position < indexed_position:
        raise IndexPositionWentBack(indexed_position, batch.indexed_position)
    end = batch.indexed_position
    for entry in batch.adds:
        _check_entry(entry, end)
    for old_position, entry in batch.rolled:
        _check_entry(entry, end)
        check_u63("rolled old position", old_position)
    for position, fired_ms in batch.fired:
        if type(position) is not int or type(fired_ms) is not int or not (
                0 <= position < _LIMIT_63 and 0 <= fired_ms < _LIMIT_63):
            raise ValueError(f"fired mark ({position!r}, {fired_ms!r}) must be two ints in [0, 2**63)")
    for topic, message_id, cancelled_ms, tombstone_position, due_ms in batch.cancels:
        check_u63("cancelled_ms", cancelled_ms)
        check_u63("tombstone position", tombstone_position)
        if due_ms is not None:
            check_u63("cancelled timer's deliver_at_ms", due_ms)
        id_prefix(message_id, topic)  # refuses ids and topics the layout cannot hold
    for position, damaged_ms in batch.damaged:
        check_u63("damaged position", position)
        check_u63("damaged_ms", damaged_ms)
    for level, offset in batch.level_progress.items():
        if type(level) is not int or not 0 < level < 1 << 16:
            raise ValueError(f"delay level {level!r} must be an int in [1, 65535]")
        check_u63("level offset", offset)
    for base, floor in batch.link_floors:
        if type(base) is not int or type(floor) is not int or not (0 <= base < _LIMIT_63 and 0 <= floor < end):
            raise ValueError(f"link floor ({base!r}, {floor!r}) must be two ints in [0, 2**63), the floor "
                             f"inside the batch's log range (it ends at {end})")
    for position, linked_ms, body in batch.link_copies:
        if type(position) is not int or not 0 <= position < end or not isinstance(body, bytes):
            raise ValueError(f"link copy at {position!r} must be an int inside the batch's log range (it ends "
                             f"at {end}) with a bytes body")
        check_u63("link record store time", linked_ms)
