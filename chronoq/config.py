"""Broker configuration: every limit named, with a default, checked at the edge.

Theory of operation: `Config` is a frozen dataclass; a field's name carries its unit
(`_ms`, `_bytes`). `Config.load()` layers defaults < TOML file < environment
(`CHRONOQ_<FIELD>` upper-case) < explicit overrides, and validates once. Components receive the
whole `Config` and read what they need; nothing mutates it after start.
"""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

KiB = 1024
MiB = 1024 * KiB
SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"


class ConfigError(ValueError):
    """A configuration value is out of range or of the wrong type."""


@dataclass(frozen=True, slots=True)
class Config:
    data_dir: Path = Path("data")

    # -- commit log ------------------------------------------------------------------------
    flush: Literal["sync", "async"] = "sync"
    """sync (the default): a send is acknowledged only once fsynced (group commit). async: a send
    is acknowledged once written to the page cache and visible, and fsynced within
    flush_interval_ms, so a power loss (not a process crash) can lose what was acknowledged in the
    last interval: faster, and a named choice, never the default."""
    flush_interval_ms: int = 200
    segment_size_bytes: int = 256 * MiB
    max_message_size_bytes: int = 4 * MiB
    """Largest encoded record (body + properties + header)."""
    max_properties_size_bytes: int = 32 * KiB
    max_property_count: int = 128
    max_topic_name_length: int = 127
    max_tag_length: int = 255
    max_keys_count: int = 32
    max_message_id_length: int = 128
    retention_ms: int = 72 * HOUR_MS
    retention_check_interval_ms: int = 60 * SECOND_MS

    # -- a full disk (docs/design.md, "A full disk") -------------------------------------------
    disk_min_free_bytes: int = 64 * MiB
    """Producer sends are refused (`DiskFull`, retriable) while the data directory's file system
    has less free space than this; the broker's own writes (fired timers, rolls, DLQ copies,
    cancels, consumer state, checkpoints) may use it. 0 disables the check."""
    disk_reserve_file_bytes: int = 8 * MiB
    """Size of `DATA_DIR/reserve`, space set aside while the disk has room and given up when the
    broker starts on a disk with less than this free: RocksDB cannot open without writing (a new
    MANIFEST at every open). 0: no reserve file."""
    disk_full_retry_ms: int = 1000
    """After a write ran out of space: how long dispatch, timer firing, retention and
    checkpoints wait before trying again."""

    # -- topics and consumers ----------------------------------------------------------------
    auto_create_topics: bool = True
    default_queue_count: int = 4
    max_queue_count: int = 256
    consume_queue_entries_per_file: int = 300_000
    checkpoint_interval_ms: int = 1000
    max_delivery_attempts: int = 16
    default_invisible_duration_ms: int = 30 * SECOND_MS
    min_invisible_duration_ms: int = 1 * SECOND_MS
    max_invisible_duration_ms: int = 12 * HOUR_MS
    max_receive_batch: int = 64
    max_long_poll_ms: int = 30 * SECOND_MS
    dedupe_window_ms: int = 10 * MINUTE_MS
    """A send repeating a message id seen on the same topic within this window returns the first
    result and stores nothing (client retries are idempotent)."""
    dedupe_window_max_entries: int = 200_000
    """The dedupe window also forgets its oldest ids past this many (about 190 bytes each), so its
    memory is bounded whatever the send rate; a retry older than either bound is stored again."""
    max_send_batch: int = 1024
    read_cache_bytes: int = 32 * MiB
    """Records dispatched most recently, kept decoded so the consumer that reads them next (and a
    short timer's fire) skips the disk read and the decode; 0 turns it off. Counted as record
    bytes plus an estimate of the Python objects around each one."""

    # -- timers ------------------------------------------------------------------------------
    timer_wheel_enable: bool = True
    timer_engine: Literal["rocksdb", "spark"] = "rocksdb"
    timer_spark_backstop_ms: int = 60_000
    """With timer_engine = "spark": the broker itself fires a timer overdue by this much (the
    Spark job is down, or dropped it), so none waits forever."""
    timer_precision_ms: int = 1
    timer_max_delay_ms: int = 30 * DAY_MS
    timer_congest_num_each_slot: int = 0
    """Most messages due within one second; 0 means unlimited."""
    timer_fire_batch: int = 2048
    """Timers fired per step; the loop steps again at once while due timers remain."""
    timer_roll_batch: int = 1024
    """Timers rolled forward per step before retention (their bodies are in memory meanwhile)."""
    timer_index_block_cache_bytes: int = 32 * MiB
    """RocksDB block cache of the timer index, holding its index and filter blocks as well: with
    the memtables below, what bounds the index's memory at any backlog."""
    timer_index_write_buffer_bytes: int = 64 * MiB
    """All memtables of the timer index together (RocksDB db_write_buffer_size)."""
    delay_levels: str = DEFAULT_DELAY_LEVELS
    schedule_topic_levels_enable: bool = True
    """True: delay-level messages take RocketMQ 4's path (one queue per level, head scanned)."""

    groups_block_cache_bytes: int = 8 * MiB
    """RocksDB block cache of the consumer-group store (offsets, in-flight entries)."""
    groups_write_buffer_bytes: int = 8 * MiB
    """All memtables of the consumer-group store together."""

    clock_catchup_ppm: int = 0
    """After the wall clock was stepped forward, broker time (which follows the monotonic clock,
    so nothing fires early) is behind it; it closes the gap by running this many millionths
    faster than real time. Every delay running meanwhile is shortened by the same fraction, so
    the default 0 never catches up (until a restart) and is never early in real time. At most
    1,000,000 (twice the real rate). See "Time" in docs/design.md."""

    trace_enable: bool = False
    """Journal accepted/fired/first-received times of timer messages (`chronoq trace export`)."""

    # -- server ------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8081
    tls_cert_file: str = ""
    tls_key_file: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        self._validate()

    def _validate(self) -> None:
        if self.flush not in ("sync", "async"):
            raise ConfigError(f"flush must be 'sync' or 'async', not {self.flush!r}")
        if self.timer_engine not in ("rocksdb", "spark"):
            raise ConfigError(f"timer_engine must be 'rocksdb' or 'spark', not {self.timer_engine!r}")
        positive = [
            "flush_interval_ms", "segment_size_bytes", "max_message_size_bytes",
            "max_properties_size_bytes", "max_property_count", "max_topic_name_length",
            "default_queue_count", "max_queue_count", "consume_queue_entries_per_file",
            "checkpoint_interval_ms", "max_delivery_attempts", "default_invisible_duration_ms",
            "min_invisible_duration_ms", "max_invisible_duration_ms", "max_receive_batch",
            "timer_precision_ms", "timer_max_delay_ms", "timer_fire_batch", "timer_roll_batch", "retention_ms",
            "retention_check_interval_ms", "max_send_batch", "max_message_id_length",
            "timer_spark_backstop_ms", "dedupe_window_max_entries",
            "timer_index_block_cache_bytes", "timer_index_write_buffer_bytes", "groups_block_cache_bytes",
            "groups_write_buffer_bytes", "disk_full_retry_ms",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, not {value!r}")
        if isinstance(self.clock_catchup_ppm, bool) or not isinstance(self.clock_catchup_ppm, int) \
                or not 0 <= self.clock_catchup_ppm <= 1_000_000:
            raise ConfigError(f"clock_catchup_ppm must be an integer in 0..1000000, not {self.clock_catchup_ppm!r}")
        for name in ("disk_min_free_bytes", "disk_reserve_file_bytes", "read_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0 disables it), not {value!r}")
        if self.timer_congest_num_each_slot < 0:
            raise ConfigError("timer_congest_num_each_slot must be >= 0 (0 = unlimited)")
        if self.max_message_size_bytes > self.segment_size_bytes:
            raise ConfigError("max_message_size_bytes must not exceed segment_size_bytes")
        if not (self.min_invisible_duration_ms <= self.default_invisible_duration_ms
                <= self.max_invisible_duration_ms):
            raise ConfigError("need min_invisible_duration_ms <= default <= max_invisible_duration_ms")
        if self.default_queue_count > self.max_queue_count:
            raise ConfigError("default_queue_count must not exceed max_queue_count")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, not {self.port}")
        parse_delay_levels(self.delay_levels)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        return parse_delay_levels(self.delay_levels)

    @classmethod
    def load(cls, toml_path: str | Path | None = None, env: Mapping[str, str] | None = None,
             **overrides: Any) -> Config:
        values: dict[str, Any] = {}
        if toml_path is not None:
            with open(toml_path, "rb") as f:
                doc = tomllib.load(f)
            # The [auth] table is read by chronoq.server.auth.load_auth (users are not limits).
            values.update({k: v for k, v in doc.get("chronoq", doc).items() if k != "auth"})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, raw in (env or {}).items():
            if key.startswith("CHRONOQ_"):
                name = key[len("CHRONOQ_"):].lower()
                if name in fields:
                    values[name] = _coerce(name, raw, cls.__dataclass_fields__[name].default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(fields)
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        for name, value in values.items():
            _check_type(name, value, fields[name].default)
        return cls(**values)


def _check_type(name: str, value: Any, default: Any) -> None:
    """A TOML value of the wrong type is a ConfigError naming it, not an AttributeError from deep
    inside validation (found by tests/test_hostile_input.py: `delay_levels = false`)."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    elif isinstance(default, Path):
        ok, kind = isinstance(value, str | Path), "a path (string)"
    else:
        return
    if not ok:
        raise ConfigError(f"{name} must be {kind}, not {value!r}")


def _coerce(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"CHRONOQ_{name.upper()} must be a boolean, not {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"CHRONOQ_{name.upper()} must be an integer, not {raw!r}") from None
    return raw


_UNITS_MS = {"ms": 1, "s": SECOND_MS, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}


def parse_duration_ms(text: str) -> int:
    """'1500ms', '5s', '10m', '2h', '3d' -> milliseconds."""
    text = text.strip()
    for unit in ("ms", "s", "m", "h", "d"):
        if text.endswith(unit):
            number = text[: -len(unit)]
            if number.isdigit():
                return int(number) * _UNITS_MS[unit]
    raise ConfigError(f"cannot read duration {text!r}: use a whole number with ms, s, m, h or d")


def parse_delay_levels(text: str) -> tuple[int, ...]:
    levels = tuple(parse_duration_ms(part) for part in text.split())
    if not levels:
        raise ConfigError("delay_levels must name at least one level")
    if any(b < a for a, b in itertools.pairwise(levels)):
        raise ConfigError(f"delay_levels must not decrease: {text!r}")
    return levels
