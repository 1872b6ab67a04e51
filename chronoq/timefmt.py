"""Times, durations and sizes for people: the one formatter behind every error message, CLI table and report.

Theory of operation: chronoq keeps time as integer milliseconds everywhere a program reads it
(errors' `details`, the admin JSON, the disk): ms since the epoch for instants, plain ms for
durations. A person reads "2026-11-23T09:00:00Z" and "3h12m" faster and with fewer mistakes than
1795424400000 and 11520000, so every text meant for a person goes through here, and the raw
values stay beside it for programs. Pure functions, no clock: `relative` takes `now_ms`, and rounds
to the nearest unit it shows (a time to come is read a moment after it was fixed, so truncation would
show one unit less than was asked for).

Instants are ISO 8601 in UTC with a "Z" (`instant`): text made on the server cannot know the
reader's zone, and ISO 8601 can be pasted back into `chronoq send --at`. The CLI, which knows
its reader's zone, shows local time with the offset (`local_instant`).

Durations keep the two largest units a person uses, truncated toward zero: 12ms, 1.25s, 4m03s,
3h12m, 2d03h, 400 days, 2,520 days. Truncation can make two different durations read the same
(30 days and 30 days 1 s); where a message compares a value with a limit, `exact` says the
difference. Every duration written here reads back with `chronoq.config.parse_duration_ms`
(what `chronoq send --in` and `consume --invisible` take): a value copied from a message can be
pasted into a flag.

Sizes (`byte_size`) are exact bytes with thousands separators, and binary units beside them from
1 KiB on: "5,000,368 bytes (4.8 MiB)", comparable with a setting in bytes and read at a glance.
"""

from __future__ import annotations

from datetime import UTC, datetime

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS
MAX_EPOCH_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z: the last time `datetime` (and so every date shown) can hold."""
DAYS_ALONE_FROM = 10
"""From this many days on, hours are dropped ("400 days", not "400d05h"): they no longer matter."""


def duration(ms: int | float) -> str:
    """A signed duration in its two largest units: '12ms', '1.25s', '4m03s', '3h12m', '2d03h', '30 days'."""
    ms = int(ms)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    if ms < SECOND_MS:
        return f"{sign}{ms}ms"
    if ms < MINUTE_MS:
        seconds = f"{ms / SECOND_MS:.3f}".rstrip("0").rstrip(".")
        return f"{sign}{seconds}s"
    if ms < HOUR_MS:
        minutes, rest = divmod(ms, MINUTE_MS)
        return f"{sign}{minutes}m{rest // SECOND_MS:02d}s"
    if ms < DAY_MS:
        hours, rest = divmod(ms, HOUR_MS)
        return f"{sign}{hours}h{rest // MINUTE_MS:02d}m"
    days, rest = divmod(ms, DAY_MS)
    hours = rest // HOUR_MS
    if hours and days < DAYS_ALONE_FROM:
        return f"{sign}{days}d{hours:02d}h"
    return f"{sign}{days:,} day{'s' if days != 1 else ''}"


def byte_size(n: int) -> str:
    """'512 bytes', '4,194,304 bytes (4 MiB)', '5,000,368 bytes (4.8 MiB)'."""
    n = int(n)
    text = f"{n:,} byte{'s' if n != 1 else ''}"
    if abs(n) < 1024:
        return text
    value = float(abs(n))
    units = ("KiB", "MiB", "GiB", "TiB")
    for unit in units:
        value /= 1024
        if value < 1024 or unit == units[-1]:
            break
    short = f"{value:.1f}".removesuffix(".0")
    return f"{text} ({'-' if n < 0 else ''}{short} {unit})"


def exact(ms: int) -> str:
    """Every non-zero unit down to the millisecond: '30d 0h 0m 1s', '1h 0m 0.25s'. For the rare
    text where `duration`'s rounding would hide the point (a value just over a limit)."""
    ms = int(ms)
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    parts = []
    for unit, size in (("d", DAY_MS), ("h", HOUR_MS), ("m", MINUTE_MS)):
        count, ms = divmod(ms, size)
        if count or parts:
            parts.append(f"{count}{unit}")
    if ms or not parts:
        parts.append(f"{ms / SECOND_MS:.3f}".rstrip("0").rstrip(".") + "s")
    return sign + " ".join(parts)


def duration_against(value_ms: int, limit_ms: int) -> tuple[str, str]:
    """`value_ms` and `limit_ms` as durations, the value exact when both would read the same."""
    value, limit = duration(value_ms), duration(limit_ms)
    if value == limit and value_ms != limit_ms:
        value = exact(value_ms)
    return value, limit


def instant(ms: int | float) -> str:
    """ms since the epoch as ISO 8601 UTC: '2026-11-23T09:00:00Z', '...T09:00:00.250Z'. A value
    no calendar date can hold says so rather than raising (it is shown in an error, usually)."""
    ms = int(ms)
    try:
        when = datetime.fromtimestamp(ms / SECOND_MS, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms since the epoch (no calendar date)"
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    if ms % SECOND_MS:
        text += f".{ms % SECOND_MS:03d}"
    return text + "Z"


def local_instant(ms: int | float | None) -> str:
    """ms since the epoch in the local zone, with milliseconds and the offset (for the CLI)."""
    if ms is None:
        return "-"
    try:
        return datetime.fromtimestamp(int(ms) / SECOND_MS).astimezone().isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return instant(ms)


def _shown_step(ms: int) -> int:
    """The smallest step `duration` shows for a duration of `ms` (>= 0): 1 ms below a minute, then
    the second, the minute, the hour, and the day from `DAYS_ALONE_FROM` days on."""
    if ms < MINUTE_MS:
        return 1
    if ms < HOUR_MS:
        return SECOND_MS
    if ms < DAY_MS:
        return MINUTE_MS
    return HOUR_MS if ms < DAYS_ALONE_FROM * DAY_MS else DAY_MS


def relative(ms: int, now_ms: int) -> str:
    """'in 4m03s', '3h12m ago' or 'now', rounded to the nearest step shown. A due time fixed a
    moment before `now_ms` (`chronoq send --in 29d`, then the clock read to print it) is 28 days
    23 h 59 min 59.9 s away: truncated, that would read "in 28 days" for the 29 days asked for."""
    delta = int(ms) - int(now_ms)
    if delta == 0:
        return "now"
    away = abs(delta)
    step = _shown_step(away)
    away = (away + step // 2) // step * step
    return f"in {duration(away)}" if delta > 0 else f"{duration(away)} ago"
