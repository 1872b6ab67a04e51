"""The blocking SDK: `Admin`, `Producer`, `Consumer`, twins of the asyncio classes.

Theory of operation: the SDK is written once, async (`chronoq.client.aio`). Each sync client
owns a private event-loop thread and its async twin, created on that loop; every method hands
the twin's coroutine to the loop and waits for the result (the httpcore habit of one source of
truth, reached by a portal rather than by code generation).

Why a loop thread and not unasync-style generation: unasync rewrites `async def`/`await` into
plain code, which works when the sync face has a sync transport with the same API. grpc's sync
and aio stubs differ (streaming calls, channel types, error classes), so generated code would
need hand-written exceptions in exactly the places that matter, the RPC calls; a portal keeps
one implementation for every code path. The cost is one thread per client and a hop per call
(tens of microseconds; a call is a network round trip anyway).

The loop thread belongs to the client: `close()` (or leaving `with`) closes the twin's channel,
stops the loop and joins the thread; a call another thread is still waiting in (a long-polling
`receive`) raises `ClientClosed`, and so does any call after. A client a program drops without
closing is closed the same way when it is garbage collected (a `weakref.finalize`, which also
runs at interpreter exit), so forgotten clients do not pile up threads, loops and channels. It is
a daemon thread so that a client a program forgets to close cannot keep the interpreter alive.

The blocking methods are derived, not listed: `_derive_twins` walks each async class and gives
the sync class a twin of every public coroutine method (it runs on the portal) and of every
public async generator (a plain generator pulling one item at a time through the portal), with
the same name, signature and docstring; the sync class shows its async class's constructor
signature (`inspect.signature(Producer)`, `help(Producer)`). A new async method therefore has its twin the moment it
exists, and nothing can drift. Attribute reads pass through to the async client only for plain
values (`server`, `group`, ...): a public callable the derivation did not make a twin of is
refused by name, rather than handing blocking code a coroutine it can never run. Attribute writes
pass through for the async class's `SETTINGS` (`timeout_ms`, `send_attempts`, `group`...), which
it checks and every call reads; any other public name is refused with AttributeError, since a
value stored on the wrapper would silently change nothing.
`tests/client/test_sync_twins.py` checks every public async method.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from chronoq.client.aio import AsyncAdmin, AsyncConsumer, AsyncProducer
from chronoq.client.errors import ClientClosed

T = TypeVar("T")


class _LoopThread:
    """An event loop running in its own thread; `call` runs a coroutine there and waits."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # Calls still running (other threads wait on them) are cancelled and run to their end,
        # so no waiter is left with a future that never completes.
        left = asyncio.all_tasks(self._loop)
        for task in left:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def call(self, coro: Coroutine[Any, Any, T], what: str | None = None) -> T:
        """Run `coro` on the loop and wait; `what` names the call in a `ClientClosed`."""
        what = what or getattr(coro, "__qualname__", type(coro).__name__)
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync chronoq client cannot be called from its own loop thread")
        if self._stopping or not self._thread.is_alive():
            coro.close()
            raise ClientClosed(what, during=False)
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except concurrent.futures.CancelledError:
            # Only the shutdown cancels a call of ours: the client was closed while it waited.
            if self._stopping:
                raise ClientClosed(what, during=True) from None
            raise

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def shut(self, impl: AsyncAdmin) -> None:
        """Close `impl`'s channel on the loop, then stop the loop and end the thread. For
        `close()` and for the garbage collector's finalizer, which may run on any thread,
        this loop's own included: there it cannot wait for its own loop, so it schedules both."""
        if self._stopping or not self._thread.is_alive():
            return
        if threading.current_thread() is self._thread:
            self._stopping = True
            task = self._loop.create_task(impl.close())
            task.add_done_callback(lambda _: self._loop.stop())
            return
        try:
            self.call(impl.close())  # a call waiting on the channel then raises ClientClosed
        finally:
            self.stop()


