"""The blocking SDK is derived from the async one: every public async method has a working twin.

Structural: each public coroutine method of `AsyncAdmin`, `AsyncProducer` and `AsyncConsumer`
(inherited ones included) has a blocking twin of the same signature on `Admin`, `Producer`,
`Consumer`, and each public async generator a plain-generator twin; a public callable that gets
no twin is refused by name instead of handing out a coroutine. Working: the twins run against a
real `chronoq serve`, including the ones that used to be missing (`receive_stream` returned an
async generator blocking code could never run; `fire_timers` and `StoredRecord.position` were
what the Spark job's own JSON client existed for).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import pydoc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronoq.client import (
    Admin,
    ArmOutcome,
    ArmResult,
    AsyncAdmin,
    AsyncConsumer,
    AsyncProducer,
    ClientClosed,
    Consumer,
    FireOutcome,
    InvalidArgument,
    Producer,
    RequestTimedOut,
)
from chronoq.client.sync import _derive_twins, _SyncClient
from chronoq.client.testing import ServerProcess
from chronoq.model import TIMER_TOPIC

PAIRS = [(Admin, AsyncAdmin), (Producer, AsyncProducer), (Consumer, AsyncConsumer)]


def _public_async(cls: type) -> list[tuple[str, object]]:
    return [(name, member) for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and (inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member))]


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_every_public_async_method_has_a_blocking_twin_of_the_same_signature(sync_cls: type,
                                                                            async_cls: type) -> None:
    names = _public_async(async_cls)
    assert names, async_cls
    for name, member in names:
        twin = inspect.getattr_static(sync_cls, name, None)
        assert twin is not None, f"{sync_cls.__name__}.{name} is missing"
        assert not inspect.iscoroutinefunction(twin) and not inspect.isasyncgenfunction(twin), name
        if inspect.isasyncgenfunction(member):
            assert inspect.isgeneratorfunction(twin), f"{sync_cls.__name__}.{name} must be a plain generator"
        assert list(inspect.signature(twin).parameters) == list(inspect.signature(member).parameters), name  # type: ignore[arg-type]
        assert twin.__doc__ == member.__doc__


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_help_shows_the_async_signatures_not_args_and_kwargs(sync_cls: type, async_cls: type) -> None:
    """`inspect.signature` and `help()` show a blocking client's real parameters: the constructor's
    (before, `Producer(*args, **kwargs)`, its forwarding `__init__`), and every method's in full,
    annotations and defaults included; a stream twin returns a plain `Iterator`."""
    assert inspect.signature(sync_cls) == inspect.signature(async_cls)
    assert f"{sync_cls.__name__}{inspect.signature(async_cls)}" in pydoc.render_doc(sync_cls, renderer=pydoc.plaintext)
    for name, member in _public_async(async_cls):
        twin = getattr(sync_cls, name)
        expected = inspect.signature(member)  # type: ignore[arg-type]
        if inspect.isasyncgenfunction(member):
            expected = expected.replace(return_annotation="Iterator[Any]")
        assert inspect.signature(twin) == expected, name
        if name not in vars(_SyncClient):  # close(): the sync client's own, not a derived twin
            assert twin.__wrapped__ is member, name


def test_a_public_callable_without_a_twin_is_refused_by_name() -> None:
    class WithHelper(AsyncAdmin):
        def helper(self) -> int:
            return 1

    class Blocking(_SyncClient):
        _async_cls = WithHelper

    _derive_twins(Blocking)
    with Blocking("127.0.0.1:1") as client:
        assert client.server == "127.0.0.1:1"  # plain values still read through
        with pytest.raises(AttributeError, match=r"Blocking.helper: WithHelper.helper has no blocking twin"):
            _ = client.helper


@pytest.fixture(scope="module")
def spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # timer_firer = "spark": the broker fires by itself only timers due within a second (its hand-off
    # horizon) and those handed over (ArmTimers); the others, for 60 s (its backstop), only by FireTimers.
    with ServerProcess(tmp_path_factory.mktemp("twins") / "data",
                       settings={"timer_firer": "spark", "timer_handoff_horizon_ms": 1000}) as proc:
        yield proc.address


def test_receive_stream_is_a_plain_generator_against_a_real_server(spark_server: str) -> None:
    with Producer(spark_server) as producer, Consumer("g", "streamed", server=spark_server) as consumer:
        producer.create_topic("streamed", queue_count=1)
        sent = [producer.send("streamed", f"m{i}").message_id for i in range(3)]
        got = []
        for msg in consumer.receive_stream(8, wait=2000):
            got.append(msg.message_id)
            consumer.ack(msg)
            if len(got) == 3:
                break  # leaving the loop closes the stream on the client's loop
        assert got == sent
        assert consumer.receive(8) == []


def test_fire_timers_and_record_positions_through_the_blocking_sdk(spark_server: str, tmp_path: Path) -> None:
    with Admin(spark_server) as admin, Producer(spark_server) as producer:
        receipt = producer.send("fired-by-job", "t", deliver_at=int(time.time() * 1000) + 1500)
        assert receipt.deliver_at_ms is not None
        records = [r for q in admin.describe_topic(TIMER_TOPIC).queues
                   for r in admin.read(TIMER_TOPIC, q.queue_id, q.min_offset, 64).messages
                   if r.message_id == receipt.message_id]
        assert len(records) == 1 and records[0].position is not None
        time.sleep(max(0.0, (receipt.deliver_at_ms - time.time() * 1000) / 1000) + 0.05)
        assert admin.fire_timers([records[0].position]) == FireOutcome(fired=1, skipped=0)
        assert admin.fire_timers([records[0].position]) == FireOutcome(fired=0, skipped=1)
        assert admin.query(receipt.message_id)[0].state == "delivered"


def test_setting_a_blocking_clients_attribute_reaches_the_client_it_runs(spark_server: str) -> None:
    """`p.timeout_ms = 1` used to be stored on the wrapper and ignored by every call."""
    with Producer(spark_server) as producer, Consumer("g", "settings", server=spark_server) as consumer:
        producer.send("settings", "warm")
        producer.send_attempts = 1
        producer.timeout_ms = 1
        assert producer.timeout_ms == 1 and producer._impl.timeout_ms == 1
        with pytest.raises(RequestTimedOut):
            producer.send("settings", "x" * 2_000_000)  # 1 ms is too short to store 2 MB durably
        producer.timeout_ms = 10_000
        producer.send("settings", "y")
        consumer.group = "other"
        assert consumer._impl.group == "other"
        with pytest.raises(InvalidArgument, match="max_batch"):
            producer.max_batch = 0
        with pytest.raises(AttributeError, match=r"cannot set Producer.server = .*fixed when the client is made"):
            producer.server = "127.0.0.1:1"
        with pytest.raises(AttributeError, match=r"Producer.timeout = 5: AsyncProducer has no such setting"):
            producer.timeout = 5


def _loop_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("chronoq-"))


def test_a_blocking_client_dropped_without_close_ends_its_thread(spark_server: str) -> None:
    """Each dropped, unclosed client used to leave its loop thread, loop and channel behind."""
    before = _loop_threads()

    def use_and_forget(i: int) -> None:
        Producer(spark_server).send("forgotten", f"m{i}")

    for i in range(5):
        use_and_forget(i)
    gc.collect()
    assert _loop_threads() == before
    closed = Producer(spark_server)
    closed.close()
    closed.close()  # a second close, and the collector after it, do nothing
    del closed
    gc.collect()
    assert _loop_threads() == before


@pytest.mark.slow
def test_close_from_another_thread_interrupts_a_long_poll_with_client_closed(spark_server: str) -> None:
    """It used to surface as a bare concurrent.futures.CancelledError (the async client's as an
    asyncio.CancelledError, though nobody had cancelled the caller's task)."""
    consumer = Consumer("g", "closed-under", server=spark_server)
    consumer.create_topic("closed-under", queue_count=1)
    outcome: list[BaseException | list[object]] = []

    def wait() -> None:
        try:
            outcome.append(consumer.receive(4, wait=15_000))
        except BaseException as e:  # the test inspects whatever arrives
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.0)
    consumer.close()
    waiter.join(10)
    assert not waiter.is_alive()
    [err] = outcome
    assert isinstance(err, ClientClosed) and err.details == {"call": "ReceiveMessage", "during": True}, err
    with pytest.raises(ClientClosed, match="is closed"):
        consumer.receive(1)

    async def async_side() -> None:
        async with AsyncConsumer("g", "closed-under", server=spark_server) as c:
            task = asyncio.create_task(c.receive(4, wait=15_000))
            await asyncio.sleep(1.0)
            await c.close()
            with pytest.raises(ClientClosed):
                await task
            cancelled = asyncio.create_task(c.receive(4, wait=15_000))  # reopens the channel
            await asyncio.sleep(0.5)
            cancelled.cancel()  # the caller's own cancellation stays a CancelledError
            with pytest.raises(asyncio.CancelledError):
                await cancelled

    asyncio.run(async_side())


