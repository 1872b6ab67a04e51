"""The broker's methods that move a consumer group on a topic (used by the Pulsar door's SEEK,
UNSUBSCRIBE and `initialPosition=Latest`): `start_group_at_end`, `reset_group`, `offset_at_time`,
`inflight_handle`, `make_visible`."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.config import Config
from chronoq.errors import InvalidQueueId
from chronoq.model import OutgoingMessage
from tests.support.brokers import arun


def test_reset_moves_forgets_and_drops_what_was_in_flight(tmp_path: Path) -> None:
    async def run() -> None:
        async with await Broker.open(Config(data_dir=tmp_path / "data"), background=False) as broker:
            await broker.create_topic("t", 1)
            await broker.send_batch([OutgoingMessage("t", f"m{i}".encode()) for i in range(4)])
            got = await broker.receive("g", "t", batch_size=2, invisible_duration_ms=60_000)
            assert [r.message.body for r in got] == [b"m0", b"m1"]
            assert broker.inflight_handle("g", "t", 0, 0) == got[0].receipt_handle
            assert await broker.reset_group("g", "t", {0: 1}) == 2  # both in flight dropped
            assert broker.inflight_handle("g", "t", 0, 0) is None
            again = await broker.receive("g", "t", batch_size=10, invisible_duration_ms=60_000)
            assert [r.message.body for r in again] == [b"m1", b"m2", b"m3"]
            await broker.make_visible("g", "t", again[0].receipt_handle)
            back = await broker.receive("g", "t", batch_size=10, invisible_duration_ms=60_000)
            assert [(r.message.body, r.delivery_attempt) for r in back] == [(b"m1", 2)]
            await broker.reset_group("g", "t", None)  # forgotten: starts at the queue's start again
            assert [r.message.body for r in await broker.receive("g", "t", batch_size=10)] == \
                [b"m0", b"m1", b"m2", b"m3"]
            with pytest.raises(InvalidQueueId):
                await broker.reset_group("g", "t", {3: 0})
            assert await broker.start_group_at_end("new", "t")
            assert not await broker.start_group_at_end("new", "t")  # it has offsets now
            assert await broker.receive("new", "t", batch_size=10) == []

    arun(run())


def test_offset_at_time_finds_the_first_message_stored_at_or_after(tmp_path: Path) -> None:
    async def run() -> None:
        async with await Broker.open(Config(data_dir=tmp_path / "data"), background=False) as broker:
            await broker.create_topic("t", 1)
            stamps = []
            for i in range(5):
                (result,) = await broker.send_batch([OutgoingMessage("t", f"m{i}".encode())])
                stamps.append((await broker.read("t", 0, result.queue_offset, 1))[0].store_ms)
            assert await broker.offset_at_time("t", 0, 0) == 0
            assert await broker.offset_at_time("t", 0, stamps[-1] + 1) == 5
            for i, stamp in enumerate(stamps):
                first = stamps.index(stamp)  # messages stored in the same ms: the first of them
                assert await broker.offset_at_time("t", 0, stamp) == first, (i, stamps)

    arun(run())
