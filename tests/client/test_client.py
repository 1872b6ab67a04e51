"""The SDK against a real `chronoq serve` in its own process (temp data dir, free port).

Each test uses its own topics, so one server serves the module. Real time is involved (timers
due 1-2 s ahead, invisible durations of 1 s), hence `slow`; bounds are generous on lateness and
strict on earliness (a timer message must never arrive before its time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronoq import errors as core
from chronoq.client import (
    AsyncAdmin,
    AsyncConsumer,
    AsyncProducer,
    BatchSendError,
    Consumer,
    InvalidArgument,
    Producer,
    RequestTooLarge,
    ServerUnavailable,
    outgoing,
)
from chronoq.client.testing import ServerProcess, free_port

pytestmark = pytest.mark.slow

LATE_BOUND_MS = 1500
"""Generous: a loaded 2-core machine runs other engineers' tests at the same time."""
_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{int(time.time() * 1000) % 100000}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = Path(tmp_path_factory.mktemp("chronoq")) / "data"
    # Topics must be created explicitly: the tests cover TopicNotFound and create_topic.
    with ServerProcess(data, settings={"auto_create_topics": False}) as proc:
        yield proc.address


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_unreachable_server_is_a_retriable_error() -> None:
    async def body() -> None:
        async with AsyncAdmin(f"127.0.0.1:{free_port()}", timeout_ms=2000) as a:
            with pytest.raises(ServerUnavailable) as e:
                await a.list_topics()
        assert e.value.retriable

    asyncio.run(body())


def test_sync_send_receive_ack_round_trip(server: str) -> None:
    topic = fresh("rt")
    with Producer(server) as p, Consumer("g1", topic, server=server) as c:
        info = p.create_topic(topic, queue_count=2)
        assert (info.name, info.queue_count) == (topic, 2)
        r = p.send(topic, b"hello", tag="greet", keys=("k1", "k2"), properties={"color": "blue"})
        assert r.recall_handle is None and r.deliver_at_ms is None
        got = c.receive(8, wait=3000)
        assert [m.message_id for m in got] == [r.message_id]
        m = got[0]
        assert (m.body, m.tag, m.keys, m.properties.get("color")) == (b"hello", "greet", ("k1", "k2"), "blue")
        assert m.delivery_attempt == 1 and m.deliver_at_ms is None and m.body_digest_ok is True
        c.ack(m)
        assert c.receive(8, wait=0) == []
        sent = {p.send(topic, f"m{i}").message_id for i in range(3)}
        got = []
        while len(got) < 3:
            more = c.receive(8, wait=3000)
            assert more
            got.extend(more)
        assert {m.message_id for m in got} == sent
        c.ack(*got)  # one AckMessage with three entries
        assert c.receive(8, wait=0) == []
        with pytest.raises(core.InvalidReceiptHandle):
            c.ack(got[0])  # already acked
    # The portal threads are gone once the clients are closed.
    assert not [t for t in threading.enumerate() if t.name.startswith("chronoq-")]


def test_timer_deliver_at_arrives_on_time_never_early(server: str) -> None:
    topic = fresh("at")

    async def body() -> None:
        async with AsyncProducer(server) as p, AsyncConsumer("g", topic, server=server) as c:
            await p.create_topic(topic)
            due_ms = now_ms() + 2000
            r = await p.send(topic, b"later", deliver_at=due_ms)
            assert r.recall_handle and r.deliver_at_ms == due_ms
            [status] = await p.query(r.message_id)
            assert (status.state, status.deliver_at_ms, status.topic) == ("pending", due_ms, topic)
            got = []
            while not got and now_ms() < due_ms + 5000:
                got = await c.receive(4, wait=3000)
            assert [m.message_id for m in got] == [r.message_id]
            assert got[0].deliver_at_ms == due_ms
            assert 0 <= got[0].lateness_ms <= LATE_BOUND_MS, got[0].lateness_ms
            await c.ack(got[0])
            [status] = await p.query(r.message_id)
            assert status.state == "delivered" and status.fired_ms >= due_ms

    asyncio.run(body())