def test_arm_timers_through_the_blocking_sdk(spark_server: str) -> None:
    """A timer accepted within the hand-off horizon is the broker's own: an arm of it is a
    repeat, it fires at its due time without the job, and an arm after that says it fired."""
    with Admin(spark_server) as admin, Producer(spark_server) as producer:
        receipt = producer.send("armed-by-job", "t", deliver_at=int(time.time() * 1000) + 300)
        assert receipt.deliver_at_ms is not None
        position = next(r.position for q in admin.describe_topic(TIMER_TOPIC).queues
                        for r in admin.read(TIMER_TOPIC, q.queue_id, q.min_offset, 64).messages
                        if r.message_id == receipt.message_id)
        assert position is not None
        timer = (position, "armed-by-job", receipt.message_id)
        first = admin.arm_timers([timer])
        assert first == ArmOutcome((ArmResult(position, "already_armed"),)) and first.count("already_armed") == 1
        deadline = time.monotonic() + 10
        while admin.query(receipt.message_id)[0].state != "delivered":
            assert time.monotonic() < deadline, "the armed timer did not fire"
            time.sleep(0.05)
        status = admin.query(receipt.message_id)[0]
        assert status.fired_ms is not None and status.fired_ms >= receipt.deliver_at_ms
        again = admin.arm_timers([timer]).results[0]
        assert again.result == "fired" and again.reason is not None and "has fired" in again.reason
