"""Schedules: the broker's room for recurring schedules, over the accept path and the timer room.

Theory of operation:
1. Durable: every change is a record in the commit log's `chronoq.schedules` topic
   (`recurring/records.py`), made durable before the call returns; `open` replays that topic
   into the live table (memory: one `Schedule` per name, `schedule_max_count` at most).
2. Issued as timers: a schedule has at most one occurrence ahead of time in the timer index, an
   ordinary timer message sent through the accept path (admission, dedupe window, routing, group
   commit), with id `<name>@<nominal ms>.v<version>` and the properties `SCHEDULE_NAME` and
   `SCHEDULE_DUE_MS` (the nominal due time). The timer engine fires it like any timer: never
   early, as precisely. Once an issued occurrence has come due, `step` issues the next one (then
   a `progress` record); `run` sleeps until the earliest such time. Not at the due instant
   itself: each schedule issues its next occurrence at its own point of the first half of the
   gap after the one that came due (`_issue_at`: a fraction from a hash of its name). Issues are
   sends (the accept path, the log's group commit, the timer index) on the event loop the fire
   step runs on; made at the due instants, they would pile onto the instants occurrences fire
   (schedules made together come due together) and make them late. Spread over the gap they
   are an even trickle, and a step that falls behind still has half a gap before the next
   occurrence is due. An occurrence further ahead than `timer_max_delay_ms` is issued once it
   is within it.
3. Exactly once per occurrence: before a send, the occurrence's id is looked up in the timer
   index; one already there (sent before a crash that lost the `progress` record after it) is
   not sent again. Within a run the dedupe window does the same for a retry.
4. Catch-up: occurrences whose time passed without being issued (the broker was down, or the
   schedule paused) are missed; the schedule's `catch_up` says what to deliver of them: `skip`
   (none; the default), `latest` (the last one, at once), `all` (each, at once, at most
   `schedule_catch_up_max_occurrences`, the latest ones). At open (`reconcile`, before the timer
   loop starts), an issued occurrence that came due while the broker was down is missed too and
   withdrawn (a tombstone) unless the policy delivers it; so is one issued under a definition an
   update, pause or delete replaced, if a crash came before its withdrawal.
5. Update (body, expression, zone, ...), pause and delete: the new record first, then the
   pending occurrence is cancelled (a tombstone, `TimerService.cancel`). A cancel that comes too
   late (the occurrence is firing or fired) leaves it delivered as it was; the change applies
   from the next occurrence. Update and resume issue the next occurrence of the new definition.
6. Retention: `roll_before` re-appends a `put` for every schedule whose latest record lies below
   the live segments, so the log always holds each schedule whole.
One `asyncio.Lock` orders every change and step, so a step never issues for a schedule a
concurrent change is rewriting. Nothing reads the clock but through the injected `Clock`, and
`step(now_ms)` takes its time as an argument.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from chronoq.accept import Accept
from chronoq.clock import Clock
from chronoq.config import Config
from chronoq.errors import (
    ChronoqError,
    InvalidSchedule,
    MessageTypeNotAccepted,
    ScheduleExists,
    ScheduleNotFound,
    TimerNotPending,
    TooManySchedules,
)
from chronoq.model import (
    ALL_MESSAGE_TYPES,
    PROP_SCHEDULE_DUE_MS,
    PROP_SCHEDULE_NAME,
    SCHEDULES_TOPIC,
    MessageType,
    OutgoingMessage,
    SendResult,
    TimerState,
)
from chronoq.recurring import records
from chronoq.recurring.records import Schedule, ScheduleChange
from chronoq.recurring.spec import Recurrence, check, check_name, jitter_offset_ms
from chronoq.store.messagestore import MessageStore, PreparedMessage
from chronoq.timer.metrics import DelayHistogram
from chronoq.timer.service import TimerService
from chronoq.validate import prepare

log = logging.getLogger("chronoq.schedules")

LATENESS_EDGES_MS = (1, 5, 10, 50, 100, 500, 1_000, 5_000, 10_000, 60_000, 600_000, 3_600_000, 86_400_000)
"""Buckets of `lateness`: ms after an occurrence's due time."""
Send = Callable[[list[OutgoingMessage]], Awaitable[list[Any]]]
RETRY_MS = 1_000
"""After an issue failed (a full disk, a topic gone), the schedule is looked at again this much later."""
ISSUE_GRID_MS = 50
"""Issue times are rounded up to a multiple of this (when that keeps them in the first half of
the gap), so the schedules whose turn comes within it share one step: one send and one
`progress` append for them all, not one each."""
ISSUE_SLICE = 32
"""Schedules one `_issue` call issues for at most (one send, one progress append): a step with
more goes in slices, one after the other. A slice holds the event loop for its CPU time (the
occurrences' planning, id look-ups and the accept path's checks and write: ~0.2 ms each), and
timers due meanwhile wait it out: 32 keep that near 6 ms, where 256 held the loop for 50 ms
and more with 100,000 schedules firing each minute. The price is a group commit per slice: some
3,000 issues a second at the least, above what the grid asks of it at that load (1,667)."""


