"""What the timer index forgets: link records behind retention, and finished timers' history.

Theory of operation: `IndexRetention` sits between `IndexDb` (the database) and
`RocksTimerIndex` (`timer/index.py`) in the index's class chain, and holds the calls with which
the broker lets the index drop state it no longer needs.
- Links: a link record (`store/links.py`) names the timer records a fire delivered, and those
  records stay as long as it does. For each commit-log segment the index keeps the lowest timer
  record position a link record in it names (the `f` counters, mirrored in `_link_floors`), so
  retention reads a row per segment, not per link record, to know how far back it must keep the
  log (`linked_floor`). A copy of each link record's body is kept while the record is retained
  (`links` family), what a reader falls back on when the record is damaged on disk
  (`link_copy`). `forget_links_below` drops both below the position retention deleted up to,
  and remembers `live_links_from`, in one write.
- History: a delivered or cancelled timer keeps its `id`, `key` and `pos` rows, so a query still
  answers, until `prune_history` forgets those finished before a time. It walks the `history`
  family in time order, about `_PRUNE_CHUNK` timers a write (a fired row speaks for up to
  `index_codec.HISTORY_FIRED_MAX`), deleting each finished timer's rows and the redirects
  a roll left (the `pos` row of a rolled timer's old position) whose time is before it.

Apart from `timer/index.py` because none of it is on the path of a send or a fire: it is the
index's own retention, called by the broker's (`chronoq/retention.py`).
"""

from __future__ import annotations

from rocksdict import WriteBatch

from chronoq.errors import TimerIndexClosed
from chronoq.timer.index_codec import (
    CF_COUNTERS,
    CF_HISTORY,
    CF_ID,
    CF_KEY,
    CF_LINKS,
    CF_META,
    CF_POS,
    HIST_FIRED,
    HIST_REDIRECT,
    HIST_STATUS,
    HISTORY_KEY,
    META_LIVE_LINKS_FROM,
    POS_DONE,
    POS_ROLLED,
    U64,
    MalformedValue,
    decode_fired_history,
    decode_link_copy,
    facts_keys,
    history_timers,
    key_cf_key,
)
from chronoq.timer.index_db import IndexDb

_PRUNE_CHUNK = 10_000


class IndexRetention(IndexDb):
    """Links and history kept, then forgotten (module docstring). The mirrors below are loaded
    and kept by `RocksTimerIndex`."""

    _link_floors: dict[int, int]
    """Segment base -> the lowest timer record position a link record in that segment names
    (mirror of the `f` counters)."""
    _live_links_from: int | None
    """Mirror of the `live_links_from` meta key."""

    # -- links -------------------------------------------------------------------------------

    def linked_floor(self, segment_base: int) -> int | None:
        return min((f for b, f in self._link_floors.items() if b >= segment_base), default=None)

    def forget_links_below(self, position: int, live_from: int | None = None) -> None:
        if self._closed:
            raise TimerIndexClosed(self._path)
        gone = [b for b in self._link_floors if b < position]
        with self._guard():
            db = self._writable()
            wb = WriteBatch(raw_mode=True)
            for base in gone:
                wb.delete(b"f" + U64.pack(base), self._handle[CF_COUNTERS])
            wb.delete_range(U64.pack(0), U64.pack(position), self._handle[CF_LINKS])
            if live_from is not None:
                wb.put(META_LIVE_LINKS_FROM, U64.pack(live_from), self._handle[CF_META])
            db.write(wb, self._write_opt)
        for base in gone:
            del self._link_floors[base]
        if live_from is not None:
            self._live_links_from = live_from

    def link_copy(self, position: int) -> tuple[bytes, int] | None:
        with self._guard():
            value = self._cf[CF_LINKS].get(U64.pack(position))
            return None if value is None else decode_link_copy(value)

    def link_copies_in(self, start: int, end: int) -> list[int]:
        with self._guard():
            return [U64.unpack(key)[0] for key, _ in
                    self._scan_range(CF_LINKS, U64.pack(start), U64.pack(end))]

    def live_links_from(self) -> int | None:
        return self._live_links_from

    # -- history -----------------------------------------------------------------------------

    def prune_history(self, before_ms: int) -> int:
        if self._closed:
            raise TimerIndexClosed(self._path)
        if before_ms <= 0:
            return 0
        pruned = 0
        with self._guard():
            start, upper = b"", HISTORY_KEY.pack(min(before_ms, (1 << 64) - 1), 0)
            while True:
                rows = self._scan_range(CF_HISTORY, start, upper, limit=_PRUNE_CHUNK)
                if not rows:
                    return pruned
                # About `_PRUNE_CHUNK` timers a write, not rows: a fired row speaks for up to
                # HISTORY_FIRED_MAX (the last row taken may run past the chunk by less than that).
                timers = 0
                for i, (_, hv) in enumerate(rows):
                    timers += history_timers(hv)
                    if timers >= _PRUNE_CHUNK:
                        rows = rows[:i + 1]
                        break
                pruned += self._prune_rows(rows)
                start = rows[-1][0] + b"\x00"  # past what was just deleted: no tombstone walk

    def _prune_rows(self, rows: list[tuple[bytes, bytes]]) -> int:
        """Delete one chunk of history and what it points at; returns the statuses forgotten."""
        db = self._writable()  # before the batch is built: it names this handle's column families
        wb = WriteBatch(raw_mode=True)
        h = self._handle
        finished = [(HISTORY_KEY.unpack(hk)[1], hv[1:]) for hk, hv in rows if hv[0] == HIST_STATUS]
        redirects = [HISTORY_KEY.unpack(hk)[1] for hk, hv in rows if hv[0] == HIST_REDIRECT]
        fired_rows = [hv for _, hv in rows if hv[0] == HIST_FIRED]
        if len(finished) + len(redirects) + len(fired_rows) != len(rows):
            raise MalformedValue("history row of unknown kind")
        for hv in fired_rows:
            finished.extend((U64.unpack_from(ik, len(ik) - 8)[0], ik) for ik in decode_fired_history(hv))
        forgotten = 0
        if finished:
            facts = self._cf[CF_ID].get([ik for _, ik in finished])
            states = self._cf[CF_POS].get([U64.pack(position) for position, _ in finished])
            for (position, ik), value, state in zip(finished, facts, states, strict=True):
                if value is None or state is None or state[0] != POS_DONE:
                    continue  # already gone
                for key in facts_keys(value):
                    wb.delete(key_cf_key(key, position), h[CF_KEY])
                wb.delete(ik, h[CF_ID])
                wb.delete(U64.pack(position), h[CF_POS])
                forgotten += 1
        position_keys = [U64.pack(position) for position in redirects]
        for pk, pv in zip(position_keys, self._cf[CF_POS].get(position_keys) if redirects else [], strict=True):
            if pv is not None and pv[0] == POS_ROLLED:
                wb.delete(pk, h[CF_POS])
        for hk, _ in rows:
            wb.delete(hk, h[CF_HISTORY])
        db.write(wb, self._write_opt)
        return forgotten
