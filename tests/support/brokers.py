"""Opening brokers in tests: the one function that calls `Broker.open`, and the simulated brokers
most tests run on.

Theory of operation: every test that needs a `Broker` in its own process gets it from
`open_broker` (same arguments and defaults as `Broker.open`), directly or through the helpers
below, so how a test broker is opened (a timer engine to choose, a setting every test wants) is a
one-line change here. A *simulated* broker is a real RocksDB-backed broker in the test's temporary
directory, on a `FakeClock` and with `background=False`: time moves only when the test advances
the clock and timers fire only when it calls `run_due()`, so a two-day delay runs in microseconds
and the same way every time. `SimulatedBrokers` (the `brokers` fixture of tests/conftest.py) opens
such brokers on the test's data directory and clock: `async with brokers() as broker:` closes the
broker whatever happened; `await brokers.open()` gives one the test closes itself (a test that
reopens a directory, or simulates a crash, by closing and opening again on the same clock).

The broker-level timer suites run over every timer index a broker can run on (`TIMER_ENGINES`, the
values `timer_engine` accepts): a test module uses the `each_timer_engine` fixture
(tests/conftest.py), which sets `TIMER_ENGINE`, and `open_broker` gives that engine to every broker
whose config leaves `timer_engine` at its default. A test that reads or damages the RocksDB
index's files is marked `rocksdb_index`: it has no meaning on another engine and runs on RocksDB only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import typing
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from chronoq import envvars
from chronoq.broker import Broker
from chronoq.clock import Clock, FakeClock
from chronoq.config import Config

T = TypeVar("T")

TIMER_ENGINES: tuple[str, ...] = typing.get_args(typing.get_type_hints(Config)["timer_engine"])
"""Every timer index a broker runs on (`chronoq/timer/engines.py`)."""
DEFAULT_TIMER_ENGINE: str = next(f.default for f in dataclasses.fields(Config) if f.name == "timer_engine")
TIMER_ENGINE = os.environ.get(envvars.TEST_TIMER_ENGINE, DEFAULT_TIMER_ENGINE)
"""The index `open_broker` gives a broker: the default, or the one `each_timer_engine` is running
(a child process started by a test that runs on several engines reads it from
CHRONOQ_TEST_TIMER_ENGINE)."""

SMALL_LIMITS: dict[str, Any] = {
    "segment_size_bytes": 4096,
    "max_message_size_bytes": 2048,
    "consume_queue_entries_per_file": 8,
    "default_queue_count": 2,
}
"""Small enough that a handful of messages roll segments and consume-queue files."""


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion on a fresh event loop (the tests use no pytest-asyncio)."""
    return asyncio.run(coro)


def small_config(data_dir: Path, **overrides: Any) -> Config:
    """A Config on `data_dir` with `SMALL_LIMITS`, then `overrides`."""
    return Config(data_dir=data_dir, **{**SMALL_LIMITS, **overrides})


async def open_broker(config: Config, clock: Clock | None = None, *, background: bool = True) -> Broker:
    """Open a Broker for a test: every test broker is opened here. `clock=None` is the broker's own
    `SystemClock` (real time); `background=False` runs no background task (no timer loop, flusher
    wake-ups or checkpoints unless the test calls them). A config on the default engine runs on
    `TIMER_ENGINE` instead (`each_timer_engine`)."""
    if config.timer_engine == DEFAULT_TIMER_ENGINE != TIMER_ENGINE:
        config = config.replace(timer_engine=TIMER_ENGINE)
    return await Broker.open(config, clock=clock, background=background)


async def simulated_broker(data_dir: Path, clock: Clock, **settings: Any) -> Broker:
    """A broker on `data_dir` (Config's defaults but `settings`) on `clock` (a `FakeClock`, or a
    `SystemClock` on simulated kernel clocks), with no background tasks."""
    return await open_broker(Config(data_dir=data_dir, **settings), clock, background=False)


class SimulatedBrokers:
    """Simulated brokers on one test's data directory and `FakeClock` (the `brokers` fixture).

    `brokers(**settings)` / `brokers(config)`: an async context manager giving an open broker,
    closed on exit. `brokers.open(...)`: the same broker, closed by the caller. `settings` are
    Config fields over Config's defaults; a `config` is used as given (its own data directory)."""

    def __init__(self, data_dir: Path, clock: FakeClock) -> None:
        self.data_dir = data_dir
        self.clock = clock

    def config(self, **settings: Any) -> Config:
        return Config(data_dir=self.data_dir, **settings)

    async def open(self, config: Config | None = None, **settings: Any) -> Broker:
        if config is not None and settings:
            raise TypeError(f"give a config or settings, not both (settings: {sorted(settings)})")
        return await open_broker(config or self.config(**settings), self.clock, background=False)

    @contextlib.asynccontextmanager
    async def __call__(self, config: Config | None = None, **settings: Any) -> AsyncIterator[Broker]:
        broker = await self.open(config, **settings)
        try:
            yield broker
        finally:
            await broker.close()
