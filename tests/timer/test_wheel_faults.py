"""The file wheel's files damaged, missing or torn: a broker on it loses nothing acknowledged.

Each case runs a real in-process broker with `timer_engine = "wheel"` on a simulated clock: one
timer fired, one cancelled, five pending; the broker closes; the wheel's files are damaged the
way a disk or an operator could; the broker opens again and must know every timer's state,
fire the pending ones on time, and not fire the others again. Damage the checks can see makes
the wheel unusable (`TimerIndexCorrupt`): it is destroyed and rebuilt from the commit log. A torn
wheel file (the slot table) is no damage at all: it is written again from the TimerLog's units at
every open. `chronoq check` reports the damage as a repair, reading without writing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chronoq.clock import FakeClock
from chronoq.config import HOUR_MS
from chronoq.model import OutgoingMessage, TimerState
from chronoq.store import files
from chronoq.store.check import check_data_dir
from chronoq.timer import wheel_files as wf
from chronoq.timer.wheel import WheelTimerEngine
from tests.support.brokers import simulated_broker
from tests.support.timers import START_MS, assert_not_early, drain, log_end, pending_total, run

WHEEL = {"timer_engine": "wheel"}


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def _damage(wheel_dir: Path, how: str) -> None:
    log, facts, table = (wheel_dir / f"{n}.0" for n in ("timerlog", "timerfacts", "timerwheel"))
    if how == "deleted":
        shutil.rmtree(wheel_dir)
    elif how == "checkpoint-garbage":
        (wheel_dir / "timercheck").write_bytes(b"not a checkpoint")
    elif how == "checkpoint-missing":
        (wheel_dir / "timercheck").unlink()
    elif how == "timerlog-short":
        os.truncate(log, log.stat().st_size - wf.UNIT_SIZE - 7)
    elif how == "facts-flipped":
        _flip(facts, facts.stat().st_size // 2)
    elif how == "unit-position-flipped":
        _flip(log, 3 * wf.UNIT_SIZE + 36)  # the commit-log position of the fourth unit
    elif how == "unit-chain-flipped":
        _flip(log, 2 * wf.UNIT_SIZE + 6)  # the previous-unit link of the third unit
    elif how == "wheel-garbage":
        table.write_bytes(os.urandom(table.stat().st_size))
    elif how == "wheel-missing":
        table.unlink()
    else:
        raise AssertionError(how)


REBUILT = {"deleted", "checkpoint-garbage", "checkpoint-missing", "timerlog-short", "facts-flipped",
           "unit-position-flipped", "unit-chain-flipped"}


@pytest.mark.parametrize("how", ["deleted", "checkpoint-garbage", "checkpoint-missing", "timerlog-short",
                                 "facts-flipped", "unit-position-flipped", "unit-chain-flipped", "wheel-garbage",
                                 "wheel-missing"])
def test_damaged_or_missing_wheel_files_lose_nothing(tmp_path: Path, how: str) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        b = await simulated_broker(data, clock, **WHEEL)
        fired = await b.send(OutgoingMessage("orders", b"fired", delay_ms=1000))
        cancelled = await b.send(OutgoingMessage("orders", b"cancelled", delay_ms=HOUR_MS))
        pending = [await b.send(OutgoingMessage("orders", f"p{i}".encode(), delay_ms=2 * HOUR_MS + i,
                                                keys=(f"key{i}",))) for i in range(5)]
        await b.cancel(recall_handle=cancelled.recall_handle)
        clock.advance(1000)
        assert await b.run_due() == 1
        assert [m.body for m in await drain(b, "orders")] == [b"fired"]
        end = log_end(b)
        await b.close()
        wheel_dir = data / files.TIMER_WHEEL_DIR
        _damage(wheel_dir, how)
        report = check_data_dir(data)
        if how in REBUILT and how != "deleted":
            assert any(str(wheel_dir) in r and "rebuilds it from the log" in r for r in report.repairs), report.repairs
        else:
            assert not any(str(wheel_dir) in r for r in report.repairs), report.repairs
        b = await simulated_broker(data, clock, **WHEEL)
        try:
            assert b.timer.engine.indexed_position == end
            assert pending_total(b) == 5
            assert b.query(fired.message_id)[0].state is TimerState.DELIVERED
            assert b.query(cancelled.message_id)[0].state is TimerState.CANCELLED
            assert [s.message_id for s in b.query_key("key3")] == [pending[3].message_id]
            assert await b.run_due() == 0
            clock.set(START_MS + 2 * HOUR_MS + 10)
            assert await b.run_due() == 5
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in pending)
            assert_not_early(got)
        finally:
            await b.close()

    run(body())


def test_changing_the_wheel_size_rebuilds_it_and_loses_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        b = await simulated_broker(data, clock, **WHEEL)
        sent = [await b.send(OutgoingMessage("orders", f"m{i}".encode(), delay_ms=(i + 1) * HOUR_MS))
                for i in range(4)]
        await b.close()
        assert "ask for 64 of 60000 ms" in (WheelTimerEngine.verify(data / files.TIMER_WHEEL_DIR, slot_ms=60_000,
                                                                     slots=64) or "")
        b = await simulated_broker(data, clock, timer_wheel_slot_ms=60_000, timer_wheel_slots=64, **WHEEL)
        try:
            assert pending_total(b) == 4
            clock.set(START_MS + 4 * HOUR_MS)  # beyond the 64-minute window: each was rolled on the way
            assert await b.run_due() == 4
            got = await drain(b, "orders")
            assert [m.message_id for m in got] == [r.message_id for r in sent]
            assert_not_early(got)
        finally:
            await b.close()

    run(body())


@pytest.mark.parametrize("start, then", [("rocksdb", "wheel"), ("wheel", "rocksdb"), ("wheel", "memory")])
def test_switching_engines_on_a_data_directory_rebuilds_the_new_one_from_the_log(
        tmp_path: Path, start: str, then: str) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        data = tmp_path / "data"
        b = await simulated_broker(data, clock, timer_engine=start)
        fired = await b.send(OutgoingMessage("orders", b"fired", delay_ms=1000))
        cancelled = await b.send(OutgoingMessage("orders", b"cancelled", delay_ms=HOUR_MS))
        pending = [await b.send(OutgoingMessage("orders", f"p{i}".encode(), delay_ms=2 * HOUR_MS))
                   for i in range(3)]
        await b.cancel(recall_handle=cancelled.recall_handle)
        clock.advance(1000)
        assert await b.run_due() == 1
        await drain(b, "orders")
        await b.close()
        b = await simulated_broker(data, clock, timer_engine=then)
        try:
            assert pending_total(b) == 3
            assert b.query(fired.message_id)[0].state is TimerState.DELIVERED
            assert b.query(cancelled.message_id)[0].state is TimerState.CANCELLED
            clock.set(START_MS + 2 * HOUR_MS)
            assert await b.run_due() == 3
            got = await drain(b, "orders")
            assert sorted(m.message_id for m in got) == sorted(r.message_id for r in pending)
            assert_not_early(got)
        finally:
            await b.close()

    run(body())
