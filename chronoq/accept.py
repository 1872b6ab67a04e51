"""Accept: the first room a message walks through, from a producer's send to its acknowledgement.

Theory of operation: `send_batch` runs each message through admission (`validate.prepare`: every
rule, before any write), its topic (`Topics.for_send`), the dedupe window (a repeat of a recent id
on the same topic is answered with the first result and stores nothing; a concurrent repeat waits
for the first), and timer routing (`TimerService.route`: a timer message is rewritten to the
timer topic, a delay-level message to its level's queue). What passed is appended to the log in
one write and the batch waits for the group commit that makes it durable; the store dispatches
it (consume queues, timer index, long polls) before the senders are released, so an
acknowledged message is durable, visible and indexed. Refusals change nothing: reservations a
routed timer took are released if the batch is not written. `send_columns` (the bulk send, rows of
one topic as columns) differs only in its admission, `validate.prepare_columns`, which gives each
row what `prepare` gives it; from there both take the one path (`_send`).

Owned by the broker's event loop (no locks); time comes from the clock it is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.dedupe import DedupeWindow
from chronoq.errors import BrokerClosed, ChronoqError, InvalidBatchSize, InvalidQueueId, MessageTypeNotAccepted
from chronoq.model import TIMER_TOPIC, OutgoingMessage, SendResult, StoredMessage, TopicConfig
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timer.recall import encode_recall_handle
from chronoq.timer.service import TimerService
from chronoq.topics import Topics
from chronoq.validate import TimerRequest, prepare, prepare_columns


class Accept:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, topics: Topics, timer: TimerService) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        self.topics = topics
        self.timer = timer
        self.recent = DedupeWindow(config.dedupe_window_ms, config.dedupe_window_max_entries)
        self._sending: dict[tuple[str, str], tuple[asyncio.Future[list[SendResult]], int]] = {}
        """(topic, id) being written -> (its batch's future, its index in the batch's results): a
        concurrent send of the same id waits for the first. One future per batch, not per message."""
        self._finishing: set[asyncio.Future[None]] = set()
        """Batches whose senders went away after the write, waiting for durability to finish."""

    async def send_batch(self, msgs: Sequence[OutgoingMessage], *, partial: bool = False,
                         create_near_topics: bool = False) -> list[Any]:
        """Store `msgs` durably. All-or-nothing validation by default (the first bad message is
        raised and nothing is stored); with `partial=True` each bad message yields its error in
        its slot and the good ones are stored. `create_near_topics`: see `Topics.for_send`."""
        if len(msgs) > self.config.max_send_batch:
            raise InvalidBatchSize(len(msgs), self.config.max_send_batch)
        config, levels = self.config, self.timer.levels
        return await self._send(len(msgs), lambda i, now: prepare(msgs[i], config, now, levels), partial,
                                create_near_topics)

    async def send_columns(self, topic: str, ids: Sequence[str | None], bodies: Sequence[bytes], *,
                           due_kind: str | None = None, due: Sequence[int] | None = None,
                           tags: Sequence[str] | None = None, keys: Sequence[tuple[str, ...]] | None = None,
                           properties: Sequence[Mapping[str, str]] | None = None,
                           refused: Mapping[int, ChronoqError] | None = None,
                           create_near_topics: bool = False) -> list[Any]:
        """A bulk send (`protocol/bulk.py`): the rows of one topic as columns, each judged alone
        (`partial`), at most `max_bulk_send_rows` of them. Admission is `validate.prepare_columns`
        (the rules and errors of `prepare`, per row); `refused` gives rows already refused by
        the decoder. Then the path of every send: dedupe, routing, one append, one group commit."""
        n = len(ids)
        if n > self.config.max_bulk_send_rows:
            raise InvalidBatchSize(n, self.config.max_bulk_send_rows)
        admitted: list[Any] = []

        def admit(i: int, now: int) -> tuple[PreparedMessage, TimerRequest | None]:
            if not admitted:
                admitted.extend(prepare_columns(topic, ids, bodies, self.config, now, self.timer.levels,
                                                due_kind=due_kind, due=due, tags=tags, keys=keys,
                                                properties=properties))
                for row, error in (refused or {}).items():
                    admitted[row] = error
            outcome = admitted[i]
            if isinstance(outcome, ChronoqError):
                raise outcome
            return outcome

        return await self._send(n, admit, True, create_near_topics)

    async def _send(self, count: int, admit: Callable[[int, int], tuple[PreparedMessage, TimerRequest | None]],
                    partial: bool, create_near_topics: bool) -> list[Any]:
        """Store the `count` messages `admit(i, now)` prepares (or refuses, raising): the path
        every send takes after its door's admission."""
        # One statvfs per call, not per message: below the send reserve nothing is written
        # (duplicates of earlier sends included: they are answered again once there is room).
        self.store.check_room_for_send()
        now = self.clock.now_ms()
        self.recent.expire(now)
        outcomes: list[Any] = [None] * count
        to_write: list[PreparedMessage] = []
        slots: list[tuple[int, tuple[str, str], int | None]] = []
        waits: list[tuple[int, tuple[asyncio.Future[list[SendResult]], int]]] = []
        repeats: list[tuple[int, int]] = []  # (slot in msgs, index in to_write) for ids repeated in this batch
        batch_keys: dict[tuple[str, str], int] = {}
        try:
            for i in range(count):
                try:
                    prepared, timer = admit(i, now)
                    topic = self.topics.for_send(prepared.topic, create_near=create_near_topics)
                    _check_queue_id(prepared, topic)
                    if prepared.message_type not in topic.message_types:
                        raise MessageTypeNotAccepted(topic.name, prepared.message_type.name,
                                                     sorted(t.name for t in topic.message_types))
                    key = (prepared.topic, prepared.message_id)
                    if (dup := self.recent.get(key)) is not None:
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
                        raise
                    outcomes[i] = e
                    continue
                batch_keys[key] = len(to_write)
                to_write.append(prepared)
                slots.append((i, key, timer.deliver_at_ms if timer is not None else None))
            for topic_name in {key[0] for _, key, _ in slots}:
                self.topics.ensure(topic_name)
        except BaseException:
            # A refusal of the batch, an auto-create that found no space, or anything unexpected
            # (text that cannot be encoded, say): give back the timer slots this batch reserved,
            # or their seconds stay full for good.
            self.timer.release_reservations(to_write)
            raise
        batch_done: asyncio.Future[list[SendResult]] = asyncio.get_running_loop().create_future()
        for j, (_, key, _) in enumerate(slots):
            self._sending[key] = (batch_done, j)
        # Whatever happens from here, every key leaves `_sending` and `batch_done` is settled:
        # a later send of the same id waits on it, and would wait forever.
        stored: list[StoredMessage] = []
        try:
            stored = self._write(to_write, now)
            if stored:
                await self.store.wait_durable(stored[-1].position + stored[-1].size)
        except asyncio.CancelledError:
            if stored and self.store.log.failure is None:
                # The sender went away after its records were written (a client's deadline
                # cancels the handler): they become durable all the same. The batch is finished
                # when they do, so a retry of an id gets this result rather than storing the
                # message again, and a retry already waiting gets it too.
                self._finish_when_durable(stored, slots, batch_done, now)
            else:
                self._fail(slots, batch_done, BrokerClosed())
            raise
        except BaseException as e:
            self._fail(slots, batch_done, e)
            raise
        for (i, _, _), result in zip(slots, self._finish(stored, slots, batch_done, now), strict=True):
            outcomes[i] = result
        for i, j in repeats:
            outcomes[i] = _as_duplicate(outcomes[slots[j][0]])
        for i, (fut, j) in waits:
            outcomes[i] = _as_duplicate((await fut)[j])
        return outcomes

    def _finish(self, stored: list[StoredMessage], slots: list[tuple[int, tuple[str, str], int | None]],
                batch_done: asyncio.Future[list[SendResult]], now: int) -> list[SendResult]:
        """The batch is durable: its results, answered to whoever waits for an id of it, and
        remembered for retries (`dedupe_window_ms`)."""
        try:
            results = [_result_for(rec, key, deliver_at_ms)
                       for (_, key, deliver_at_ms), rec in zip(slots, stored, strict=True)]
        except BaseException as e:
            self._fail(slots, batch_done, e)
            raise
        for _, key, _ in slots:
            self._sending.pop(key, None)
        batch_done.set_result(results)
        for (_, key, _), result in zip(slots, results, strict=True):
            self.recent.add(key, now, result)
        return results

    def _fail(self, slots: list[tuple[int, tuple[str, str], int | None]],
              batch_done: asyncio.Future[list[SendResult]], error: BaseException) -> None:
        """The batch failed: its ids are no longer in flight, and whoever waits for one gets the
        error (a cancellation or exit as `BrokerClosed`: a future holds exceptions only)."""
        for _, key, _ in slots:
            self._sending.pop(key, None)
        if not batch_done.done():
            batch_done.set_exception(error if isinstance(error, Exception) else BrokerClosed())
            batch_done.exception()  # mark retrieved: waiters may not exist

    def _finish_when_durable(self, stored: list[StoredMessage], slots: list[tuple[int, tuple[str, str], int | None]],
                             batch_done: asyncio.Future[list[SendResult]], now: int) -> None:
        async def finish() -> None:
            try:
                await self.store.wait_durable(stored[-1].position + stored[-1].size)
            except BaseException as e:  # the log failed, or the broker closed: nobody to tell but waiters
                self._fail(slots, batch_done, e)
                return
            self._finish(stored, slots, batch_done, now)

        task = asyncio.ensure_future(finish())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    def clock_rebased(self, step_ms: int) -> None:
        """Broker time moved back by `step_ms` (a re-base, `clock.py`): the dedupe window's times too."""
        self.recent.clock_rebased(step_ms)

    def forget(self, topic: str, message_id: str, deliver_at_ms: int) -> None:
        """The id's timer due at `deliver_at_ms` was cancelled: a new send of it is a new timer to
        store, not a retry to answer with the cancelled one's result (stored nowhere, it would
        never fire). A later send of the id, due at another time, stays remembered."""
        self.recent.discard((topic, message_id), deliver_at_ms)

    def _write(self, to_write: list[PreparedMessage], now: int) -> list[StoredMessage]:
        try:
            return self.store.append(to_write, now)
        except BaseException:
            self.timer.release_reservations(to_write)
            raise


def _result_for(rec: StoredMessage, key: tuple[str, str], deliver_at_ms: int | None) -> SendResult:
    topic, message_id = key
    if deliver_at_ms is None:
        return SendResult(message_id, topic, rec.queue_id, rec.queue_offset, rec.position)
    # Only timers in the time index can be recalled and queried; a delay-level message waits in
    # its level's queue (RocketMQ 4), which, as in RocketMQ 4, offers neither.
    handle = encode_recall_handle(topic, deliver_at_ms, message_id) if rec.topic == TIMER_TOPIC else None
    return SendResult(message_id, topic, rec.queue_id, rec.queue_offset, rec.position, deliver_at_ms, handle)


def _check_queue_id(msg: PreparedMessage, topic: TopicConfig) -> None:
    """A queue id outside the topic is refused per message, before anything is written (the
    store would refuse it too, but for the whole batch)."""
    qid = msg.queue_id
    if qid is not None and (isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < topic.queue_count):
        raise InvalidQueueId(topic.name, qid, topic.queue_count)


def _as_duplicate(result: SendResult) -> SendResult:
    return replace(result, duplicate=True)