def test_relative_delay_and_delay_level_use_the_servers_clock(server: str) -> None:
    topic = fresh("in")

    async def body() -> None:
        async with AsyncProducer(server) as p, AsyncConsumer("g", topic, server=server) as c:
            await p.create_topic(topic)
            sent_ms = now_ms()
            a = await p.send(topic, b"delay", delay=1200)
            b = await p.send(topic, b"level", delay_level=1)  # level 1 = 1s in the default table
            # (The broker's query covers timer-wheel messages; delay-level ones travel RocketMQ 4's
            # schedule topic and are checked by their arrival time only.)
            [s] = await p.query(a.message_id)
            assert s.state == "pending" and sent_ms + 1200 <= s.deliver_at_ms <= now_ms() + 1200
            seen: dict[str, int] = {}
            while len(seen) < 2 and now_ms() < sent_ms + 6000:
                for m in await c.receive(4, wait=2000):
                    seen[m.message_id] = m.received_ms
                    await c.ack(m)
            assert set(seen) == {a.message_id, b.message_id}
            assert seen[a.message_id] >= sent_ms + 1200 and seen[b.message_id] >= sent_ms + 1000

    asyncio.run(body())


def test_recall_and_cancel_stop_delivery(server: str) -> None:
    topic = fresh("recall")

    async def body() -> None:
        async with AsyncProducer(server) as p, AsyncConsumer("g", topic, server=server) as c:
            await p.create_topic(topic)
            due_ms = now_ms() + 2500
            recalled = await p.send(topic, b"recalled", deliver_at=due_ms)
            cancelled = await p.send(topic, b"cancelled", deliver_at=due_ms)
            kept = await p.send(topic, b"kept", deliver_at=due_ms)
            assert await p.recall(topic, recalled.recall_handle) == recalled.message_id
            assert await p.cancel(topic, cancelled.message_id) == cancelled.message_id
            for r in (recalled, cancelled):
                [s] = await p.query(r.message_id)
                assert s.state == "cancelled" and s.cancelled_ms is not None
            with pytest.raises(core.BadRequest) as e:
                await p.recall(topic, recalled.recall_handle)
            assert e.value.code == 42800
            with pytest.raises(core.TimerAlreadyCancelled):  # the admin service names the class
                await p.cancel(topic, cancelled.message_id)
            seen = []
            while now_ms() < due_ms + 2500:
                for m in await c.receive(8, wait=1000):
                    seen.append(m.body)
                    await c.ack(m)
            assert seen == [b"kept"]
            with pytest.raises(core.BadRequest) as late:
                await p.recall(topic, kept.recall_handle)
            assert late.value.code == 42800

    asyncio.run(body())


def test_change_invisible_renews_the_handle_and_redelivery_without_ack(server: str) -> None:
    topic = fresh("inv")

    async def body() -> None:
        async with AsyncProducer(server) as p, AsyncConsumer("g", topic, server=server) as c:
            await p.create_topic(topic, queue_count=1)
            r = await p.send(topic, b"work")
            [m] = await c.receive(1, invisible=1000, wait=3000)
            old_handle = m.receipt_handle
            new_handle = await c.change_invisible(m, 20_000)
            assert new_handle == m.receipt_handle != old_handle
            await asyncio.sleep(1.5)
            assert await c.receive(1, wait=0) == []  # still hidden: the change took effect
            with pytest.raises(core.InvalidReceiptHandle) as e:
                await c.ack(dataclasses.replace(m, receipt_handle=old_handle))
            assert e.value.code == 40013
            await c.change_invisible(m, 1000)  # hand it back soon without acking
            again = []
            while not again and now_ms() < m.received_ms + 8000:
                again = await c.receive(1, invisible=5000, wait=2000)
            assert again[0].message_id == r.message_id and again[0].delivery_attempt == 2
            await c.ack(again[0])

    asyncio.run(body())


