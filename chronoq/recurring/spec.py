"""When a schedule fires: its recurrence (an interval or a cron expression in a time zone), pure.

Theory of operation: a `Recurrence` answers one question, `next_after(after_ms)`: the first
*nominal* occurrence strictly after an instant (ms since the epoch), within the schedule's start
and end; `latest_in(after_ms, at_ms)` is the catch-up's question, the last one in (after, at].
Nothing here reads a clock: every instant is an argument.

- `every_ms`: occurrences at `anchor_ms + k * every_ms` (k >= 0), in real time (a zone changes
  nothing; a DST change neither stretches nor shortens an interval). The anchor is the start,
  if given, or the moment of the create (or of the update that set the interval) plus one
  interval, so `--every 2m` first fires two minutes after it is made.
- `cron`: 5 fields (minute hour day month weekday) or 6 with seconds first, or an alias
  (`@yearly`, `@annually`, `@monthly`, `@weekly`, `@daily`, `@midnight`, `@hourly`), matched by
  cronsim (a maintained library: healthchecks.io's) against *wall-clock* times of `zone`, an IANA
  name (`zoneinfo`). cronsim is given naive wall times only; how a wall time becomes an instant is
  decided here, the same for every expression:
  * a wall time that happens twice (a DST fall-back repeats an hour) fires once, at its first
    instant (the earlier offset);
  * a wall time that never happens (a spring-forward gap) fires at the instant the gap ends (02:30
    in New York on the spring change fires at 03:00 EDT); several in one gap fire once, then.
  So "05:00 every day" is exactly once a day, every day, at 05:00 local time, and an expression
  that fires every 15 minutes of the wall clock does not fire in the repeated hour a second time,
  nor four times at the end of a gap: for a real-time rhythm, use `every_ms`.
- Jitter (`jitter_offset_ms`): a schedule may spread its occurrences over a window after each
  nominal time, by an offset derived from the schedule's name and the nominal time (so the same
  occurrence always gets the same offset, after a restart too). The message is then late by up
  to the window, never early; the window must be shorter than the gap between occurrences.

`check` is admission: every rule a schedule must satisfy before anything is stored, each
refusal its own error with its values (`chronoq/errors.py`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from chronoq.errors import InvalidSchedule, ScheduleIntervalTooShort, ScheduleNeverFires, UnknownTimeZone
from chronoq.timefmt import duration

CATCH_UP_POLICIES = ("skip", "latest", "all")
"""What the broker does with occurrences that passed while it was down or the schedule paused:
deliver none of them (the default), only the latest, or every one (up to
`schedule_catch_up_max_occurrences`)."""

ALIASES = {
    "@yearly": "0 0 0 1 1 *", "@annually": "0 0 0 1 1 *", "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0", "@daily": "0 0 0 * * *", "@midnight": "0 0 0 * * *", "@hourly": "0 0 * * * *",
}
MAX_SCHEDULE_NAME_LENGTH = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_%|-]+")
GAP_SAMPLE = 64
"""Occurrences looked at, from the first, to find the shortest gap between two (for the minimum
interval and the jitter window): a cron expression's rhythm repeats, and 64 cover any minute,
hour or day pattern's closest pair in practice."""
MAX_CANDIDATES = 100_000
"""Wall-clock matches one look walks past before it gives up (the repeated hour skips at most
an hour's worth; this only bounds a pathological expression)."""
MAX_YEARS_AHEAD = 200
"""An occurrence further ahead than this is none (bounds expressions that match almost never)."""


