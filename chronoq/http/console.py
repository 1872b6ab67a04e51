"""The web console's logic: reading people's input, the charts, the delivery-error history, access.

Theory of operation: the console is a static page (`static/index.html` + a small script, no
build step, nothing fetched from the internet) that calls the JSON endpoints of `http/server.py`.
Those endpoints call the admin service's methods in process (`AdminService`: ListTopics, Stats,
QueryMessage, CancelMessage, SearchTimers, PendingByDue), the same code the gRPC admin API and
`chronoq` CLI go through, so the console has no second path into the broker. This module holds
what is the console's own:

- `parse_time_ms` reads a time as a person types it ("now", "+10m", "2026-11-24T07:00Z", epoch
  ms) and `ConsoleInputError` says what was wrong with it, never a stack trace; `check_range`
  checks the search form's range in the form's words ("due from", "to") and UTC times
  (`spoken_utc`), before the search runs;
- `pending_chart_svg` and `error_chart_svg` draw the two charts on the server as SVG (no
  JavaScript chart library to vendor; they are images the page reloads);
- `ErrorHistory` samples the delivery-error histogram every `console_sample_interval_ms` and keeps
  the last `console_history_samples` intervals (count, p50, p99, max of *that* interval, from the
  difference of two snapshots of the cumulative histogram); it is in memory and restarts empty;
- `Access.check(request, role)` is the one door every HTTP call but `/healthz` goes through
  ("read" for a topic's views, "admin" for cancel and for the broker-wide views that call no
  admin method: `/metrics` and the delivery-error chart), called by `HttpServer.call` before it
  calls an admin method; with auth on it turns the HTTP Basic credentials (a browser's, or a
  Prometheus scrape's `basic_auth`) into the caller the admin methods check.

Nothing here blocks: each function does bounded work (limits in `config.py`).
"""

from __future__ import annotations

import base64
import binascii
import html
import re
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from chronoq.clock import Clock
from chronoq.config import DAY_MS, HOUR_MS, MINUTE_MS, SECOND_MS
from chronoq.errors import ConsoleInputError, Unauthorized
from chronoq.errors import (
    Forbidden as Forbidden,  # re-exported: the access check raises it (errors.py defines every client-visible error)
)
from chronoq.server.auth import ANONYMOUS, Authenticator, Principal
from chronoq.timefmt import MAX_EPOCH_MS, duration
from chronoq.timer.metrics import LatencyHistogram

Role = Literal["read", "admin"]

