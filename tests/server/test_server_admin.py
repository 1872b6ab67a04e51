"""chronoq.admin.v1.Admin (JSON over gRPC) over a real Broker."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

from chronoq.server.auth import ANONYMOUS
from tests.support.grpc_server import running


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


def test_read_messages_caps_its_reply_by_bytes_and_pages_past_big_messages(tmp_path: Path) -> None:
    """Large messages: a reply holds what fits in the byte budget below gRPC's send limit, says
    `truncated`, and `next_offset` pages on; before, 12 messages of 250 KiB made one reply of 4 MiB,
    over the 1.5 MiB limit of this config, and the call always failed."""
    from chronoq.model import OutgoingMessage
    from chronoq.server.admin_service import AdminService
    from chronoq.server.net import max_request_bytes

    async def body() -> None:
        async with running(tmp_path, max_message_size_bytes=256 * 1024, flush="async") as h:
            await h.broker.create_topic("big", 1)
            sizes = [250 * 1024] * 6 + [10] * 3 + [250 * 1024] * 3
            await h.broker.send_batch([OutgoingMessage(topic="big", body=bytes([i]) * n) for i, n in enumerate(sizes)])
            got: list[int] = []
            offset, replies = 0, 0
            while offset < len(sizes):
                raw = await h.channel.unary_unary("/chronoq.admin.v1.Admin/ReadMessages")(
                    json.dumps({"topic": "big", "queue_id": 0, "offset": offset, "max_messages": 1024}).encode(),
                    timeout=10)
                assert len(raw) <= max_request_bytes(h.broker.config)
                reply = json.loads(raw)
                assert reply["code"] == 20000, reply
                got += [m["queue_offset"] for m in reply["messages"]]
                assert [base64.b64decode(m["body_b64"]) for m in reply["messages"]] == \
                    [bytes([i]) * sizes[i] for i in range(offset, reply["next_offset"])]
                assert reply["truncated"] is (reply["next_offset"] < len(sizes))
                offset, replies = reply["next_offset"], replies + 1
            assert got == list(range(len(sizes))) and 3 <= replies <= 5

            # A budget smaller than any message: one message per reply, never none.
            admin = AdminService(h.broker, h.broker.config)
            admin.read_reply_budget_bytes = 1
            for offset in range(len(sizes)):
                reply = await admin.read_messages({"topic": "big", "queue_id": 0, "offset": offset,
                                                   "max_messages": 5}, ANONYMOUS)
                assert [m["queue_offset"] for m in reply["messages"]] == [offset]
                assert reply["next_offset"] == offset + 1 and reply["truncated"] is (offset + 1 < len(sizes))
    run(body())


def test_query_and_cancel_check_ids_and_keys_like_every_door(tmp_path: Path) -> None:
    """A message id or key no message can carry gets the same specific error as through the
    gRPC path (before: a 100,000-character one reached the index and came back 50000, an empty
    or control-character id a TimerNotFound)."""
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.admin("CreateTopic", {"name": "t1"})
            long_id, long_key = "a" * 100_000, "k" * 100_000
            cases = [
                ("QueryMessage", {"message_id": long_id, "topic": "t1"}, "InvalidMessageId", "max_message_id_length"),
                ("QueryMessage", {"message_id": long_id}, "InvalidMessageId", "max_message_id_length"),
                ("QueryMessage", {"message_id": "a\x00b", "topic": "t1"}, "InvalidMessageId", "printable ASCII"),
                ("QueryMessage", {"key": long_key}, "InvalidKeys", "the record format allows 65535"),
                ("QueryMessage", {"key": "a\x00b"}, "InvalidKeys", "control characters"),
                ("CancelMessage", {"message_id": long_id, "topic": "t1"}, "InvalidMessageId", "max_message_id_length"),
                ("CancelMessage", {"message_id": "a\x00b", "topic": "t1"}, "InvalidMessageId", "printable ASCII"),
                ("CancelMessage", {"message_id": "", "topic": "t1"}, "InvalidMessageId", "empty"),
            ]
            for method, doc, error, says in cases:
                reply = await h.admin(method, doc)
                assert reply["code"] in (40005, 40009) and reply["error"] == error, (method, reply)
                assert says in reply["message"] and len(reply["message"]) < 300, reply
            # Well-formed ids and keys are still looked up.
            assert (await h.admin("QueryMessage", {"message_id": "no-such-id", "topic": "t1"}))["statuses"] == []
            assert (await h.admin("QueryMessage", {"key": "no-such-key"}))["statuses"] == []
    run(body())


def test_search_and_fire_refuse_times_and_positions_beyond_what_is_stored(tmp_path: Path) -> None:
    """Integers past 2^63 reached the timer index's encoder and came back as a false
    TimerIndexCorrupt (50001); they are a bad request naming the field, and the index is fine."""
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.admin("CreateTopic", {"name": "t1"})
            now = h.broker.clock.now_ms()
            cases = [
                ("SearchTimers", {"from_ms": 2**70, "to_ms": 2**70 + 1}, "from_ms", "1180591620717411303424 is not a"),
                ("SearchTimers", {"from_ms": 2**63, "to_ms": 2**63 + 1}, "from_ms", "is not a time in ms since 1970"),
                ("SearchTimers", {"from_ms": now, "to_ms": 2**63}, "to_ms", "9223372036854775808 is not a time"),
                ("SearchTimers", {"from_ms": -1, "to_ms": 5}, "from_ms", "-1 is not a time in ms since 1970"),
                ("SearchTimers", {"from_ms": 10**40, "to_ms": 1}, "from_ms", "a 41-digit number is not"),
                ("FireTimers", {"positions": [0, 2**70]}, "positions[1]", "is not a commit-log position in 0..2^63-1"),
                ("FireTimers", {"positions": [-1]}, "positions[0]", "-1 is not a commit-log position"),
                ("ArmTimers", {"timers": [{"position": 2**70, "topic": "t1", "message_id": "m"}]},
                 "timers[0].position", "is not a commit-log position in 0..2^63-1"),
                ("ArmTimers", {"timers": [{"position": "7", "topic": "t1", "message_id": "m"}]},
                 "timers[0].position", "'7' is not a commit-log position"),
                ("ArmTimers", {"timers": [5]}, "timers[0]", "must be an object {position, topic, message_id}"),
            ]
            for method, doc, field, says in cases:
                reply = await h.admin(method, doc)
                assert (reply["code"], reply["error"]) == (40000, "InvalidField"), (method, doc, reply)
                assert reply["details"]["field"] == field and says in reply["message"], reply
            # The top of the range is accepted, and the index still answers.
            reply = await h.admin("SearchTimers", {"from_ms": 2**63 - 2, "to_ms": 2**63 - 1})
            assert reply["code"] == 20000 and reply["timers"] == [], reply
            assert (await h.admin("FireTimers", {"positions": [2**63 - 1]}))["code"] == 20000
            reply = await h.admin("ArmTimers", {"timers": [{"position": 2**63 - 1, "topic": "t1", "message_id": "m"}]})
            assert reply["code"] == 20000 and reply["unknown"] == 1, reply
            assert reply["results"][0]["result"] == "unknown" and "position 9223372036854775807" in \
                reply["results"][0]["reason"], reply
            assert (await h.admin("Stats", {}))["code"] == 20000
    run(body())


def test_lone_surrogates_are_refused_per_field_and_per_message(tmp_path: Path) -> None:
    """JSON's "\\ud800" decodes to a lone surrogate, which json.loads accepts and UTF-8 cannot
    encode: it reached the record encoder (SendBatch, failing the whole batch with 50000 and, with
    timer_congest_num_each_slot on, leaving the slots of the entries before it reserved) or the
    index (QueryMessage, CancelMessage). It is now a 40000 naming the field, in SendBatch in the
    bad entry's own slot while the others are stored."""
    async def body() -> None:
        async with running(tmp_path, timer_congest_num_each_slot=3) as h:
            await h.admin("CreateTopic", {"name": "t1"})
            due = (h.broker.clock.now_ms() // 1000 + 3600) * 1000
            timer = json.dumps({"topic": "t1", "body_b64": b64(b"x"), "deliver_at_ms": due}).encode()
            bad = [b'{"topic":"t1","body_b64":"eA==","tag":"\\ud800"}',
                   b'{"topic":"t1","body_b64":"eA==","keys":["ok","a\\udc00"]}',
                   b'{"topic":"t1","body_b64":"eA==","keys":"\\udc00"}',
                   b'{"topic":"t1","body_b64":"eA==","properties":{"a":"x\\ud800"}}',
                   b'{"topic":"t1","body_b64":"eA==","properties":{"\\ud800":"x"}}']
            reply = await h.admin("SendBatch", b'{"messages":[' + b",".join([timer, timer, *bad]) + b"]}")
            assert reply["code"] == 20000, reply
            results = reply["results"]
            assert all("message_id" in r for r in results[:2]), results
            fields = ["tag", "keys[1]", "keys", "properties['a']", "properties key"]
            for r, field in zip(results[2:], fields, strict=True):
                err = r["error"]
                assert (err["code"], err["error"], err["details"]["field"]) == (40000, "InvalidField", field), r
                assert "lone UTF-16 surrogate" in err["message"], r
            assert "character 1 is a lone UTF-16 surrogate (U+D800)" in results[5]["error"]["message"]
            assert h.broker.timer.engine.pending_total == 2
            # The slot keeps room for exactly one more timer (limit 3): nothing was left reserved.
            third = await h.admin("SendBatch", {"messages": [json.loads(timer)]})
            assert "message_id" in third["results"][0], third

            for method, raw, field in [("QueryMessage", b'{"key":"\\ud800"}', "key"),
                                       ("QueryMessage", b'{"message_id":"\\ud800","topic":"t1"}', "message_id"),
                                       ("CancelMessage", b'{"message_id":"\\ud800","topic":"t1"}', "message_id")]:
                reply = await h.admin(method, raw)
                assert (reply["code"], reply["error"], reply["details"]["field"]) == (40000, "InvalidField", field)
    run(body())
