"""Fixtures shared by every layer's tests, and the per-test timeout of the long tests.

Tests live by layer in subdirectories (store, timer, broker, protocol, server, client, spark,
e2e, interop); what several of them share is the `tests.support` package, imported by full name.
The fixtures here wrap it for the common cases: a data directory in `tmp_path`, a small-limits
config factory, the test's `FakeClock`, simulated brokers on both (`brokers`, `run_broker`), and
real small disks (`mount`: tmpfs, `tests.support.disks`) for the full-disk faults. A run in which
the default marker expression left out every test collected ends with a line saying how to run them.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from chronoq.clock import FakeClock
from chronoq.config import Config
from tests.support import brokers as support_brokers
from tests.support.brokers import SimulatedBrokers, arun, small_config
from tests.support.disks import Disk, mount_tmpfs, unmount
from tests.support.invariants import assert_queues_match_log

LONG_TEST_TIMEOUT_S = 600
"""Slow, Spark and interop tests start processes, JVMs and Spark sessions (their fixtures' time
counts too): they get this instead of pyproject's global per-test `timeout` (120 s, for the fast
tests), unless they name their own with `@pytest.mark.timeout`."""


DEFAULT_LEFT_OUT = ("slow", "spark", "interop")
"""The markers pyproject's `addopts` leaves out (`-m 'not slow and not spark and not interop'`)."""
_DESELECTED = pytest.StashKey[list[pytest.Item]]()


def pytest_deselected(items: list[pytest.Item]) -> None:
    for item in items:
        item.config.stash.setdefault(_DESELECTED, []).append(item)


def _marker_on_the_command_line(config: pytest.Config) -> bool:
    return any(str(arg).startswith("-m") for arg in config.invocation_params.args)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """When nothing ran because every test collected was left out by the default marker
    expression (`pytest tests/e2e/test_power_loss.py`, all slow), say so and how to run them:
    pytest's own word is only "N deselected" and exit status 5."""
    deselected = config.stash.get(_DESELECTED, [])
    if exitstatus != pytest.ExitCode.NO_TESTS_COLLECTED or not deselected or _marker_on_the_command_line(config):
        return
    if not all(any(item.get_closest_marker(m) for m in DEFAULT_LEFT_OUT) for item in deselected):
        return  # some were left out by something else (-k): not the default selection's doing alone
    marked = sorted({m for item in deselected for m in DEFAULT_LEFT_OUT if item.get_closest_marker(m)})
    terminalreporter.write_line(
        f"no test ran: the {len(deselected)} tests collected are marked {' or '.join(marked)}, which "
        "the default selection (pyproject's addopts: -m 'not slow and not spark and not interop') leaves out; "
        'run them with -m "" (as scripts/test.sh, the CI run, does)', yellow=True, bold=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None and any(
                item.get_closest_marker(m) for m in ("slow", "spark", "interop")):
            item.add_marker(pytest.mark.timeout(LONG_TEST_TIMEOUT_S))


@pytest.fixture(params=support_brokers.TIMER_ENGINES)
def each_timer_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per timer index a broker runs on (`timer_engine`), given to every broker
    the test opens through `tests.support.brokers.open_broker`. A test marked `rocksdb_index` reads
    or damages that index's files, and runs on it alone; one marked `durable_index` reads an index
    on disk (`chronoq check`), and runs on the durable ones."""
    marker = request.node.get_closest_marker("rocksdb_index")
    if marker is not None and request.param != "rocksdb":
        pytest.skip(f"reads or damages the RocksDB index's files ({marker.args[0]})")
    durable = request.node.get_closest_marker("durable_index")
    if durable is not None and request.param == "memory":
        pytest.skip(f"reads a timer index on disk ({durable.args[0]})")
    monkeypatch.setattr(support_brokers, "TIMER_ENGINE", request.param)
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
def brokers(data_dir: Path, clock: FakeClock) -> SimulatedBrokers:
    """Simulated brokers on the test's data dir and `clock` (Config's defaults): `async with
    brokers(**settings) as broker:`, or `await brokers.open(...)` for one the test closes itself."""
    return SimulatedBrokers(data_dir, clock)


@pytest.fixture
def run_broker(make_config: Callable[..., Config], brokers: SimulatedBrokers) -> Callable[..., None]:
    """`run_broker(body, **overrides)`: open a simulated broker on the test's data dir with
    `make_config(**overrides)` (small limits), run `await body(broker, clock)` on a fresh event
    loop, and close the broker whatever happened."""

    def run(body: Callable[..., Coroutine[Any, Any, Any]], **overrides: Any) -> None:
        async def main() -> None:
            async with brokers(make_config(**overrides)) as broker:
                await body(broker, brokers.clock)

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
