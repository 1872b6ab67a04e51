"""The in-process broker API: what the gRPC server, the SDK's tests, Spark and the CLI stand on.

Theory of operation: one asyncio event loop owns all broker state; blocking work is limited to
short page-cache writes and RocksDB calls on the loop, with fsync in a worker thread. Producers
call `send`/`send_batch`: admission (`validate.py`) -> routing of timer messages
(`timer/service.py`) -> `MessageStore.append` -> wait for the group-commit fsync. Durable records
are dispatched to consume queues and to the timer engine before any sender is released, so an
acknowledged message is durable *and* indexed. Consumers use RocketMQ 5 simple-consumer calls
(`consumers.py`).

Background work belongs to the broker and stops with it: the flusher, the timer loop (sleeps
until the engine's next deadline, woken early by new timers), the checkpoint loop and retention.
With `background=False` only the flusher runs, and a test moves a `FakeClock` and calls
`run_due()`, so two days of timers run in milliseconds, deterministically.

Every decision by time uses `clock` (broker time, which a wall-clock step cannot move back or
jump forward: `clock.py`); a long poll's `wait_ms` is a real-time wait on the loop's clock.

A full disk is back-pressure (docs/design.md, "A full disk"; `store/diskspace.py`): a producer
send below `disk_min_free_bytes` is refused with `DiskFull` before anything is written; the
broker's own writes use that reserve. A background step that runs out of space anyway (timer
firing, retention, a checkpoint) waits `disk_full_retry_ms` and tries again, with one warning per
episode; `close` completes whatever the disk says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

from chronoq.clock import Clock, SystemClock
from chronoq.config import Config
from chronoq.dedupe import DedupeWindow
from chronoq.errors import (
    BrokerClosed,
    ChronoqError,
    DiskFull,
    FlushFailed,
    InvalidRecallHandle,
    MessageTypeNotAccepted,
    TopicNotFound,
)
from chronoq.model import (
    ALL_MESSAGE_TYPES,
    SCHEDULE_TOPIC,
    SYS_DLQ_ORIGIN_OFFSET,
    SYS_DLQ_ORIGIN_QUEUE_ID,
    SYS_DLQ_ORIGIN_TOPIC,
    SYS_FIRED_FROM,
    SYS_REAL_TOPIC,
    SYS_TIMER_DEL_UNIQKEY,
    SYS_TIMER_ROLLED_FROM,
    TIMER_TOPIC,
    MessageType,
    OutgoingMessage,
    ReceivedMessage,
    SendResult,
    StoredMessage,
    TimerStatus,
    TopicConfig,
    dlq_topic,
    is_system_topic,
)
from chronoq.store import files
from chronoq.store.groups import GroupStore, InFlight
from chronoq.store.messagestore import MessageStore, OpenReport, PreparedMessage
from chronoq.timer.index import RocksTimerIndex, TimerIndexCorrupt
from chronoq.timer.service import TimerService, decode_recall_handle, encode_recall_handle
from chronoq.trace import ACCEPTED, FIRED, TraceJournal
from chronoq.validate import check_group_name, check_topic_name, prepare

log = logging.getLogger("chronoq.broker")
_SendOutcome = SendResult | ChronoqError


class Broker:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, groups: GroupStore,
                 timer: TimerService, open_report: OpenReport) -> None:
        from chronoq.consumers import ConsumerGroups

        self.config = config
        self.clock = clock
        self.store = store
        self.groups = groups
        self.timer = timer
        self.consumers = ConsumerGroups(config, store, groups, timer.levels)
        self.open_report = open_report
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._arrivals: dict[str, list[asyncio.Future[None]]] = {}
        """Long polls waiting per topic: plain futures, woken in one loop turn by a dispatch."""
        self._timer_wakeup = asyncio.Event()
        self._recent = DedupeWindow(config.dedupe_window_ms, config.dedupe_window_max_entries)
        self._sending: dict[tuple[str, str], tuple[asyncio.Future[list[SendResult]], int]] = {}
        """(topic, id) being written -> (its batch's future, its index in the batch's results): a
        concurrent send of the same id waits for the first. One future per batch, not per message."""
        self.fatal: BaseException | None = None
        self._index_damaged: TimerIndexCorrupt | None = None
        """Set when the timer index failed while running: the timer loop rebuilds it."""
        self.index_rebuilds = 0
        self.trace: TraceJournal | None = TraceJournal(config.data_dir) if config.trace_enable else None

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    async def open(cls, config: Config, *, clock: Clock | None = None, background: bool = True) -> Broker:
        clock = clock or SystemClock(catchup_ppm=config.clock_catchup_ppm)
        store, report = MessageStore.open(config, opened_ms=clock.now_ms())
        groups = timer = None
        try:
            groups, report.groups_reset = GroupStore.open_or_reset(
                config.data_dir / files.GROUPS_DIR, block_cache_bytes=config.groups_block_cache_bytes,
                write_buffer_bytes=config.groups_write_buffer_bytes, disk=store.disk)
            groups.clamp(lambda topic, queue_id: store.queue(topic, queue_id).next_offset)
            broker_ref: list[Broker] = []

            async def append(msgs: list[PreparedMessage]) -> list[StoredMessage]:
                return await broker_ref[0]._append(msgs)

            timer = _open_timer_service(config, store, append)
            broker = cls(config, clock, store, groups, timer, report)
            broker_ref.append(broker)
        except BaseException:
            if timer is not None:
                timer.engine.close()
            if groups is not None:
                groups.close()
            store.close()
            raise
        now = clock.now_ms()
        store.create_topic(TIMER_TOPIC, 1, ALL_MESSAGE_TYPES, now, exist_ok=True)
        store.create_topic(SCHEDULE_TOPIC, timer.levels.max_level, ALL_MESSAGE_TYPES, now, exist_ok=True)
        store.listeners.append(broker._on_dispatch)
        store.log.on_failed = broker._store_failed
        broker._spawn(store.log.flush_loop(), "flusher")
        if background:
            broker._spawn(broker._timer_loop(), "timer")
            broker._spawn(broker._every(config.checkpoint_interval_ms, broker._checkpoint, "checkpoint"),
                          "checkpoint")
            broker._spawn(broker._every(config.retention_check_interval_ms, broker._retention, "retention"),
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

    async def _every(self, interval_ms: int, work: Any, name: str) -> None:
        """Run `work` every `interval_ms`; after one that found the disk full, again after
        `disk_full_retry_ms` (if sooner), logging once per episode, never dying of it."""
        delay_ms = interval_ms
        while True:
            await asyncio.sleep(delay_ms / 1000)
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
        self.store.checkpoint()
        if self.trace is not None:
            self.trace.flush()

    def _rebuild_timer_index(self, reason: TimerIndexCorrupt) -> None:
        """Replace a timer index found damaged while running by one rebuilt from the log (up to
        what has been dispatched; later records arrive through dispatch as usual). Runs in one
        step on the loop, so no fire, cancel or roll sees a half-built index."""
        log.error("%s: rebuilding it from the commit log while running", reason.message)
        path = self.config.data_dir / files.TIMER_DIR
        with contextlib.suppress(Exception):
            self.timer.engine.close()
        RocksTimerIndex.destroy(path)
        self.timer.engine = RocksTimerIndex.open(path, **_index_memory(self.config), disk=self.store.disk)
        self.timer.recover(self.store.dispatched_position)
        self._index_damaged = None
        self.index_rebuilds += 1

    async def _timer_loop(self) -> None:
        while True:
            if self._index_damaged is not None:
                try:
                    self._rebuild_timer_index(self._index_damaged)
                except DiskFull as e:  # destroyed, but no room to make it again yet
                    self.store.disk.note_full("timer index rebuild", e)
                    await asyncio.sleep(self.config.disk_full_retry_ms / 1000)
                    continue
            now = self.clock.now_ms()
            self._timer_wakeup.clear()
            try:
                fired = await self.timer.fire_due(now)
            except TimerIndexCorrupt as e:
                self._index_damaged = e
                continue
            except DiskFull as e:
                # Fired copies (or the index) found no space: nothing fired; try again soon. The
                # timers stay pending, so nothing is lost and nothing fires early.
                self.store.disk.note_full("timer firing", e)
                await asyncio.sleep(self.config.disk_full_retry_ms / 1000)
                continue
            self.store.disk.note_ok("timer firing")
            if fired >= self.config.timer_fire_batch:
                continue
            deadline = self.timer.next_deadline_ms()
            if deadline is None:
                await self._timer_wakeup.wait()
            elif deadline > now or fired == 0:
                # fired == 0 with a past deadline: the head is held by a cancel in progress;
                # its completion (or any new timer) sets the wake-up.
                sleeper = asyncio.ensure_future(self.clock.sleep_until(max(deadline, now + (fired == 0))))
                waker = asyncio.ensure_future(self._timer_wakeup.wait())
                try:
                    await asyncio.wait((sleeper, waker), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
                    waker.cancel()

    async def run_due(self) -> int:
        """Do all work due at `clock.now_ms()`: fire every due timer (in batches). Returns the
        number fired. For tests with a FakeClock and `background=False`."""
        total = 0
        while True:
            fired = await self.timer.fire_due(self.clock.now_ms())
            total += fired
            if fired == 0:
                return total

    async def _retention(self, now_ms: int) -> None:
        limit = await self.store.expired_before(now_ms)
        for pin in (self.groups.min_inflight_position(), self.timer.min_level_position()):
            if pin is not None:
                limit = min(limit, pin)
        if limit <= self.store.log.start_position:
            return
        await self.timer.roll_before(limit, now_ms)
        if self.timer.pending_below(limit):
            # A timer the roll skipped (it was being fired or cancelled) is still pending there,
            # or one failed to roll: keep the segments; the next tick tries again.
            log.info("retention: pending timers remain below position %d; deleting nothing this time", limit)
            return
        self.store.checkpoint()
        self.store.delete_before(limit)
        self.timer.engine.prune_history(now_ms - self.config.retention_ms)

    async def enforce_retention(self) -> None:
        await self._retention(self.clock.now_ms())

    def _on_dispatch(self, msgs: list[StoredMessage]) -> None:
        if self._index_damaged is None:
            try:
                self.timer.on_dispatch(msgs, self.clock.now_ms())
            except TimerIndexCorrupt as e:
                # The records are durable in the log; only the derived index is hurt. The timer
                # loop rebuilds it (from the log, these records included); senders go on.
                self._index_damaged = e
                self._timer_wakeup.set()
        if self.trace is not None:
            self._trace_dispatch(msgs)
        topics = {m.topic for m in msgs}
        if TIMER_TOPIC in topics or SCHEDULE_TOPIC in topics:
            self._timer_wakeup.set()
        for topic in topics:
            for waiter in self._arrivals.pop(topic, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _trace_dispatch(self, msgs: list[StoredMessage]) -> None:
        assert self.trace is not None
        for m in msgs:
            due = m.deliver_at_ms
            if due is None:
                continue
            if m.topic == TIMER_TOPIC:
                sp = m.system_properties
                if SYS_TIMER_ROLLED_FROM not in sp and SYS_TIMER_DEL_UNIQKEY not in sp:
                    self.trace.record(ACCEPTED, m.system_properties[SYS_REAL_TOPIC], m.message_id, m.store_ms, due)
            elif SYS_FIRED_FROM in m.system_properties:
                self.trace.record(FIRED, m.topic, m.message_id, m.store_ms, due)

    async def _append(self, msgs: list[PreparedMessage]) -> list[StoredMessage]:
        stored = self.store.append(msgs, self.clock.now_ms())
        if stored:
            await self.store.wait_durable(stored[-1].position + stored[-1].size)
        return stored

    # -- topics -----------------------------------------------------------------------------

    async def create_topic(self, name: str, queue_count: int | None = None,
                           message_types: Iterable[MessageType] | None = None) -> TopicConfig:
        self._check_open()
        from chronoq.errors import InvalidQueueCount, SystemTopicForbidden

        check_topic_name(name, self.config)
        if is_system_topic(name):
            raise SystemTopicForbidden(name)
        count = self.config.default_queue_count if queue_count is None else queue_count
        if not isinstance(count, int) or not 1 <= count <= self.config.max_queue_count:
            raise InvalidQueueCount(count, self.config.max_queue_count)
        types = frozenset(MessageType(t) for t in message_types) if message_types is not None else ALL_MESSAGE_TYPES
        if not types:
            raise MessageTypeNotAccepted(name, "any", [])
        return self.store.create_topic(name, count, types, self.clock.now_ms())

    def get_topic(self, name: str) -> TopicConfig:
        return self.store.get_topic(name)

    def list_topics(self) -> list[TopicConfig]:
        return sorted((t for t in self.store.topics.values() if not is_system_topic(t.name)), key=lambda t: t.name)

    def _topic_for(self, name: str, *, create: bool = True) -> TopicConfig:
        topic = self.store.topics.get(name)
        if topic is not None:
            return topic
        if not self.config.auto_create_topics:
            raise TopicNotFound(name, auto_create=False)
        if not create:
            # The topic auto-create would make; send_batch creates it only once a message to it
            # is accepted, so a refused message leaves no topic behind.
            return TopicConfig(name, self.config.default_queue_count, ALL_MESSAGE_TYPES, self.clock.now_ms())
        return self.store.create_topic(name, self.config.default_queue_count, ALL_MESSAGE_TYPES,
                                       self.clock.now_ms(), exist_ok=True)

    # -- produce ----------------------------------------------------------------------------

    async def send(self, msg: OutgoingMessage) -> SendResult:
        outcome = (await self.send_batch([msg], partial=True))[0]
        if isinstance(outcome, ChronoqError):
            raise outcome
        return outcome

    async def send_batch(self, msgs: Sequence[OutgoingMessage], *, partial: bool = False) -> list[Any]:
        """Store `msgs` durably. All-or-nothing validation by default (the first bad message is
        raised and nothing is stored); with `partial=True` each bad message yields its error in
        its slot and the good ones are stored."""
        self._check_open()
        if len(msgs) > self.config.max_send_batch:
            from chronoq.errors import InvalidBatchSize
            raise InvalidBatchSize(len(msgs), self.config.max_send_batch)
        # One statvfs per call, not per message: below the send reserve nothing is written
        # (duplicates of earlier sends included: they are answered again once there is room).
        self.store.check_room_for_send()
        now = self.clock.now_ms()
        self._expire_recent(now)
        outcomes: list[Any] = [None] * len(msgs)
        to_write: list[PreparedMessage] = []
        slots: list[tuple[int, tuple[str, str], int | None]] = []
        waits: list[tuple[int, tuple[asyncio.Future[list[SendResult]], int]]] = []
        repeats: list[tuple[int, int]] = []  # (slot in msgs, index in to_write) for ids repeated in this batch
        batch_keys: dict[tuple[str, str], int] = {}
        for i, msg in enumerate(msgs):
            try:
                prepared, timer = prepare(msg, self.config, now, self.timer.levels)
                topic = self._topic_for(prepared.topic, create=False)
                _check_queue_id(prepared, topic)
                if prepared.message_type not in topic.message_types:
                    raise MessageTypeNotAccepted(topic.name, prepared.message_type.name,
                                                 sorted(t.name for t in topic.message_types))
                key = (prepared.topic, prepared.message_id)
                if (dup := self._recent.get(key)) is not None:
                    outcomes[i] = dup
                    continue
                if key in self._sending:
                    waits.append((i, self._sending[key]))
                    continue
                if key in batch_keys:
                    repeats.append((i, batch_keys[key]))
                    continue
                if timer is not None:
                    prepared = self.timer.route(prepared, timer.deliver_at_ms, timer.delay_level, now)
            except ChronoqError as e:
                if not partial:
                    self.timer.release_reservations(to_write)
                    raise
                outcomes[i] = e
                continue
            batch_keys[key] = len(to_write)
            to_write.append(prepared)
            slots.append((i, key, timer.deliver_at_ms if timer is not None else None))
        for topic_name in {key[0] for _, key, _ in slots}:
            self._topic_for(topic_name)
        batch_done: asyncio.Future[list[SendResult]] = asyncio.get_running_loop().create_future()
        for j, (_, key, _) in enumerate(slots):
            self._sending[key] = (batch_done, j)
        try:
            stored = self._write_prepared(to_write, now)
            if stored:
                await self.store.wait_durable(stored[-1].position + stored[-1].size)
        except BaseException as e:
            for _, key, _ in slots:
                self._sending.pop(key, None)
            batch_done.set_exception(e if isinstance(e, Exception) else BrokerClosed())
            batch_done.exception()  # mark retrieved: waiters may not exist
            raise
        results: list[SendResult] = []
        for (i, key, deliver_at_ms), rec in zip(slots, stored, strict=True):
            result = self._result_for(rec, key, deliver_at_ms)
            outcomes[i] = result
            results.append(result)
            self._recent.add(key, now, result)
            self._sending.pop(key, None)
        batch_done.set_result(results)
        for i, j in repeats:
            outcomes[i] = _as_duplicate(outcomes[slots[j][0]])
        for i, (fut, j) in waits:
            outcomes[i] = _as_duplicate((await fut)[j])
        return outcomes

    def _write_prepared(self, to_write: list[PreparedMessage], now: int) -> list[StoredMessage]:
        try:
            return self.store.append(to_write, now)
        except BaseException:
            self.timer.release_reservations(to_write)
            raise

    def _result_for(self, rec: StoredMessage, key: tuple[str, str], deliver_at_ms: int | None) -> SendResult:
        topic, message_id = key
        if deliver_at_ms is None:
            return SendResult(message_id, topic, rec.queue_id, rec.queue_offset, rec.position)
        # Only timers in the time index can be recalled and queried; a delay-level message waits
        # in its level's queue (RocketMQ 4), which, as in RocketMQ 4, offers neither.
        handle = encode_recall_handle(topic, deliver_at_ms, message_id) if rec.topic == TIMER_TOPIC else None
        return SendResult(message_id, topic, rec.queue_id, rec.queue_offset, rec.position, deliver_at_ms, handle)

    def _expire_recent(self, now_ms: int) -> None:
        self._recent.expire(now_ms)

    # -- consume ----------------------------------------------------------------------------

    async def receive(self, group: str, topic: str, *, filter_expression: str = "*", batch_size: int = 32,
                      invisible_duration_ms: int | None = None, wait_ms: int = 0,
                      queue_id: int | None = None) -> list[ReceivedMessage]:
        from chronoq.consumers import TagFilter

        self._check_open()
        check_group_name(group, self.config)
        check_topic_name(topic, self.config)
        tcfg = self.store.topics.get(topic)
        if tcfg is None:  # a consumer never creates a topic: a mistyped name must not appear
            raise TopicNotFound(topic, auto_create=self.config.auto_create_topics)
        tag_filter = TagFilter.parse(filter_expression)
        invisible = invisible_duration_ms  # None: the broker's retry backoff (consumers.invisible_for)
        wait_ms = max(0, min(wait_ms, self.config.max_long_poll_ms))
        loop = asyncio.get_running_loop()
        # A long poll is a real-time wait, not a timer: it ends on the loop's monotonic clock even
        # while broker time is paused (a wall-clock step back). Visibility stays in broker time.
        deadline_s = loop.time() + wait_ms / 1000
        while True:
            # Registered before looking, so a dispatch between the look and the wait still wakes us.
            waiter: asyncio.Future[None] = loop.create_future()
            waiters = self._arrivals.setdefault(topic, [])
            if len(waiters) >= 64:  # long polls that timed out while the topic was quiet
                waiters[:] = [w for w in waiters if not w.done()]
            waiters.append(waiter)
            now = self.clock.now_ms()
            outcome = self.consumers.receive(group, tcfg, tag_filter, batch_size, invisible, now, queue_id)
            if outcome.exhausted:
                await self._dead_letter(group, outcome.exhausted)
            remaining_s = deadline_s - loop.time()
            if outcome.delivered or remaining_s <= 0:
                waiter.cancel()  # done, so the next registration's pruning drops it
                if self.trace is not None:
                    for rm in outcome.delivered:
                        due = rm.message.deliver_at_ms
                        if due is not None and rm.delivery_attempt == 1:
                            self.trace.received(rm.message.topic, rm.message.message_id, now, due)
                return outcome.delivered
            wake_s = remaining_s
            next_visible = self.groups.next_visible_ms(group, topic)
            if next_visible is not None:
                # The clock says how long in real time until broker time can reach it (a paused
                # clock is looked at every few ms, not spun on).
                wake_s = min(wake_s, max(self.clock.real_wait_ms(next_visible), 1) / 1000)
            # A bare future and a timer, not wait_for(event.wait()): that wakes through two extra
            # tasks, each a loop turn, and a busy loop's turn is a millisecond.
            timer = loop.call_later(wake_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()

    async def ack(self, group: str, topic: str, receipt_handle: str) -> None:
        self._check_open()
        self.consumers.ack(group, topic, receipt_handle)

    async def ack_many(self, group: str, topic: str, receipt_handles: Sequence[str]) -> list[ChronoqError | None]:
        """Ack several handles in one store write; per handle, None or the error refusing it."""
        self._check_open()
        return self.consumers.ack_many(group, topic, receipt_handles)

    async def change_invisible_duration(self, group: str, topic: str, receipt_handle: str,
                                        invisible_duration_ms: int) -> str:
        self._check_open()
        entry = self.consumers.change_invisible(group, topic, receipt_handle, invisible_duration_ms,
                                                self.clock.now_ms())
        return entry.receipt_handle

    async def nack(self, group: str, topic: str, receipt_handle: str) -> str:
        """Failed consumption: visible again after the delay level for its attempt (RocketMQ's
        level 3 + attempts). Returns the new receipt handle."""
        self._check_open()
        entry = self.groups.lookup_handle(group, topic, receipt_handle)
        delay_ms = self.timer.levels.retry_delay_ms(entry.attempt)
        return self.consumers.postpone(group, topic, receipt_handle, delay_ms, self.clock.now_ms()).receipt_handle

    async def forward_to_dlq(self, group: str, topic: str, receipt_handle: str) -> None:
        self._check_open()
        entry = self.groups.lookup_handle(group, topic, receipt_handle)
        msg = self.store.readable(entry.position, entry.size)
        if msg is None:
            self.consumers.drop([entry])
            return
        await self._dead_letter(group, [(entry, msg)])

    async def _dead_letter(self, group: str, items: list[tuple[InFlight, StoredMessage]]) -> None:
        dlq = dlq_topic(group)
        self.store.create_topic(dlq, 1, ALL_MESSAGE_TYPES, self.clock.now_ms(), exist_ok=True)
        copies = []
        for _entry, msg in items:
            sp = dict(msg.system_properties)
            sp.update({SYS_DLQ_ORIGIN_TOPIC: msg.topic, SYS_DLQ_ORIGIN_QUEUE_ID: str(msg.queue_id),
                       SYS_DLQ_ORIGIN_OFFSET: str(msg.queue_offset)})
            copies.append(PreparedMessage(
                topic=dlq, message_id=msg.message_id, message_type=msg.message_type, body=msg.body,
                born_ms=msg.born_ms, tag=msg.tag, keys=msg.keys, properties=msg.properties,
                system_properties=sp, queue_id=0))
        await self._append(copies)  # durable in the DLQ before it leaves the group
        self.consumers.drop([entry for entry, _ in items])

    # -- read by offset ---------------------------------------------------------------------

    async def read(self, topic: str, queue_id: int, offset: int, max_messages: int) -> list[StoredMessage]:
        self._check_open()
        tcfg = self.get_topic(topic)
        if not 0 <= queue_id < tcfg.queue_count:
            from chronoq.errors import InvalidQueueId
            raise InvalidQueueId(topic, queue_id, tcfg.queue_count)
        cq = self.store.queue(topic, queue_id)
        out: list[StoredMessage] = []
        offset = max(offset, cq.min_offset)
        while len(out) < max_messages and offset < cq.next_offset:
            entries = cq.read_range(offset, max_messages - len(out))
            if not entries:
                break
            for off, position, size, _ in entries:
                msg = self.store.readable(position, size)
                if msg is not None:
                    out.append(msg)
                offset = off + 1
        return out

    def queue_offsets(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self.store.queue(topic, queue_id)
        return cq.min_offset, cq.next_offset

    # -- timers -----------------------------------------------------------------------------

    async def cancel(self, *, recall_handle: str | None = None, topic: str | None = None,
                     message_id: str | None = None) -> str:
        self._check_open()
        deliver_at_ms = None
        if recall_handle is not None:
            topic, deliver_at_ms, message_id = decode_recall_handle(recall_handle)
        if topic is None or message_id is None:
            raise InvalidRecallHandle("give a recall handle, or both topic and message id")
        await self.timer.cancel(topic, message_id, self.clock.now_ms(), deliver_at_ms=deliver_at_ms)
        # Forget the id's first send: sent again now, it is a new timer to store, not a retry
        # to answer with the cancelled one's result (stored nowhere, it would never fire).
        self._recent.discard((topic, message_id))
        self._timer_wakeup.set()
        return message_id

    def query(self, message_id: str, topic: str | None = None) -> list[TimerStatus]:
        return self.timer.query(message_id, topic)

    def query_key(self, key: str) -> list[TimerStatus]:
        return self.timer.engine.lookup_key(key)

    async def fire_timers(self, positions: list[int]) -> tuple[int, int]:
        """For the Spark engine: fire these pending timers now (idempotent)."""
        self._check_open()
        return await self.timer.fire_positions(positions, self.clock.now_ms())

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
            "timer": self.timer.stats(now),
            "clock": {"behind_wall_ms": self._behind_wall_ms()},
            "disk": self.store.disk_stats(),
        }

    def _behind_wall_ms(self) -> int:
        """How far broker time is behind the wall clock (< 0: ahead, paused after a step back);
        0 for a clock without a wall clock behind it (FakeClock)."""
        behind = getattr(self.clock, "behind_wall_ms", None)
        return int(behind()) if behind is not None else 0


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _check_queue_id(msg: PreparedMessage, topic: TopicConfig) -> None:
    """A queue id outside the topic is refused per message, before anything is written (the
    store would refuse it too, but for the whole batch)."""
    qid = msg.queue_id
    if qid is not None and (isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < topic.queue_count):
        from chronoq.errors import InvalidQueueId
        raise InvalidQueueId(topic.name, qid, topic.queue_count)


def _as_duplicate(result: SendResult) -> SendResult:
    from dataclasses import replace

    return replace(result, duplicate=True)


def _index_memory(config: Config) -> dict[str, int]:
    return {"block_cache_bytes": config.timer_index_block_cache_bytes,
            "write_buffer_bytes": config.timer_index_write_buffer_bytes}


def _open_timer_service(config: Config, store: MessageStore, append: Any) -> TimerService:
    """Open the timer index and bring it up to the log's end. It is derived state: missing,
    damaged (at open or while replaying), of another format version, or ahead of the log (files
    restored from different times), it is destroyed and rebuilt from the commit log."""
    path = config.data_dir / files.TIMER_DIR
    index: RocksTimerIndex | None = None
    try:
        index = RocksTimerIndex.open(path, **_index_memory(config), disk=store.disk)
        if index.indexed_position > store.log.end_position:
            raise TimerIndexCorrupt(path, f"it covers the log up to {index.indexed_position}, past the log's "
                                          f"end {store.log.end_position}")
        timer = TimerService(config, store, index, append)
        timer.recover()
        return timer
    except TimerIndexCorrupt as e:
        log.warning("%s: rebuilding it from the commit log", e.message)
        if index is not None:
            index.close()
    except BaseException:
        # Not damage (a full disk, say): keep the index as it is for the next start.
        if index is not None:
            index.close()
        raise
    RocksTimerIndex.destroy(path)
    timer = TimerService(config, store, RocksTimerIndex.open(path, **_index_memory(config), disk=store.disk), append)
    try:
        timer.recover()
    except BaseException:
        timer.engine.close()
        raise
    return timer

