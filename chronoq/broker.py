"""The broker: the composition root and the one facade the server, the SDK's tests, Spark and the CLI use.

Theory of operation: a message walks through rooms, each a module of its own:
- `accept.py`: admission (`validate.py`), topics (`topics.py`), the dedupe window, timer routing
  (`timer/service.py`), the append, the wait for the group commit;
- the store (`store/`): the commit log and consume queues; then *dispatch* (`dispatch.py`, the
  one list of where a durable record goes: its queues, the timer index, the trace, the long
  polls), before any sender is released, so an acknowledged message is durable, visible and
  indexed;
- `timer/loop.py` and `timer/service.py`: when timers fire, and what firing writes (a link record
  entering each timer record into its real topic's queue, which dispatch then makes visible);
- `deliver.py` over `consumers.py`: receive (long polls), ack, invisible durations, retries, DLQ;
- `retention.py`: rolling pending timers forward and deleting expired segments;
- `recurring/service.py`: recurring schedules, each occurrence a timer sent through `accept.py`
  (their records replayed at open, their missed occurrences settled before the timer loop starts).
This module builds them (`open`), each given what it needs when built; the timer index is the
one `timer_engine` names (`timer/engines.py`), and who fires is `timer_firer`'s
(`timer/firing.py`). It owns their background tasks (the flusher, the timer loop, the
checkpoint and retention ticks), stops them (`close`), and refuses work once one of them failed
(`fatal`). Its public methods only check that the broker is open and hand over to a room.
The two doors also count what passed them, per topic, in plain dicts (`accepted_by_topic`,
`timers_by_topic`, `delivered_by_topic`; and each timer's delay, `timer_delays_by_topic`): one
dict update per message or receive (a histogram bucket per timer), read by the
Prometheus collector at scrape time (`http/metrics.py`), never a lock or a metrics library call
on the hot path. `send_batch` and `receive` count by themselves; a door that stores or receives
more than its clients see (the Pulsar door: a delayed message's immediate copy, a fired timer an
Exclusive subscription skips) passes `count=False` and counts what its clients saw
(`count_accepted`, `count_delivered`), so every door's traffic reads the same.

One asyncio event loop owns all broker state; blocking work is limited to short page-cache writes
and RocksDB calls on the loop, with fsync in a worker thread (the group commit's, the
checkpoint tick's). With `background=False` only the flusher runs, and a test moves a
`FakeClock` and calls `run_due()`, so two days of timers run in
milliseconds, deterministically.

Every decision by time uses `clock` (broker time, which a wall-clock step cannot jump forward,
and moves back only by a re-base: `clock.py`); timers fire by its fire horizon, never before the
wall clock reaches their due time; a long poll's `wait_ms` is a real-time wait on the loop's
clock. What this run stamped in broker time follows a re-base (`_clock_rebased`: in-flight
visible times, retention's store times, the dedupe window), so no redelivery or retention waits
out a step back longer than `clock_max_backward_step_ms`; what an earlier run stamped with a
clock that was ahead is brought back at open (`GroupStore.restamp_ahead`; docs/design.md, "Time").

A full disk is back-pressure (docs/design.md, "A full disk"; `store/diskspace.py`): a producer
send below `disk_min_free_bytes` is refused with `DiskFull` before anything is written; the
broker's own writes use that reserve. A background step that runs out of space anyway (timer
firing, retention, a checkpoint) waits `disk_full_retry_ms` and tries again, with one warning per
episode; `close` completes whatever the disk says.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from chronoq.accept import Accept
from chronoq.clock import Clock, SystemClock
from chronoq.config import Config, ConfigError
from chronoq.deliver import Deliver
from chronoq.dispatch import Dispatch
from chronoq.errors import (
    BrokerClosed,
    ChronoqError,
    DiskFull,
    FlushFailed,
    InvalidQueueId,
    InvalidRecallHandle,
    RecallTopicMismatch,
)
from chronoq.model import (
    ALL_MESSAGE_TYPES,
    LINKS_TOPIC,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    MessageType,
    OutgoingMessage,
    ReceivedMessage,
    SendResult,
    StoredMessage,
    TimerStatus,
    TopicConfig,
)
from chronoq.recurring.records import Schedule, ScheduleChange
from chronoq.recurring.service import Schedules
from chronoq.retention import Retention
from chronoq.store import files
from chronoq.store.commitlog import FsyncTimes
from chronoq.store.groups import GroupStore
from chronoq.store.messagestore import MessageStore, OpenReport
from chronoq.timer.engine import TimerEntry
from chronoq.timer.engines import EngineChoice, engine_choice
from chronoq.timer.loop import TimerLoop, open_timer_service
from chronoq.timer.metrics import DELAY_EDGES_MS, DelayHistogram, TimerLatencies
from chronoq.timer.reads import FiredReads
from chronoq.timer.recall import decode_recall_handle
from chronoq.timer.service import TimerService
from chronoq.topics import Topics
from chronoq.trace import TraceJournal

log = logging.getLogger("chronoq.broker")


class Broker:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, groups: GroupStore,
                 timer: TimerService, engines: EngineChoice, open_report: OpenReport) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.groups = groups
        self.timer = timer
        self.open_report = open_report
        fired_reads = FiredReads(store, timer)
        self.trace: TraceJournal | None = TraceJournal(
            config.data_dir, segment_size_bytes=config.trace_segment_size_bytes,
            retention_bytes=config.trace_retention_bytes, fired_in=fired_reads.fired_in) \
            if config.trace_enable else None
        self.topics = Topics(config, store, clock)
        self.accept = Accept(config, clock, store, self.topics, timer)
        append = _appender(store, clock)
        self.deliver = Deliver(config, clock, store, groups, self.topics, timer.levels, append, self.trace)
        self.consumers = self.deliver.consumers
        self.timer_loop = TimerLoop(config, clock, store, timer, engines)
        self.schedules = Schedules(config, clock, store, self.accept, timer,
                                   send=functools.partial(self.send_batch, partial=True, create_near_topics=True))
        self.retention = Retention(config, store, groups, timer, roll_schedules=self.schedules.roll_before)
        # The path of every durable record, in one place (`chronoq/dispatch.py`): its queues,
        # the timer index (where a link record tells the timer room its fire is durable), the
        # trace, the long polls. A fired timer reads through its link as `timer/reads.py` says.
        self.dispatch = Dispatch(queues=store, timer_index=self.timer_loop, trace=self.trace,
                                 long_polls=self.deliver)
        store.dispatch_through(self.dispatch, fired_reads)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._stop_following_clock: Callable[[], None] = _nothing
        self._fatal: BaseException | None = None
        self._failed = asyncio.Event()
        # Counted at the doors (see the module docstring); restart at zero, as Prometheus expects.
        self.accepted_by_topic: dict[str, int] = {}
        self.timers_by_topic: dict[str, int] = {}
        self.delivered_by_topic: dict[str, int] = {}
        self.timer_delays_by_topic: dict[str, DelayHistogram] = {}
        """Per topic, each accepted timer's delay (due minus accepted, ms; 0 when already due):
        RocketMQ's `rocketmq_delay_message_latency`."""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def fatal(self) -> BaseException | None:
        """Why the broker stopped accepting work (a background task died, the log failed), or None."""
        return self._fatal

    @fatal.setter
    def fatal(self, why: BaseException | None) -> None:
        self._fatal = why
        if why is None:
            self._failed.clear()
        else:
            self._failed.set()

    async def wait_failed(self) -> BaseException:
        """Return `fatal` once the broker has failed (the server's watchdog waits on it)."""
        while self._fatal is None:
            await self._failed.wait()
            if self._fatal is None:
                self._failed.clear()
        return self._fatal

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    async def open(cls, config: Config, *, clock: Clock | None = None, background: bool = True) -> Broker:
        clock = clock or SystemClock(catchup_ppm=config.clock_catchup_ppm,
                                     max_backward_step_ms=config.clock_max_backward_step_ms)
        store, report = MessageStore.open(config, opened_ms=clock.now_ms())
        groups = timer = None
        try:
            groups, report.groups_reset = GroupStore.open_or_reset(
                config.data_dir / files.GROUPS_DIR, block_cache_bytes=config.groups_block_cache_bytes,
                write_buffer_bytes=config.groups_write_buffer_bytes, disk=store.disk)
            groups.clamp(lambda topic, queue_id: store.queue(topic, queue_id).next_offset)
            groups.restamp_ahead(clock.now_ms(), max(config.max_invisible_duration_ms, *config.delay_levels_ms))
            engines = engine_choice(config, store.disk)
            timer = open_timer_service(config, store, _appender(store, clock), engines)
            if stranded := timer.delay_queues.stranded():
                shown = ", ".join(f"level {lv}: {n}" for lv, n in sorted(stranded.items()))
                raise ConfigError(f"delay_levels has {timer.levels.max_level} levels, but messages sent at higher "
                                  f"levels have not fired yet ({shown}); nothing would fire them. Keep at least "
                                  f"{max(stranded)} levels until they have")
            broker = cls(config, clock, store, groups, timer, engines, report)
        except BaseException:
            if timer is not None:
                timer.engine.close()
            if groups is not None:
                groups.close()
            store.close()
            raise
        now = clock.now_ms()
        store.create_topic(TIMER_TOPIC, 1, ALL_MESSAGE_TYPES, now, exist_ok=True)
        store.create_topic(LINKS_TOPIC, 1, ALL_MESSAGE_TYPES, now, exist_ok=True)
        store.create_topic(SCHEDULE_TOPIC, timer.levels.max_level, ALL_MESSAGE_TYPES, now, exist_ok=True)
        store.log.on_failed = broker._store_failed
        broker._stop_following_clock = clock.add_rebase_listener(broker._clock_rebased)
        broker._spawn(store.log.flush_loop(), "flusher")
        try:
            # Before the timer loop runs: an occurrence that came due while the broker was down
            # is still the schedule's to withdraw, as its catch-up policy says.
            broker.schedules.replay()
            await broker.schedules.reconcile(clock.now_ms())
        except BaseException:
            await broker.close()
            raise
        if background:
            broker._spawn(broker.timer_loop.run(), "timer")
            broker._spawn(broker.schedules.run(), "schedules")
            broker._spawn(broker._every(config.checkpoint_interval_ms, broker._checkpoint, "checkpoint"),
                          "checkpoint")
            broker._spawn(broker._every(config.retention_check_interval_ms, broker.retention.step, "retention"),
                          "retention")
        return broker

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"chronoq-{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _store_failed(self, reason: str) -> None:
        """The commit log failed for good (an fsync error): stop, as for a dead task."""
        if self.fatal is None:
            self.fatal = FlushFailed(reason)
            log.error("storage failed, the broker stops accepting work: %s", reason)

    def _clock_rebased(self, step_ms: int, now_ms: int) -> None:
        """Broker time was just moved back by `step_ms` (`clock.py`): what this broker stamped in
        it, and measures against it, moves back with it, so each keeps the real time it had left:
        in-flight visible times (memory and store), retention's store times, the dedupe window.
        Timers' due times stay: an absolute one is a wall-clock fact, and one set by a delay fires
        up to the step late, never early."""
        moved = self.groups.rebase(step_ms, now_ms)
        self.store.clock_rebased(step_ms)
        self.accept.clock_rebased(step_ms)
        log.info("re-base of %d ms: %d in-flight messages, retention's store times and the dedupe window moved "
                 "back with broker time", step_ms, moved)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # A background task must not die silently: the broker stops accepting work.
            self.fatal = exc
            log.error("background task %s failed", task.get_name(), exc_info=exc)
            self.store.log.fail(f"background task {task.get_name()} failed: {exc!r}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_following_clock()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        try:
            await self.store.log.flush_now()
        except ChronoqError:
            pass
        # Each part closes whatever the others did: a RocksDB that cannot flush on a full disk
        # must not keep the store from writing its checkpoint and releasing the data directory.
        for name, close in (("timer index", self.timer.engine.close), ("consumer-group store", self.groups.close)):
            try:
                close()
            except Exception:
                log.exception("closing the %s failed; closing the rest", name)
        try:
            self.store.close()
        finally:
            if self.trace is not None:
                self.trace.close()

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosed()
        if self.fatal is not None:
            failure = self.store.log.failure
            if isinstance(self.fatal, FlushFailed) and failure is not None:
                raise FlushFailed(failure)  # says which fsync failed, rather than only "closed"
            raise BrokerClosed() from self.fatal

    # -- background -------------------------------------------------------------------------

    async def _every(self, interval_ms: int, work: Callable[[int], Awaitable[None]], name: str) -> None:
        """Run `work` every `interval_ms`; after one that found the disk full, again after
        `disk_full_retry_ms` (if sooner), logging once per episode, never dying of it."""
        delay_ms = interval_ms
        while True:
            await self.clock.sleep_ms(delay_ms)
            try:
                await work(self.clock.now_ms())
            except DiskFull as e:
                self.store.disk.note_full(name, e)
                delay_ms = min(interval_ms, self.config.disk_full_retry_ms)
            else:
                self.store.disk.note_ok(name)
                delay_ms = interval_ms

    async def _checkpoint(self, now_ms: int) -> None:
        """One checkpoint tick: the reserve file made again if space allows, the checkpoint
        written (DiskFull on a full disk: the old one stays valid), the trace flushed."""
        self.store.disk.tend()
        await self.store.checkpoint_in_background()  # its fsyncs on a worker thread, not the loop
        if self.trace is not None:
            self.trace.flush()

    async def run_due(self) -> int:
        """Issue the schedules' occurrences due at the clock's fire horizon, then fire every
        timer due then; returns how many timers fired. For tests with a FakeClock and
        `background=False`."""
        await self.schedules.step(self.clock.fire_horizon_ms())
        return await self.timer_loop.run_due()

    async def enforce_retention(self) -> None:
        await self.retention.step(self.clock.now_ms())

    @property
    def index_rebuilds(self) -> int:
        return self.timer_loop.index_rebuilds

    # -- topics -----------------------------------------------------------------------------

    async def create_topic(self, name: str, queue_count: int | None = None,
                           message_types: Iterable[MessageType] | None = None) -> TopicConfig:
        self._check_open()
        return self.topics.create(name, queue_count, message_types)

    def get_topic(self, name: str) -> TopicConfig:
        return self.topics.get(name)

    def topic_for_send(self, name: str) -> TopicConfig:
        """The topic, or for a new one with auto-create on, the route its first send will give it
        (creating nothing). A name near an existing topic's gets its route too: consumers ask for
        routes as well, and the send or receive that follows is refused naming the near topic."""
        return self.topics.for_send(name, create_near=True)

    def list_topics(self) -> list[TopicConfig]:
        return self.topics.list()

    # -- accept -----------------------------------------------------------------------------

    async def send(self, msg: OutgoingMessage, *, create_near_topics: bool = False) -> SendResult:
        outcome = (await self.send_batch([msg], partial=True, create_near_topics=create_near_topics))[0]
        if isinstance(outcome, ChronoqError):
            raise outcome
        return outcome

    async def send_batch(self, msgs: Sequence[OutgoingMessage], *, partial: bool = False,
                         create_near_topics: bool = False, count: bool = True) -> list[Any]:
        """Store `msgs` durably (see `accept.py`). All-or-nothing validation by default; with
        `partial=True` each bad message yields its error in its slot and the good ones are stored.
        `create_near_topics`: the sender asked for its topics, so a missing one whose name is near
        an existing topic's is auto-created rather than refused (`chronoq/topics.py`).
        `count=False`: the caller counts what its producers sent (`count_accepted`)."""
        self._check_open()
        now = self.clock.now_ms()
        outcomes = await self.accept.send_batch(msgs, partial=partial, create_near_topics=create_near_topics)
        if count:
            self.count_accepted(outcomes, now)
        return outcomes

    async def send_columns(self, topic: str, ids: Sequence[str | None], bodies: Sequence[bytes], *,
                           due_kind: str | None = None, due: Sequence[int] | None = None,
                           tags: Sequence[str] | None = None, keys: Sequence[tuple[str, ...]] | None = None,
                           properties: Sequence[Mapping[str, str]] | None = None,
                           refused: Mapping[int, ChronoqError] | None = None,
                           create_near_topics: bool = False) -> list[Any]:
        """A bulk send: the rows of one topic as columns (`accept.py` `send_columns`), each row's
        outcome (a `SendResult` or its `ChronoqError`) in its slot, as `send_batch(partial=True)`."""
        self._check_open()
        now = self.clock.now_ms()
        outcomes = await self.accept.send_columns(topic, ids, bodies, due_kind=due_kind, due=due, tags=tags,
                                                  keys=keys, properties=properties, refused=refused,
                                                  create_near_topics=create_near_topics)
        self.count_accepted(outcomes, now)
        return outcomes

    def count_accepted(self, outcomes: Iterable[Any], now: int) -> None:
        """Count the stored messages among `send_batch` outcomes (duplicates not), per topic, and
        each timer's delay from `now` (broker time, ms), when the send began."""
        accepted, timers, delays = self.accepted_by_topic, self.timers_by_topic, self.timer_delays_by_topic
        for outcome in outcomes:
            if type(outcome) is SendResult and not outcome.duplicate:
                topic = outcome.topic
                accepted[topic] = accepted.get(topic, 0) + 1
                if outcome.deliver_at_ms is not None:
                    timers[topic] = timers.get(topic, 0) + 1
                    hist = delays.get(topic)
                    if hist is None:
                        hist = delays[topic] = DelayHistogram(DELAY_EDGES_MS)
                    hist.record(max(0, outcome.deliver_at_ms - now))

    # -- schedules ------------------------------------------------------------------------------

    async def create_schedule(self, name: str, topic: str, body: bytes, **spec: Any) -> Schedule:
        """A recurring schedule (`recurring/service.py`; `spec`: every_ms or cron, zone, start_ms,
        end_ms, catch_up, jitter_ms, limit, tag, properties); durable when this returns."""
        self._check_open()
        return await self.schedules.create(name, topic, body, **spec)

    async def update_schedule(self, name: str, change: ScheduleChange) -> Schedule:
        self._check_open()
        return await self.schedules.update(name, change)

    async def pause_schedule(self, name: str) -> Schedule:
        self._check_open()
        return await self.schedules.pause(name)

    async def resume_schedule(self, name: str) -> Schedule:
        self._check_open()
        return await self.schedules.resume(name)

    async def delete_schedule(self, name: str) -> Schedule:
        self._check_open()
        return await self.schedules.delete(name)

    def get_schedule(self, name: str) -> Schedule:
        return self.schedules.get(name)

    def list_schedules(self) -> list[Schedule]:
        return self.schedules.list()

    def schedule_upcoming(self, name: str, count: int) -> list[int]:
        """The schedule's next `count` occurrences (nominal due times, ms)."""
        return self.schedules.upcoming(name, count)

    # -- deliver ----------------------------------------------------------------------------

    async def receive(self, group: str, topic: str, *, filter_expression: str = "*", batch_size: int = 32,
                      invisible_duration_ms: int | None = None, wait_ms: int = 0,
                      queue_id: int | None = None, count: bool = True) -> list[ReceivedMessage]:
        """`count=False`: the caller counts what reached its consumers (`count_delivered`)."""
        self._check_open()
        received = await self.deliver.receive(group, topic, filter_expression=filter_expression,
                                              batch_size=batch_size, invisible_duration_ms=invisible_duration_ms,
                                              wait_ms=wait_ms, queue_id=queue_id)
        if received and count:
            self.count_delivered(topic, len(received))
        return received

    def count_delivered(self, topic: str, n: int) -> None:
        """Count `n` messages handed to consumers of `topic`."""
        self.delivered_by_topic[topic] = self.delivered_by_topic.get(topic, 0) + n

    async def ack(self, group: str, topic: str, receipt_handle: str) -> None:
        self._check_open()
        self.deliver.ack(group, topic, receipt_handle)

    async def ack_many(self, group: str, topic: str, receipt_handles: Sequence[str]) -> list[ChronoqError | None]:
        """Ack several handles in one store write; per handle, None or the error refusing it."""
        self._check_open()
        return self.deliver.ack_many(group, topic, receipt_handles)

    async def change_invisible_duration(self, group: str, topic: str, receipt_handle: str,
                                        invisible_duration_ms: int) -> str:
        self._check_open()
        return self.deliver.change_invisible_duration(group, topic, receipt_handle, invisible_duration_ms)

    async def nack(self, group: str, topic: str, receipt_handle: str) -> str:
        """Failed consumption: visible again after the delay level for its attempt. Returns the
        new receipt handle."""
        self._check_open()
        return self.deliver.nack(group, topic, receipt_handle)

    async def forward_to_dlq(self, group: str, topic: str, receipt_handle: str) -> None:
        self._check_open()
        await self.deliver.forward_to_dlq(group, topic, receipt_handle)

    async def read(self, topic: str, queue_id: int, offset: int, max_messages: int) -> list[StoredMessage]:
        self._check_open()
        return self.deliver.read(topic, queue_id, offset, max_messages)

    def queue_offsets(self, topic: str, queue_id: int) -> tuple[int, int]:
        return self.deliver.queue_offsets(topic, queue_id)

    def inflight_handle(self, group: str, topic: str, queue_id: int, offset: int) -> str | None:
        """The current receipt handle of the group's in-flight message at (queue, offset), or
        None when the group holds none there (acked, dead-lettered, never received)."""
        entry = self.groups.get(group, topic, queue_id, offset)
        return None if entry is None else entry.receipt_handle

    async def make_visible(self, group: str, topic: str, receipt_handle: str) -> str:
        """An in-flight message receivable again at once (its attempt stays: the next delivery
        counts it), below `min_invisible_duration_ms`, which bounds what a consumer may ask.
        Returns the new receipt handle."""
        self._check_open()
        return self.consumers.postpone(group, topic, receipt_handle, 0, self.clock.now_ms()).receipt_handle

    async def start_group_at_end(self, group: str, topic: str) -> bool:
        """A group new to the topic starts at its queues' ends (receives only what comes next);
        one that has received on it goes on where it is. True when the offsets were set."""
        self._check_open()
        config = self.topics.get(topic)
        if any(self.groups.offset(group, topic, qid) is not None for qid in range(config.queue_count)):
            return False
        ends = [(group, topic, qid, self.queue_offsets(topic, qid)[1]) for qid in range(config.queue_count)]
        self.groups.commit(offsets=ends)
        return True

    async def reset_group(self, group: str, topic: str, offsets: Mapping[int, int] | None) -> int:
        """Move the group on the topic: every message it holds in flight is dropped (receivable
        again if its offset is at or before it) and each queue's next offset set as `offsets`
        says, clamped to what the queue holds; None forgets the group on the topic (a later
        receive starts at the queues' starts). Returns the in-flight messages dropped."""
        self._check_open()
        config = self.topics.get(topic)
        clamped = None
        if offsets is not None:
            clamped = {}
            for qid, offset in offsets.items():
                if not 0 <= qid < config.queue_count:
                    raise InvalidQueueId(topic, qid, config.queue_count)
                low, high = self.queue_offsets(topic, qid)
                clamped[qid] = min(max(offset, low), high)
        return self.groups.reset(group, topic, clamped)

    async def offset_at_time(self, topic: str, queue_id: int, at_ms: int) -> int:
        """The first offset of the queue whose message entered it at or after `at_ms` (its store
        time; a fired timer's, its due time), found by bisection (the queue's order is that of
        entry); the queue's end if none did."""
        self._check_open()
        low, high = self.queue_offsets(topic, queue_id)
        lo, hi = low, high
        while lo < hi:
            mid = (lo + hi) // 2
            entered = self._entered_ms(topic, queue_id, mid, high)
            if entered is None or entered >= at_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _entered_ms(self, topic: str, queue_id: int, offset: int, end: int) -> int | None:
        """When the first readable message at or after `offset` entered the queue (None: none)."""
        found = self.deliver.read(topic, queue_id, offset, 1)
        if not found or found[0].queue_offset >= end:
            return None
        msg = found[0]
        return max(msg.store_ms, msg.deliver_at_ms or 0)

    # -- timers -----------------------------------------------------------------------------

    async def cancel(self, *, recall_handle: str | None = None, topic: str | None = None,
                     message_id: str | None = None) -> str:
        """Cancel a pending timer by recall handle or by (topic, message id); returns the id. With
        both a handle and a topic, the handle must be that topic's (`RecallTopicMismatch`). A
        handle names one timer by its due time too; by id alone, several pending timers of the
        id (reused after the dedupe window) are refused (`TimerIdAmbiguous`)."""
        self._check_open()
        deliver_at_ms = None
        if recall_handle is not None:
            handle_topic, deliver_at_ms, message_id = decode_recall_handle(recall_handle)
            if topic is not None and topic != handle_topic:
                # RocketMQ's rule: a recall names its topic, and a handle of another topic is refused
                # (the caller's right to that topic was checked on the request's topic).
                raise RecallTopicMismatch(handle_topic, topic)
            topic = handle_topic
        if topic is None or message_id is None:
            raise InvalidRecallHandle("give a recall handle, or both topic and message id")
        # Forgotten once the tombstone is durable, even if this caller has gone away by then.
        forget = functools.partial(self.accept.forget, topic, message_id)
        # Due by the fire horizon, as the loop fires: a timer the loop has not fired may be cancelled.
        await self.timer.cancel(topic, message_id, self.clock.fire_horizon_ms(), deliver_at_ms=deliver_at_ms,
                                then=forget)
        self.timer_loop.poke()
        return message_id

    def query(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        return self.timer.query(message_id, topic)

    def query_key(self, key: str) -> list[TimerStatus]:
        return self.timer.engine.lookup_key(key)

    def pending_between(self, from_ms: int, to_ms: int, topic: str | None, limit: int,
                        max_scanned: int) -> tuple[list[TimerEntry], bool]:
        """Pending timers due in [from_ms, to_ms) (of `topic`, None: all), earliest first (the
        console's search; `TimerEngine.pending_between`)."""
        return self.timer.engine.pending_between(from_ms, to_ms, topic, limit, max_scanned)

    def pending_due_before_s(self, slot_s: int) -> int:
        """Pending timers due in seconds before `slot_s`, from the index's counters."""
        return self.timer.engine.pending_due_before_s(slot_s)

    def pending_total(self) -> int:
        return self.timer.engine.metrics(self.clock.now_ms()).pending_total

    def timer_latencies(self) -> TimerLatencies:
        """The timer index's latency histograms since start (delivery error, enqueue and fire lag)."""
        return self.timer.engine.latencies

    @property
    def fired_by_topic(self) -> Mapping[str, int]:
        """Timers fired since start, per real topic (counted where they fire)."""
        return self.timer.fired_by_topic

    def timers_undispatched(self) -> int:
        """Timer records written and not yet indexed (waiting for their group commit)."""
        return self.store.undispatched(TIMER_TOPIC)

    async def fire_timers(self, positions: list[int]) -> tuple[int, int]:
        """For the Spark engine: fire these pending timers now if due by the fire horizon, as the
        loop fires (idempotent)."""
        self._check_open()
        return await self.timer.fire_positions(positions, self.clock.fire_horizon_ms())

    async def arm_timers(self, timers: list[tuple[int, str, str]]) -> list[tuple[str, str | None]]:
        """For the Spark engine: hand these timers, (position, topic, message id), to the timer
        loop, which fires each at its due time (`TimerService.arm`; idempotent)."""
        self._check_open()
        results, earliest = self.timer.arm(timers)
        if earliest is not None:
            self.timer_loop.wake_for(earliest)
        return results

    def stats(self) -> dict[str, Any]:
        now = self.clock.now_ms()
        log_ = self.store.log
        return {
            "now_ms": now,
            "topics": len(self.list_topics()),
            "commitlog": {"start_position": log_.start_position, "end_position": log_.end_position,
                          "segments": len(log_.segments()), "fsyncs": log_.fsync_count,
                          "damaged_ranges": len(log_.damage), "damaged": [d.to_dict() for d in log_.damage.ranges()],
                          "reads_skipped_damaged": self.store.skipped_damaged},
            "timer": self.timer.stats(self.clock.fire_horizon_ms()),
            "clock": self.clock.stats(),
            "disk": self.store.disk_stats(),
            "trace": self.trace_stats(),
            "groups": self.group_stats(),
            "schedules": self.schedules.stats(),
        }

    def now_ms(self) -> int:
        """Broker time (`clock.py`)."""
        return self.clock.now_ms()

    def disk_stats(self) -> dict[str, object]:
        """Free space, its limits, and what a full disk is holding back (`MessageStore.disk_stats`)."""
        return self.store.disk_stats()

    def fsync_seconds(self) -> FsyncTimes:
        """The commit log's group-commit fsync durations since start."""
        return self.store.log.fsync_seconds

    def trace_stats(self) -> dict[str, Any]:
        """Whether the delivery trace is on (`trace_enable`), still recording, and if it stopped
        for the run (full disk, a file of an unknown version), why: otherwise only a log line."""
        trace = self.trace
        return {"enabled": trace is not None, "active": trace is not None and trace.stopped is None,
                "stopped_reason": trace.stopped_reason if trace is not None else None,
                "stopped": trace.stopped if trace is not None else None}

    def group_stats(self) -> list[dict[str, Any]]:
        """Per (consumer group, topic) with stored offsets: messages not yet handed out (`lag`)
        and handed out but not acked (`inflight`). O(groups x queues), no scan of messages."""
        out = []
        for group, topic in self.groups.groups():
            try:
                config = self.topics.get(topic)
            except ChronoqError:
                continue  # a topic gone since (not possible today; never fail stats for it)
            out.append({"group": group, "topic": topic, "lag": self.consumers.lag(group, config),
                        "inflight": self.groups.inflight_count(group, topic)})
        return out


def _nothing() -> None:
    return None


def _appender(store: MessageStore, clock: Clock) -> Callable[[list[Any]], Awaitable[list[StoredMessage]]]:
    """The broker's own writers (timer firing, rolls, tombstones, dead letters) append with the
    store time of the moment and wait until durable and dispatched: all they need of the broker."""

    async def append(msgs: list[Any]) -> list[StoredMessage]:
        return await store.append_durable(msgs, clock.now_ms())

    return append
