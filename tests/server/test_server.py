"""MessagingService over a real Broker and real gRPC (in-process server, loopback channel)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import grpc
import pytest

from chronoq.clock import FakeClock
from chronoq.protocol.v2 import Code, definition, service
from tests.support.grpc_server import message, messages_of, receive_request, resource, running, status_of

START_MS = 1_800_000_000_000


def run(coro) -> None:
    asyncio.run(coro)


async def send(h, *msgs: definition.Message) -> service.SendMessageResponse:
    return await h.stub.SendMessage(service.SendMessageRequest(messages=list(msgs)), timeout=10)


def test_route_of_a_new_topic_is_the_one_auto_create_will_make_and_names_this_server(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=3) as h:
            res = await h.stub.QueryRoute(service.QueryRouteRequest(topic=resource("orders")), timeout=10)
            assert res.status.code == Code.OK
            assert len(res.message_queues) == 3
            host, port = h.address.split(":")
            for q in res.message_queues:
                assert (q.broker.id, q.permission) == (0, definition.READ_WRITE)
                assert [(a.host, a.port) for a in q.broker.endpoints.addresses] == [(host, int(port))]
                assert set(q.accept_message_types) == {definition.NORMAL, definition.FIFO, definition.DELAY,
                                                       definition.TRANSACTION}
            # Consumers ask for routes too, so a route creates nothing; the first send does.
            assert "orders" not in h.broker.store.topics
            assignment = await h.stub.QueryAssignment(service.QueryAssignmentRequest(
                topic=resource("orders"), group=resource("g")), timeout=10)
            assert assignment.status.code == Code.OK and len(assignment.assignments) == 3
            assert (await send(h, message("orders", b"x"))).status.code == Code.OK
            assert h.broker.get_topic("orders").queue_count == 3
    run(body())


def test_route_for_an_unknown_topic_without_auto_create_is_40402(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, auto_create_topics=False) as h:
            res = await h.stub.QueryRoute(service.QueryRouteRequest(topic=resource("nope")), timeout=10)
            assert res.status.code == 40402 and "nope" in res.status.message
            assert not res.message_queues
    run(body())


def test_send_receive_change_invisible_ack(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            res = await send(h, message("orders", b"payload", message_id="CLIENT-ID-1", tag="TagA"))
            assert res.status.code == Code.OK
            assert [(e.status.code, e.message_id) for e in res.entries] == [(Code.OK, "CLIENT-ID-1")]
            stream = await h.receive(receive_request("orders"))
            assert status_of(stream) == Code.OK
            [got] = messages_of(stream)
            sp = got.system_properties
            assert (got.body, sp.message_id, sp.tag, sp.delivery_attempt) == (b"payload", "CLIENT-ID-1", "TagA", 1)
            assert sp.body_digest.checksum == hashlib.md5(b"payload").hexdigest().upper()
            change = service.ChangeInvisibleDurationRequest(group=resource("g"), topic=resource("orders"),
                                                            receipt_handle=sp.receipt_handle, message_id="CLIENT-ID-1")
            change.invisible_duration.seconds = 60
            changed = await h.stub.ChangeInvisibleDuration(change, timeout=10)
            assert changed.status.code == Code.OK and changed.receipt_handle != sp.receipt_handle
            ack = service.AckMessageRequest(group=resource("g"), topic=resource("orders"), entries=[
                service.AckMessageEntry(message_id="CLIENT-ID-1", receipt_handle=sp.receipt_handle)])
            stale = await h.stub.AckMessage(ack, timeout=10)
            assert stale.status.code == 40013  # the old handle was superseded by the change
            ack.entries[0].receipt_handle = changed.receipt_handle
            acked = await h.stub.AckMessage(ack, timeout=10)
            assert acked.status.code == Code.OK and acked.entries[0].status.code == Code.OK
            assert status_of(await h.receive(receive_request("orders"))) == Code.MESSAGE_NOT_FOUND
    run(body())


def test_a_retried_send_with_the_same_id_stores_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1) as h:
            first = await send(h, message("orders", message_id="RETRY-1"))
            again = await send(h, message("orders", message_id="RETRY-1"))
            assert first.entries[0].offset == again.entries[0].offset
            assert h.broker.queue_offsets("orders", 0) == (0, 1)
    run(body())


@pytest.mark.slow
def test_timer_message_recall_and_delivery_times(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            now_ms = time.time_ns() // 1_000_000
            due = await send(h, message("t", b"due", message_id="DUE", deliver_at_ms=now_ms + 1500))
            gone = await send(h, message("t", b"gone", message_id="GONE", deliver_at_ms=now_ms + 1500))
            assert due.entries[0].recall_handle and gone.entries[0].recall_handle
            recall = await h.stub.RecallMessage(service.RecallMessageRequest(
                topic=resource("t"), recall_handle=gone.entries[0].recall_handle), timeout=10)
            assert (recall.status.code, recall.message_id) == (Code.OK, "GONE")
            again = await h.stub.RecallMessage(service.RecallMessageRequest(
                topic=resource("t"), recall_handle=gone.entries[0].recall_handle), timeout=10)
            assert again.status.code == 42800
            assert status_of(await h.receive(receive_request("t"))) == Code.MESSAGE_NOT_FOUND
            stream = await h.receive(receive_request("t", long_poll_s=5))
            arrived_ms = time.time_ns() // 1_000_000
            assert [m.system_properties.message_id for m in messages_of(stream)] == ["DUE"]
            assert now_ms + 1500 <= arrived_ms <= now_ms + 2500
            sp = messages_of(stream)[0].system_properties
            assert sp.delivery_timestamp.seconds * 1000 + sp.delivery_timestamp.nanos // 1_000_000 == now_ms + 1500
            assert status_of(await h.receive(receive_request("t", long_poll_s=1))) == Code.MESSAGE_NOT_FOUND
    run(body())


def test_broker_errors_become_specific_statuses_and_store_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            end = h.broker.store.log.end_position
            cases = [
                (message("rmq_sys_wheel_timer"), 40002),
                (message("orders", deliver_at_ms=42), 40012),
                (message("orders", body=b""), 41302),
                (message("orders", b"x" * (4 * 1024 * 1024 + 1)), 41301),
            ]
            for msg, code in cases:
                res = await send(h, msg)
                assert res.status.code == code, (msg.topic.name, res.status)
                assert res.status.message
            res = await send(h, message("orders"), message("bad topic"))
            assert res.status.code == 40002
            assert h.broker.store.log.end_position == end
            ack = service.AckMessageRequest(group=resource("g"), topic=resource("orders"), entries=[
                service.AckMessageEntry(message_id="m", receipt_handle="garbage")])
            assert (await h.stub.AckMessage(ack, timeout=10)).status.code == 40013
    run(body())


def test_undecodable_request_bytes_get_a_40000_status(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            reply = service.SendMessageResponse.FromString(await h.raw("SendMessage", b"\xff\xff\xff\xff"))
            assert reply.status.code == 40000 and "malformed SendMessage" in reply.status.message
            reply = service.QueryRouteResponse.FromString(await h.raw("QueryRoute", b"\x0a\x05ab"))
            assert reply.status.code == 40000
    run(body())


@pytest.mark.slow
def test_long_poll_answers_before_the_client_deadline(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.admin("CreateTopic", {"name": "quiet"})
            started = time.monotonic()
            stream = await h.receive(receive_request("quiet", long_poll_s=20), timeout_s=2.5)
            elapsed_s = time.monotonic() - started
            assert status_of(stream) == Code.MESSAGE_NOT_FOUND
            assert 1.0 <= elapsed_s < 2.5
    run(body())


def test_long_poll_wakes_when_a_message_arrives(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await h.admin("CreateTopic", {"name": "wake"})
            poll = asyncio.create_task(h.receive(receive_request("wake", long_poll_s=10)))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            await send(h, message("wake", b"hi"))
            stream = await poll
            assert [m.body for m in messages_of(stream)] == [b"hi"]
            assert time.monotonic() - started < 1.0
    run(body())


def test_telemetry_answers_each_settings(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, max_message_size_bytes=1 << 20) as h:
            settings = definition.Settings(client_type=definition.PRODUCER)
            settings.publishing.topics.add(name="orders")

            async def commands():
                yield service.TelemetryCommand(settings=settings)
                yield service.TelemetryCommand(thread_stack_trace=service.ThreadStackTrace(nonce="n"))
                yield service.TelemetryCommand(settings=settings)

            replies = [r async for r in h.stub.Telemetry(commands(), timeout=10)]
            assert len(replies) == 2
            for reply in replies:
                assert reply.status.code == Code.OK
                assert reply.settings.publishing.max_body_size == 1 << 20
                assert reply.settings.backoff_policy.HasField("exponential_backoff")
    run(body())


def test_auto_renew_keeps_a_held_message_invisible_and_the_first_handle_acks(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        async with running(tmp_path, clock=clock, background=False, default_invisible_duration_ms=9000) as h:
            await send(h, message("push", b"held"))
            req = receive_request("push", invisible_s=None, auto_renew=True)
            [got] = messages_of(await h.receive(req))
            handle = got.system_properties.receipt_handle
            assert got.system_properties.invisible_duration.seconds == 9
            for _ in range(4):  # 4 x 5 s: well past the first 9 s
                clock.advance(5000)
                await h.messaging.renewals.renew_due()
                await h.broker.run_due()
                assert status_of(await h.receive(receive_request("push", group="g"))) == Code.MESSAGE_NOT_FOUND
            ack = service.AckMessageRequest(group=resource("g"), topic=resource("push"), entries=[
                service.AckMessageEntry(message_id=got.system_properties.message_id, receipt_handle=handle)])
            assert (await h.stub.AckMessage(ack, timeout=10)).status.code == Code.OK
            assert len(h.messaging.renewals) == 0
            clock.advance(60_000)
            await h.broker.run_due()
            assert status_of(await h.receive(receive_request("push"))) == Code.MESSAGE_NOT_FOUND
    run(body())


def test_auto_renew_stops_when_the_client_says_goodbye(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        async with running(tmp_path, clock=clock, background=False, default_invisible_duration_ms=9000) as h:
            await send(h, message("push", b"held"))
            metadata = (("x-mq-client-id", "client-A"),)
            req = receive_request("push", invisible_s=None, auto_renew=True)
            got = [r async for r in h.stub.ReceiveMessage(req, timeout=10, metadata=metadata)]
            assert len(messages_of(got)) == 1
            bye = await h.stub.NotifyClientTermination(
                service.NotifyClientTerminationRequest(group=resource("g")), timeout=10, metadata=metadata)
            assert bye.status.code == Code.OK and len(h.messaging.renewals) == 0
            clock.advance(10_000)
            await h.messaging.renewals.renew_due()
            again = messages_of(await h.receive(receive_request("push")))
            assert [m.system_properties.delivery_attempt for m in again] == [2]
    run(body())


def test_dead_letter_forward_and_unsupported_rpcs(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            await send(h, message("orders", b"poison", message_id="POISON"))
            [got] = messages_of(await h.receive(receive_request("orders")))
            res = await h.stub.ForwardMessageToDeadLetterQueue(service.ForwardMessageToDeadLetterQueueRequest(
                group=resource("g"), topic=resource("orders"), receipt_handle=got.system_properties.receipt_handle,
                message_id="POISON", delivery_attempt=1, max_delivery_attempts=16), timeout=10)
            assert res.status.code == Code.OK
            dlq = await h.broker.read("%DLQ%g", 0, 0, 10)
            assert [m.message_id for m in dlq] == ["POISON"]
            end = await h.stub.EndTransaction(service.EndTransactionRequest(topic=resource("orders")), timeout=10)
            assert end.status.code == 50500 and "EndTransaction" in end.status.message
            pulled = [r async for r in h.stub.PullMessage(service.PullMessageRequest(), timeout=10)]
            assert [r.status.code for r in pulled] == [50500]
            beat = await h.stub.Heartbeat(service.HeartbeatRequest(client_type=definition.PRODUCER), timeout=10)
            assert beat.status.code == Code.OK
    run(body())


def test_every_unary_rpc_answers_an_empty_request_with_a_status(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path) as h:
            for method in service.DESCRIPTOR.services_by_name["MessagingService"].methods:
                if method.client_streaming or method.server_streaming:
                    continue
                response_type = getattr(service, method.output_type.name)
                try:
                    reply = response_type.FromString(await h.raw(method.name, b""))
                except grpc.aio.AioRpcError as exc:
                    raise AssertionError(f"{method.name} failed as an RPC: {exc}") from None
                assert reply.status.code != 0, method.name
    run(body())


def test_auto_renew_stops_for_a_silent_client(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        async with running(tmp_path, clock=clock, background=False, default_invisible_duration_ms=9000) as h:
            await send(h, message("push", b"held"))
            alive, silent = (("x-mq-client-id", "client-alive"),), (("x-mq-client-id", "client-silent"),)
            await send(h, message("push", b"held-too"))
            req = receive_request("push", invisible_s=None, auto_renew=True, batch=1)
            bodies = {}
            for metadata in (alive, silent):
                got = messages_of([r async for r in h.stub.ReceiveMessage(req, timeout=10, metadata=metadata)])
                assert len(got) == 1
                bodies[metadata] = got[0].body
            redelivered: list[bytes] = []
            for _ in range(14):  # 70 s in 5 s steps; only client-alive keeps heartbeating
                clock.advance(5000)
                await h.stub.Heartbeat(service.HeartbeatRequest(group=resource("g")), timeout=10, metadata=alive)
                await h.messaging.renewals.renew_due()
                redelivered += [m.body for m in messages_of(await h.receive(receive_request("push")))]
            # The silent client's message came back once its renewals stopped; the other stayed held.
            assert redelivered == [bodies[silent]]
            assert len(h.messaging.renewals) == 1
    run(body())


def test_delay_level_travels_as_the_delay_property(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock(START_MS)
        async with running(tmp_path, clock=clock, background=False) as h:
            msg = message("lvl", b"level-2")
            msg.system_properties.message_type = definition.DELAY
            msg.user_properties["DELAY"] = "2"  # the second level: 5 s by default
            res = await send(h, msg)
            # A delay-level message waits in its level's queue (RocketMQ 4's path), which, as in
            # RocketMQ 4, cannot be recalled: no recall handle is given.
            assert res.status.code == Code.OK and res.entries[0].recall_handle == ""
            clock.advance(4999)
            await h.broker.run_due()
            assert status_of(await h.receive(receive_request("lvl"))) == Code.MESSAGE_NOT_FOUND
            clock.advance(1)
            await h.broker.run_due()
            assert [m.body for m in messages_of(await h.receive(receive_request("lvl")))] == [b"level-2"]
    run(body())


def test_a_wildcard_bound_server_routes_to_the_clients_access_point(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, wildcard=True) as h:
            req = service.QueryRouteRequest(topic=resource("orders"))
            req.endpoints.scheme = definition.DOMAIN_NAME
            req.endpoints.addresses.add(host="broker.example", port=18081)
            res = await h.stub.QueryRoute(req, timeout=10)
            endpoints = res.message_queues[0].broker.endpoints
            assert endpoints.scheme == definition.DOMAIN_NAME
            assert [(a.host, a.port) for a in endpoints.addresses] == [("broker.example", 18081)]
    run(body())


def test_client_ids_are_tracked_only_while_they_hold_and_are_bounded(tmp_path: Path) -> None:
    """`x-mq-client-id` comes from the caller: before, every id of every call was kept for 45 s
    (4,000 heartbeats with 6 KB ids: 25 MB) and the silent sweep was ids x held entries. Now an id
    longer than max_client_id_length is refused, only ids holding auto-renewed messages are
    tracked, at most max_renewing_clients of them (one more is Throttled, and nothing is taken
    invisible for it), and an id is forgotten with its last entry."""
    async def body() -> None:
        clock = FakeClock(START_MS)
        async with running(tmp_path, clock=clock, background=False, default_invisible_duration_ms=9000,
                           max_client_id_length=64, max_renewing_clients=2) as h:
            def cid(name: str) -> tuple[tuple[str, str], ...]:
                return (("x-mq-client-id", name),)

            beat = await h.stub.Heartbeat(service.HeartbeatRequest(), timeout=10, metadata=cid("x" * 65))
            assert beat.status.code == Code.BAD_REQUEST
            assert "x-mq-client-id: 65 characters; the limit (max_client_id_length) is 64" in beat.status.message
            for i in range(100):  # calls from ids holding nothing keep nothing
                beat = await h.stub.Heartbeat(service.HeartbeatRequest(), timeout=10, metadata=cid(f"idle-{i}"))
                assert beat.status.code == Code.OK
            assert h.messaging.renewals.client_count == 0

            for i in range(4):
                await send(h, message("push", f"m{i}".encode()))
            req = receive_request("push", invisible_s=None, auto_renew=True, batch=1)
            for name in ("client-a", "client-b"):
                got = [r async for r in h.stub.ReceiveMessage(req, timeout=10, metadata=cid(name))]
                assert len(messages_of(got)) == 1
            assert h.messaging.renewals.client_count == 2
            # A third client would be one too many: refused before anything is received.
            refused = [r async for r in h.stub.ReceiveMessage(req, timeout=10, metadata=cid("client-c"))]
            assert status_of(refused) == Code.TOO_MANY_REQUESTS and not messages_of(refused)
            assert "the limit (max_renewing_clients) is 2" in refused[-1].status.message
            assert len(messages_of(await h.receive(receive_request("push", batch=4)))) == 2  # still visible

            # client-a falls silent, client-b heartbeats: client-a is dropped and forgotten, and
            # client-c is admitted in its place.
            for _ in range(10):
                clock.advance(5000)
                await h.stub.Heartbeat(service.HeartbeatRequest(), timeout=10, metadata=cid("client-b"))
                await h.messaging.renewals.renew_due()
            assert h.messaging.renewals.client_count == 1 and len(h.messaging.renewals) == 1
            await h.broker.run_due()
            got = [r async for r in h.stub.ReceiveMessage(req, timeout=10, metadata=cid("client-c"))]
            assert len(messages_of(got)) == 1 and h.messaging.renewals.client_count == 2
            # An id is forgotten with its last held entry (its ack here).
            m = messages_of(got)[0]
            ack = service.AckMessageRequest(group=resource("g"), topic=resource("push"), entries=[
                service.AckMessageEntry(message_id=m.system_properties.message_id,
                                        receipt_handle=m.system_properties.receipt_handle)])
            assert (await h.stub.AckMessage(ack, timeout=10)).status.code == Code.OK
            assert h.messaging.renewals.client_count == 1
    run(body())