class Schedules:
    def __init__(self, config: Config, clock: Clock, store: MessageStore, accept: Accept,
                 timer: TimerService, send: Send) -> None:
        self.config = config
        self._send = send
        """The broker's partial send (`Broker.send_batch(..., partial=True)`): the door's counts
        see occurrences as they see every timer."""
        self.clock = clock
        self.store = store
        self.accept = accept
        self.timer = timer
        self.table: dict[str, Schedule] = {}
        self._positions: dict[str, int] = {}
        self._deleted: dict[str, tuple[str, records.Pending]] = {}
        self._heap: list[tuple[int, str]] = []
        self._wake: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._creating: list[tuple[Schedule, int, asyncio.Future[Schedule]]] = []
        """Creates waiting for the next batch (`_create_batch`)."""
        self._tasks: set[asyncio.Future[None]] = set()
        self.lateness = DelayHistogram(LATENESS_EDGES_MS)
        """Per step's look at a schedule, ms from when it was planned (`_issue_at`: its next
        occurrence's issue) to the step that made it (the timer engine fires the occurrence
        itself: its own delivery error is the timer's)."""
        self.counts: Counter[str] = Counter()
        """issued, late (issued after their due time: catch-up), skipped (missed, not delivered: a
        cron schedule's counted up to `schedule_catch_up_max_occurrences` per outage or pause),
        withdrawn (cancelled by a change or at start-up), failed (sends refused)."""

    # -- open ----------------------------------------------------------------------------------

    def replay(self) -> int:
        """Rebuild the table from the schedules topic; return the records read."""
        if SCHEDULES_TOPIC not in self.store.topics:
            return 0
        cq = self.store.queue(SCHEDULES_TOPIC, 0)
        offset, replayed, n = cq.min_offset, records.Replayed(), 0
        while offset < cq.next_offset:
            entries = cq.read_range(offset, 1024)
            if not entries:
                break
            batch = []
            for off, position, size, _ in entries:
                msg = self.store.readable(position, size)
                if msg is not None:
                    batch.append((position, msg.body))
                offset = off + 1
            records.replay(batch, replayed)
            n += len(batch)
        self.table, self._deleted, self._positions = replayed.schedules, replayed.deleted, replayed.positions
        for s in self.table.values():
            self._plan(s)
        return n

    async def reconcile(self, now_ms: int) -> None:
        """At open, before the timer loop runs: withdraw issued occurrences a change replaced
        (a crash came between the change's record and the cancel), and those that came due while
        the broker was down that the catch-up policy does not deliver (module docstring, 4)."""
        async with self._lock:
            for name, (topic, pending) in list(self._deleted.items()):
                await self._withdraw(topic, name, pending, now_ms, at_open=True)
            self._deleted.clear()
            changed = []
            for s in self.table.values():
                if s.pending is None:
                    continue
                nominal, due, version = s.pending
                stale = s.paused or version != s.version
                missed = due <= now_ms and (
                    s.catch_up == "skip"
                    or (s.catch_up == "latest" and (n := s.recurrence.next_after(nominal)) is not None and n <= now_ms))
                if not (stale or missed) or not self._is_pending(s.topic, s.occurrence_id(nominal, version)):
                    continue
                if await self._withdraw(s.topic, s.name, s.pending, now_ms, at_open=True):
                    s.count -= 1
                    if stale:
                        s.after_ms = min(s.after_ms, nominal - 1)  # issued again under the new definition
                    else:
                        self.counts["skipped"] += 1
                    s.pending = None
                    changed.append(s)
                    self._plan(s)
            await self._append([records.progress_record(s) for s in changed], changed)

    # -- changes ---------------------------------------------------------------------------------

    async def create(self, name: str, topic: str, body: bytes, *, every_ms: int | None = None,
                     cron: str | None = None, zone: str = "UTC", start_ms: int | None = None,
                     end_ms: int | None = None, catch_up: str = "skip", jitter_ms: int = 0,
                     limit: int | None = None, tag: str | None = None,
                     properties: Mapping[str, str] | None = None) -> Schedule:
        """Make a schedule; durable when this returns, its first occurrence issued."""
        check_name(name)
        now = self.clock.now_ms()
        rec = Recurrence(every_ms=every_ms, cron=cron, zone=zone, start_ms=start_ms, end_ms=end_ms,
                         anchor_ms=_anchor(every_ms, start_ms, now))
        s = Schedule(name=name, topic=topic, body=body, recurrence=rec, catch_up=catch_up, jitter_ms=jitter_ms,
                     limit=limit, tag=tag, properties=dict(properties or {}), created_ms=now, updated_ms=now,
                     after_ms=now)
        # Creates that arrive together are made together (one put record append and one issue
        # for all of them, so they share group commits), each refused or made on its own.
        done: asyncio.Future[Schedule] = asyncio.get_running_loop().create_future()
        self._creating.append((s, now, done))
        if len(self._creating) == 1:
            self._tasks.add(task := asyncio.ensure_future(self._create_batch()))
            task.add_done_callback(self._tasks.discard)
        return await done

    async def _create_batch(self) -> None:
        async with self._lock:
            batch, self._creating = self._creating, []
            made: list[tuple[Schedule, asyncio.Future[Schedule]]] = []
            names: set[str] = set()
            for s, now, done in batch:
                try:
                    if s.name in self.table or s.name in names:
                        raise ScheduleExists(s.name)
                    if len(self.table) + len(made) >= self.config.schedule_max_count:
                        raise TooManySchedules(len(self.table) + len(made), self.config.schedule_max_count)
                    self._check(s, now)
                except ChronoqError as e:
                    if not done.done():
                        done.set_exception(e)
                    continue
                names.add(s.name)
                made.append((s, done))
            if not made:
                return
            schedules = [s for s, _ in made]
            try:
                await self._append([records.put_record(s) for s in schedules], schedules)
                for s in schedules:
                    self.table[s.name] = s
                await self._issue(schedules, self.clock.fire_horizon_ms())
            except BaseException as e:
                for _, done in made:
                    if not done.done():
                        done.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
                if not isinstance(e, Exception):
                    raise
                return
        self._changed.set()
        for s, done in made:
            if not done.done():
                done.set_result(s)

    async def update(self, name: str, change: ScheduleChange) -> Schedule:
        """Change a schedule; it applies from its next occurrence (the pending one is withdrawn
        and issued again under the new definition, unless it is already firing)."""
        now = self.clock.now_ms()
        async with self._lock:
            old = self._get(name)
            every, cron = old.recurrence.every_ms, old.recurrence.cron
            if change.every_ms is not None:
                every, cron = change.every_ms, None
            elif change.cron is not None:
                every, cron = None, change.cron
            start = change.start_ms if change.start_ms is not None else old.recurrence.start_ms
            rec = Recurrence(every_ms=every, cron=cron,
                             zone=change.zone if change.zone is not None else old.recurrence.zone,
                             start_ms=start,
                             end_ms=change.end_ms if change.end_ms is not None else old.recurrence.end_ms,
                             anchor_ms=old.recurrence.anchor_ms if every == old.recurrence.every_ms
                             and start == old.recurrence.start_ms else _anchor(every, start, now))
            new = replace(old, recurrence=rec, version=old.version + 1, updated_ms=now,
                          body=change.body if change.body is not None else old.body,
                          catch_up=change.catch_up if change.catch_up is not None else old.catch_up,
                          jitter_ms=change.jitter_ms if change.jitter_ms is not None else old.jitter_ms,
                          limit=change.limit if change.limit is not None else old.limit,
                          tag=change.tag if change.tag is not None else old.tag,
                          properties=dict(change.properties) if change.properties is not None else dict(old.properties))
            self._check(new, now)
            await self._append([records.put_record(new)], [new])
            self.table[name] = new
            await self._take_back_pending(new, now)
            await self._append([records.progress_record(new)], [new])
            if not new.paused:
                await self._issue([new], self.clock.fire_horizon_ms())
        self._changed.set()
        return new

    async def pause(self, name: str) -> Schedule:
        now = self.clock.now_ms()
        async with self._lock:
            s = self._get(name)
            if not s.paused:
                # A new version: an occurrence issued again after the resume gets a new id, never
                # the one of the occurrence the pause withdrew (its tombstone names that id).
                s.paused, s.version = True, s.version + 1
                s.updated_ms = now
                await self._append([records.put_record(s)], [s])
                await self._take_back_pending(s, now)
                await self._append([records.progress_record(s)], [s])
                self._plan(s)
        return s

    async def resume(self, name: str) -> Schedule:
        """Resume: occurrences that passed while paused are missed (`catch_up` decides)."""
        now = self.clock.now_ms()
        async with self._lock:
            s = self._get(name)
            if s.paused:
                s.paused, s.version = False, s.version + 1
                s.updated_ms = now
                await self._append([records.put_record(s)], [s])
                await self._issue([s], self.clock.fire_horizon_ms())
        self._changed.set()
        return s

    async def delete(self, name: str) -> Schedule:
        now = self.clock.now_ms()
        async with self._lock:
            s = self._get(name)
            await self._append([records.delete_record(s)], [s])
            del self.table[name]
            self._positions.pop(name, None)
            self._wake.pop(name, None)
            if s.pending is not None:
                await self._withdraw(s.topic, s.name, s.pending, now, at_open=False)
        return s

    def get(self, name: str) -> Schedule:
        return self._get(name)

    def list(self) -> list[Schedule]:
        return [self.table[n] for n in sorted(self.table)]

    def upcoming(self, name: str, count: int) -> list[int]:
        """The next `count` nominal occurrences not yet delivered: the pending one (if it has not
        come yet), then those after it, within the end and the limit."""
        s = self._get(name)
        now = self.clock.now_ms()
        out: list[int] = []
        if s.pending is not None and s.pending[0] > now:
            out.append(s.pending[0])
        left = None if s.limit is None else s.limit - s.count
        at = max(s.after_ms, now)
        while len(out) < count and (left is None or left > 0):
            nxt = s.recurrence.next_after(at)
            if nxt is None:
                break
            out.append(nxt)
            at = nxt
            if left is not None:
                left -= 1
        return out

    def _get(self, name: str) -> Schedule:
        s = self.table.get(name)
        if s is None:
            raise ScheduleNotFound(name)
        return s

    def _check(self, s: Schedule, now: int) -> None:
        """Every rule, before anything is written: the recurrence's, the topic's, the message's."""
        check(s.name, s.recurrence, now_ms=now, min_interval_ms=self.config.schedule_min_interval_ms,
              jitter_ms=s.jitter_ms, limit=s.limit, catch_up=s.catch_up)
        topic = self.accept.topics.for_send(s.topic)
        if MessageType.DELAY not in topic.message_types:
            raise MessageTypeNotAccepted(topic.name, MessageType.DELAY.name,
                                         sorted(t.name for t in topic.message_types))
        msg = self._message(s, now, now)
        prepare(msg, self.config, now, self.timer.levels)
        room = self.config.max_message_size_bytes - len(records.put_record(s)) - 1024
        if room < 0:
            raise InvalidSchedule(s.name, "body", f"{len(s.body)} bytes",
                                  f"with the schedule's fields is {-room} bytes too large for one record "
                                  "(max_message_size_bytes)")

    # -- issuing ---------------------------------------------------------------------------------

    def next_wake_ms(self) -> int | None:
        """When `step` next has work: the earliest nominal time of an issued occurrence (or of a
        retry, or of an occurrence coming within `timer_max_delay_ms`)."""
        while self._heap:
            wake, name = self._heap[0]
            if self._wake.get(name) == wake:
                return wake
            heapq.heappop(self._heap)
        return None

    def _plan(self, s: Schedule, wake: int | None = None) -> None:
        """Put `s` on the step's agenda at `wake`, by default at `_issue_at`; off it when paused
        or done."""
        if wake is None and not s.paused:
            wake = self._issue_at(s)
        if wake is None or s.paused:
            self._wake.pop(s.name, None)
            return
        self._wake[s.name] = wake
        heapq.heappush(self._heap, (wake, s.name))

    def _issue_at(self, s: Schedule) -> int | None:
        """When to issue the next occurrence of `s` (None: there is none): not before the one
        issued last is due (at most one ahead of time; with its jitter, that is still before the
        next's nominal time, the jitter being shorter than the gap), nor before the next comes
        within `timer_max_delay_ms`; from there, a fraction of the first half of the gap to the
        next, the same for a schedule every time (a hash of its name), so issues are spread
        over the gap rather than heaped on the instants occurrences come due, and at least half
        the gap is left to make the issue before the next is due; rounded up to the
        `ISSUE_GRID_MS` grid. An overdue next (catch-up): at once."""
        if s.limit is not None and s.count >= s.limit:
            return None
        nxt = s.recurrence.next_after(s.after_ms)
        if nxt is None:
            return None
        earliest = max(s.after_ms, s.pending[1]) if s.pending is not None else s.after_ms
        if nxt <= earliest:
            return earliest
        at = max(earliest + issue_offset_ms(s.name, nxt - earliest), nxt - self.config.timer_max_delay_ms)
        shared = -(-at // ISSUE_GRID_MS) * ISSUE_GRID_MS
        return shared if shared <= max(at, earliest + (nxt - earliest) // 2) else at

    async def step(self, now_ms: int) -> int:
        """Issue the next occurrence of every schedule whose time to issue it (`_issue_at`) has
        come by `now_ms`, and the missed ones its catch-up policy delivers; return how many were
        issued."""
        first = self.next_wake_ms()
        if first is None or first > now_ms:
            return 0
        async with self._lock:
            due: list[Schedule] = []
            while (wake := self.next_wake_ms()) is not None and wake <= now_ms:
                _, name = heapq.heappop(self._heap)
                self._wake.pop(name, None)
                s = self.table.get(name)
                if s is not None and not s.paused:
                    self.lateness.record(now_ms - wake)
                    due.append(s)
            issued = 0
            size = min(ISSUE_SLICE, self.config.max_send_batch)
            for i in range(0, len(due), size):
                issued += await self._issue(due[i:i + size], now_ms)
            return issued

    async def _issue(self, batch: list[Schedule], now_ms: int) -> int:
        """Issue, for each schedule of `batch`, what is due by `now_ms` (missed occurrences its
        policy delivers) and its next occurrence; then one `progress` record each."""
        msgs: list[OutgoingMessage] = []
        owners: list[tuple[Schedule, int, int]] = []  # (schedule, nominal, due)
        plans: dict[str, tuple[int, records.Pending | None, int, int | None]] = {}
        passed_over: dict[str, int] = {}
        max_ahead = self.config.timer_max_delay_ms
        for s in batch:
            after, count, pending = s.after_ms, s.count, s.pending
            rec = s.recurrence
            nxt = rec.next_after(after)
            issue: list[int] = []
            if nxt is not None and nxt <= now_ms:
                missed_latest = rec.latest_in(after, now_ms)
                if s.catch_up == "latest" and missed_latest is not None:
                    issue.append(missed_latest)
                elif s.catch_up == "all":
                    issue.extend(self._missed(rec, after, now_ms))
                passed_over[s.name] = max(0, self._count_missed(rec, after, now_ms) - len(issue))
                after = now_ms
                nxt = rec.next_after(now_ms)
            wake = None
            if nxt is not None and nxt - now_ms <= max_ahead:
                issue.append(nxt)
            elif nxt is not None:
                wake = nxt - max_ahead
            if s.limit is not None:
                issue = issue[:max(0, s.limit - count)]
            for nominal in issue:
                due = nominal + jitter_offset_ms(s.name, nominal, s.jitter_ms)
                owners.append((s, nominal, due))
                msgs.append(self._message(s, nominal, due))
                pending = (nominal, due, s.version)
                after = max(after, nominal)
                count += 1
            plans[s.name] = (after, pending, count, wake)
        fresh = [i for i, (s, nominal, _) in enumerate(owners)
                 if not self._is_known(s.topic, s.occurrence_id(nominal))]
        outcomes: list[Any] = []
        for j in range(0, len(fresh), self.config.max_send_batch):
            part = [msgs[i] for i in fresh[j:j + self.config.max_send_batch]]
            try:
                outcomes.extend(await self._send(part))
            except ChronoqError as e:  # the whole batch refused (a full disk): each is retried
                outcomes.extend([e] * len(part))
        failed: dict[str, str] = {}
        for i, outcome in zip(fresh, outcomes, strict=True):
            s, nominal, due = owners[i]
            if isinstance(outcome, ChronoqError):
                failed.setdefault(s.name, outcome.message)
                self.counts["failed"] += 1
                log.warning("schedule %r: its occurrence due at %d was refused: %s", s.name, nominal, outcome.message)
            elif isinstance(outcome, SendResult) and not outcome.duplicate:
                self.counts["issued"] += 1
                if due < now_ms:
                    self.counts["late"] += 1
        moved = []
        for s in batch:
            if s.name in failed:
                s.last_error = failed[s.name]
                self._plan(s, now_ms + RETRY_MS)
                continue
            after, pending, count, wake = plans[s.name]
            self.counts["skipped"] += passed_over.get(s.name, 0)
            if (after, pending, count) != (s.after_ms, s.pending, s.count):
                s.after_ms, s.pending, s.count = after, pending, count
                moved.append(s)
            s.last_error = None
            self._plan(s, wake)
        if moved:
            await self._append([records.progress_record(s) for s in moved], moved)
        return len(fresh) - len(failed)

    def _missed(self, rec: Recurrence, after: int, now_ms: int) -> list[int]:
        cap = self.config.schedule_catch_up_max_occurrences
        out: list[int] = []
        at = after
        while (n := rec.next_after(at)) is not None and n <= now_ms:
            out.append(n)
            if len(out) > cap:
                del out[:len(out) - cap]
            at = n
        return out

    def _count_missed(self, rec: Recurrence, after: int, now_ms: int) -> int:
        """How many occurrences lie in (after, now_ms]: exact for an interval; a cron schedule's
        are walked, at most `schedule_catch_up_max_occurrences` counted (what `all` walks too)."""
        if rec.every_ms is not None:
            first, last = rec.next_after(after), rec.latest_in(after, now_ms)
            return 0 if first is None or last is None or first > last else (last - first) // rec.every_ms + 1
        n, at = 0, after
        while n < self.config.schedule_catch_up_max_occurrences and (nxt := rec.next_after(at)) is not None \
                and nxt <= now_ms:
            n, at = n + 1, nxt
        return n

    def _message(self, s: Schedule, nominal: int, due: int) -> OutgoingMessage:
        return OutgoingMessage(s.topic, s.body, message_id=s.occurrence_id(nominal), tag=s.tag,
                               properties={**s.properties, PROP_SCHEDULE_NAME: s.name,
                                           PROP_SCHEDULE_DUE_MS: str(nominal)},
                               message_type=MessageType.DELAY, deliver_at_ms=due)

    def _is_known(self, topic: str, message_id: str) -> bool:
        """Whether this occurrence was sent already (pending or fired; a withdrawn one is not)."""
        return any(st.state is not TimerState.CANCELLED for st in self.timer.query(message_id, topic))

    def _is_pending(self, topic: str, message_id: str) -> bool:
        return any(st.state is TimerState.PENDING for st in self.timer.query(message_id, topic))

    async def _take_back_pending(self, s: Schedule, now_ms: int) -> None:
        """Withdraw the issued occurrence (a change replaces it): if withdrawn, occurrences from
        its time on are issued again; if it fired (or is firing), it stays delivered."""
        if s.pending is None:
            return
        nominal = s.pending[0]
        if await self._withdraw(s.topic, s.name, s.pending, now_ms, at_open=False):
            s.count -= 1
            s.after_ms = max(min(s.after_ms, nominal - 1), now_ms)
        else:
            s.after_ms = max(s.after_ms, nominal, now_ms)
        s.pending = None

    async def _withdraw(self, topic: str, name: str, pending: records.Pending, now_ms: int, *, at_open: bool) -> bool:
        """Cancel the occurrence `pending` of schedule `name`; True if it was withdrawn, False if
        it fired (or is firing) or is unknown. At open nothing fires yet, so an occurrence already
        due may still be withdrawn (`reconcile`)."""
        nominal, due, version = pending
        message_id = f"{name}@{nominal}.v{version}"
        horizon = min(now_ms, due - 1) if at_open else self.clock.fire_horizon_ms()
        try:
            await self.timer.cancel(topic, message_id, horizon, deliver_at_ms=due,
                                    then=functools.partial(self.accept.forget, topic, message_id))
        except ChronoqError as e:
            if not isinstance(e, TimerNotPending):
                log.info("schedule %r: its occurrence %s was not withdrawn: %s", name, message_id, e.message)
            return False
        self.counts["withdrawn"] += 1
        return True

    # -- the log -----------------------------------------------------------------------------------

    async def _append(self, bodies: list[bytes], owners: list[Schedule]) -> None:
        """Append one record per owner (message id: its name) and wait until durable; note where
        each owner's latest `put` lies (retention rolls a schedule whose `put` it would drop: a
        `progress` record alone does not make a schedule)."""
        if not bodies:
            return
        now = self.clock.now_ms()
        self.store.create_topic(SCHEDULES_TOPIC, 1, ALL_MESSAGE_TYPES, now, exist_ok=True)
        msgs = [PreparedMessage(SCHEDULES_TOPIC, owner.name, MessageType.NORMAL, body, now, queue_id=0)
                for body, owner in zip(bodies, owners, strict=True)]
        stored = await self.store.append_durable(msgs, now)
        for owner, body, rec in zip(owners, bodies, stored, strict=True):
            if body.startswith(records.PUT_PREFIX):
                self._positions[owner.name] = rec.position

    async def roll_before(self, position: int, now_ms: int) -> int:
        """Re-append (as `put`) every schedule whose latest record lies below `position`, so
        retention can delete those segments; return how many."""
        async with self._lock:
            old = [self.table[n] for n, p in self._positions.items() if p < position and n in self.table]
            for i in range(0, len(old), self.config.max_send_batch):
                part = old[i:i + self.config.max_send_batch]
                await self._append([records.put_record(s) for s in part], part)
            return len(old)

    # -- the loop ------------------------------------------------------------------------------------

    def poke(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        """Step whenever the earliest schedule's time comes by the fire horizon, forever."""
        while True:
            self._changed.clear()
            horizon = self.clock.fire_horizon_ms()
            wake = self.next_wake_ms()
            if wake is not None and wake <= horizon:
                await self.step(horizon)
                continue
            waits = [asyncio.ensure_future(self._changed.wait())]
            if wake is not None:
                waits.append(asyncio.ensure_future(self.clock.sleep_until_horizon(wake, horizon)))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def stats(self) -> dict[str, Any]:
        """Counts by state and of occurrences. A schedule on the step's agenda has an occurrence to
        come, so only the others are asked whether they are finished (a cron schedule's next
        occurrence costs about 0.1 ms to compute: a scrape of 100,000 must not pay it for each)."""
        paused = sum(1 for s in self.table.values() if s.paused)
        finished = sum(1 for s in self.table.values() if not s.paused and s.name not in self._wake and s.finished)
        return {"schedules": len(self.table), "paused": paused, "finished": finished,
                "active": len(self.table) - paused - finished, **{k: self.counts[k] for k in
                                                                    ("issued", "late", "skipped", "withdrawn",
                                                                     "failed")}}


def issue_offset_ms(name: str, gap_ms: int) -> int:
    """How long after the occurrence issued last came due schedule `name` issues its next, when
    `gap_ms` separate that due time from the next's nominal time: its own fraction (a hash of
    the name, in [0, 1)) of the first half of the gap, so a schedule's issues keep their place
    and different schedules' are spread evenly."""
    return (gap_ms // 2 * (zlib.crc32(name.encode()) & 0xFFFF)) >> 16


def _anchor(every_ms: int | None, start_ms: int | None, now_ms: int) -> int:
    """The first occurrence of an interval's grid: the start, or one interval from now."""
    if every_ms is None:
        return 0
    return start_ms if start_ms is not None else now_ms + every_ms
