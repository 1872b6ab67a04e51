"""The SDK's bulk send (`AsyncProducer.send_columns`, admin SendColumns) against a real broker
behind a real gRPC server: per-row outcomes (stored, duplicate, refused with the error a single
send gets), requests cut by rows and learned from the server's limit, a lost reply retried with
the same ids and answered as duplicates (stored once), and the sync twin."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chronoq import errors as core
from chronoq.client import AsyncProducer, BulkOutcome, Producer
from chronoq.protocol import bulk
from tests.client.test_retry_server_errors import serving
from tests.support.grpc_server import running


def run(coro) -> None:
    asyncio.run(coro)


def test_rows_are_stored_refused_with_their_reasons_or_answered_as_duplicates(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1) as h:
            now = h.broker.now_ms()
            async with AsyncProducer(h.address) as producer:
                single = await producer.send("orders", b"alone", message_id="r0", deliver_at=now + 60_000)
                ids = ["r0", "r1", "bad id", "r3", "r1"]
                out = await producer.send_columns("orders", [b"a", b"b", b"c", b"", b"e"], message_ids=ids,
                                                  deliver_at_ms=[now + 60_000, now + 61_000, now + 1, now + 1,
                                                                 now + 62_000])
                assert isinstance(out, BulkOutcome)
                assert out.status == ["duplicate", "stored", "refused", "refused", "duplicate"]
                assert (out.stored, out.duplicates, out.refused) == (1, 2, 2)
                assert type(out.errors[2]) is core.InvalidMessageId and "bad id" in str(out.errors[2])
                assert type(out.errors[3]) is core.MessageBodyEmpty
                with pytest.raises(core.InvalidMessageId) as direct:
                    await producer.send("orders", b"c", message_id="bad id")
                assert str(out.errors[2]) == str(direct.value)
                first = out.receipt(0)
                assert (first.offset, first.recall_handle, first.duplicate) == (single.offset, single.recall_handle,
                                                                                True)
                r1 = out.receipt(1)
                assert r1.deliver_at_ms == now + 61_000 and r1.recall_handle
                assert out.receipt(4).offset == r1.offset
                assert await producer.recall("orders", r1.recall_handle) is not None
            assert h.broker.pending_total() == 1  # r0; r1 recalled
    run(body())


def test_requests_are_cut_by_rows_and_a_lower_server_limit_is_learned(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1, max_bulk_send_rows=4) as h:
            async with AsyncProducer(h.address, max_bulk_rows=10, bulk_in_flight=2) as producer:
                bodies = [f"body {i}".encode() for i in range(23)]
                out = await producer.send_columns("plain", bodies, message_ids=[f"m{i}" for i in range(23)])
                assert out.status == ["stored"] * 23
                assert producer.max_bulk_rows == 4
                assert sorted(out.offsets) == list(range(23))
                assert all(d is None for d in out.deliver_at_ms) and not any(out.recallable)
            stored = {m.message_id: m.body for m in await h.broker.read("plain", 0, 0, 100)}
            assert stored == {f"m{i}": bodies[i] for i in range(23)}
            calls = [c for c in h.calls if c.endswith("/" + bulk.METHOD)]
            assert len(calls) >= 6 + 1  # the refused first request, then at most 4 rows a request
    run(body())


def test_a_lost_reply_is_retried_with_the_same_ids_and_stores_each_row_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as served:
            served.calls.lose_reply.add((bulk.METHOD, 1))
            async with AsyncProducer(served.address) as producer:
                out = await producer.send_columns("orders", [b"x", b"y", b"z"], delay_ms=[60_000] * 3)
            assert served.calls.counts[bulk.METHOD] == 2
            assert out.status == ["duplicate"] * 3  # the first attempt stored them; the retry was answered
            assert len(set(out.message_ids)) == 3
            broker = served.brokers[-1]
            assert broker.pending_total() == 3
    run(body())


def test_the_sync_producer_has_the_bulk_send(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1) as h:
            def send() -> BulkOutcome:
                with Producer(h.address) as producer:
                    return producer.send_columns("orders", bulk.Packed.of([b"p", b"q"]), message_ids=["s1", "s2"],
                                                 tags=["A", "B|C"])
            out = await asyncio.to_thread(send)
            assert out.status == ["stored", "refused"] and type(out.errors[1]) is core.InvalidTag
    run(body())
