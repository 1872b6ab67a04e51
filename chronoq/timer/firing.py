"""Who fires timers, and when the broker's own loop steps in: the firing policy.

Theory of operation: a timer engine answers "what is due at now_ms?"; the firing policy says
what the broker's timer loop does with that answer. With the broker as the firer (the default,
`timer_firer = "broker"`) the loop fires what is due at `now_ms`. With a job as the firer
(`timer_firer = "spark"`: a Spark job reads the timer topic and hands each timer over, ArmTimers,
when it comes within `handoff_ms` of its due time) the loop fires the armed timers at their due
time (`timer/handoff.py` says which are armed) and is a backstop for the rest: it fires what is
overdue by `backstop_ms`, so a job that is down, or dropped a timer, never leaves one waiting
forever. Each fire path skips whatever already fired, so no timer fires twice. The policy is a
value built once from the config (`firing_policy`): the timer service asks it, instead of
comparing setting values. Which index holds the timers (`timer_engine`) is another question, `timer/engines.py`'s.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chronoq.config import Config


@dataclass(frozen=True, slots=True)
class FiringPolicy:
    firer: str
    """"broker" (its loop fires what is due) or "job" (an outside job fires; the loop is its backstop)."""
    backstop_ms: int = 0
    """How overdue an unarmed timer must be before the broker's loop fires it (0: as soon as it is due)."""
    handoff_ms: int = 0
    """With a job as the firer: the hand-off horizon (`timer_handoff_horizon_ms`)."""

    def loop_horizon_ms(self, now_ms: int) -> int:
        """The loop fires timers due at or before this."""
        return now_ms - self.backstop_ms

    def loop_deadline_ms(self, engine_deadline_ms: int | None) -> int | None:
        """When the loop next has work, given the engine's next due time."""
        return None if engine_deadline_ms is None else engine_deadline_ms + self.backstop_ms


BROKER_FIRES = FiringPolicy("broker")

_BY_FIRER: dict[str, Callable[[Config], FiringPolicy]] = {
    "broker": lambda config: BROKER_FIRES,
    "spark": lambda config: FiringPolicy("job", config.timer_spark_backstop_ms, config.timer_handoff_horizon_ms),
}
"""Each `timer_firer` value and its policy: the one place that setting is looked at."""


def firing_policy(config: Config) -> FiringPolicy:
    """The policy of `config.timer_firer` (`Config` has refused any other value)."""
    return _BY_FIRER[config.timer_firer](config)
