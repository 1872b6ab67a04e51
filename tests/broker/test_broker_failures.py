"""A broker whose background work fails must refuse work and release every waiting sender."""

from __future__ import annotations

import asyncio
import os

import pytest

from chronoq.errors import BrokerClosed, FlushFailed
from chronoq.model import OutgoingMessage
from chronoq.store import group_commit
from tests.support.brokers import SimulatedBrokers


def test_a_dying_flusher_fails_waiting_senders_instead_of_hanging(brokers: SimulatedBrokers, monkeypatch) -> None:
    async def body() -> None:
        broker = await brokers.open()
        await broker.send(OutgoingMessage("t", b"before"))

        def explode(fds: list[int]) -> None:
            raise RuntimeError("simulated flusher bug")

        monkeypatch.setattr(group_commit, "_fsync_all", explode)
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"lost?")), 5)
        assert broker.fatal is not None
        with pytest.raises(BrokerClosed):
            await broker.send(OutgoingMessage("t", b"after"))
        monkeypatch.undo()
        await broker.close()

    asyncio.run(body())


def test_an_fsync_error_fails_the_senders_it_covered_and_later_writes(brokers: SimulatedBrokers, monkeypatch) -> None:
    async def body() -> None:
        broker = await brokers.open()

        def eio(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", eio)
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"x")), 5)
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"y")), 5)
        monkeypatch.undo()
        await broker.close()

    asyncio.run(body())


def test_a_send_whose_sender_went_away_after_the_write_is_answered_to_its_retry(brokers: SimulatedBrokers) -> None:
    """A client's deadline cancels the send's handler while it waits for durability, after its
    record was written. The record becomes durable all the same; the handler used to forget the
    id, so the client's retry stored the message a second time, and a retry already waiting was
    told the broker had closed."""
    async def body() -> None:
        broker = await brokers.open()
        try:
            msg = OutgoingMessage("t", b"x", message_id="ID-1")
            first = asyncio.ensure_future(broker.send(msg))
            await asyncio.sleep(0)  # written; waiting for its group commit
            overlapping = asyncio.ensure_future(broker.send(msg))  # a retry while the first waits
            await asyncio.sleep(0)
            first.cancel()  # what grpc.aio does to the handler when the client's deadline passes
            with pytest.raises(asyncio.CancelledError):
                await first
            waited = await asyncio.wait_for(overlapping, 5)
            later = await broker.send(msg)  # a retry after the first was cancelled
            assert waited.duplicate and later.duplicate
            assert waited.position == later.position
            stored = [m for q in range(broker.topics.get("t").queue_count)
                      for m in await broker.read("t", q, 0, 10) if m.message_id == "ID-1"]
            assert len(stored) == 1
        finally:
            await broker.close()

    asyncio.run(body())
