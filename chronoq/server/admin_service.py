"""`chronoq.admin.v1.Admin`: topics, timer queries, searches and cancels, offset reads, stats, batch sends.

Theory of operation: a JSON-over-gRPC service beside MessagingService on the same port (the
RocketMQ v2 protocol has no admin RPCs). Each method is a unary RPC whose request and reply bodies
are UTF-8 JSON objects; the codec is `chronoq.protocol.admin`, and this module only calls the
broker. Errors are converted at one point (`_handler`): a `ChronoqError` becomes
`{"code", "message", "error", "retriable", "details"}` (details: the error's values for programs,
`protocol/admin.py` `details_json`), anything else a 50000 reply and a log line.

The web console (`chronoq/http/`) calls these same methods in process, so it has no second path
into the broker; SearchTimers (pending timers in a due-time range) and PendingByDue (counts per
bar, for its chart) exist for it, bounded by the `timer_search_*` and `timer_chart_max_bars`
limits, and serve programs as well.

Auth (`chronoq.server.auth`): each call is authenticated from its metadata like a RocketMQ call,
then each method asks the caller for what it needs before touching the broker: CreateTopic, Stats,
FireTimers, ArmTimers and QueryMessage by key are admin only (they span every topic); SendBatch needs publish
on every topic of the batch (one forbidden topic refuses the whole batch, nothing stored);
CancelMessage publish on the topic (by handle: the handle's topic, which must match a topic the
request also names); QueryMessage by id publish or subscribe on its topic (admin without one);
ReadMessages subscribe; DescribeTopic publish or subscribe; ListTopics lists only the topics the
caller may publish or subscribe to (any authenticated caller may list: the SDK's `ping`).

ReadMessages caps its reply by count (`max_send_batch`) and by bytes (`read_reply_budget_bytes`,
`READ_REPLY_MARGIN_BYTES` below gRPC's send limit, which follows `max_message_size_bytes`), always
carrying at least one message; it reads a few messages at a time, so the server never holds more
than about one reply (not a send batch of messages at the size limit). `next_offset` is where to
read on; `truncated` says the byte budget stopped the reply with messages left.

Schedules (recurring, `chronoq/recurring/`): CreateSchedule and UpdateSchedule need publish on
the schedule's topic, as its messages are sends; Pause, Resume and Delete publish on it too;
DescribeSchedule (with its next `count` occurrences, default 5) publish or subscribe; and
ListSchedules lists the schedules of the topics the caller may see. A schedule on a topic the
caller may neither publish to nor subscribe to is answered as one that does not exist
(ScheduleNotFound, "no schedule X", the same reply word for word), so a caller learns nothing
of the names on topics it has no rights on; one it may see but not change is Forbidden.

SendBatch reports per message: messages that fail to decode get their own error entry and the
rest go to `Broker.send_batch(partial=True)` in one durable write, which reports each message's
outcome in its slot (one bad message does not fail the others). Its optional `"create_topic":
true` asks for the batch's topics: a missing one whose name is near an existing topic's is
auto-created rather than refused (`chronoq/topics.py`; it needs no more than publish, as any
auto-create, and does nothing with auto-create off).

SendColumns is the bulk form of SendBatch, and the one method whose bodies are not JSON: up to
`max_bulk_send_rows` rows of one topic as packed columns (`chronoq/protocol/bulk.py`), judged per
row by the same admission (`Broker.send_columns`), stored in one durable write, answered with
result columns (a refusal of the whole request is the usual JSON error object). It needs publish
on its topic.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from array import array
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from chronoq.config import Config
from chronoq.errors import ChronoqError, Forbidden, InvalidBatchSize, ScheduleNotFound
from chronoq.model import OutgoingMessage
from chronoq.protocol import admin as codec
from chronoq.protocol import bulk
from chronoq.protocol.errors import InvalidField, MalformedRequest, MissingField
from chronoq.recurring.records import Schedule, ScheduleChange
from chronoq.server.auth import AUTH_OFF, Authenticator, Principal
from chronoq.server.grpc_service import authenticate
from chronoq.server.net import max_request_bytes
from chronoq.timefmt import duration
from chronoq.timer.recall import decode_recall_handle
from chronoq.validate import check_key, check_message_id, check_topic_name

if TYPE_CHECKING:
    from chronoq.broker import Broker  # the type only: the broker imports the store, the servers stay light

log = logging.getLogger(__name__)

Method = Callable[[dict[str, Any], Principal], Awaitable[dict[str, Any]]]

READ_REPLY_MARGIN_BYTES = 64 * 1024
"""Room for a ReadMessages reply's envelope (code, message, next_offset, truncated) between its
messages' byte budget and gRPC's send limit (`net.max_request_bytes`)."""


class AdminService:
    def __init__(self, broker: Broker, config: Config, authenticator: Authenticator | None = None) -> None:
        self.broker = broker
        self.config = config
        self.auth = authenticator or Authenticator(AUTH_OFF)
        self.read_reply_budget_bytes = max_request_bytes(config) - READ_REPLY_MARGIN_BYTES
        """The most encoded JSON of messages one ReadMessages reply carries: below gRPC's send
        limit (`max_request_bytes`, from `max_message_size_bytes`) by the reply's envelope."""

    def generic_handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, Method] = {
            "CreateTopic": self.create_topic, "ListTopics": self.list_topics, "DescribeTopic": self.describe_topic,
            "QueryMessage": self.query_message, "CancelMessage": self.cancel_message,
            "ReadMessages": self.read_messages, "Stats": self.stats, "SendBatch": self.send_batch,
            "FireTimers": self.fire_timers, "SearchTimers": self.search_timers, "PendingByDue": self.pending_by_due,
            "CreateSchedule": self.create_schedule, "UpdateSchedule": self.update_schedule,
            "PauseSchedule": self.pause_schedule, "ResumeSchedule": self.resume_schedule,
            "DeleteSchedule": self.delete_schedule, "ListSchedules": self.list_schedules,
            "DescribeSchedule": self.describe_schedule,
        }
        methods["ArmTimers"] = self.arm_timers  # the Spark engine's hand-off (below)
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(name, body))
                    for name, body in methods.items()}
        handlers[bulk.METHOD] = grpc.unary_unary_rpc_method_handler(self.send_columns)
        return grpc.method_handlers_generic_handler(codec.SERVICE_NAME, handlers)

    def _handler(self, name: str, body: Method) -> Callable[[bytes, Any], Awaitable[bytes]]:
        async def handle(data: bytes, context: Any) -> bytes:
            try:
                caller = authenticate(self.auth, context)
                reply = await body(codec.parse_request(name, data), caller)
            except ChronoqError as err:
                reply = codec.error_json(err)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.exception("admin %s failed", name)
                reply = codec.internal_json(err)
            return codec.encode_reply(reply)
        handle.__name__ = name
        return handle

    # -- topics ----------------------------------------------------------------------------------

    async def create_topic(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        caller.require_admin("CreateTopic")
        topic = await self.broker.create_topic(codec.arg_topic(doc, self.config, "name"),
                                               codec.arg_int(doc, "queue_count", required=False),
                                               codec.arg_message_types(doc))
        return codec.ok_json(topic=codec.topic_json(topic))

    async def list_topics(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        return codec.ok_json(topics=[codec.topic_json(t) for t in self.broker.list_topics() if caller.may_see(t.name)])

    async def describe_topic(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_topic(doc, self.config, "name")
        caller.require_see(name)
        topic = self.broker.get_topic(name)
        queues = []
        for queue_id in range(topic.queue_count):
            min_offset, next_offset = self.broker.queue_offsets(topic.name, queue_id)
            queues.append({"queue_id": queue_id, "min_offset": min_offset, "max_offset": next_offset})
        return codec.ok_json(topic=codec.topic_json(topic), queues=queues)

    # -- timers ----------------------------------------------------------------------------------

    async def query_message(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        message_id = codec.arg_str(doc, "message_id", required=False)
        key = codec.arg_str(doc, "key", required=False)
        if message_id:
            check_message_id(message_id, self.config)  # the rule of every door, before the index sees it
        elif key:
            check_key(key)
        topic = codec.arg_topic(doc, self.config) if doc.get("topic") is not None else None
        if topic is not None and message_id:
            caller.require_see(topic)
        else:
            caller.require_admin("QueryMessage without a topic")
        if message_id:
            statuses = self.broker.query(message_id, topic)
        elif key:
            statuses = self.broker.query_key(key)
        else:
            raise MissingField("message_id or key", "QueryMessage")
        return codec.ok_json(statuses=[codec.timer_status_json(s) for s in statuses])

    async def cancel_message(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        recall_handle = codec.arg_str(doc, "recall_handle", required=False)
        topic = codec.arg_topic(doc, self.config) if doc.get("topic") is not None else None
        if recall_handle:
            handle_topic = decode_recall_handle(recall_handle)[0]
            caller.require_publish([topic if topic is not None else handle_topic])
            message_id = await self.broker.cancel(recall_handle=recall_handle, topic=topic)
        else:
            topic = codec.arg_topic(doc, self.config)
            message_id = check_message_id(codec.arg_str(doc, "message_id"), self.config)
            caller.require_publish([topic])
            message_id = await self.broker.cancel(topic=topic, message_id=message_id)
        return codec.ok_json(message_id=message_id)

    async def search_timers(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        """Pending timers due in [from_ms, to_ms), of `topic` if given, earliest first. Bounded by
        `timer_search_max_range_ms`, `timer_search_max_rows` (or a smaller `limit`) and
        `timer_search_max_scanned`; `truncated` says a bound stopped it with more in the range.
        A topic's timers are for whoever may publish or subscribe to it; every topic's, admin only."""
        topic = codec.arg_topic(doc, self.config) if doc.get("topic") else None
        if topic is not None:
            caller.require_see(topic)
        else:
            caller.require_admin("SearchTimers without a topic")
        from_ms = codec.arg_stored_int(doc, "from_ms", "time in ms since 1970")
        to_ms = codec.arg_stored_int(doc, "to_ms", "time in ms since 1970")
        limit = codec.arg_int(doc, "limit", required=False) or self.config.timer_search_max_rows
        if to_ms <= from_ms:
            raise InvalidField("to_ms", f"the range must end after it starts ({from_ms} .. {to_ms})")
        max_range_ms = self.config.timer_search_max_range_ms
        if to_ms - from_ms > max_range_ms:
            raise InvalidField("to_ms", f"the range covers {duration(to_ms - from_ms)}, more than "
                                        f"timer_search_max_range_ms ({duration(max_range_ms)}); search a narrower one")
        if not 0 < limit <= self.config.timer_search_max_rows:
            raise InvalidField("limit", f"{limit} is not in 1..{self.config.timer_search_max_rows} "
                                        "(timer_search_max_rows)")
        if topic is not None:
            self.broker.get_topic(topic)  # TopicNotFound names an unknown topic
        entries, truncated = self.broker.pending_between(
            from_ms, to_ms, topic, limit, self.config.timer_search_max_scanned)
        return codec.ok_json(timers=[codec.timer_entry_json(e) for e in entries], truncated=truncated)

    async def pending_by_due(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        """Pending timers (all topics) per bar of `bar_s` seconds from `from_s` on, `bars` bars,
        from the index's per-second counters (no scan of the timers). Admin only: it spans topics."""
        caller.require_admin("PendingByDue")
        bar_s, bars = codec.arg_int(doc, "bar_s") or 0, codec.arg_int(doc, "bars") or 0
        from_s = codec.arg_int(doc, "from_s", required=False)
        if bar_s <= 0:
            raise InvalidField("bar_s", f"{bar_s} must be positive")
        if not 0 < bars <= self.config.timer_chart_max_bars:
            raise InvalidField("bars", f"{bars} is not in 1..{self.config.timer_chart_max_bars} (timer_chart_max_bars)")
        now_ms = self.broker.now_ms()
        if from_s is None:
            from_s = now_ms // 1000
        edges = [self.broker.pending_due_before_s(from_s + i * bar_s) for i in range(bars + 1)]
        total = self.broker.pending_total()
        return codec.ok_json(from_s=from_s, bar_s=bar_s, counts=[b - a for a, b in itertools.pairwise(edges)],
                             before=edges[0], after=total - edges[-1], total=total)

    async def fire_timers(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        """For the Spark timer engine: fire the pending timers whose records lie at these
        commit-log positions, if due. Idempotent: a position already fired is skipped."""
        caller.require_admin("FireTimers")
        positions = doc.get("positions")
        if not isinstance(positions, list) or not all(type(p) is int for p in positions):
            raise MalformedRequest("FireTimers", "'positions' must be a list of commit-log positions (integers)")
        if len(positions) > self.config.max_send_batch:
            raise InvalidBatchSize(len(positions), self.config.max_send_batch)
        for i, p in enumerate(positions):
            if not 0 <= p <= codec.MAX_STORED_INT:
                raise InvalidField(f"positions[{i}]", f"{codec.show_int(p)} is not a commit-log position "
                                                      "in 0..2^63-1")
        fired, skipped = await self.broker.fire_timers(positions)
        return codec.ok_json(fired=fired, skipped=skipped)

    # -- the Spark engine's hand-off ---------------------------------------------------------------

    async def arm_timers(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        """For the Spark timer engine: hand pending timers to the broker's loop before they are
        due (`timer/handoff.py`); each then fires at its due time. `timers`: a list of
        {"position", "topic", "message_id"} (the timer record's commit-log position and the
        timer it must be), at most `max_send_batch`. Admin only. Idempotent; per timer a
        `result`: armed, already_armed, or refused with a `reason`: fired, cancelled, damaged,
        unknown (`TimerService.arm`)."""
        caller.require_admin("ArmTimers")
        timers = doc.get("timers")
        if not isinstance(timers, list):
            raise MalformedRequest("ArmTimers", "'timers' must be a list of {position, topic, message_id}")
        if len(timers) > self.config.max_send_batch:
            raise InvalidBatchSize(len(timers), self.config.max_send_batch)
        wanted: list[tuple[int, str, str]] = []
        for i, t in enumerate(timers):
            if not isinstance(t, dict):
                raise InvalidField(f"timers[{i}]", "must be an object {position, topic, message_id}")
            position = t.get("position")
            if type(position) is not int or not 0 <= position <= codec.MAX_STORED_INT:
                raise InvalidField(f"timers[{i}].position",
                                   f"{codec.show_int(position) if type(position) is int else repr(position)} "
                                   "is not a commit-log position in 0..2^63-1")
            topic = codec.arg_topic(t, self.config)
            message_id = check_message_id(codec.arg_str(t, "message_id"), self.config)
            wanted.append((position, topic, message_id))
        results = await self.broker.arm_timers(wanted)
        counts = {name: 0 for name in ("armed", "already_armed", "fired", "cancelled", "damaged", "unknown")}
        out = []
        for (position, _, _), (result, reason) in zip(wanted, results, strict=True):
            counts[result] += 1
            out.append({"position": position, "result": result} if reason is None
                       else {"position": position, "result": result, "reason": reason})
        return codec.ok_json(results=out, **counts)

    # -- reads, stats, sends ---------------------------------------------------------------------

    async def read_messages(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        topic = codec.arg_topic(doc, self.config)
        if not caller.may_subscribe(topic):
            raise Forbidden.permission(caller.name, "read (subscribe to)", f"topic {topic!r}")
        queue_id = codec.arg_int(doc, "queue_id") or 0
        offset = codec.arg_int(doc, "offset") or 0
        max_messages = codec.arg_int(doc, "max_messages") or 0
        if max_messages <= 0:
            raise InvalidField("max_messages", f"{max_messages} must be positive")
        entries, next_offset, truncated = await self._read_within_budget(
            topic, queue_id, offset, min(max_messages, self.config.max_send_batch))
        return codec.ok_json(messages=entries, next_offset=next_offset, truncated=truncated)

    async def _read_within_budget(self, topic: str, queue_id: int, offset: int,
                                  want: int) -> tuple[list[dict[str, Any]], int, bool]:
        """ReadMessages' reply: at most `want` messages (a send batch's worth) and at most
        `read_reply_budget_bytes` of encoded JSON, so the reply fits gRPC's send limit whatever
        the messages' sizes; the first message always goes (one message at the size limit fits
        alone), so a caller pages past a big one. Read a few at a time, never more than the
        budget left could hold at the message size limit, so the server holds at most about one
        reply's worth (not `want` messages of 4 MiB). Returns (entries, next_offset, truncated):
        `truncated` says the byte budget stopped the reply with messages left before `want`."""
        budget, max_size = self.read_reply_budget_bytes, self.config.max_message_size_bytes
        entries: list[dict[str, Any]] = []
        used, next_offset = 0, offset
        while len(entries) < want:
            chunk = max(1, min(want - len(entries), (budget - used) // max_size))
            messages = await self.broker.read(topic, queue_id, next_offset, chunk)
            if not messages:
                break
            for m in messages:
                entry = codec.stored_message_json(m)
                size = codec.encoded_size(entry) + 1  # the comma between entries
                if entries and used + size > budget:
                    return entries, next_offset, True
                entries.append(entry)
                used += size
                next_offset = m.queue_offset + 1
        return entries, next_offset, False

    async def stats(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        caller.require_admin("Stats")
        return codec.ok_json(**self.broker.stats())

    # -- schedules ----------------------------------------------------------------------------------

    async def create_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        topic = codec.arg_topic(doc, self.config)
        caller.require_publish({topic})
        spec = codec.schedule_spec_from_json(doc)
        body = spec.pop("body", None)
        if body is None:
            raise MissingField("body_b64")
        s = await self.broker.create_schedule(name, topic, body, **spec)
        return codec.ok_json(schedule=codec.schedule_json(s, self.broker.schedule_upcoming(s.name, 5)))

    async def update_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        self._schedule(name, caller, change=True)
        s = await self.broker.update_schedule(name, ScheduleChange(**codec.schedule_spec_from_json(doc)))
        return codec.ok_json(schedule=codec.schedule_json(s, self.broker.schedule_upcoming(s.name, 5)))

    async def pause_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        self._schedule(name, caller, change=True)
        return codec.ok_json(schedule=codec.schedule_json(await self.broker.pause_schedule(name)))

    async def resume_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        self._schedule(name, caller, change=True)
        s = await self.broker.resume_schedule(name)
        return codec.ok_json(schedule=codec.schedule_json(s, self.broker.schedule_upcoming(s.name, 5)))

    async def delete_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        self._schedule(name, caller, change=True)
        return codec.ok_json(schedule=codec.schedule_json(await self.broker.delete_schedule(name)))

    def _schedule(self, name: str, caller: Principal, *, change: bool) -> Schedule:
        """The schedule `name` for a caller who may see it (publish or subscribe on its topic)
        and, to `change` it, publish. One on a topic the caller may not see is ScheduleNotFound,
        as a name that does not exist: a refusal naming its topic would tell that it exists."""
        s = self.broker.get_schedule(name)
        if not caller.may_see(s.topic):
            raise ScheduleNotFound(name)
        if change:
            caller.require_publish({s.topic})
        return s

    async def list_schedules(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        return codec.ok_json(schedules=[codec.schedule_json(s) for s in self.broker.list_schedules()
                                        if caller.may_see(s.topic)])

    async def describe_schedule(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        name = codec.arg_str(doc, "name")
        s = self._schedule(name, caller, change=False)
        count = codec.arg_int(doc, "count", required=False) or 5
        if not 1 <= count <= 1000:
            raise InvalidField("count", "must be 1..1000")
        return codec.ok_json(schedule=codec.schedule_json(s, self.broker.schedule_upcoming(name, count)))

    async def send_batch(self, doc: dict[str, Any], caller: Principal) -> dict[str, Any]:
        entries = doc.get("messages")
        if not isinstance(entries, list):
            raise MalformedRequest("SendBatch", "'messages' must be a list")
        if not 1 <= len(entries) <= self.config.max_send_batch:
            raise InvalidBatchSize(len(entries), self.config.max_send_batch)
        create_near_topics = codec.arg_bool(doc, "create_topic")
        results: list[dict[str, Any] | None] = [None] * len(entries)
        decoded: list[tuple[int, OutgoingMessage]] = []
        for i, entry in enumerate(entries):
            try:
                decoded.append((i, codec.message_from_json(entry, self.config)))
            except ChronoqError as err:
                results[i] = {"error": codec.error_json(err)}
        caller.require_publish({m.topic for _, m in decoded})
        if decoded:
            outcomes = await self.broker.send_batch([m for _, m in decoded], partial=True,
                                                    create_near_topics=create_near_topics)
            for (i, _), outcome in zip(decoded, outcomes, strict=True):
                results[i] = ({"error": codec.error_json(outcome)} if isinstance(outcome, ChronoqError)
                              else codec.send_result_json(outcome))
        return codec.ok_json(results=results)

    # -- bulk sends: SendColumns (binary frames, `protocol/bulk.py`) ----------------------------------

    async def send_columns(self, data: bytes, context: Any) -> bytes:
        """SendColumns: rows of one topic as packed columns, each row judged alone (as SendBatch's
        messages), in one durable write. The reply is the binary result columns, or an admin JSON
        error object for a refusal of the whole request (authentication, publish rights on the
        topic, a frame that cannot be read, too many rows). A topic name the rules refuse is each
        row's error, as it is each message's in SendBatch."""
        try:
            caller = authenticate(self.auth, context)
            req = bulk.decode_request(data)
            n = len(req.ids)
            if not 1 <= n <= self.config.max_bulk_send_rows:
                raise InvalidBatchSize(n, self.config.max_bulk_send_rows)
            try:
                check_topic_name(req.topic, self.config)
            except ChronoqError:
                pass  # every row's error, from admission
            else:
                caller.require_publish([req.topic])
            refused: dict[int, ChronoqError] = {row: InvalidField(name, reason)
                                                for row, (name, reason) in req.row_errors.items()}
            due_kind = {bulk.DUE_NONE: None, bulk.DUE_AT: "deliver_at_ms", bulk.DUE_DELAY: "delay_ms"}[req.due_kind]
            outcomes = await self.broker.send_columns(
                req.topic, req.ids, req.bodies, due_kind=due_kind, due=req.due, tags=req.tags, keys=req.keys,
                properties=req.properties, refused=refused, create_near_topics=req.create_topic)
            return bulk_reply(outcomes)
        except ChronoqError as err:
            reply = codec.error_json(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("admin %s failed", bulk.METHOD)
            reply = codec.internal_json(err)
        return codec.encode_reply(reply)


def bulk_reply(outcomes: list[Any]) -> bytes:
    """A SendColumns reply from the broker's per-row outcomes (`SendResult` or `ChronoqError`)."""
    n = len(outcomes)
    status = bytearray(n)
    queue_ids = array("i", bytes(4 * n))
    offsets = array("q", bytes(8 * n))
    due = array("q", bytes(8 * n))
    errors: list[tuple[int, dict[str, Any]]] = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, ChronoqError):
            status[i] = bulk.REFUSED
            queue_ids[i] = offsets[i] = due[i] = -1
            errors.append((i, codec.error_json(outcome)))
            continue
        status[i] = (bulk.DUPLICATE if outcome.duplicate else bulk.STORED) | (
            bulk.HAS_HANDLE if outcome.recall_handle is not None else 0)
        queue_ids[i] = outcome.queue_id
        offsets[i] = outcome.queue_offset
        due[i] = -1 if outcome.deliver_at_ms is None else outcome.deliver_at_ms
    return bulk.encode_reply(status, queue_ids, offsets, due, errors)