class _SyncClient:
    _async_cls: type[AsyncAdmin] = AsyncAdmin

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._portal = _LoopThread(f"chronoq-{type(self).__name__}")

        async def build() -> AsyncAdmin:
            return self._async_cls(*args, **kwargs)

        try:
            self._impl = self._portal.call(build())
        except BaseException:
            self._portal.stop()
            raise
        # A client dropped without close() is closed when collected (or at interpreter exit):
        # the finalizer holds the portal and the twin, never this wrapper.
        self._finalizer = weakref.finalize(self, self._portal.shut, self._impl)

    @property
    def _closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()  # runs once: a second close(), or the collector after it, does nothing

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Plain attributes (server, group, topic, timeout_ms...) read through to the twin.
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._impl, name)
        if callable(value):
            raise AttributeError(f"{type(self).__name__}.{name}: {type(self._impl).__name__}.{name} has no blocking "
                                 f"twin (only its coroutine and async-generator methods get one); use "
                                 f"{type(self._impl).__name__} from asyncio code")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # A setting (timeout_ms, send_attempts, group...) is written to the twin, which every call
        # reads; anything else is refused, since a value kept on this wrapper would change nothing.
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        settings = self._impl.SETTINGS
        if name in settings:
            setattr(self._impl, name, value)  # checked there (InvalidArgument); read by the next call
            return
        why = ("it is fixed when the client is made: make a new client" if hasattr(self._impl, name)
               else f"{type(self._impl).__name__} has no such setting")
        raise AttributeError(f"cannot set {type(self).__name__}.{name} = {value!r}: {why} "
                             f"(settings: {', '.join(sorted(settings))})")


def _twin(async_cls: type, name: str) -> Callable[..., Any]:
    """A blocking method that runs the async method `name` on the client's loop thread."""
    target = getattr(async_cls, name)

    @functools.wraps(target)
    def method(self: _SyncClient, *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(getattr(self._impl, name)(*args, **kwargs))

    return method


def _stream_twin(async_cls: type, name: str) -> Callable[..., Iterator[Any]]:
    """A plain generator over the async generator `name`: each item is one `__anext__` on the
    client's loop thread; closing the generator (or leaving its `for`) closes the async one."""
    target = getattr(async_cls, name)

    @functools.wraps(target)
    def method(self: _SyncClient, *args: Any, **kwargs: Any) -> Iterator[Any]:
        async def start() -> AsyncIterator[Any]:
            return getattr(self._impl, name)(*args, **kwargs)

        stream = self._portal.call(start())
        try:
            while True:
                try:
                    item = self._portal.call(stream.__anext__(), name)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self._closed:  # a closed client already shut its loop, and the stream with it
                self._portal.call(stream.aclose(), name)

    method.__annotations__ = {**target.__annotations__, "return": "Iterator[Any]"}
    # `inspect.signature` would follow `__wrapped__` to the async generator's `-> AsyncIterator`.
    method.__signature__ = inspect.signature(target).replace(return_annotation="Iterator[Any]")  # type: ignore[attr-defined]
    return method


def _derive_twins(sync_cls: type[_SyncClient]) -> None:
    """Give `sync_cls` a twin of every public coroutine and async-generator method of its async
    class (inherited ones included); `close` and the context-manager methods are its own. The class
    takes the async class's constructor signature too (`inspect.signature`, `help()`): its own
    `__init__` forwards `*args, **kwargs`, which says nothing to a reader."""
    sync_cls.__signature__ = inspect.signature(sync_cls._async_cls)  # type: ignore[attr-defined]
    for name, member in inspect.getmembers(sync_cls._async_cls):
        if name.startswith("_") or name in vars(_SyncClient):
            continue
        if inspect.iscoroutinefunction(member):
            setattr(sync_cls, name, _twin(sync_cls._async_cls, name))
        elif inspect.isasyncgenfunction(member):
            setattr(sync_cls, name, _stream_twin(sync_cls._async_cls, name))


class Admin(_SyncClient):
    """Blocking twin of `AsyncAdmin`."""

    _async_cls = AsyncAdmin


class Producer(_SyncClient):
    """Blocking twin of `AsyncProducer`: `send`, `send_batch`, `recall`, `cancel` and the admin calls."""

    _async_cls = AsyncProducer


class Consumer(_SyncClient):
    """Blocking twin of `AsyncConsumer`: `receive`, `receive_stream` (a plain generator), `ack`,
    `change_invisible` and the admin calls."""

    _async_cls = AsyncConsumer


for _cls in (Admin, Producer, Consumer):
    _derive_twins(_cls)