@pytest.mark.parametrize("via", ["grpc", "admin"])
def test_send_batch_then_read_by_offset(server: str, via: str) -> None:
    topic = fresh(f"batch-{via}")

    async def body() -> None:
        async with AsyncProducer(server, batch_via=via, max_batch=40) as p:
            await p.create_topic(topic, queue_count=3)
            msgs = [outgoing(topic, f"m{i}", tag="b") for i in range(100)]
            receipts = await p.send_batch(msgs)
            assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
            d = await p.describe_topic(topic)
            assert sum(q.max_offset - q.min_offset for q in d.queues) == 100
            bodies = []
            for q in d.queues:
                offset = q.min_offset
                while offset < q.max_offset:
                    page = await p.read(topic, q.queue_id, offset, 16)
                    assert page.messages and page.next_offset > offset
                    bodies.extend(m.body for m in page.messages)
                    offset = page.next_offset
            assert sorted(bodies) == sorted(m.body for m in msgs)
            # Resending the same ids stores nothing new (the server's dedupe window).
            again = await p.send_batch(msgs[:5])
            assert [r.message_id for r in again] == [m.message_id for m in msgs[:5]]
            assert sum(q.max_offset - q.min_offset for q in (await p.describe_topic(topic)).queues) == 100

    asyncio.run(body())


def test_batch_with_a_bad_message(server: str) -> None:
    topic = fresh("badbatch")

    async def body() -> None:
        async with AsyncProducer(server, batch_via="admin") as p:
            await p.create_topic(topic)
            msgs = [outgoing(topic, b"ok1"), outgoing(topic, b"bad", delay=-5), outgoing(topic, b"ok2")]
            with pytest.raises(BatchSendError) as e:
                await p.send_batch(msgs)
            results = e.value.outcome.results
            assert isinstance(results[1], core.InvalidDeliveryTime)
            assert [r.message_id for r in e.value.outcome.receipts] == [msgs[0].message_id, msgs[2].message_id]
        # Over SendMessage the protocol refuses the whole request: nothing of it is stored.
        async with AsyncProducer(server, batch_via="grpc") as p:
            before = sum(q.max_offset for q in (await p.describe_topic(topic)).queues)
            with pytest.raises(core.InvalidDeliveryTime):
                await p.send_batch([outgoing(topic, b"ok3"), outgoing(topic, b"x", deliver_at=5)])
            assert sum(q.max_offset for q in (await p.describe_topic(topic)).queues) == before

    asyncio.run(body())


def test_server_refusals_arrive_as_chronoq_errors(server: str) -> None:
    async def body() -> None:
        async with AsyncProducer(server) as p:
            with pytest.raises(core.TopicNotFound) as e:
                await p.send(fresh("nosuch"), b"x")
            assert e.value.code == 40402 and "does not exist" in e.value.message and not e.value.retriable
            topic = fresh("normal-only")
            await p.create_topic(topic, message_types=["NORMAL"])
            with pytest.raises(core.TopicExists):
                await p.create_topic(topic)
            with pytest.raises(core.BadRequest) as typed:
                await p.send(topic, b"t", delay=1000)
            assert typed.value.code == 40014
            too_far = now_ms() + 400 * 24 * 3600 * 1000
            any_type = fresh("any-type")
            await p.create_topic(any_type)
            with pytest.raises(core.InvalidDeliveryTime) as far:
                await p.send(any_type, b"t", deliver_at=too_far)
            assert far.value.code == 40012
            missing = fresh("nosuch")
            with pytest.raises(core.TopicNotFound) as admin_err:
                await p.describe_topic(missing)
            # The admin service sends the error's values too: a program reads them, not the text.
            assert admin_err.value.details["topic"] == missing and admin_err.value.details["server_code"] == 40402
            assert [t.message_types for t in await p.list_topics() if t.name == topic] == [("NORMAL",)]

    asyncio.run(body())


def test_stats_report_pending_timers(server: str) -> None:
    topic = fresh("stats")

    async def body() -> None:
        async with AsyncProducer(server) as p:
            await p.create_topic(topic)
            before = await p.stats()
            await p.send(topic, b"s", delay=3_600_000)
            after = await p.stats()
            assert before["timer"]["pending_by_topic"].get(topic, 0) == 0
            assert after["timer"]["pending_by_topic"][topic] == 1
            assert after["timer"]["pending_total"] == before["timer"]["pending_total"] + 1

    asyncio.run(body())


