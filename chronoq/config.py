"""Broker configuration: every limit named, with a default, checked at the edge.

Theory of operation: `Config` is a frozen dataclass; a field's name carries its unit
(`_ms`, `_bytes`). Each setting is declared once: its type annotation and, for an integer, its
range beside its default (`limit(default, minimum=..., maximum=...)`); `check_setting` checks any
value against that declaration, so no list of names to check can fall out of step with the
fields. `Config.load()` layers defaults < TOML file < environment (`CHRONOQ_<FIELD>` upper-case)
< explicit overrides, checking each value where it comes from: a TOML value must already have
the setting's type (`port = "18460"` is refused, not converted), an environment variable's text
is read as that type, and a refusal is one line naming the source, the key, the value and what
was expected. A `CHRONOQ_*` variable that names no setting refuses the start too, naming the
nearest known name, unless it is one of the clients' (`chronoq.envvars`, their one list): a
misspelled setting is never ignored without a word. Rules that tie settings together are
checked once all are in. Components receive the whole `Config` and read what they need; nothing
mutates it after start.

Why not pydantic: it would be chronoq's first dependency outside the broker's own needs for a
few dozen flat fields, and its lax mode converts `"18460"` and `"false"` silently; the strict
checks needed here are a screen of code over `dataclasses.fields`.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from chronoq import envvars
from chronoq.timefmt import byte_size, duration

KiB = 1024
MiB = 1024 * KiB
SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS

MAX_QUEUE_COUNT_CEILING = 256
"""The most `max_queue_count` may be set to. RocketMQ's brokers create 8 queues a topic by
default (its clients ask for 4) and 8-16 is the usual range; 256 is 16 times that. Creating a
topic writes one header-only file per queue on the event loop, and a directory fsync each: 256
queues held the loop ~120 ms here (1,024: ~0.7 s; 65,000: 139 s, no send, receive or timer
meanwhile; measured 2026-11-25)."""

log = logging.getLogger("chronoq.config")

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"


class ConfigError(ValueError):
    """A configuration value is out of range or of the wrong type."""


def limit(default: int, *, minimum: int = 1, maximum: int | None = None) -> Any:
    """An integer setting and its range, declared once, beside its default: `Config` checks
    every integer field against the range its declaration gives (1 and up unless it says
    otherwise; `minimum=0` where 0 turns the thing off)."""
    return field(default=default, metadata={"minimum": minimum, "maximum": maximum})


@dataclass(frozen=True, slots=True)
class Config:
    data_dir: Path = Path("data")

    # -- commit log ------------------------------------------------------------------------
    flush: Literal["sync", "async"] = "sync"
    """sync (the default): a send is acknowledged only once fsynced (group commit). async: a send
    is acknowledged once written to the page cache and visible, and fsynced within
    flush_interval_ms, so a power loss (not a process crash) can lose what was acknowledged in the
    last interval: faster, and a named choice, never the default."""
    flush_interval_ms: int = limit(200)
    segment_size_bytes: int = limit(256 * MiB)
    max_message_size_bytes: int = limit(4 * MiB, maximum=512 * MiB)
    """Largest encoded record (body + properties + header). At most 512 MiB: gRPC's request
    limit (twice this, plus 1 MiB) must fit a 32-bit int."""
    max_properties_size_bytes: int = limit(32 * KiB)
    max_property_count: int = limit(128)
    max_topic_name_length: int = limit(127)
    max_tag_length: int = limit(255)
    max_keys_count: int = limit(32)
    max_message_id_length: int = limit(128)
    max_client_id_length: int = limit(512, maximum=65_536)
    """Longest `x-mq-client-id` header, in characters, on any MessagingService call; longer is
    refused (40000). The official clients send `host@pid#...`: a host name is at most 253."""
    retention_ms: int = limit(72 * HOUR_MS)
    retention_check_interval_ms: int = limit(60 * SECOND_MS)
    retention_inflight_hold_ms: int = limit(24 * HOUR_MS, minimum=0)
    """How long past `retention_ms` a message a consumer group holds in flight (received, not
    acked) keeps its segment. Without a bound, a group that received once and went away would
    keep every later segment, and the disk would fill. Past it, the segment goes, and the
    group's in-flight entry with it."""

    # -- a full disk (docs/design.md, "A full disk") -------------------------------------------
    disk_min_free_bytes: int = limit(64 * MiB, minimum=0)
    """Producer sends are refused (`DiskFull`, retriable) while the data directory's file system
    has less free space than this; the broker's own writes (fired timers, rolls, DLQ copies,
    cancels, consumer state, checkpoints) may use it. 0 disables the check."""
    disk_reserve_file_bytes: int = limit(8 * MiB, minimum=0)
    """Size of `DATA_DIR/reserve`, space set aside while the disk has room and given up when the
    broker starts on a disk with less than this free: RocksDB cannot open without writing (a new
    MANIFEST at every open). 0: no reserve file."""
    disk_full_retry_ms: int = limit(1000)
    """After a write ran out of space: how long dispatch, timer firing, retention and
    checkpoints wait before trying again."""

    # -- topics and consumers ----------------------------------------------------------------
    auto_create_topics: bool = True
    auto_create_topic_near_names: bool = False
    """With auto-create on, whether a send may create a topic whose name is near an existing
    topic's (`chronoq.topics`: `ordres` beside `orders`, `Orders`). Off (the default): such a
    send is refused with `TopicNameTooNear`, naming the near topics, and creates nothing; the
    sender may still ask for the topic (`send --create-topic`, the SDK's `create_topics=True`)
    or create it (`chronoq topics create`). On: for programs that create topics by sending, with
    names that may be near each other; every new name is auto-created, as without this check."""
    default_queue_count: int = limit(4)
    max_queue_count: int = limit(256, maximum=MAX_QUEUE_COUNT_CEILING)
    """Most queues a topic may have (at most `MAX_QUEUE_COUNT_CEILING`, 256: a topic's creation
    holds the event loop while it makes every queue's file)."""
    consume_queue_entries_per_file: int = limit(300_000)
    max_open_queue_files: int = limit(256)
    """Consume-queue files held open at once, over all queues (least recently used closed first,
    fdatasynced first if written since the last checkpoint): the store's descriptors stay
    bounded whatever the number of topics and queues. A checkpoint syncs duplicates of the dirty
    ones on its thread, so consume queues use up to twice this many descriptors: keep that well
    under `ulimit -n` (the default fits a soft limit of 1,024 with room for the log, RocksDB and
    connections). A broker that writes to more queues than this per checkpoint interval pays an
    fsync per eviction: raise both."""
    checkpoint_interval_ms: int = limit(1000)
    max_delivery_attempts: int = limit(16)
    default_invisible_duration_ms: int = limit(30 * SECOND_MS)
    min_invisible_duration_ms: int = limit(1 * SECOND_MS)
    max_invisible_duration_ms: int = limit(12 * HOUR_MS)
    max_renewing_clients: int = limit(10_000)
    """Most client ids (`x-mq-client-id`) holding auto-renewed messages (PushConsumers) at once;
    an auto-renew receive from one more is refused with Throttled (42900, retried by the clients)
    until one lets go. The server tracks only these ids (about 1 KiB each at the longest)."""
    max_receive_batch: int = limit(64)
    max_receive_response_bytes: int = limit(4 * MiB, maximum=64 * MiB)
    """Bytes of messages in one response of chronoq's batched receive (ReceiveMessages, the SDK's
    way to receive): a receive's messages go in as few responses as this allows, and a single
    larger message goes alone, so no response is larger than RocketMQ's one-message stream's
    largest by more than this. The SDK accepts responses of up to 256 MiB."""
    max_receive_scan_entries: int = limit(10_000)
    """Queue entries one receive step looks at, over all queues, before it gives the event loop
    back (and goes on in the next step). A tag filter that matches little made one receive walk
    the whole backlog in one step: 16 s of a stalled broker for 10 M entries."""
    max_long_poll_ms: int = limit(30 * SECOND_MS)
    dedupe_window_ms: int = limit(10 * MINUTE_MS)
    """A send repeating a message id seen on the same topic within this window returns the first
    result and stores nothing (client retries are idempotent)."""
    dedupe_window_max_entries: int = limit(200_000)
    """The dedupe window also forgets its oldest ids past this many (about 190 bytes each), so its
    memory is bounded whatever the send rate; a retry older than either bound is stored again."""
    max_send_batch: int = limit(1024)
    max_bulk_send_rows: int = limit(8192, maximum=1_000_000)
    """Rows one bulk send (admin SendColumns: one topic, packed columns) may carry; its bytes are
    bounded by gRPC's request limit as every request's."""
    read_cache_bytes: int = limit(32 * MiB, minimum=0)
    """Records dispatched most recently, kept decoded so the consumer that reads them next (and a
    short timer's fire) skips the disk read and the decode; 0 turns it off. Counted as record
    bytes plus an estimate of the Python objects around each one."""

    gc_young_objects: int = limit(50_000, minimum=700, maximum=10_000_000)
    """`chronoq serve`'s young-generation threshold for Python's cyclic collector (the first of
    `gc.set_threshold`): container objects made, net of those freed, between two young
    collections. CPython's default, 700, is a collection every few dozen timers a fire step
    handles, and each moves the step's live objects on to older generations, collected again:
    with 50,000 (and the older generations' `GC_OLDER_THRESHOLDS`, `server/serve.py`) a fired
    timer costs 6 % fewer instructions (65.0 k -> 60.9 k, counted by callgrind over a fire step;
    docs/performance.md), an accepted one ~1 %; a young collection of 100,000 objects held the loop 3 ms (measured
    2026-11-27). Only cycles wait for it: most objects are freed by their reference count as
    soon as they are dropped."""

    # -- timers ------------------------------------------------------------------------------
    timer_wheel_enable: bool = True
    timer_engine: Literal["rocksdb", "wheel", "memory"] = "rocksdb"
    """The timer index the broker keeps (`timer/engines.py`, the one place this is read):
    "rocksdb" (the default) keeps it on disk beside the log, so a restart replays only what the
    index had not applied. "memory" keeps it in the process only: it is NOT durable, and every
    start rebuilds it by replaying the whole retained commit log (slower to start, O(pending)
    lookups); nothing acknowledged is lost, since the log is the truth, but the statuses of
    timers whose records retention deleted are forgotten. Chosen only by naming it. "wheel" is
    RocketMQ 5's own design (RIP-43: a TimerLog of 52-byte units chained per slot of a
    memory-mapped TimerWheel, `timer/wheel.py`), durable in `data_dir/timerwheel`, with its id
    maps and counters in memory (more memory per pending timer than "rocksdb"; docs/performance.md
    compares the two). The old value
    "spark" is read as `timer_firer = "spark"` on the RocksDB index, with a warning naming the
    new setting, for one release."""
    timer_firer: Literal["broker", "spark"] = "broker"
    """Who fires due timers (`timer/firing.py`): "broker" (the default: its own loop) or "spark"
    (a Spark job reads the timer topic and hands each timer to the broker, ArmTimers, when it
    enters `timer_handoff_horizon_ms`; the broker's loop fires armed timers at their due time and
    the others `timer_spark_backstop_ms` late, as a backstop)."""
    timer_wheel_slot_ms: int = limit(1000, maximum=60_000)
    """With timer_engine = "wheel": the width of one TimerWheel slot. Firing stays to the
    millisecond whatever the width (a slot's timers are ordered by their exact due times); the
    width sets the wheel file's size (32 bytes a slot) for a given window."""
    timer_wheel_slots: int = limit(7 * 24 * 3600, minimum=16, maximum=1 << 28)
    """With timer_engine = "wheel": slots in the TimerWheel (RocketMQ's default: 7 days of 1 s
    slots, a 19 MB file). Timers due beyond slots x slot width are chained into the window's
    last slot with the ROLL magic and linked again when it comes up."""
    timer_spark_backstop_ms: int = limit(60_000)
    """With timer_firer = "spark": the broker itself fires a timer overdue by this much (the
    Spark job is down, or dropped it), so none waits forever."""
    timer_handoff_horizon_ms: int = limit(5 * 60_000, minimum=1000, maximum=DAY_MS)
    """With timer_firer = "spark": the near horizon (`timer/handoff.py`). The job hands each timer
    over (ArmTimers) when it comes this close to its due time, and the broker's loop then fires it
    at its due time; a timer accepted already this close, or due this close when the broker
    starts, is the broker's without a hand-over. The broker's memory holds the armed timers, so
    it follows the timers due within the horizon; the job needs about two micro-batches to arm a
    timer, so keep the horizon well above that (a minute or more)."""
    timer_precision_ms: int = limit(1)
    timer_max_delay_ms: int = limit(30 * DAY_MS, maximum=100 * 365 * DAY_MS)
    """Latest due time a send may ask for, from now. At most 100 years: a due time must fit the
    index's 63 bits (2^63 - 1, "no limit", let a delay overflow them and stop the broker)."""
    timer_congest_num_each_slot: int = limit(0, minimum=0)
    """Most messages due within one second; 0 means unlimited."""
    timer_fire_gap_ms: int = limit(5, minimum=0, maximum=1000)
    """After a fire step that fired something, the next starts no sooner than this many ms after
    it: timers falling due in between fire together and share one group commit, instead of one
    step (and one fsync) each. Adds at most this much lateness while timers come due faster than
    one per gap; a timer due after a quiet spell fires at once. 0: every due time its own step."""
    timer_fire_batch: int = limit(8192, maximum=1_000_000)
    """Timers fired per step; the loop steps again at once while due timers remain. A step holds
    the loop ~4 µs a timer (~35 ms at 8,192) and hands it back while its group commit runs, so
    bigger steps fire a backlog sooner (100,000 due at once, with a consumer reading them: all
    fired after ~0.86 s at 8,192, ~1.2-1.4 s at 2,048) and make other calls wait longer meanwhile.
    A steady stream fires in small steps (`timer_fire_gap_ms`) whatever this is."""
    timer_links_per_record: int = limit(128, maximum=65_535)
    """Most timers one link record fires (a fire step writes as many as it needs). A record is
    the unit a damaged sector costs: 128 links are ~3.9 KB, one 4 KiB page. A damaged link record
    is read from the timer index's copy of it, so this bounds what a second fault (the copy lost
    too: the index rebuilt from the log) sends back to fire again."""
    timer_roll_batch: int = limit(1024)
    """Timers rolled forward per step before retention (their bodies are in memory meanwhile)."""

    # -- recurring schedules (`chronoq/recurring/`) --------------------------------------------
    schedule_min_interval_ms: int = limit(1 * SECOND_MS, minimum=1)
    """The shortest gap a recurring schedule's occurrences may have (an `every` interval, or two
    of a cron expression's next occurrences): each occurrence is a timer, a group commit and a
    record of progress, so a schedule may not ask for more than this rate."""
    schedule_max_count: int = limit(200_000)
    """Most schedules at once: each lives in the broker's memory (about 1-2 KiB with a short body),
    and its records are replayed at every start."""
    schedule_catch_up_max_occurrences: int = limit(10_000)
    """With catch-up policy `all`, the most missed occurrences of one schedule delivered after an
    outage or a pause (the latest ones); the rest are skipped."""
    timer_index_block_cache_bytes: int = limit(32 * MiB)
    """RocksDB block cache of the timer index, holding its index and filter blocks as well: with
    the memtables below, what bounds the index's memory at any backlog."""
    timer_index_write_buffer_bytes: int = limit(64 * MiB)
    """All memtables of the timer index together (RocksDB db_write_buffer_size)."""
    delay_levels: str = DEFAULT_DELAY_LEVELS
    schedule_topic_levels_enable: bool = True
    """True: delay-level messages take RocketMQ 4's path (one queue per level, head scanned)."""

    groups_block_cache_bytes: int = limit(8 * MiB)
    """RocksDB block cache of the consumer-group store (offsets, in-flight entries)."""
    groups_write_buffer_bytes: int = limit(8 * MiB)
    """All memtables of the consumer-group store together."""

    clock_catchup_ppm: int = limit(20_000, minimum=0, maximum=1_000_000)
    """While broker time (which follows the monotonic clock) is behind the wall clock, it may run
    this many millionths faster than real time to close the gap, never past the wall clock. The
    default 20,000 (2 %) keeps it with a wall clock that gains on the monotonic clock (virtual
    machines' clocks do: 5,000 ppm was seen on one, so with 0 every timer ran later by 0.5 % of the broker's uptime)
    and closes a forward step slowly (one hour in 50), shortening delays running meanwhile by
    at most 2 % of real time. 0: never catch up (until a restart), never early in real time.
    At most 1,000,000 (twice the real rate). See "Time" in docs/design.md."""
    clock_max_backward_step_ms: int = limit(MINUTE_MS, minimum=SECOND_MS, maximum=DAY_MS)
    """A step back of the wall clock by at most this much pauses broker time until the wall clock
    catches up (what broker time stamps, relative delays and invisible durations, comes up to
    this much late, never early); a larger one re-bases broker time to the wall clock at once
    (logged at ERROR, counted in `stats` and `chronoq_clock_rebases_total`), moving in-flight
    messages' visible times, auto-renew deadlines and retention's store times back with it, so
    nothing waits longer than this for a clock that was ahead. Timers never fire before the wall
    clock reaches their due time, whatever this is. 1 s to 1 day; the default 1 minute rides out
    NTP's ordinary corrections without store times going back. See "Time" in docs/design.md."""

    trace_enable: bool = False
    """Journal accepted/fired/first-received times of timer messages (`chronoq trace export`)."""
    trace_segment_size_bytes: int = limit(64 * MiB, minimum=4 * KiB)
    """The trace journal is segments of at most this many bytes; a new one starts when the next
    event would not fit. At least 4 KiB, more than the largest event (names at their limits)."""
    trace_retention_bytes: int = limit(1024 * MiB, minimum=8 * KiB)
    """Most bytes the trace journal keeps on disk (the disk of the commit log, where a full disk
    stops sends): the oldest segments are deleted first, and an export says they were. At least
    twice trace_segment_size_bytes, so one full closed segment stays beside the active one."""

    # -- server ------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = limit(8081, maximum=65535)
    tls_cert_file: str = ""
    tls_key_file: str = ""

    # -- HTTP: metrics, health, web console (chronoq/http/) -------------------------------------
    http_port: int = limit(0, minimum=0, maximum=65535)
    """Port for GET /metrics (Prometheus), /healthz and the web console, on `host`; 0 = off."""
    pulsar_port: int = limit(0, minimum=0, maximum=65535)
    """Port for Apache Pulsar's binary protocol (chronoq/pulsar/door.py: Pulsar's official clients
    produce and consume there), on `host`; 0 = off."""
    pulsar_delay_all_subscriptions_topics: str = ""
    """Topics (names or shell-style globs, separated by commas) on whose Pulsar subscriptions
    `deliver_at_time` holds for every subscription type. Elsewhere it holds, as in Pulsar, on
    Shared and Key_Shared subscriptions only, and Exclusive and Failover ones receive a delayed
    message at once (chronoq/pulsar/messages.py). Read when a message is sent."""
    pulsar_max_delivery_delay_ms: int = limit(0, minimum=0)
    """A Pulsar SEND whose `deliver_at_time` is more than this past its `publish_time` is
    refused with NotAllowedError (Pulsar's `delayedDeliveryMaxDelayInMillis`); 0 = no limit
    beyond `timer_max_delay_ms`."""
    pulsar_checksum_error_clients: str = "Pulsar-CPP-*"
    """Pulsar clients (CONNECT's `client_version`, names or shell-style globs, separated by
    commas) to which a SEND refused with NotAllowedError (`pulsar_max_delivery_delay_ms`) is
    answered ChecksumError instead, the message text starting "NotAllowed:". The C++ client 4.x
    (and the Python and Node clients built on it, `Pulsar-CPP-v...`) fails a single send only
    for ChecksumError; on any other SEND_ERROR it reconnects and sends the message again until
    its send timeout. The Java client fails the send for NotAllowedError, as Pulsar intends."""
    pulsar_max_producers_per_connection: int = limit(1000)
    """Producers one Pulsar connection may hold; one more is refused with NotAllowedError."""
    pulsar_max_consumers_per_connection: int = limit(1000)
    """Consumers one Pulsar connection may hold; one more is refused with NotAllowedError."""
    pulsar_max_permits_per_consumer: int = limit(100_000)
    """Most FLOW permits a Pulsar consumer may hold; a FLOW past it is cut to it, with a log line
    (the client's default receiver queue is 1000)."""
    pulsar_max_pending_sends_per_connection: int = limit(10_000)
    """SENDs a Pulsar connection may have waiting for their receipts; past it the door stops
    reading that connection until receipts go out (back-pressure on the socket, not an error)."""
    pulsar_max_write_buffer_bytes: int = limit(4 * MiB, minimum=64 * KiB)
    """Bytes a Pulsar connection's outgoing buffer may hold: above it the door stops pushing
    MESSAGEs and reading requests on that connection until the client reads, so a client that
    never reads cannot grow the broker's memory."""
    timer_search_max_range_ms: int = limit(31 * DAY_MS)
    """Widest due-time range one search of pending timers (admin SearchTimers, the console) may cover."""
    timer_search_max_rows: int = limit(500)
    """Most pending timers one search returns (the reply says when there are more)."""
    timer_search_max_scanned: int = limit(10_000)
    """Most index entries one search reads while filtering by topic; past it the reply says the
    search stopped early. The search runs on the event loop, at ~3-7 us per entry here (measured
    2026-11-24), so this bounds how long it holds the loop (and delays timers) to tens of ms."""
    console_sample_interval_ms: int = limit(10 * SECOND_MS)
    """How often the console samples the delivery error for its over-time chart."""
    console_history_samples: int = limit(360)
    """Samples kept for that chart (360 x 10 s = the last hour), in memory only."""
    timer_chart_max_bars: int = limit(400)
    """Most bars one pending-by-due-time chart (admin PendingByDue) may ask for."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.timer_engine in _DEPRECATED_TIMER_ENGINES:
            # The engine name once said who fires too; that is `timer_firer` now.
            firer = _DEPRECATED_TIMER_ENGINES[self.timer_engine]
            log.warning('timer_engine = "%s" is deprecated and will be refused in the next release: it now '
                        'names the timer index ("rocksdb" or "memory"); who fires is timer_firer = "%s". '
                        'Read as timer_engine = "rocksdb", timer_firer = "%s"', self.timer_engine, firer, firer)
            object.__setattr__(self, "timer_engine", "rocksdb")
            object.__setattr__(self, "timer_firer", firer)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name)))
        self._validate_together()

    def _validate_together(self) -> None:
        """The rules that tie two settings together (each alone was checked by `check_setting`)."""
        if self.max_message_size_bytes > self.segment_size_bytes:
            raise ConfigError(f"max_message_size_bytes = {self.max_message_size_bytes} must not exceed "
                              f"segment_size_bytes = {self.segment_size_bytes}")
        if not (self.min_invisible_duration_ms <= self.default_invisible_duration_ms
                <= self.max_invisible_duration_ms):
            raise ConfigError(
                f"need min_invisible_duration_ms <= default_invisible_duration_ms <= max_invisible_duration_ms, "
                f"not {self.min_invisible_duration_ms} / {self.default_invisible_duration_ms} / "
                f"{self.max_invisible_duration_ms}")
        if self.default_queue_count > self.max_queue_count:
            raise ConfigError(f"default_queue_count = {self.default_queue_count} must not exceed "
                              f"max_queue_count = {self.max_queue_count}")
        if self.trace_retention_bytes < 2 * self.trace_segment_size_bytes:
            raise ConfigError(f"trace_retention_bytes = {self.trace_retention_bytes} must be at least twice "
                              f"trace_segment_size_bytes = {self.trace_segment_size_bytes} (one full segment "
                              "beside the one being written)")
        if self.http_port == self.port:
            raise ConfigError(f"http_port = {self.http_port} is also the gRPC port (port); the console and /metrics "
                              "need a port of their own (--http-port)")
        if self.pulsar_port and self.pulsar_port in (self.port, self.http_port):
            raise ConfigError(f"pulsar_port = {self.pulsar_port} is also the "
                              f"{'gRPC port (port)' if self.pulsar_port == self.port else 'HTTP port (http_port)'}; "
                              "the Pulsar door needs a port of its own (--pulsar-port)")
        parse_delay_levels(self.delay_levels)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    @property
    def delay_levels_ms(self) -> tuple[int, ...]:
        return parse_delay_levels(self.delay_levels)

    @classmethod
    def load(cls, toml_path: str | Path | None = None, env: Mapping[str, str] | None = None,
             **overrides: Any) -> Config:
        """Defaults < the TOML file (its `[chronoq]` table, or its top level) < `CHRONOQ_<KEY>`
        environment variables < `overrides` (None = not given). Each value is checked where it
        comes from, so an error names its source, key and value and what was expected."""
        values: dict[str, Any] = {}
        if toml_path is not None:
            with open(toml_path, "rb") as f:
                try:
                    doc = tomllib.load(f)
                except tomllib.TOMLDecodeError as e:
                    raise ConfigError(f"{toml_path}: not valid TOML: {e}") from None
            if "chronoq" in doc:
                # With a [chronoq] table, anything beside it but [auth] would be silently ignored.
                outside = sorted(k for k in doc if k not in ("chronoq", "auth"))
                if outside:
                    raise ConfigError(f"{toml_path}: {', '.join(outside)} outside the [chronoq] table; settings "
                                      "go inside it (or, without the table, at the top level)")
            for key, value in doc.get("chronoq", doc).items():
                if key == "auth":
                    continue  # read by chronoq.server.auth.load_auth: users are not limits
                values[key] = check_setting(key, value, source=f"{toml_path}: ")
        for key, raw in (env or {}).items():
            if not key.startswith(envvars.PREFIX):
                continue
            name = key[len(envvars.PREFIX):].lower()
            if name in _FIELDS:
                values[name] = check_setting(name, _from_env(name, raw, key), source=f"environment {key}: ")
            elif key not in envvars.NOT_SETTINGS:
                raise ConfigError(unknown_env_message(key))
        for key, value in overrides.items():
            if value is not None:
                values[key] = check_setting(key, value)
        return cls(**values)


def unknown_env_message(key: str) -> str:
    """One line for a `CHRONOQ_*` variable that is neither a setting nor one of the clients'
    (`chronoq.envvars`): the nearest known name, compared without the common prefix (which
    would make every pair look alike)."""
    known = [f"{envvars.PREFIX}{name.upper()}" for name in _FIELDS] + sorted(envvars.NOT_SETTINGS)
    stems = {k[len(envvars.PREFIX):]: k for k in known}
    near = difflib.get_close_matches(key[len(envvars.PREFIX):].upper(), stems, n=1)
    if near:
        nearest = stems[near[0]]
        hint = f"did you mean {nearest}" + (" (a client's variable)?" if nearest in envvars.NOT_SETTINGS else "?")
    else:
        hint = "docs/design.md, \"Limits\", lists the settings"
    return (f"environment {key}: no such setting; {hint} (the broker refuses a CHRONOQ_* name it does not know "
            "rather than ignore a misspelling)")


def check_setting(name: str, value: Any, *, source: str = "") -> Any:
    """`value` as setting `name` holds it (a path from a string; nothing else is converted), or a
    one-line `ConfigError` naming the source, the key, the value and what was expected."""
    f = _FIELDS.get(name)
    if f is None:
        near = difflib.get_close_matches(name, _FIELDS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else " (docs/design.md, \"Limits\", lists the settings)"
        raise ConfigError(f"{source}unknown configuration key {name!r}{hint}")
    kind = _HINTS[name]
    expected = _expectation(f, kind)
    ok: bool
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and f.metadata.get("minimum", 1) <= value \
            and (f.metadata.get("maximum") is None or value <= f.metadata["maximum"])
    elif kind is Path:
        ok = isinstance(value, (str, Path)) and str(value) != ""
        value = Path(value) if ok else value
    elif get_origin(kind) is Literal:
        ok = isinstance(value, str) and (value in get_args(kind)
                                         or (name == "timer_engine" and value in _DEPRECATED_TIMER_ENGINES))
    elif kind is str:
        ok = isinstance(value, str)
    else:  # Mapping
        ok = isinstance(value, Mapping)
    if not ok:
        raise ConfigError(f"{source}{name} = {toml_text(value)}: expected {expected}{_as_milliseconds(name, value)}")
    return value


def toml_text(value: Any) -> str:
    """`value` as a TOML file spells it, for messages that show a setting as `name = value`: true
    and false, strings in double quotes with TOML's escapes, arrays and inline tables; what TOML
    cannot hold (None, a Path, other objects) as a string or as Python writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # inf and nan are spelt as in TOML
    if isinstance(value, str | Path):
        escaped = []
        for ch in str(value):
            if ch in _TOML_ESCAPES:
                escaped.append(_TOML_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                escaped.append(f"\\u{ord(ch):04X}")
            else:
                escaped.append(ch)
        return '"' + "".join(escaped) + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {toml_text(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "isoformat"):  # TOML's dates and times, as tomllib returns them
        return str(value.isoformat())
    return repr(value)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_text(key)


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
                 "\r": "\\r"}


def _as_milliseconds(name: str, value: Any) -> str:
    """For a `_ms` setting given a duration ('90d'), the number it means: the setting's unit is
    in its name, and a duration is what a person has in mind."""
    if not (name.endswith("_ms") and isinstance(value, str)):
        return ""
    try:
        ms = parse_duration_ms(value)
    except ConfigError:
        return ""
    return f"; in milliseconds, {value.strip()} is {ms}"


def _expectation(f: dataclasses.Field[Any], kind: Any) -> str:
    if kind is bool:
        return "true or false"
    if kind is int:
        low, high = f.metadata.get("minimum", 1), f.metadata.get("maximum")
        if high is not None:
            if f.name.endswith("_ms"):
                return f"an integer in {low:,}..{high:,} ({duration(low)}..{duration(high)})"
            if f.name.endswith("_bytes"):
                return f"an integer in {low:,}..{high:,} ({byte_size(high).partition('(')[2].rstrip(')')} at most)"
            return f"an integer in {low}..{high}" if high < 100_000 else f"an integer in {low:,}..{high:,}"
        return f"an integer >= {low}" + (" (0 turns it off)" if low == 0 else "")
    if kind is Path:
        return "a path (a non-empty string)"
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(toml_text(v) for v in get_args(kind))
    if kind is str:
        return "a string"
    return "a table"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _from_env(name: str, raw: str, key: str) -> Any:
    """An environment variable's text as the setting's type; text that is not one is returned
    as it is, for `check_setting` to refuse with its one-line message."""
    kind = _HINTS[name]
    if kind is bool:
        word = raw.strip().lower()
        return True if word in _TRUE else False if word in _FALSE else raw
    if kind is int:
        try:
            return int(raw.strip().replace("_", ""))
        except ValueError:
            return raw
    if kind is not str and kind is not Path and get_origin(kind) is not Literal:
        raise ConfigError(f"environment {key}: {name} cannot be set from the environment (set it in the TOML file)")
    return raw


_UNITS_MS = {"d": DAY_MS, "h": HOUR_MS, "m": MINUTE_MS, "s": SECOND_MS, "ms": 1}
"""Largest first: the order the parts of a compound duration ('1h30m') must come in."""
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")
_DAYS = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+) days?")
"""How `chronoq.timefmt.duration` writes 10 days and more: '30 days', '2,520 days'."""


