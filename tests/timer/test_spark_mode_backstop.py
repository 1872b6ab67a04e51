"""timer_firer = "spark": a timer the Spark job neither hands over (ArmTimers, `test_handoff.py`) nor
fires (FireTimers) waits for the job; the broker's own loop is its backstop, for timers overdue by
`timer_spark_backstop_ms`, and never fires twice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage, TimerState
from tests.support.brokers import open_broker

pytestmark = pytest.mark.usefixtures("each_timer_engine")


def test_the_broker_leaves_timers_to_the_job_then_backs_it_up(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock()
        # Due beyond the hand-off horizon when accepted: the job's, not the broker's.
        config = Config(data_dir=tmp_path, timer_firer="spark", timer_spark_backstop_ms=60_000,
                        timer_handoff_horizon_ms=1000)
        broker = await open_broker(config, clock=clock, background=False)
        await broker.run_due()
        by_job = await broker.send(OutgoingMessage("t", b"fired by the job", delay_ms=2000))
        dropped = await broker.send(OutgoingMessage("t", b"dropped by the job", delay_ms=2000))
        clock.advance(2000)
        assert await broker.run_due() == 0  # due, but the job decides
        # The job fires the first one (by the position of its timer record).
        timer_pos = broker.query(by_job.message_id)[0].position
        assert await broker.fire_timers([timer_pos]) == (1, 0)
        assert await broker.fire_timers([timer_pos]) == (0, 1)  # a retried call fires nothing twice
        clock.advance(60_000 - 1)
        assert await broker.run_due() == 0  # the dropped one is not yet overdue by the backstop
        clock.advance(1)
        assert await broker.run_due() == 1  # now the broker fires it itself
        states = {broker.query(r.message_id)[0].state for r in (by_job, dropped)}
        assert states == {TimerState.DELIVERED}
        bodies = sorted(m.message.body for m in await broker.receive("g", "t"))
        assert bodies == [b"dropped by the job", b"fired by the job"]
        await broker.close()

    asyncio.run(body())