def test_tls(tmp_path: Path) -> None:
    """With a certificate and key the server speaks TLS only; the SDK trusts a given root."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    root = cert.read_bytes()
    settings = {"tls_cert_file": cert, "tls_key_file": key}
    with ServerProcess(tmp_path / "data", settings=settings, tls_root_certificates=root) as proc:
        with Producer(proc.address, tls=True, root_certificates=root) as p:
            r = p.send("tls-topic", b"secret", delay=60_000)
            assert p.query(r.message_id)[0].state == "pending"
        with Producer(proc.address, timeout_ms=2000) as plain, pytest.raises(ServerUnavailable):
            plain.list_topics()
        # TLS without the CA that signed the server's certificate: not retriable (the next attempt
        # fails the same way), and the error says which certificate to give. Before, `retriable`
        # was True, and a retrying caller kept trying a handshake that could not succeed.
        with Producer(proc.address, tls=True, timeout_ms=5000) as untrusting, \
                pytest.raises(ServerUnavailable) as refused:
            untrusting.list_topics()
        assert not refused.value.retriable, refused.value
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value), refused.value
        assert "the server's certificate is not trusted" in str(refused.value), refused.value
        assert "root_certificates=" in str(refused.value) and "CHRONOQ_CA_CERT" in str(refused.value)


def test_the_http_port_is_named_not_grpcs_http2_parse_error(tmp_path: Path) -> None:
    """The SDK given the console/metrics port: one attempt (the next meets the same HTTP/1.1
    server), and an error that says so and where the gRPC port is named."""
    http_port = free_port()
    with ServerProcess(tmp_path / "data", args=["--http-port", str(http_port)]):
        started = time.monotonic()
        with Producer(f"127.0.0.1:{http_port}", timeout_ms=5000) as p, pytest.raises(ServerUnavailable) as e:
            p.list_topics()
        assert time.monotonic() - started < 4, "retried a port that answers HTTP/1.1"
    assert not e.value.retriable
    assert e.value.details["detail"] == "this port answers HTTP/1.1, not gRPC", e.value.details
    assert "console/metrics port, --http-port" in str(e.value) and "chronoq serving on HOST:PORT" in str(e.value)


@pytest.mark.parametrize("via", ["grpc", "admin"])
def test_send_batch_splits_by_encoded_size_under_the_servers_request_limit(server: str, via: str) -> None:
    """640 messages of 16 KiB are ~10.5 MB as protobuf, ~14 MB as JSON: over the server's default
    gRPC limit (2 x 4 MiB + 1 MiB). They used to go in one request (split by count only), which
    gRPC refused with RESOURCE_EXHAUSTED, retried three times."""
    topic = fresh(f"big-{via}")

    async def body() -> None:
        async with AsyncProducer(server, batch_via=via) as p:
            await p.create_topic(topic, queue_count=2)
            msgs = [outgoing(topic, bytes([i % 251]) * 16384) for i in range(640)]
            receipts = await p.send_batch(msgs)
            assert [r.message_id for r in receipts] == [m.message_id for m in msgs]
            d = await p.describe_topic(topic)
            assert sum(q.max_offset - q.min_offset for q in d.queues) == 640

    asyncio.run(body())


def test_a_request_over_the_servers_size_limit_is_not_retried(server: str) -> None:
    topic = fresh("huge")

    async def body() -> None:
        async with AsyncProducer(server, send_attempts=3) as p:
            await p.create_topic(topic)
            with pytest.raises(RequestTooLarge) as e:
                await p.send(topic, b"z" * (10 * 1024 * 1024))
            assert not e.value.retriable and e.value.details["method"] == "SendMessage"
            assert "larger than max" in e.value.details["detail"]
            # The sizes in bytes a person reads, and the limit a single message meets (it advised
            # max_batch_bytes, which a single send does not use).
            assert re.search(r"\(10,485,\d{3} bytes \(10 MiB\), above its limit of [\d,]+ bytes \(\d+ MiB\)\); one "
                             r"message may be at most the server's max_message_size_bytes", e.value.message), \
                e.value.message

    asyncio.run(body())


def test_the_receipts_due_time_is_the_one_the_server_fixed(tmp_path: Path) -> None:
    """The receipt's `deliver_at_ms` used to be the client's own request: None for `delay=`, and
    the unrounded time under the server's `timer_precision_ms`. It now comes from the server
    (the recall handle encodes it), so it equals what QueryMessage reports."""
    with ServerProcess(tmp_path / "data", settings={"timer_precision_ms": 1000}) as proc:
        async def body() -> None:
            async with AsyncProducer(proc.address) as p:
                relative = await p.send("due", b"in", delay=60_000)
                asked_ms = now_ms() + 60_123
                absolute = await p.send("due", b"at", deliver_at=asked_ms)
                for r in (relative, absolute):
                    [status] = await p.query(r.message_id)
                    assert r.deliver_at_ms == status.deliver_at_ms and r.deliver_at_ms % 1000 == 0, (r, status)
                assert absolute.deliver_at_ms is not None and asked_ms < absolute.deliver_at_ms < asked_ms + 1000
                level = await p.send("due", b"level", delay_level=1)  # no handle; SendBatch names the time
                assert level.recall_handle is None and level.deliver_at_ms is not None

        asyncio.run(body())


@pytest.mark.parametrize("port", ["+65536", "0", "70000", "\u0661"])
def test_a_server_port_outside_1_to_65535_is_refused_by_name(server: str, port: str) -> None:
    """gRPC takes a port modulo 65536: a client given `<port + 65536>` used to reach the server."""
    real = int(server.rpartition(":")[2])
    address = f"127.0.0.1:{real + 65536 if port == '+65536' else port}"

    async def body() -> None:
        with pytest.raises(InvalidArgument) as e:
            async with AsyncAdmin(address, timeout_ms=2000) as a:
                await a.list_topics()
        assert e.value.details["value"] == address and e.value.details["name"] == "server"

    asyncio.run(body())


@pytest.mark.parametrize("via", ["grpc", "admin"])
def test_a_batch_of_one_message_group_keeps_the_group_in_one_queue(server: str, via: str) -> None:
    """FIFO: messages of one group go to one queue, in order. Through the admin SendBatch (the
    SDK's default for batches) the group was dropped on the way: the messages scattered over
    the topic's queues as plain messages, so their order was lost."""
    topic = fresh(f"fifo-{via}")

    async def body() -> None:
        async with AsyncProducer(server, batch_via=via) as p, AsyncConsumer("g", topic, server=server) as c:
            await p.create_topic(topic, queue_count=4)
            msgs = [outgoing(topic, f"{i}".encode(), message_group="order-42") for i in range(24)]
            receipts = await p.send_batch(msgs)
            assert len({r.queue_id for r in receipts}) == 1
            got = []
            while len(got) < len(msgs):
                batch = await c.receive(32, wait=2_000)
                assert batch, f"received {len(got)} of {len(msgs)}"
                got += batch
                await c.ack(*batch)
            assert [m.body for m in got] == [m.body for m in msgs]  # in order, one queue

    asyncio.run(body())


def test_send_batch_learns_a_servers_smaller_batch_limit(tmp_path: Path) -> None:
    """A broker with `max_send_batch` 256 refused every request of the SDK's default 1,024
    messages: `send_batch` of 600 always failed. SendBatch names the limit; the SDK now sends
    in requests of that size."""
    from chronoq.client.testing import ServerProcess

    server = ServerProcess(tmp_path / "data", settings={"max_send_batch": 256}).start()
    try:
        async def body() -> None:
            async with AsyncProducer(server.address) as p:
                await p.create_topic("small", queue_count=1)
                receipts = await p.send_batch([outgoing("small", f"{i}".encode()) for i in range(600)])
                assert len(receipts) == 600 and p.max_batch == 256
                d = await p.describe_topic("small")
                assert sum(q.max_offset - q.min_offset for q in d.queues) == 600

        asyncio.run(body())
    finally:
        server.stop()


def test_an_empty_group_or_topic_is_named_by_the_consumer_not_the_wire() -> None:
    """AsyncConsumer('', 'orders') went to the server, which said only "ReceiveMessage: field
    'group.name' is required"."""
    for group, topic, name in (("", "orders", "group"), ("billing", "", "topic")):
        with pytest.raises(InvalidArgument) as e:
            AsyncConsumer(group, topic, server="127.0.0.1:1")
        assert e.value.details["name"] == name
        assert e.value.message == f"invalid {name} '': a non-empty string is required"
