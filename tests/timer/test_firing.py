"""The firing policy: every `timer_firer` value has one, and it says who fires and when the loop steps in."""

from __future__ import annotations

import typing

import pytest

from chronoq.config import Config
from chronoq.timer.firing import BROKER_FIRES, FiringPolicy, firing_policy

FIRERS = typing.get_args(typing.get_type_hints(Config)["timer_firer"])


@pytest.mark.parametrize("name", FIRERS)
def test_every_firer_the_config_accepts_has_a_policy(name: str) -> None:
    assert isinstance(firing_policy(Config(timer_firer=name)), FiringPolicy)


def test_the_broker_fires_what_is_due_now() -> None:
    policy = firing_policy(Config())
    assert policy is BROKER_FIRES and policy.firer == "broker"
    assert (policy.loop_horizon_ms(10_000), policy.loop_deadline_ms(12_000), policy.loop_deadline_ms(None)) == (
        10_000, 12_000, None)


def test_with_a_job_firing_the_loop_is_only_its_backstop() -> None:
    policy = firing_policy(Config(timer_firer="spark", timer_spark_backstop_ms=60_000))
    assert policy.firer == "job"
    assert policy.loop_horizon_ms(100_000) == 40_000  # fires only what is overdue by the backstop
    assert policy.loop_deadline_ms(12_000) == 72_000
