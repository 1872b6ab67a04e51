"""`chronoq.timefmt`: the dates and durations every error, CLI table and report shows a person."""

from __future__ import annotations

import re

import pytest

from chronoq import timefmt
from chronoq.config import ConfigError, parse_duration_ms
from chronoq.errors import (
    DeliveryTimeTooFar,
    InvalidDelayLevel,
    InvalidInvisibleDuration,
    MessageTooLarge,
    NegativeDelay,
    TimerAlreadyFired,
    TopicNotFound,
)

DAY_MS = 86_400_000


@pytest.mark.parametrize(("ms", "text"), [
    (0, "0ms"), (12, "12ms"), (999, "999ms"), (1000, "1s"), (1250, "1.25s"), (59_999, "59.999s"),
    (60_000, "1m00s"), (243_000, "4m03s"), (3_600_000, "1h00m"), (11_520_000, "3h12m"), (DAY_MS, "1 day"),
    (2 * DAY_MS + 3 * 3_600_000, "2d03h"), (30 * DAY_MS, "30 days"), (400 * DAY_MS + 5 * 3_600_000, "400 days"),
    (-1250, "-1.25s"), (-7_325_000, "-2h02m"),
])
def test_duration_keeps_the_two_largest_units(ms: int, text: str) -> None:
    assert timefmt.duration(ms) == text


def test_exact_and_a_value_just_over_its_limit() -> None:
    assert timefmt.exact(30 * DAY_MS + 1000) == "30d 0h 0m 1s"
    assert timefmt.exact(250) == "0.25s"
    # Both would read "30 days": the value is said exactly so the refusal makes sense.
    assert timefmt.duration_against(30 * DAY_MS + 1000, 30 * DAY_MS) == ("30d 0h 0m 1s", "30 days")
    assert timefmt.duration_against(31 * DAY_MS, 30 * DAY_MS) == ("31 days", "30 days")


def test_instant_is_iso_8601_utc_and_never_raises() -> None:
    assert timefmt.instant(1_830_026_081_925) == "2027-12-28T20:34:41.925Z"
    assert timefmt.instant(1_830_026_081_000) == "2027-12-28T20:34:41Z"
    assert timefmt.instant(10**18) == "1000000000000000000 ms since the epoch (no calendar date)"
    assert timefmt.relative(5_000, 0) == "in 5s" and timefmt.relative(0, 5_000) == "5s ago"
    assert timefmt.relative(7, 7) == "now"


@pytest.mark.parametrize(("asked_ms", "text"), [
    (29 * DAY_MS, "in 29 days"), (3 * DAY_MS, "in 3 days"), (DAY_MS, "in 1 day"), (2 * 3_600_000, "in 2h00m"),
    (90 * 60_000, "in 1h30m"), (5 * 60_000, "in 5m00s"), (10_000, "in 9.9s"),
])
def test_a_due_time_read_a_moment_later_shows_the_delay_asked_for(asked_ms: int, text: str) -> None:
    """`chronoq send --in 29d` printed "(in 28 days)": the due time is fixed when the server takes
    the message, the clock read to print it 100 ms later, and 28.99 days truncated to 28. Rounded
    to the nearest step shown, the delay reads as asked (below a minute every ms is shown)."""
    sent_ms = 1_800_000_000_000
    assert timefmt.relative(sent_ms + asked_ms, sent_ms + 100) == text


