"""The commit log's sync thread: calls run in order, off the loop, and each outcome reaches its
`done` callback and its future; a future nobody waits for any more does not break the thread,
nor lose the outcome."""

from __future__ import annotations

import asyncio
import threading

from chronoq.store.group_commit import SyncThread


def test_calls_run_in_order_on_the_thread_and_errors_reach_their_future() -> None:
    seen: list[tuple[int, str]] = []

    def record(n: int) -> None:
        seen.append((n, threading.current_thread().name))
        if n == 2:
            raise OSError(5, "Input/output error")

    async def main() -> None:
        worker = SyncThread("test-sync")
        loop = asyncio.get_running_loop()
        try:
            outcomes: list[BaseException | None] = []
            futs = [worker.run(loop, record, n, outcomes.append) for n in range(4)]
            done = await asyncio.gather(*futs, return_exceptions=True)
        finally:
            worker.stop()
        assert done[0] is None and done[1] is None and done[3] is None
        assert isinstance(done[2], OSError) and done[2].errno == 5
        assert outcomes == done

    asyncio.run(main())
    assert seen == [(0, "test-sync"), (1, "test-sync"), (2, "test-sync"), (3, "test-sync")]


def test_a_cancelled_waiter_does_not_stop_later_calls_nor_lose_the_outcome() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def slow(n: int) -> None:
        gate.wait(5)
        ran.append(n)
        if n == 1:
            raise OSError(5, "Input/output error")

    async def main() -> None:
        worker = SyncThread("test-sync")
        loop = asyncio.get_running_loop()
        outcomes: list[BaseException | None] = []
        first = worker.run(loop, slow, 1, outcomes.append)
        first.cancel()  # the flusher stopped while its fsync ran
        second = worker.run(loop, slow, 2, outcomes.append)
        gate.set()
        await asyncio.wait_for(second, 5)
        worker.stop()
        assert first.cancelled()
        assert isinstance(outcomes[0], OSError) and outcomes[1:] == [None]  # the error still arrived

    asyncio.run(main())
    assert ran == [1, 2]  # the cancelled call still ran to its end, as a system call does


def test_stop_waits_for_the_calls_already_queued() -> None:
    ran: list[int] = []

    async def main() -> None:
        worker = SyncThread("test-sync")
        loop = asyncio.get_running_loop()
        for n in range(3):
            worker.run(loop, ran.append, n, _ignore)
        worker.stop()  # joins: every queued call has run by now

    asyncio.run(main())
    assert ran == [0, 1, 2]


def test_outcome_after_the_loop_closed_is_dropped_and_the_thread_goes_on() -> None:
    gate = threading.Event()
    finished = threading.Event()

    def slow(_n: int) -> None:
        gate.wait(5)
        finished.set()

    worker = SyncThread("test-sync")

    async def leave_one_running() -> None:
        worker.run(asyncio.get_running_loop(), slow, 0, _ignore)

    asyncio.run(leave_one_running())  # the loop closes with the call still running
    gate.set()
    assert finished.wait(5)
    ran: list[int] = []

    async def next_call() -> None:
        await asyncio.wait_for(worker.run(asyncio.get_running_loop(), ran.append, 1, _ignore), 5)

    try:
        asyncio.run(next_call())  # the thread survived handing its outcome to a closed loop
    finally:
        worker.stop()
    assert ran == [1]


def _ignore(_outcome: BaseException | None) -> None:
    pass
