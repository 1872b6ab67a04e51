"""Which timer index the broker runs on: the one place `timer_engine` is read.

Theory of operation: the timer room (`timer/service.py`, `timer/loop.py`) works against the
`TimerEngine` protocol (`timer/engine.py`) and never names an implementation. What it needs of
the choice is three things, which an `EngineChoice` holds: open an index for this data directory
(`open`), throw one away so it can be built again from the commit log (`destroy`: a damaged
index, or one that cannot be used at open), and whether what the index applied survives a
restart (`durable`). `engine_choice(config)` maps the setting to one:
- "rocksdb" (the default): `RocksTimerIndex` in `data_dir/timer`, durable; at open the log is
  replayed from the index's `indexed_position`, and an index that cannot be used is rebuilt.
- "wheel": `WheelTimerEngine` in `data_dir/timerwheel`, RocketMQ 5's TimerLog + TimerWheel,
  durable; replayed from its checkpoint's `indexed_position` like the RocksDB index.
- "memory": `MemoryTimerEngine`, NOT durable: each open starts empty and the whole retained log
  is replayed into it (the log is the truth, so nothing acknowledged is lost; start-up takes
  longer, and lookups scan every pending timer). For tests and trials, chosen only by name.
Who fires the due timers is another setting (`timer_firer`, `timer/firing.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chronoq.config import Config
from chronoq.store import files
from chronoq.store.diskspace import DiskSpace
from chronoq.timer.engine import TimerEngine
from chronoq.timer.index import RocksTimerIndex
from chronoq.timer.memory import MemoryTimerEngine
from chronoq.timer.wheel import WheelTimerEngine


@dataclass(frozen=True, slots=True)
class EngineChoice:
    name: str
    """The `timer_engine` value it was chosen by."""
    durable: bool
    """Whether an index opened again after a restart still holds what was applied to it."""
    open: Callable[[], TimerEngine]
    """Open (or create) the index."""
    destroy: Callable[[], None]
    """Remove the index, whatever state it is in, so the next `open` starts empty."""


def _rocksdb(config: Config, disk: DiskSpace) -> EngineChoice:
    path = config.data_dir / files.TIMER_DIR

    def open_index() -> TimerEngine:
        return RocksTimerIndex.open(path, block_cache_bytes=config.timer_index_block_cache_bytes,
                                    write_buffer_bytes=config.timer_index_write_buffer_bytes, disk=disk)

    return EngineChoice("rocksdb", True, open_index, lambda: RocksTimerIndex.destroy(path))


def _wheel(config: Config, disk: DiskSpace) -> EngineChoice:
    path = config.data_dir / files.TIMER_WHEEL_DIR

    def open_wheel() -> TimerEngine:
        return WheelTimerEngine.open(path, slot_ms=config.timer_wheel_slot_ms, slots=config.timer_wheel_slots,
                                     disk=disk)

    return EngineChoice("wheel", True, open_wheel, lambda: WheelTimerEngine.destroy(path))


def _memory(config: Config, disk: DiskSpace) -> EngineChoice:
    return EngineChoice("memory", False, MemoryTimerEngine, _nothing)


def _nothing() -> None:
    return None


_BY_NAME: dict[str, Callable[[Config, DiskSpace], EngineChoice]] = {"rocksdb": _rocksdb, "wheel": _wheel,
                                                                   "memory": _memory}
"""Each `timer_engine` value and how its index is opened and destroyed."""


def engine_choice(config: Config, disk: DiskSpace) -> EngineChoice:
    """The index `config.timer_engine` names (`Config` has refused any other value), on the
    data directory's disk (a RocksDB index refuses writes the disk has no room for)."""
    return _BY_NAME[config.timer_engine](config, disk)
