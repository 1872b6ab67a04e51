"""Memory limits that keep the broker flat under a large timer backlog: the dedupe window's count
bound (and that a duplicate inside it still gets the original result, recall handle included),
and the RocksDB sizes of the timer index and the group store, read back from the OPTIONS file
RocksDB writes at open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config, ConfigError
from chronoq.dedupe import DedupeWindow
from chronoq.model import OutgoingMessage as Msg
from chronoq.model import SendResult
from chronoq.store import files
from chronoq.store.groups import GroupStore
from chronoq.timer.index import RocksTimerIndex
from chronoq.timer.index_codec import COLUMN_FAMILIES
from chronoq.timer.recall import encode_recall_handle
from tests.support.brokers import SimulatedBrokers, open_broker

MiB = 1024 * 1024



def test_the_dedupe_window_forgets_its_oldest_ids_past_its_count_bound(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        due_ms = clock.now_ms() + 60_000
        first = await broker.send_batch([Msg("orders", b"x", message_id=f"id-{i}", deliver_at_ms=due_ms)
                                         for i in range(4)])
        assert len(broker.accept.recent) == 3
        end = broker.store.log.end_position
        # id-1..id-3 are inside the bound: a retry stores nothing and gets every original field.
        again = await broker.send(Msg("orders", b"x", message_id="id-3", deliver_at_ms=due_ms))
        assert broker.store.log.end_position == end
        assert again.duplicate and not first[3].duplicate
        assert again == SendResult(**{**_fields(first[3]), "duplicate": True})
        assert again.recall_handle is not None
        # id-0 was evicted by the count bound (well inside dedupe_window_ms): stored again.
        evicted = await broker.send(Msg("orders", b"x", message_id="id-0", deliver_at_ms=due_ms))
        assert not evicted.duplicate and evicted.position >= end
        assert len(broker.accept.recent) == 3

    run_broker(body, dedupe_window_max_entries=3)


def test_a_duplicate_of_a_normal_message_keeps_its_fields(run_broker: Callable) -> None:
    async def body(broker: Broker, clock: FakeClock) -> None:
        first = await broker.send(Msg("orders", b"x", message_id="plain", queue_id=1))
        clock.advance(1000)
        again = await broker.send(Msg("orders", b"y", message_id="plain"))
        assert again == SendResult(**{**_fields(first), "duplicate": True})
        assert again.deliver_at_ms is None and again.recall_handle is None

    run_broker(body)


def _fields(r: SendResult) -> dict[str, Any]:
    return {name: getattr(r, name) for name in SendResult.__slots__}


def test_the_window_expires_by_age_and_by_count_in_insertion_order() -> None:
    window = DedupeWindow(window_ms=100, max_entries=2)
    handle = encode_recall_handle("t", 5_000, "a")
    window.add(("t", "a"), 0, SendResult("a", "t", 1, 7, 700, 5_000, handle))
    window.add(("t", "b"), 50, SendResult("b", "t", 0, 8, 800))
    assert window.get(("t", "a")) == SendResult("a", "t", 1, 7, 700, 5_000, handle, True)
    assert window.get(("u", "a")) is None  # per topic
    window.expire(100)  # "a" is exactly window_ms old: kept
    assert ("t", "a") in window
    window.expire(101)
    assert ("t", "a") not in window and ("t", "b") in window
    window.add(("t", "c"), 60, SendResult("c", "t", 0, 9, 900))
    window.add(("t", "d"), 61, SendResult("d", "t", 0, 10, 1000))
    assert [k in window for k in (("t", "b"), ("t", "c"), ("t", "d"))] == [False, True, True]
    assert len(window) == 2
    # Re-adding a key moves it to the newest end (the deque holds each key once).
    window.add(("t", "c"), 62, SendResult("c", "t", 0, 11, 1100))
    window.add(("t", "e"), 63, SendResult("e", "t", 0, 12, 1200))
    assert [k in window for k in (("t", "c"), ("t", "d"), ("t", "e"))] == [True, False, True]
    assert window.get(("t", "c")) == SendResult("c", "t", 0, 11, 1100, duplicate=True)


def test_a_cancel_forgets_an_id_only_if_the_send_remembered_is_the_cancelled_timer() -> None:
    """An id reused after the window names a second timer, due at another time; a cancel of the
    first used to forget the second's result too, and a retry of the second send then stored a
    copy that fired as well."""
    window = DedupeWindow(window_ms=100, max_entries=10)
    window.add(("t", "X"), 0, SendResult("X", "t", 0, 8, 800, 9_000, encode_recall_handle("t", 9_000, "X")))
    window.discard(("t", "X"), 5_000)  # the first timer of X, due at 5,000: not the one remembered
    assert window.get(("t", "X")) is not None
    window.discard(("t", "X"), 9_000)
    assert window.get(("t", "X")) is None
    window.add(("t", "Y"), 1, SendResult("Y", "t", 0, 9, 900))
    window.discard(("t", "Y"))  # no due time: forgotten whatever it was
    assert ("t", "Y") not in window and len(window) == 0


def test_the_window_holds_any_queue_id_a_record_holds() -> None:
    """Queue ids were packed in 16 bits while a record holds 32: remembering a send to queue
    70,000 raised after the record was durable."""
    window = DedupeWindow(window_ms=100, max_entries=2)
    window.add(("t", "a"), 0, SendResult("a", "t", 70_000, 7, 700))
    assert window.get(("t", "a")) == SendResult("a", "t", 70_000, 7, 700, duplicate=True)


def test_a_send_that_fails_after_it_is_durable_does_not_hang_later_sends_of_its_id(brokers: SimulatedBrokers,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any failure between durability and the answer (remembering the result failed, here) used
    to leave the id marked in flight, so every later send of it waited forever."""
    async def body() -> None:
        broker = await brokers.open(Config(data_dir=tmp_path / "data"))
        try:
            real_add = broker.accept.recent.add

            def add_fails(*args: Any) -> None:
                monkeypatch.setattr(broker.accept.recent, "add", real_add)
                raise RuntimeError("injected: the result could not be remembered")

            monkeypatch.setattr(broker.accept.recent, "add", add_fails)
            with pytest.raises(RuntimeError, match="injected"):
                await broker.send(Msg("orders", b"x", message_id="ID1"))
            again = await asyncio.wait_for(broker.send(Msg("orders", b"x", message_id="ID1")), 5)
            assert again.message_id == "ID1"
        finally:
            await broker.close()

    asyncio.run(body())


