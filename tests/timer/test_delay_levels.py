"""RocketMQ 4 delay levels: lookup, clamping, refusal, and the retry rule."""

from __future__ import annotations

import pytest

from chronoq.config import Config, ConfigError
from chronoq.errors import InvalidDelayLevel
from chronoq.timer.levels import DelayLevels

S, M, H = 1000, 60_000, 3_600_000
DEFAULT_MS = (1 * S, 5 * S, 10 * S, 30 * S, 1 * M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 7 * M, 8 * M, 9 * M,
              10 * M, 20 * M, 30 * M, 1 * H, 2 * H)


@pytest.fixture
def levels() -> DelayLevels:
    return DelayLevels.from_config(Config())


def test_default_table_matches_rocketmq(levels: DelayLevels) -> None:
    assert levels.max_level == 18
    assert levels.levels_ms == DEFAULT_MS
    assert [levels.delay_ms(level) for level in range(1, 19)] == list(DEFAULT_MS)


def test_a_level_above_the_top_is_clamped(levels: DelayLevels) -> None:
    assert levels.delay_ms(19) == 2 * H
    assert levels.delay_ms(1_000) == 2 * H
    assert levels.clamp(19) == 18


@pytest.mark.parametrize("bad", [0, -1, -18])
def test_a_level_below_one_is_refused_with_the_range(levels: DelayLevels, bad: int) -> None:
    with pytest.raises(InvalidDelayLevel) as info:
        levels.delay_ms(bad)
    assert info.value.details == {"level": bad, "max_level": 18, "top_delay_ms": 2 * H}
    assert "1..18" in str(info.value)


@pytest.mark.parametrize("bad", [True, 1.0, "3", None])
def test_a_level_that_is_not_an_int_is_refused(levels: DelayLevels, bad: object) -> None:
    with pytest.raises(InvalidDelayLevel):
        levels.delay_ms(bad)  # type: ignore[arg-type]


def test_retry_level_is_three_plus_redeliveries_clamped(levels: DelayLevels) -> None:
    assert levels.level_for_retry(1) == 3  # the first delivery failed: RocketMQ reconsumeTimes 0
    assert levels.level_for_retry(2) == 4
    assert levels.level_for_retry(16) == 18
    assert levels.level_for_retry(17) == 18
    assert levels.level_for_retry(100) == 18
    assert levels.retry_delay_ms(1) == 10 * S
    assert levels.retry_delay_ms(2) == 30 * S
    with pytest.raises(ValueError):
        levels.level_for_retry(0)


def test_a_short_table_clamps_the_retry_level() -> None:
    short = DelayLevels([500, 2_000])
    assert short.max_level == 2
    assert short.level_for_retry(1) == 2
    assert short.delay_ms(5) == 2_000
    assert short.retry_delay_ms(1) == 2_000


def test_config_table_is_used() -> None:
    levels = DelayLevels.from_config(Config(delay_levels="100ms 1s 1m"))
    assert levels.levels_ms == (100, 1000, 60_000)
    assert levels.delay_ms(3) == 60_000


@pytest.mark.parametrize("bad", [[], [1000, 500], [-1], [1.5], [True]])
def test_bad_tables_are_refused(bad: list[object]) -> None:
    with pytest.raises(ConfigError):
        DelayLevels(bad)  # type: ignore[arg-type]
