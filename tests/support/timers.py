"""Shared helpers for the broker-level timer tests (simulated time unless said otherwise).

Theory of operation: every test opens a simulated broker (`tests.support.brokers.simulated_broker`:
a real `Broker` on a temporary data directory with a `FakeClock` and `background=False`), so time
moves only when the test says and timers fire only when it calls `run_due()`. A restart is
`close()` + open again on the same directory with the same clock. A crash between two steps is
simulated without mocks by copying derived state (the timer index directory) aside and putting
the old copy back before the reopen: the broker then sees exactly what it would after a process
death at that point (a log ahead of its index).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from chronoq.broker import Broker
from chronoq.model import SYS_FIRED_FROM, SYS_TIMER_OUT_MS, StoredMessage
from chronoq.store import files
from chronoq.store.messagestore import MessageStore

T = TypeVar("T")
START_MS = 1_700_000_000_000
GROUP = "g-timer"


def fired_messages(store: MessageStore, topic: str) -> list[StoredMessage]:
    """Every fired timer the queues of `topic` hold, as a consumer reads it (through the link
    record that fired it; a delay level's or an older broker's fired copy as stored): what
    consumers of any group would get, once per time it fired."""
    out = []
    for qid in range(store.get_topic(topic).queue_count):
        cq = store.queue(topic, qid)
        offset = cq.min_offset
        while offset < cq.next_offset:
            entries = cq.read_range(offset, cq.next_offset - offset)  # (one file at a time)
            if not entries:
                break
            for off, position, size, _ in entries:
                m = store.readable_entry(topic, qid, off, position, size)
                if m is not None and SYS_FIRED_FROM in m.system_properties:
                    out.append(m)
            offset = entries[-1][0] + 1
    return out


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def run_without_cycle_collector(coro: Awaitable[T]) -> T:
    """`run` with the cyclic garbage collector off, for tests where a failed RocksDB write is
    followed by a reopen: a kept error (its traceback holds the failed call's frames) or a
    reference cycle keeps the old handle and its lock, and a collection that happens to run
    first would hide that (the test would pass or fail with the order the suite runs in)."""
    import gc

    gc.disable()
    try:
        return asyncio.run(coro)  # type: ignore[arg-type]
    finally:
        gc.enable()


async def drain(broker: Broker, topic: str, group: str = GROUP) -> list[StoredMessage]:
    """Receive and ack everything visible now on `topic`, in the order handed out."""
    out: list[StoredMessage] = []
    while True:
        got = await broker.receive(group, topic, batch_size=broker.config.max_receive_batch)
        if not got:
            return out
        for r in got:
            await broker.ack(group, topic, r.receipt_handle)
            out.append(r.message)


def due_of(msg: StoredMessage) -> int:
    return int(msg.system_properties[SYS_TIMER_OUT_MS])


def assert_not_early(msgs: list[StoredMessage], requested_due_ms: dict[str, int] | None = None) -> None:
    """Each delivered copy was stored no earlier than its due time (and than what was asked)."""
    for m in msgs:
        assert m.store_ms >= due_of(m), (m.message_id, m.store_ms, due_of(m))
        if requested_due_ms is not None:
            assert m.store_ms >= requested_due_ms[m.message_id], (m.message_id, m.store_ms)


def timer_dir(data_dir: Path) -> Path:
    return data_dir / files.TIMER_DIR


def snapshot_index(data_dir: Path, to: Path) -> None:
    """Copy the (closed) broker's timer index aside."""
    if to.exists():
        shutil.rmtree(to)
    shutil.copytree(timer_dir(data_dir), to)


def restore_index(data_dir: Path, frm: Path) -> None:
    """Put an older copy of the timer index back: the index now lags the log, as after a crash
    between a log append and the index write."""
    shutil.rmtree(timer_dir(data_dir))
    shutil.copytree(frm, timer_dir(data_dir))


def log_end(broker: Broker) -> int:
    return broker.store.log.end_position


def pending_total(broker: Broker) -> int:
    return int(broker.stats()["timer"]["pending_total"])