MAX_TIME_INPUT_CHARS = 64
"""Longest time text the console reads (an ISO date with zone is ~30)."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Access:
    """The console's single authorization point (see the module docstring).

    With auth off every caller may read and cancel. With auth on (`[auth]`) a browser
    sends HTTP Basic credentials, the user's access key and secret key (a page cannot sign
    RocketMQ's HMAC headers), checked by the same `Authenticator` as the gRPC services; the
    resulting `Principal` is what the admin methods then check, so the console may do no more
    than the same user through the CLI. "admin" asks in addition for the admin role, through the
    same `Principal.require_admin` the admin methods use: cancel, and the broker-wide views that
    call no admin method (`/metrics` names every topic and group, the delivery-error chart spans
    every topic). Every other view is "read": an admin gets the admin methods' replies, another
    user the same views cut to its topics (`http/scope.py`, by `Principal.may_see`), so one user
    sees no more through the console than through the CLI."""

    def __init__(self, authenticator: Authenticator | None = None) -> None:
        self.authenticator = authenticator

    def check(self, request: Any, role: Role) -> Principal:
        auth = self.authenticator
        if auth is None or not auth.enabled:
            return ANONYMOUS
        access_key, secret_key = basic_credentials(request.headers.get("Authorization", ""))
        principal = auth.password(access_key, secret_key)
        if role == "admin":
            principal.require_admin(f"{request.method} {request.path}")
        return principal


def basic_credentials(header: str) -> tuple[str, str]:
    """(access key, secret key) of an `Authorization: Basic ...` header, or `Unauthorized`."""
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded.strip() or len(encoded) > 4096:
        raise Unauthorized("the console needs a user's access key and secret key (HTTP Basic)", cause="no_credentials")
    try:
        access_key, sep, secret_key = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
    except (binascii.Error, ValueError):
        raise Unauthorized("the HTTP Basic credentials are not base64 of 'access key:secret key'",
                           cause="malformed") from None
    if not sep or not access_key:
        raise Unauthorized("the HTTP Basic credentials name no access key", cause="no_credentials")
    return access_key, secret_key


# -- input --------------------------------------------------------------------------------------

_RELATIVE = re.compile(r"^(?:now)?\s*([+-])\s*(\d{1,9})\s*(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": SECOND_MS, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}


def parse_time_ms(text: str, now_ms: int, field: str) -> int:
    """A time typed by a person, as epoch ms: "now", "+10m" / "now-1h" (ms, s, m, h, d), an ISO
    8601 date and time (no zone = UTC), or epoch milliseconds; within 1970-01-01T00:00:00Z ..
    `MAX_EPOCH_MS` (what `format_utc` can show: a time past it, "+999999998d" or
    "9999-12-31T23:00-14:00", is refused here rather than fail when the reply is written)."""
    value = _parse_time_ms(text, now_ms, field)
    if value > MAX_EPOCH_MS:
        raise ConsoleInputError(f"{field}: {text.strip()!r} is after {format_utc(MAX_EPOCH_MS)} "
                                f"(epoch ms {MAX_EPOCH_MS}), the last time the console can show")
    if value < 0:
        raise ConsoleInputError(f"{field}: {text.strip()!r} is before 1970-01-01T00:00:00Z (epoch ms 0); "
                                "timers are due after it")
    return value


def _parse_time_ms(text: str, now_ms: int, field: str) -> int:
    raw = (text or "").strip()
    if not raw:
        raise ConsoleInputError(f"{field}: give a time (now, +10m, 2026-11-24T07:00Z or epoch ms)")
    if len(raw) > MAX_TIME_INPUT_CHARS:
        raise ConsoleInputError(f"{field}: {len(raw)} characters is too long for a time")
    lowered = raw.lower()
    if lowered == "now":
        return now_ms
    if m := _RELATIVE.match(lowered):
        sign = 1 if m.group(1) == "+" else -1
        return now_ms + sign * int(m.group(2)) * _UNIT_MS[m.group(3)]
    if raw.isdigit():
        return int(raw)  # at most 64 digits (MAX_TIME_INPUT_CHARS); the range is checked by the caller
    try:
        parsed = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError:
        raise ConsoleInputError(f"{field}: cannot read {raw!r} as a time; use now, +10m, -1h, "
                                "2026-11-24T07:00Z or epoch milliseconds") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def spoken_utc(ms: int) -> str:
    """A time as a person reads it in a sentence: '2026-11-28 10:00:00 UTC', with milliseconds
    only when there are some ('... 10:00:00.250 UTC')."""
    text = (_EPOCH + timedelta(milliseconds=ms)).strftime("%Y-%m-%d %H:%M:%S")
    return text + (f".{ms % SECOND_MS:03d}" if ms % SECOND_MS else "") + " UTC"


def check_range(from_text: str, from_ms: int, to_text: str, to_ms: int, max_range_ms: int) -> None:
    """The search form's due-time range, checked in the form's own words ("due from", "to"), with
    what each field was read as, before the search runs: an empty or reversed range, or one wider
    than `timer_search_max_range_ms`, is a `ConsoleInputError`."""
    start = f"due from {from_text.strip()!r} ({spoken_utc(from_ms)})"
    end = f"to {to_text.strip()!r} ({spoken_utc(to_ms)})"
    if to_ms < from_ms:
        raise ConsoleInputError(f"the range's end, {end}, is before its start, {start}: the range must end "
                                "after it starts")
    if to_ms == from_ms:
        raise ConsoleInputError(f"the range's end, {end}, is its start, {start}: the range must end after "
                                "it starts")
    if to_ms - from_ms > max_range_ms:
        raise ConsoleInputError(f"the range {start} {end} covers {duration(to_ms - from_ms)}, more than "
                                f"timer_search_max_range_ms ({duration(max_range_ms)}); search a narrower one")


def format_utc(ms: int | None) -> str:
    if ms is None:
        return "-"
    # Integer arithmetic: `fromtimestamp(ms / 1000)` rounds through a float (year 9999 showed .998).
    return (_EPOCH + timedelta(milliseconds=ms)).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


# -- the pending-by-due chart -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Horizon:
    name: str
    bar_s: int
    bars: int
    label: str


HORIZONS: dict[str, Horizon] = {h.name: h for h in (
    Horizon("10m", 10, 60, "next 10 minutes, 10 s bars"),
    Horizon("1h", 60, 60, "next hour, 1 min bars"),
    Horizon("1d", 3600, 24, "next 24 hours, 1 h bars"),
    Horizon("7d", 6 * 3600, 28, "next 7 days, 6 h bars"),
    Horizon("30d", 86_400, 30, "next 30 days, 1 day bars"),
)}


def horizon(name: str) -> Horizon:
    found = HORIZONS.get(name)
    if found is None:
        raise ConsoleInputError(f"horizon: {name!r} is not one of {', '.join(HORIZONS)}")
    return found


_W, _H, _PAD_L, _PAD_B, _PAD_T = 720, 220, 56, 30, 24


def _svg(title: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
            f'role="img" aria-label="{html.escape(title)}" font-family="sans-serif" font-size="11">'
            f'<title>{html.escape(title)}</title><rect width="{_W}" height="{_H}" fill="#fff"/>'
            + "".join(body) + "</svg>")


def _axis(top: float, label_top: str) -> list[str]:
    return [f'<line x1="{_PAD_L}" y1="{_H - _PAD_B}" x2="{_W - 8}" y2="{_H - _PAD_B}" stroke="#888"/>',
            f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{_H - _PAD_B}" stroke="#888"/>',
            f'<text x="{_PAD_L - 4}" y="{_PAD_T + 4}" text-anchor="end">{html.escape(label_top)}</text>',
            f'<text x="{_PAD_L - 4}" y="{_H - _PAD_B}" text-anchor="end">0</text>',
            f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_W - 8}" y2="{_PAD_T}" stroke="#eee"/>']


def pending_chart_svg(counts: list[int], from_s: int, h: Horizon, before: int | None, after: int | None,
                      partial_from_ms: int | None = None, scope: str = "") -> str:
    """Bars of pending timers per interval from `from_s` on, with what lies outside the chart.
    `scope` names whose timers they are when not every topic's ("your topics"); a chart counted
    by a bounded scan that stopped gives `partial_from_ms` (the bars may be short from then on)
    and None for what it could not count."""
    top = max([*counts, 1])
    width = (_W - _PAD_L - 8) / max(len(counts), 1)
    plot_h = _H - _PAD_B - _PAD_T
    body = _axis(top, str(top))
    for i, n in enumerate(counts):
        if n:
            bar_h = max(1.0, plot_h * n / top)
            x = _PAD_L + i * width
            when = format_utc((from_s + i * h.bar_s) * 1000)
            body.append(f'<rect class="bar" x="{x + 1:.1f}" y="{_H - _PAD_B - bar_h:.1f}" '
                        f'width="{max(width - 2, 1):.1f}" height="{bar_h:.1f}" fill="#3b78c2">'
                        f"<title>{n} due from {when}</title></rect>")
    for i in range(0, len(counts) + 1, max(1, len(counts) // 6)):
        x = _PAD_L + i * width
        label = "now" if i == 0 else "+" + duration(i * h.bar_s * 1000)
        anchor = "end" if i == len(counts) else "start" if i == 0 else "middle"  # the ends stay inside
        body.append(f'<text x="{x:.1f}" y="{_H - _PAD_B + 14}" text-anchor="{anchor}">{html.escape(label)}</text>')
    whose = f" in {scope}" if scope else ""
    note = f"{sum(counts)} due{whose} in the {h.label}"
    if before is not None:
        note += f"; {before} overdue"
    if after is not None:
        note += f"; {after} later"
    if partial_from_ms is not None:
        note += f"; scan stopped (timer_search_max_scanned): bars from {format_utc(partial_from_ms)} may be short"
    body.append(f'<text x="{_PAD_L}" y="14">{html.escape(note)}</text>')
    return _svg(f"pending timers by due time, {h.label}", body)


# -- delivery error over time -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ErrorSample:
    at_ms: int
    count: int
    p50_ms: int | None
    p99_ms: int | None
    max_ms: int | None


def _interval_percentile(diff: list[tuple[int, int]], p: float) -> int:
    total = sum(n for _, n in diff)
    rank = max(1, -(-total * p // 100))
    seen = 0
    for key, n in diff:
        seen += n
        if seen >= rank:
            return LatencyHistogram.bucket_high(key)
    return LatencyHistogram.bucket_high(diff[-1][0])


class ErrorHistory:
    """The delivery error per sampling interval (see the module docstring)."""

    def __init__(self, histogram: LatencyHistogram, max_samples: int) -> None:
        self._histogram = histogram
        self._previous: dict[int, int] = dict(histogram.buckets())
        self.samples: deque[ErrorSample] = deque(maxlen=max_samples)

    def sample(self, now_ms: int) -> ErrorSample:
        current = dict(self._histogram.buckets())
        diff = sorted((k, n - self._previous.get(k, 0)) for k, n in current.items() if n > self._previous.get(k, 0))
        self._previous = current
        if diff:
            sample = ErrorSample(now_ms, sum(n for _, n in diff), _interval_percentile(diff, 50),
                                 _interval_percentile(diff, 99), LatencyHistogram.bucket_high(diff[-1][0]))
        else:
            sample = ErrorSample(now_ms, 0, None, None, None)
        self.samples.append(sample)
        return sample

    async def run(self, clock: Clock, interval_ms: int) -> None:
        """Sample every `interval_ms` of `clock` (the broker's) until cancelled (owned by the HTTP
        server's task group)."""
        while True:
            await clock.sleep_ms(interval_ms)
            self.sample(clock.now_ms())


def error_chart_svg(samples: list[ErrorSample], interval_ms: int) -> str:
    """P50 and P99 of the delivery error per sampling interval, oldest left."""
    points = [s for s in samples if s.count]
    top = max([s.p99_ms or 0 for s in points] + [1])
    n = max(len(samples), 2)
    step = (_W - _PAD_L - 8) / (n - 1)
    plot_h = _H - _PAD_B - _PAD_T
    body = _axis(top, duration(top))

    def line(values: list[tuple[int, int]], color: str, name: str) -> None:
        if not values:
            return
        coords = " ".join(f"{_PAD_L + i * step:.1f},{_H - _PAD_B - plot_h * v / top:.1f}" for i, v in values)
        body.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}">'
                    f"<title>{name}</title></polyline>")
        for i, v in values:
            body.append(f'<circle cx="{_PAD_L + i * step:.1f}" cy="{_H - _PAD_B - plot_h * v / top:.1f}" r="2" '
                        f'fill="{color}"/>')

    line([(i, s.p99_ms) for i, s in enumerate(samples) if s.p99_ms is not None], "#c0392b", "p99")
    line([(i, s.p50_ms) for i, s in enumerate(samples) if s.p50_ms is not None], "#27ae60", "p50")
    span = duration(interval_ms * max(len(samples) - 1, 0))
    fired = sum(s.count for s in samples)
    note = (f"fired minus due, per {duration(interval_ms)}: p99 (red), p50 (green); {fired} fired in the last {span}"
            if samples else f"no sample yet (one every {duration(interval_ms)})")
    body.append(f'<text x="{_PAD_L}" y="14">{html.escape(note)}</text>')
    body.append(f'<text x="{_PAD_L}" y="{_H - _PAD_B + 14}">-{html.escape(span)}</text>')
    body.append(f'<text x="{_W - 8}" y="{_H - _PAD_B + 14}" text-anchor="end">now</text>')
    return _svg("delivery error over time", body)
