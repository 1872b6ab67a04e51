"""A broker whose background work fails must refuse work and release every waiting sender."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.errors import BrokerClosed, FlushFailed
from chronoq.model import OutgoingMessage
from chronoq.store import commitlog


def test_a_dying_flusher_fails_waiting_senders_instead_of_hanging(tmp_path: Path, monkeypatch) -> None:
    async def body() -> None:
        broker = await Broker.open(Config(data_dir=tmp_path), clock=FakeClock(), background=False)
        await broker.send(OutgoingMessage("t", b"before"))

        def explode(fds: list[int]) -> None:
            raise RuntimeError("simulated flusher bug")

        monkeypatch.setattr(commitlog, "_fsync_all", explode)
        with pytest.raises(FlushFailed):
            await asyncio.wait_for(broker.send(OutgoingMessage("t", b"lost?")), 5)
        assert broker.fatal is not None
        with pytest.raises(BrokerClosed):
            await broker.send(OutgoingMessage("t", b"after"))
        monkeypatch.undo()
        await broker.close()

    asyncio.run(body())


def test_an_fsync_error_fails_the_senders_it_covered_and_later_writes(tmp_path: Path, monkeypatch) -> None:
    async def body() -> None:
        broker = await Broker.open(Config(data_dir=tmp_path), clock=FakeClock(), background=False)

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
