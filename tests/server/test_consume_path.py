"""The consume path's batching and wake-ups: the delivery error as a consumer sees it.

An AckMessage request is settled in one store commit, entry by entry judged alone (repeated,
stale and foreign handles refused, the rest acked); a long poll is woken by the dispatch of a
new message rather than by its timeout, and polls that time out on a quiet topic do not pile up;
`AsyncConsumer.receive_stream` yields messages as their responses arrive and may be left early.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from chronoq import errors
from chronoq.client import AsyncConsumer
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import OutgoingMessage
from chronoq.protocol.v2 import Code, service
from tests.support.brokers import open_broker
from tests.support.grpc_server import resource, running

INVISIBLE_MS = 30_000


def test_ack_many_is_one_commit_and_judges_each_handle(tmp_path: Path) -> None:
    async def body() -> None:
        clock = FakeClock()
        async with await open_broker(Config(data_dir=tmp_path / "d"), clock=clock, background=False) as b:
            for i in range(4):
                await b.send(OutgoingMessage("orders", f"m{i}".encode()))
            got = await b.receive("g", "orders", batch_size=4, invisible_duration_ms=INVISIBLE_MS)
            assert len(got) == 4
            commits = 0
            real_commit = b.groups.commit

            def counting_commit(**kw: object) -> None:
                nonlocal commits
                commits += 1
                real_commit(**kw)  # type: ignore[arg-type]

            b.groups.commit = counting_commit  # type: ignore[method-assign]
            handles = [got[0].receipt_handle, got[1].receipt_handle, got[0].receipt_handle, "not-a-handle",
                       got[2].receipt_handle]
            outcomes = await b.ack_many("g", "orders", handles)
            assert commits == 1
            assert [type(o).__name__ if o else None for o in outcomes] == [
                None, None, "InvalidReceiptHandle", "InvalidReceiptHandle", None]
            # The acked ones never come back; the unacked one does, after its invisible duration.
            clock.advance(INVISIBLE_MS + 1)
            again = await b.receive("g", "orders", batch_size=4, invisible_duration_ms=INVISIBLE_MS)
            assert [m.message.message_id for m in again] == [got[3].message.message_id]
            # Nothing valid: nothing written, every entry refused.
            assert all(isinstance(o, errors.InvalidReceiptHandle)
                       for o in await b.ack_many("g", "orders", [got[0].receipt_handle]))
            assert commits == 2  # the re-receive's commit, and none for the all-refused ack

    asyncio.run(body())


def test_ack_message_with_repeated_and_bad_entries_acks_the_good_ones(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1) as h:
            for i in range(3):
                await h.broker.send(OutgoingMessage("orders", f"m{i}".encode(), message_id=f"ID{i}"))
            got = await h.broker.receive("g", "orders", batch_size=3, invisible_duration_ms=INVISIBLE_MS)
            entries = [(m.message.message_id, m.receipt_handle) for m in got]
            entries.insert(1, entries[0])  # the same handle twice in one request
            entries.append(("ID9", "garbage"))
            req = service.AckMessageRequest(group=resource("g"), topic=resource("orders"), entries=[
                service.AckMessageEntry(message_id=mid, receipt_handle=rh) for mid, rh in entries])
            res = await h.stub.AckMessage(req, timeout=10)
            codes = [e.status.code for e in res.entries]
            assert codes[0] == codes[2] == codes[3] == Code.OK
            assert codes[1] != Code.OK and codes[4] != Code.OK
            assert [e.message_id for e in res.entries] == [mid for mid, _ in entries]
            assert h.broker.groups.min_inflight_position() is None  # all three acked

    asyncio.run(body())


def test_a_long_poll_wakes_on_dispatch_and_timed_out_polls_do_not_pile_up(tmp_path: Path) -> None:
    async def body() -> None:
        async with await open_broker(Config(data_dir=tmp_path / "d", default_queue_count=1)) as b:
            await b.create_topic("orders")
            for _ in range(200):  # quiet topic: each poll times out (wait 1 ms)
                assert await b.receive("g", "orders", wait_ms=1) == []
            assert len(b.deliver._arrivals.get("orders", [])) <= 65
            started = time.monotonic()
            poll = asyncio.create_task(b.receive("g", "orders", wait_ms=20_000))
            await asyncio.sleep(0.05)
            await b.send(OutgoingMessage("orders", b"now"))
            got = await asyncio.wait_for(poll, 10)
            assert [m.message.body for m in got] == [b"now"]
            assert time.monotonic() - started < 5  # woken by the dispatch, not the 20 s timeout

    asyncio.run(body())


def test_receive_stream_yields_each_message_and_may_stop_early(tmp_path: Path) -> None:
    async def body() -> None:
        async with running(tmp_path, default_queue_count=1) as h:
            for i in range(3):
                await h.broker.send(OutgoingMessage("orders", f"m{i}".encode(), message_id=f"ID{i}"))
            async with AsyncConsumer("g", "orders", server=h.address, timeout_ms=10_000) as c:
                first = None
                async for m in c.receive_stream(1, invisible=INVISIBLE_MS):
                    first = m
                    break
                assert first is not None and first.body == b"m0"
                rest = [m async for m in c.receive_stream(8, invisible=INVISIBLE_MS)]
                assert [m.body for m in rest] == [b"m1", b"m2"]
                assert [m.body for m in await c.receive(8, invisible=INVISIBLE_MS)] == []
                await c.ack(first, *rest)
            assert h.broker.groups.min_inflight_position() is None

    asyncio.run(body())
