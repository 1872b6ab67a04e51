"""`AsyncAdmin`: topics, timer queries, cancel by id, stats and read by offset; the base of both clients.

Theory of operation: each method is one call of chronoq's admin service (JSON bodies, through
`Connection._admin`) or, for `recall`, RocketMQ's RecallMessage (`Connection._rpc`), under the
SDK's retry policy (`client/retry.py`): a read after any retriable failure, a call that changes
something (create_topic, cancel, recall) only when the broker refused it. The values come back
as `chronoq.client.types`, converted by `chronoq.client.wire`.

Apart from `client/connection.py` (the channel, credentials, error translation) because these
are what the server offers, not how a call reaches it; `AsyncProducer` and `AsyncConsumer`
(`client/producer.py`, `client/consumer.py`) extend it, so every client can ask these.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from chronoq.client import wire
from chronoq.client.connection import Connection
from chronoq.client.retry import retrying
from chronoq.client.types import (
    ArmOutcome,
    ArmResult,
    FireOutcome,
    ReadResult,
    TimerInfo,
    TopicDescription,
    TopicInfo,
)
from chronoq.protocol.v2 import definition as pb
from chronoq.protocol.v2 import service as svc
from chronoq.timer.recall import encode_recall_handle


class AsyncAdmin(Connection):
    """Topics, timer queries, cancel by id, stats and read by offset; the base of both clients."""

    async def ping(self) -> None:
        """One cheap admin round trip; raises `ServerUnavailable` while the server is not up."""
        await self._admin("ListTopics", {})

    # -- topics --------------------------------------------------------------------------------

    async def create_topic(self, name: str, queue_count: int | None = None,
                           message_types: Iterable[str] | None = None) -> TopicInfo:
        body: dict[str, Any] = {"name": name}
        if queue_count is not None:
            body["queue_count"] = queue_count
        if message_types is not None:
            body["message_types"] = wire.message_type_names(message_types)
        reply = await self._admin_retried("CreateTopic", body, after_unknown=False)
        return wire._shape("CreateTopic", lambda r: wire.topic_from_json(r["topic"]), reply)

    async def list_topics(self) -> list[TopicInfo]:
        return wire.topics_from_json(await self._admin_retried("ListTopics", {}, after_unknown=True))

    async def describe_topic(self, name: str) -> TopicDescription:
        return wire.description_from_json(await self._admin_retried("DescribeTopic", {"name": name},
                                                                    after_unknown=True))

    # -- timers --------------------------------------------------------------------------------

    async def query(self, message_id: str, topic: str | None = None) -> list[TimerInfo]:
        """What the server knows about a timer message (empty: no timer by that id)."""
        body = {"message_id": message_id} if topic is None else {"message_id": message_id, "topic": topic}
        return wire.statuses_from_json(await self._admin_retried("QueryMessage", body, after_unknown=True))

    async def query_key(self, key: str) -> list[TimerInfo]:
        return wire.statuses_from_json(await self._admin_retried("QueryMessage", {"key": key}, after_unknown=True))

    async def cancel(self, topic: str, message_id: str, *, deliver_at: datetime | int | None = None) -> str:
        """Cancel a pending timer message by id; returns the id. Raises `TimerAlreadyFired`,
        `TimerNotFound`... when it is too late or unknown, and `TimerIdAmbiguous` (its details list
        each one's due time and recall handle) when several timers of the id are pending.
        `deliver_at` (its due time as the server fixed it: a receipt's `deliver_at_ms`, a `query`
        row's, or the ambiguity's details) names one of them: the cancel then reaches that timer
        only, as its recall handle would."""
        if deliver_at is not None:
            handle = encode_recall_handle(topic, wire.deliver_at_to_ms(deliver_at), message_id)
            body: dict[str, Any] = {"recall_handle": handle, "topic": topic}
        else:
            body = {"topic": topic, "message_id": message_id}
        reply = await self._admin_retried("CancelMessage", body, after_unknown=False)
        return wire._shape("CancelMessage", lambda r: str(r["message_id"]), reply)

    async def cancel_handle(self, recall_handle: str) -> str:
        """Cancel by recall handle through the admin service (no topic needed)."""
        reply = await self._admin_retried("CancelMessage", {"recall_handle": recall_handle}, after_unknown=False)
        return wire._shape("CancelMessage", lambda r: str(r["message_id"]), reply)

    async def recall(self, topic: str, handle: str) -> str:
        """RocketMQ's RecallMessage: cancel a timer message by the handle its send returned."""
        req = svc.RecallMessageRequest(topic=pb.Resource(name=topic), recall_handle=handle)

        async def attempt(_unknown: bool) -> str:
            resp = await self._rpc("RecallMessage", req)
            wire.check_status("RecallMessage", resp.status)
            return str(resp.message_id)

        return await retrying(self.attempts, attempt, after_unknown=False)

    # -- observation ---------------------------------------------------------------------------

    # -- recurring schedules (the admin service's *Schedule calls; replies as JSON objects) -------

    async def create_schedule(self, name: str, topic: str, body: bytes, *, every_ms: int | None = None,
                              cron: str | None = None, zone: str | None = None, start_ms: int | None = None,
                              end_ms: int | None = None, catch_up: str | None = None, jitter_ms: int | None = None,
                              limit: int | None = None, tag: str | None = None,
                              properties: dict[str, str] | None = None) -> dict[str, Any]:
        """Create a recurring schedule (`every_ms` or `cron` [6 fields: seconds first], `zone` an
        IANA name); returns it with its next occurrences (`upcoming_ms`)."""
        req = _schedule_fields(body=body, every_ms=every_ms, cron=cron, zone=zone, start_ms=start_ms, end_ms=end_ms,
                               catch_up=catch_up, jitter_ms=jitter_ms, limit=limit, tag=tag, properties=properties)
        reply = await self._admin_retried("CreateSchedule", {"name": name, "topic": topic, **req}, after_unknown=False)
        return dict(reply["schedule"])

    async def update_schedule(self, name: str, *, body: bytes | None = None, every_ms: int | None = None,
                              cron: str | None = None, zone: str | None = None, start_ms: int | None = None,
                              end_ms: int | None = None, catch_up: str | None = None, jitter_ms: int | None = None,
                              limit: int | None = None, tag: str | None = None,
                              properties: dict[str, str] | None = None) -> dict[str, Any]:
        """Change a schedule (only what is given); applies from its next occurrence."""
        req = _schedule_fields(body=body, every_ms=every_ms, cron=cron, zone=zone, start_ms=start_ms, end_ms=end_ms,
                               catch_up=catch_up, jitter_ms=jitter_ms, limit=limit, tag=tag, properties=properties)
        reply = await self._admin_retried("UpdateSchedule", {"name": name, **req}, after_unknown=False)
        return dict(reply["schedule"])

    async def pause_schedule(self, name: str) -> dict[str, Any]:
        return dict((await self._admin_retried("PauseSchedule", {"name": name}, after_unknown=False))["schedule"])

    async def resume_schedule(self, name: str) -> dict[str, Any]:
        return dict((await self._admin_retried("ResumeSchedule", {"name": name}, after_unknown=False))["schedule"])

    async def delete_schedule(self, name: str) -> dict[str, Any]:
        return dict((await self._admin_retried("DeleteSchedule", {"name": name}, after_unknown=False))["schedule"])

    async def list_schedules(self) -> list[dict[str, Any]]:
        return [dict(s) for s in (await self._admin_retried("ListSchedules", {}, after_unknown=True))["schedules"]]

    async def describe_schedule(self, name: str, count: int = 5) -> dict[str, Any]:
        """A schedule and its next `count` occurrences (`upcoming_ms`, nominal due times)."""
        reply = await self._admin_retried("DescribeSchedule", {"name": name, "count": count}, after_unknown=True)
        return dict(reply["schedule"])

    async def stats(self) -> dict[str, Any]:
        reply = await self._admin_retried("Stats", {}, after_unknown=True)
        return {k: v for k, v in reply.items() if k not in ("code", "message")}

    async def read(self, topic: str, queue_id: int, offset: int, max_messages: int = 32) -> ReadResult:
        """Messages of one queue from a logical offset, without consuming them; each carries
        its commit-log `position`."""
        body = {"topic": topic, "queue_id": queue_id, "offset": offset, "max_messages": max_messages}
        return wire.read_from_json(await self._admin_retried("ReadMessages", body, after_unknown=True))

    async def fire_timers(self, positions: Sequence[int]) -> FireOutcome:
        """Fire the pending timers recorded at these commit-log positions, if due (for a timer
        engine outside the broker, `timer_engine = "spark"`). Idempotent: a position that already
        fired, or is not pending, is skipped. At most the server's `max_send_batch` positions."""
        checked = [wire.nonnegative_int("position", p) for p in positions]
        reply = await self._admin("FireTimers", {"positions": checked})
        return FireOutcome(int(reply.get("fired", 0)), int(reply.get("skipped", 0)))

    async def arm_timers(self, timers: Sequence[tuple[int, str, str]]) -> ArmOutcome:
        """Hand pending timers, each (commit-log position, topic, message id), to the broker's own
        loop, which then fires each at its due time (the Spark engine's hand-off, with
        `timer_firer = "spark"`). Idempotent, so retried like a read. At most the server's
        `max_send_batch` timers; per timer an `ArmResult`."""
        body = [{"position": wire.nonnegative_int("position", p), "topic": t, "message_id": m} for p, t, m in timers]
        reply = await self._admin_retried("ArmTimers", {"timers": body}, after_unknown=True)
        return ArmOutcome(tuple(ArmResult(int(r["position"]), str(r["result"]), r.get("reason"))
                                for r in reply.get("results", [])))


def _schedule_fields(*, body: bytes | None, **fields: Any) -> dict[str, Any]:
    out = {k: v for k, v in fields.items() if v is not None}
    if body is not None:
        out["body_b64"] = base64.b64encode(body).decode()
    return out
