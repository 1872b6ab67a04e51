"""RocketMQ 4 delay levels: a small table from level number to delay.

Theory of operation: `Config.delay_levels` ("1s 5s 10s 30s 1m ... 2h") is parsed once into
`Config.delay_levels_ms`; `DelayLevels` wraps that tuple with RocketMQ's rules. Levels are
1-based. A level below 1 is refused (`InvalidDelayLevel`): RocketMQ treats 0 as "no delay",
but a producer that asks for a delay level and gets none would be surprised, so chronoq says so.
A level above the table's top is clamped to the top, exactly as RocketMQ's
`ScheduleMessageService` does, so a client written for a longer table still gets its longest
delay instead of an error.

Consumer redelivery uses the same table: RocketMQ's broker picks `3 + reconsumeTimes` for a
message sent back without an explicit level (`SendMessageProcessor`), so the first retry waits
level 3 (10 s with the default table) and each further retry one level more, up to the top.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from chronoq.config import Config, ConfigError
from chronoq.errors import InvalidDelayLevel

RETRY_BASE_LEVEL = 3
"""RocketMQ's first retry level (`3 + reconsumeTimes`)."""


class DelayLevels:
    __slots__ = ("_levels_ms",)

    def __init__(self, levels_ms: Sequence[int]) -> None:
        levels = tuple(levels_ms)
        if not levels:
            raise ConfigError("delay_levels must name at least one level")
        for level, delay_ms in enumerate(levels, start=1):
            if not isinstance(delay_ms, int) or isinstance(delay_ms, bool) or delay_ms < 0:
                raise ConfigError(f"delay level {level} must be a whole number of ms >= 0, not {delay_ms!r}")
        if any(b < a for a, b in itertools.pairwise(levels)):
            raise ConfigError(f"delay levels must not decrease: {list(levels)}")
        self._levels_ms = levels

    @classmethod
    def from_config(cls, config: Config) -> DelayLevels:
        return cls(config.delay_levels_ms)

    @property
    def max_level(self) -> int:
        return len(self._levels_ms)

    @property
    def levels_ms(self) -> tuple[int, ...]:
        return self._levels_ms

    def clamp(self, level: int) -> int:
        """`level` itself, or the top level if it is above the table; < 1 is refused."""
        if isinstance(level, bool) or not isinstance(level, int) or level < 1:
            raise InvalidDelayLevel(level, self.max_level, self._levels_ms[-1])
        return min(level, self.max_level)

    def delay_ms(self, level: int) -> int:
        """The delay of a 1-based `level`, clamped to the top level."""
        return self._levels_ms[self.clamp(level) - 1]

    def level_for_retry(self, delivery_attempt: int) -> int:
        """The delay level for redelivering a message whose `delivery_attempt` just failed.

        `delivery_attempt` counts deliveries the way `ReceivedMessage.delivery_attempt` does:
        1 for the first delivery, 2 for the first redelivery, and so on. RocketMQ's
        `reconsumeTimes` counts only redeliveries (0 on the first delivery), so
        reconsumeTimes = delivery_attempt - 1 and the level is 3 + reconsumeTimes: attempt 1
        fails -> level 3, attempt 2 fails -> level 4, ... clamped to the top level.
        """
        if isinstance(delivery_attempt, bool) or not isinstance(delivery_attempt, int) or delivery_attempt < 1:
            raise ValueError(f"delivery_attempt counts from 1, not {delivery_attempt!r}")
        reconsume_times = delivery_attempt - 1
        return min(RETRY_BASE_LEVEL + reconsume_times, self.max_level)

    def retry_delay_ms(self, delivery_attempt: int) -> int:
        """The redelivery delay after `delivery_attempt` failed (see `level_for_retry`)."""
        return self._levels_ms[self.level_for_retry(delivery_attempt) - 1]

    def __repr__(self) -> str:
        return f"DelayLevels({list(self._levels_ms)})"