def test_relative_rounds_to_the_nearest_step_shown_either_way() -> None:
    assert timefmt.relative(0, 29 * DAY_MS - 100) == "29 days ago"
    assert timefmt.relative(DAY_MS * 12 + DAY_MS // 2 - 1, 0) == "in 12 days"
    assert timefmt.relative(DAY_MS * 12 + DAY_MS // 2, 0) == "in 13 days"
    assert timefmt.relative(9 * DAY_MS + 23 * 3_600_000 + 40 * 60_000, 0) == "in 10 days"  # into the next unit
    assert timefmt.relative(59 * 60_000 + 59_600, 0) == "in 1h00m"
    assert timefmt.relative(59_999, 0) == "in 59.999s"


def test_errors_show_dates_and_durations_and_keep_raw_values_in_details() -> None:
    now = 1_795_000_000_000
    e = DeliveryTimeTooFar(now + 400 * DAY_MS, now, 30 * DAY_MS)
    assert e.message == ("delivery time 2027-12-23T11:06:40Z is 400 days ahead; the limit "
                         "(timer_max_delay_ms) is 30 days")
    assert e.details == {"deliver_at_ms": now + 400 * DAY_MS, "now_ms": now, "max_delay_ms": 30 * DAY_MS}
    assert "30d 0h 0m 1s ahead" in DeliveryTimeTooFar(now + 30 * DAY_MS + 1000, now, 30 * DAY_MS).message
    assert InvalidInvisibleDuration(500, 1000, 43_200_000).message.startswith(
        "invisible duration 500ms is outside [1s, 12h00m]")
    assert NegativeDelay(-5000).message == "delay -5s is negative"
    assert "was due at 2026-11-18T11:06:40Z" in TimerAlreadyFired("m1", now).message
    assert TimerAlreadyFired("m1", now).details["deliver_at_ms"] == now


def test_delay_level_refusal_names_the_top_of_the_table() -> None:
    above = InvalidDelayLevel(99, 18, 7_200_000)
    assert "delay level 99 is above the top of the delay-level table (level 18 = 2h00m)" in above.message
    assert above.details == {"level": 99, "max_level": 18, "top_delay_ms": 7_200_000}
    assert "levels are 1..18" in InvalidDelayLevel(0, 18, 7_200_000).message


def test_topic_not_found_says_only_what_is_true() -> None:
    assert TopicNotFound("x").message == "topic 'x' does not exist; create it with `chronoq topics create x`"
    assert TopicNotFound("x", auto_create=True).message.endswith("`chronoq topics create x` or send to it")
    off = TopicNotFound("x", auto_create=False).message
    assert "auto-create is off" in off and "send to it" not in off
    assert "auto-create is off" not in TopicNotFound("x", auto_create=True).message


@pytest.mark.parametrize("ms", [0, 12, 1250, 59_999, 60_000, 243_000, 3_600_000, 11_520_000, DAY_MS,
                                2 * DAY_MS + 3 * 3_600_000, 30 * DAY_MS, 2520 * DAY_MS])
def test_every_duration_shown_reads_back_as_a_flag_value(ms: int) -> None:
    """What a message or a table says ('1h30m', '12h00m', '2,520 days') can be pasted into
    `send --in` or `consume --invisible`."""
    assert parse_duration_ms(timefmt.duration(ms)) == ms


def test_durations_compound_fractional_and_refused() -> None:
    assert parse_duration_ms("1h30m") == 5_400_000 and parse_duration_ms("1.5h") == 5_400_000
    assert parse_duration_ms("2d03h") == 2 * DAY_MS + 3 * 3_600_000 and parse_duration_ms("1s500ms") == 1500
    for text, says in [("-5s", "a duration cannot be negative"), ("5", "a number needs its unit (5s, 5m"),
                       ("1m1h", "several largest first"), ("1h 30m", "several largest first"),
                       ("0.5ms", "not a whole number of milliseconds"), ("", "use a number with")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            parse_duration_ms(text)


def test_sizes_are_exact_with_thousands_and_a_binary_unit_beside() -> None:
    assert timefmt.byte_size(512) == "512 bytes" and timefmt.byte_size(1) == "1 byte"
    assert timefmt.byte_size(4 * 1024 * 1024) == "4,194,304 bytes (4 MiB)"
    assert MessageTooLarge(5_000_368, 4_194_304).message == (
        "message is 5,000,368 bytes (4.8 MiB); the limit (max_message_size_bytes) is 4,194,304 bytes (4 MiB)")
    assert timefmt.duration(2520 * DAY_MS) == "2,520 days"