def parse_duration_ms(text: str) -> int:
    """'1500ms', '5s', '10m', '2h', '3d', or several units largest first as `chronoq.timefmt`
    prints them ('1h30m', '2d03h', '4m03s', '1.25s', '30 days') -> milliseconds. A fraction is
    allowed where it comes to whole milliseconds ('1.5h'); a sign is not."""
    text = text.strip()
    usage = "use a number with ms, s, m, h or d, or several largest first (30s, 5m, 1h30m, 2d03h)"
    if text.startswith("-"):
        raise ConfigError(f"cannot read duration {text!r}: a duration cannot be negative; {usage}")
    if text.replace(".", "", 1).isdigit():
        raise ConfigError(f"cannot read duration {text!r}: a number needs its unit ({text}s, {text}m, {text}h, "
                          f"{text}d or {text}ms)")
    if days := _DAYS.fullmatch(text):
        return int(days.group(1).replace(",", "")) * DAY_MS
    total, pos, units = Fraction(0), 0, list(_UNITS_MS)
    last = -1
    while pos < len(text):
        part = _DURATION_PART.match(text, pos)
        if part is None or units.index(part.group(2)) <= last:
            raise ConfigError(f"cannot read duration {text!r}: {usage}")
        last = units.index(part.group(2))
        total += Fraction(part.group(1)) * _UNITS_MS[part.group(2)]
        pos = part.end()
    if not text:
        raise ConfigError(f"cannot read duration {text!r}: {usage}")
    if total.denominator != 1:
        raise ConfigError(f"cannot read duration {text!r}: it is not a whole number of milliseconds")
    return int(total)


def parse_delay_levels(text: str) -> tuple[int, ...]:
    levels = tuple(parse_duration_ms(part) for part in text.split())
    if not levels:
        raise ConfigError("delay_levels must name at least one level")
    if any(b < a for a, b in itertools.pairwise(levels)):
        raise ConfigError(f"delay_levels must not decrease: {text!r}")
    return levels


_DEPRECATED_TIMER_ENGINES = {"spark": "spark"}
"""Old `timer_engine` values that named who fires: value -> the `timer_firer` it means now.
Accepted (with a warning, `Config.__post_init__`) for one release."""

_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}
_HINTS: dict[str, Any] = get_type_hints(Config)
