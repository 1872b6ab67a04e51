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
stops the loop and joins the thread. It is a daemon thread so that a client a program forgets
to close cannot keep the interpreter alive.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from chronoq.client.aio import AsyncAdmin, AsyncConsumer, AsyncProducer

T = TypeVar("T")


class _LoopThread:
    """An event loop running in its own thread; `call` runs a coroutine there and waits."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync chronoq client cannot be called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


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
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._portal.call(self._impl.close())
            finally:
                self._portal.stop()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Plain attributes (server, group, topic, timeout_ms...) read through to the twin.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._impl, name)


def _twin(async_cls: type, name: str) -> Callable[..., Any]:
    target = getattr(async_cls, name)

    @functools.wraps(target)
    def method(self: _SyncClient, *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(getattr(self._impl, name)(*args, **kwargs))

    return method


_ADMIN_METHODS = ("ping", "create_topic", "list_topics", "describe_topic", "query", "query_key", "cancel",
                  "cancel_handle", "recall", "stats", "read")


class Admin(_SyncClient):
    """Blocking twin of `AsyncAdmin`."""

    _async_cls = AsyncAdmin


class Producer(_SyncClient):
    """Blocking twin of `AsyncProducer`: `send`, `send_batch`, `recall`, `cancel` and the admin calls."""

    _async_cls = AsyncProducer


class Consumer(_SyncClient):
    """Blocking twin of `AsyncConsumer`: `receive`, `ack`, `change_invisible` and the admin calls."""

    _async_cls = AsyncConsumer


for _cls, _names in ((Admin, _ADMIN_METHODS), (Producer, (*_ADMIN_METHODS, "send", "send_batch")),
                     (Consumer, (*_ADMIN_METHODS, "receive", "ack", "change_invisible"))):
    for _name in _names:
        setattr(_cls, _name, _twin(_cls._async_cls, _name))