@dataclass(frozen=True, slots=True)
class Recurrence:
    """The when of a schedule. Exactly one of `every_ms` and `cron`."""

    every_ms: int | None = None
    cron: str | None = None
    """As given (an alias, 5 or 6 fields)."""
    zone: str = "UTC"
    start_ms: int | None = None
    end_ms: int | None = None
    anchor_ms: int = 0
    """`every_ms` only: the first occurrence of the grid (the start, or made + one interval)."""

    @property
    def expression(self) -> str:
        return f"every {duration(self.every_ms)}" if self.every_ms is not None else str(self.cron)

    def fields(self) -> str:
        """The cron expression as cronsim's 6 fields (seconds first)."""
        text = ALIASES.get(str(self.cron).strip().lower(), str(self.cron))
        parts = text.split()
        if len(parts) == 5:
            parts.insert(0, "0")
        return " ".join(parts)

    def next_after(self, after_ms: int) -> int | None:
        """The first occurrence strictly after `after_ms` (and at or after the start), or None
        when there is none up to the end."""
        if self.start_ms is not None:
            after_ms = max(after_ms, self.start_ms - 1)
        if self.every_ms is not None:
            anchor, step = self.anchor_ms, self.every_ms
            found = anchor if after_ms < anchor else anchor + ((after_ms - anchor) // step + 1) * step
        else:
            found = self._cron_next(after_ms)
        if found is None or (self.end_ms is not None and found > self.end_ms):
            return None
        return found

    def latest_in(self, after_ms: int, at_ms: int) -> int | None:
        """The last occurrence in (after_ms, at_ms], or None."""
        if at_ms <= after_ms:
            return None
        if self.end_ms is not None:
            at_ms = min(at_ms, self.end_ms)
        if self.every_ms is not None:
            first = self.next_after(after_ms)
            if first is None or first > at_ms:
                return None
            return first + (at_ms - first) // self.every_ms * self.every_ms
        found = self._cron_latest(at_ms)
        if found is None or found <= after_ms or (self.start_ms is not None and found < self.start_ms):
            return None
        return found

    # -- cron in a zone ----------------------------------------------------------------------

    def _cron_next(self, after_ms: int) -> int | None:
        tz = ZoneInfo(self.zone)
        wall = _wall(after_ms, tz)
        it = CronSim(self.fields(), wall)
        limit_year = wall.year + MAX_YEARS_AHEAD
        for _ in range(MAX_CANDIDATES):
            try:
                candidate = next(it)
            except StopIteration:
                return None
            if candidate.year > limit_year:
                return None
            ms = wall_instant_ms(candidate, tz)
            if ms > after_ms:
                return ms
        return None

    def _cron_latest(self, at_ms: int) -> int | None:
        tz = ZoneInfo(self.zone)
        local = datetime.fromtimestamp(at_ms // 1000, tz)
        wall = local.replace(tzinfo=None)
        # In the second pass of a repeated hour, wall times later than this one still map (to
        # their first instant) to instants before `at_ms`: start above them.
        first_offset = wall.replace(tzinfo=tz, fold=0).utcoffset() or timedelta(0)
        shift = max(timedelta(0), first_offset - (local.utcoffset() or timedelta(0)))
        it = CronSim(self.fields(), wall + shift + timedelta(seconds=1), reverse=True)
        for _ in range(MAX_CANDIDATES):
            try:
                candidate = next(it)
            except StopIteration:
                return None
            ms = wall_instant_ms(candidate, tz)
            if ms <= at_ms:
                return ms
        return None


def _wall(ms: int, tz: ZoneInfo) -> datetime:
    """The naive wall-clock time of `ms` in `tz`, to the second (floored)."""
    return datetime.fromtimestamp(ms // 1000, tz).replace(tzinfo=None)


def wall_instant_ms(wall: datetime, tz: ZoneInfo) -> int:
    """The instant a wall-clock time of `tz` fires at: its first instant if it happens twice,
    the end of the gap if it never happens (the module docstring)."""
    first = wall.replace(tzinfo=tz, fold=0)
    ms = int(first.timestamp()) * 1000
    if datetime.fromtimestamp(ms // 1000, tz).replace(tzinfo=None) == wall:
        return ms
    # Imaginary: fold=0 reads it with the offset before the gap, which lands after the gap's
    # end; fold=1 with the offset after it, before the gap. The transition lies between.
    lo = int(wall.replace(tzinfo=tz, fold=1).timestamp())
    hi = int(first.timestamp())
    before = datetime.fromtimestamp(lo, tz).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, tz).utcoffset() == before:
            lo = mid
        else:
            hi = mid
    return hi * 1000


def jitter_offset_ms(name: str, nominal_ms: int, jitter_ms: int) -> int:
    """How late, in [0, jitter_ms), the occurrence of `name` at `nominal_ms` fires: the same for
    the same occurrence every time (a hash, not a random draw), spread evenly over the window."""
    if jitter_ms <= 0:
        return 0
    digest = hashlib.blake2b(f"{name}\0{nominal_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % jitter_ms


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(str(name), "name", name, "must be non-empty text")
    if len(name) > MAX_SCHEDULE_NAME_LENGTH:
        raise InvalidSchedule(name[:MAX_SCHEDULE_NAME_LENGTH], "name", name[:MAX_SCHEDULE_NAME_LENGTH],
                              f"is {len(name)} characters; at most {MAX_SCHEDULE_NAME_LENGTH}")
    if not _NAME_RE.fullmatch(name):
        raise InvalidSchedule(name, "name", name, "may hold only letters, digits and _ % | -")
    return name


def check_zone(name: str, zone: object) -> str:
    if not isinstance(zone, str) or not zone:
        raise UnknownTimeZone(name, str(zone))
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise UnknownTimeZone(name, zone) from None
    return zone


def check(name: str, rec: Recurrence, *, now_ms: int, min_interval_ms: int, jitter_ms: int,
          limit: int | None, catch_up: str) -> int:
    """Every rule a schedule's recurrence must satisfy; returns its first occurrence after
    `now_ms`. Raises the error of the first rule broken."""
    check_zone(name, rec.zone)
    if (rec.every_ms is None) == (rec.cron is None):
        raise InvalidSchedule(name, "expression", None, "give exactly one of an interval (every) and a cron expression")
    if catch_up not in CATCH_UP_POLICIES:
        raise InvalidSchedule(name, "catch_up", catch_up, f"is not one of {', '.join(CATCH_UP_POLICIES)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidSchedule(name, "limit", limit, "must be a whole number of occurrences, at least 1")
    if isinstance(jitter_ms, bool) or not isinstance(jitter_ms, int) or jitter_ms < 0:
        raise InvalidSchedule(name, "jitter_ms", jitter_ms, "must be a whole number of ms, 0 or more")
    if rec.start_ms is not None and rec.end_ms is not None and rec.start_ms > rec.end_ms:
        raise InvalidSchedule(name, "end", rec.end_ms, f"is before the start ({rec.start_ms})")
    if rec.every_ms is not None:
        if isinstance(rec.every_ms, bool) or not isinstance(rec.every_ms, int) or rec.every_ms <= 0:
            raise InvalidSchedule(name, "every_ms", rec.every_ms, "must be a whole number of ms above 0")
        if rec.every_ms < min_interval_ms:
            raise ScheduleIntervalTooShort(name, rec.expression, rec.every_ms, min_interval_ms)
    else:
        if not isinstance(rec.cron, str) or not rec.cron.strip():
            raise InvalidSchedule(name, "cron", rec.cron, "must be a cron expression")
        if rec.cron.strip().startswith("@") and rec.cron.strip().lower() not in ALIASES:
            raise InvalidSchedule(name, "cron", rec.cron, f"is not an alias ({', '.join(ALIASES)})")
        if len(rec.fields().split()) != 6:
            raise InvalidSchedule(name, "cron", rec.cron, "must have 5 fields, or 6 with seconds first")
        try:
            CronSim(rec.fields(), datetime(2000, 1, 1))
        except CronSimError as e:
            raise InvalidSchedule(name, "cron", rec.cron, f"cannot be read: {e}") from None
    first = rec.next_after(now_ms)
    if first is None:
        why = "no occurrence before its end" if rec.end_ms is not None else \
            f"no occurrence in the next {MAX_YEARS_AHEAD} years"
        raise ScheduleNeverFires(name, rec.expression, why)
    gap = shortest_gap_ms(rec, first)
    if gap is not None and rec.cron is not None and gap < min_interval_ms:
        raise ScheduleIntervalTooShort(name, rec.expression, gap, min_interval_ms)
    if jitter_ms and gap is not None and jitter_ms >= gap:
        raise InvalidSchedule(name, "jitter_ms", jitter_ms,
                              f"must be shorter than the gap between occurrences ({duration(gap)})")
    return first


def shortest_gap_ms(rec: Recurrence, first: int) -> int | None:
    """The shortest gap between two of the first `GAP_SAMPLE` occurrences from `first`."""
    if rec.every_ms is not None:
        return rec.every_ms
    gap, prev = None, first
    for _ in range(GAP_SAMPLE):
        nxt = rec.next_after(prev)
        if nxt is None:
            break
        gap = nxt - prev if gap is None else min(gap, nxt - prev)
        prev = nxt
    return gap


def iso_ms(text: str) -> int:
    """An ISO 8601 instant ('2026-12-01T05:00:00+08:00', '...Z'; no offset: UTC) -> ms."""
    when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)