def test_memory_limits_must_be_positive(tmp_path: Path) -> None:
    for name in ("dedupe_window_max_entries", "timer_index_block_cache_bytes", "timer_index_write_buffer_bytes",
                 "groups_block_cache_bytes", "groups_write_buffer_bytes"):
        with pytest.raises(ConfigError, match=name):
            Config(data_dir=tmp_path, **{name: 0})


def _rocksdb_options(directory: Path) -> str:
    (newest,) = sorted(directory.glob("OPTIONS-*"))[-1:]
    return newest.read_text()


def test_the_timer_index_opens_with_the_given_memory_sizes(tmp_path: Path) -> None:
    index = RocksTimerIndex.open(tmp_path / "timer", block_cache_bytes=5 * MiB, write_buffer_bytes=7 * MiB)
    index.close()
    text = _rocksdb_options(tmp_path / "timer")
    assert f"db_write_buffer_size={7 * MiB}" in text
    # Index and filter blocks are charged to the cache in every column family chronoq uses.
    sections = text.split("[TableOptions/BlockBasedTable ")[1:]
    ours = [s for s in sections if not s.startswith('"default"')]
    assert len(ours) == len(COLUMN_FAMILIES) == 8
    assert all("cache_index_and_filter_blocks=true" in s for s in ours)


def test_the_group_store_opens_with_the_given_memory_sizes(tmp_path: Path) -> None:
    GroupStore(tmp_path / "groups", block_cache_bytes=3 * MiB, write_buffer_bytes=6 * MiB).close()
    text = _rocksdb_options(tmp_path / "groups")
    assert f"db_write_buffer_size={6 * MiB}" in text
    assert f"write_buffer_size={3 * MiB}" in text
    assert "cache_index_and_filter_blocks=true" in text


def test_the_broker_passes_its_configured_memory_sizes_to_both_stores(tmp_path: Path) -> None:
    async def body() -> None:
        config = Config(data_dir=tmp_path, timer_index_write_buffer_bytes=9 * MiB, groups_write_buffer_bytes=10 * MiB)
        broker = await open_broker(config, background=False)
        await broker.close()

    asyncio.run(body())
    assert f"db_write_buffer_size={9 * MiB}" in _rocksdb_options(tmp_path / files.TIMER_DIR)
    assert f"db_write_buffer_size={10 * MiB}" in _rocksdb_options(tmp_path / files.GROUPS_DIR)
