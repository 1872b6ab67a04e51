"""chronoq.admin.v1.Admin (JSON over gRPC) over a real Broker."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

from server_harness import running


def run(coro) -> None:
    asyncio.run(coro)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_topics_create_list_describe(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            created = await h.admin("CreateTopic", {"name": "orders", "queue_count": 2,
                                                    "message_types": ["NORMAL", "delay"]})
            assert created["code"] == 20000, created
            assert created["topic"]["name"] == "orders"
            assert created["topic"]["queue_count"] == 2
            assert created["topic"]["message_types"] == ["NORMAL", "DELAY"]
            again = await h.admin("CreateTopic", {"name": "orders"})
            assert again["code"] == 40000 and again["error"] == "TopicExists" and again["retriable"] is False
            listed = await h.admin("ListTopics", {})
            assert [t["name"] for t in listed["topics"]] == ["orders"]
            described = await h.admin("DescribeTopic", {"name": "orders"})
            assert described["queues"] == [{"queue_id": 0, "min_offset": 0, "max_offset": 0},
                                           {"queue_id": 1, "min_offset": 0, "max_offset": 0}]
            missing = await h.admin("DescribeTopic", {"name": "nope"})
            assert (missing["code"], missing["error"]) == (40402, "TopicNotFound")
            assert missing["details"]["topic"] == "nope"  # the error's values, for programs
            bad = await h.admin("CreateTopic", {"name": "x", "message_types": ["LITE"]})
            assert bad["code"] == 40000 and "LITE" in bad["message"]
    run(body())


def test_send_batch_reports_each_message_and_read_returns_them(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.admin("CreateTopic", {"name": "orders", "queue_count": 1})
            reply = await h.admin("SendBatch", {"messages": [
                {"topic": "orders", "body_b64": b64(b"one"), "message_id": "ID-1", "tag": "A", "keys": ["k1"],
                 "properties": {"p": "v"}},
                {"topic": "bad topic", "body_b64": b64(b"x")},
                {"topic": "orders", "body_b64": b64(b"")},
                {"topic": "orders", "body_b64": b64(b"two"), "message_id": "ID-2"},
                {"topic": "orders", "body_b64": b64(b"three"), "message_id": "ID-1"},
            ]})
            assert reply["code"] == 20000, reply
            results = reply["results"]
            assert results[0]["message_id"] == "ID-1" and results[0]["duplicate"] is False
            assert results[1]["error"]["error"] == "InvalidTopicName"
            assert results[2]["error"]["code"] == 41302
            assert results[3]["message_id"] == "ID-2"
            assert results[4]["duplicate"] is True
            read = await h.admin("ReadMessages", {"topic": "orders", "queue_id": 0, "offset": 0, "max_messages": 10})
            assert read["next_offset"] == 2
            assert [(m["message_id"], base64.b64decode(m["body_b64"])) for m in read["messages"]] == [
                ("ID-1", b"one"), ("ID-2", b"two")]
            assert read["messages"][0]["tag"] == "A" and read["messages"][0]["properties"] == {"p": "v"}
            tail = await h.admin("ReadMessages", {"topic": "orders", "queue_id": 0, "offset": 2, "max_messages": 10})
            assert (tail["messages"], tail["next_offset"]) == ([], 2)
            bad_queue = await h.admin("ReadMessages", {"topic": "orders", "queue_id": 5, "offset": 0,
                                                       "max_messages": 1})
            assert bad_queue["error"] == "InvalidQueueId"
    run(body())


def test_query_and_cancel_a_timer(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            due_ms = time.time_ns() // 1_000_000 + 60_000
            reply = await h.admin("SendBatch", {"messages": [
                {"topic": "t", "body_b64": b64(b"a"), "message_id": "T-1", "deliver_at_ms": due_ms},
                {"topic": "t", "body_b64": b64(b"b"), "message_id": "T-2", "delay_ms": 60_000, "keys": ["kk"]}]})
            first, second = reply["results"]
            assert first["deliver_at_ms"] == due_ms and first["recall_handle"]
            status = await h.admin("QueryMessage", {"message_id": "T-1", "topic": "t"})
            assert [(s["state"], s["deliver_at_ms"]) for s in status["statuses"]] == [("pending", due_ms)]
            by_key = await h.admin("QueryMessage", {"key": "kk"})
            assert [s["message_id"] for s in by_key["statuses"]] == ["T-2"]
            cancelled = await h.admin("CancelMessage", {"topic": "t", "message_id": "T-1"})
            assert cancelled == {"code": 20000, "message": "OK", "message_id": "T-1"}
            by_handle = await h.admin("CancelMessage", {"recall_handle": second["recall_handle"]})
            assert by_handle["message_id"] == "T-2"
            states = await h.admin("QueryMessage", {"message_id": "T-2"})
            assert [s["state"] for s in states["statuses"]] == ["cancelled"]
            twice = await h.admin("CancelMessage", {"topic": "t", "message_id": "T-1"})
            assert twice["code"] == 42800
            neither = await h.admin("QueryMessage", {})
            assert neither["code"] == 40000 and "message_id or key" in neither["message"]
    run(body())


def test_stats_and_malformed_requests(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            stats = await h.admin("Stats", {})
            assert stats["code"] == 20000 and "timer" in stats and "commitlog" in stats
            for raw in (b"not json", b"[1, 2]", b"\xff\xfe"):
                reply = await h.admin("Stats", raw)
                assert (reply["code"], reply["error"]) == (40000, "MalformedRequest"), reply
            wrong = await h.admin("ReadMessages", {"topic": "t", "queue_id": "0", "offset": 0, "max_messages": 1})
            assert wrong["error"] == "InvalidField" and "queue_id" in wrong["message"]
            empty = await h.admin("SendBatch", {"messages": []})
            assert empty["error"] == "InvalidBatchSize"
    run(body())
