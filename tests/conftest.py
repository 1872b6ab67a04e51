"""Shared test helpers: a temp data directory, a small-limits config factory, `arun`, `run_broker`,
and the per-test timeout of the slow tests.

Tests live by layer in subdirectories (store, timer, broker, protocol, server, client, spark,
e2e, interop); helper modules shared across layers (`server_harness`, `auth_harness`,
`timer_helpers`, `clock_helpers`, `disk_helpers`, `protocol_strategies`) stay here in `tests/`,
which pytest puts on `sys.path` with this file.

Kept small and general on purpose; add a helper here only when two test files need it.
Helpers are fixtures (not imports) because `tests/` has several conftest modules and pytest
imports each as `conftest`; a test module importing `conftest` could get the wrong one.

Store invariants checked by `assert_queues_match_log` are computed here from the raw commit log
and consume-queue readers, independently of `chronoq check`, so the two can disagree loudly.
`mount` gives a test real small disks (tmpfs, `disk_helpers.py`) for the full-disk faults.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import timer_helpers
from disk_helpers import Disk, mount_tmpfs, unmount

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config

T = TypeVar("T")

SMALL_LIMITS: dict[str, Any] = {
    "segment_size_bytes": 4096,
    "max_message_size_bytes": 2048,
    "consume_queue_entries_per_file": 8,
    "default_queue_count": 2,
}
"""Small enough that a handful of messages roll segments and consume-queue files."""


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion on a fresh event loop (no pytest-asyncio)."""
    return asyncio.run(coro)


def small_config(data_dir: Path, **overrides: Any) -> Config:
    return Config(data_dir=data_dir, **{**SMALL_LIMITS, **overrides})


def assert_queues_match_log(store: Any) -> int:
    """Every record of the retained log sits at its (topic, queue, offset) in a consume queue,
    and every consume-queue entry from the log's start points at exactly that record.
    `store` is an open `MessageStore`. Returns the number of records checked."""
    by_queue: dict[tuple[str, int], dict[int, tuple[int, int]]] = {}
    count = 0
    for msg in store.log.scan(store.log.start_position):
        slot = by_queue.setdefault((msg.topic, msg.queue_id), {})
        assert msg.queue_offset not in slot, f"queue offset {msg.queue_offset} of {msg.topic}/{msg.queue_id} twice"
        slot[msg.queue_offset] = (msg.position, msg.size)
        count += 1
    for key, records in by_queue.items():
        cq = store.queue(*key)
        first = min(records)
        assert cq.next_offset == max(records) + 1, f"{key}: queue ends at {cq.next_offset}, log at {max(records) + 1}"
        for offset in range(first, cq.next_offset):
            entry = cq.get(offset)
            assert entry is not None and entry[:2] == records.get(offset), f"{key} offset {offset}: {entry}"
    for key in store.queue_keys():
        cq = store.queue(*key)
        for offset in range(cq.min_offset, cq.next_offset):
            entry = cq.get(offset)
            assert entry is not None, f"{key} offset {offset} missing"
            if entry[0] >= store.log.start_position:
                assert by_queue.get(key, {}).get(offset) == entry[:2], f"{key} offset {offset} -> {entry} not in log"
    return count


LONG_TEST_TIMEOUT_S = 600
"""Slow, Spark and interop tests start processes, JVMs and Spark sessions (their fixtures' time
counts too): they get this instead of pyproject's global per-test `timeout` (120 s, for the fast
tests), unless they name their own with `@pytest.mark.timeout`."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None and any(
                item.get_closest_marker(m) for m in ("slow", "spark", "interop")):
            item.add_marker(pytest.mark.timeout(LONG_TEST_TIMEOUT_S))


@pytest.fixture(params=timer_helpers.TIMER_ENGINES)
def each_timer_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per timer index a broker runs on (`timer_engine`), given to every broker
    the test opens through `timer_helpers.make_config`. A test marked `rocksdb_index` reads or
    damages that index's files, and runs on it alone."""
    marker = request.node.get_closest_marker("rocksdb_index")
    if marker is not None and request.param != "rocksdb":
        pytest.skip(f"reads or damages the RocksDB index's files ({marker.args[0]})")
    monkeypatch.setattr(timer_helpers, "TIMER_ENGINE", request.param)
    return str(request.param)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def make_config(data_dir: Path) -> Callable[..., Config]:
    """`make_config(**overrides)`: a Config on the test's data dir with `SMALL_LIMITS`."""

    def make(**overrides: Any) -> Config:
        return small_config(data_dir, **overrides)

    return make


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(name="arun")
def arun_fixture() -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return arun


@pytest.fixture
def run_broker(make_config: Callable[..., Config], clock: FakeClock) -> Callable[..., None]:
    """`run_broker(body, **overrides)`: open a Broker on the test's data dir (`make_config(**overrides)`,
    the test's `FakeClock`, no background tasks: the test drives time), run `await body(broker, clock)`
    on a fresh event loop, and close the broker whatever happened."""

    def run(body: Callable[..., Coroutine[Any, Any, Any]], **overrides: Any) -> None:
        async def main() -> None:
            broker = await Broker.open(make_config(**overrides), clock=clock, background=False)
            try:
                await body(broker, clock)
            finally:
                await broker.close()

        arun(main())

    return run


@pytest.fixture(name="assert_queues_match_log")
def assert_queues_match_log_fixture() -> Callable[[Any], int]:
    return assert_queues_match_log


@pytest.fixture
def mount() -> Iterator[Callable[[Path, int], Disk]]:
    """`mount(path, size_bytes)` mounts a tmpfs there and returns its `Disk`; unmounted after the
    test, the last mounted first (a mount inside another's directory). Skips without root."""
    mounted: list[Path] = []

    def do(path: Path, size_bytes: int) -> Disk:
        disk = mount_tmpfs(path, size_bytes)
        mounted.append(path)
        return disk

    yield do
    for path in reversed(mounted):
        unmount(path)
