"""Server-side renewal of messages received with `auto_renew` (the PushConsumer's mode).

Theory of operation: a PushConsumer's ReceiveMessage carries `auto_renew=true` and no invisible
duration: the server chooses the duration and keeps the message invisible while the client holds
it, as the Apache proxy does. chronoq gives such messages `duration_ms`
(`default_invisible_duration_ms`) unless the request names a duration, and, while the client
holds one, extends it by `duration_ms` through `Broker.change_invisible_duration` whenever less
than a third of `duration_ms` remains.

A renewal issues a new receipt handle, but the client only knows the first one, so this table
maps the handle the client holds to the current one. Ack, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue go through `settle`, which translates the handle under the
entry's lock (a renewal and an ack never race on one handle) and forgets the entry. A message is
held at most `max_hold_ms` (`max_invisible_duration_ms`) after its receipt. Renewal also stops
for a client that says goodbye (NotifyClientTermination) or falls silent: every RPC a client
makes (its heartbeat comes every 10 s) marks it alive, and a client unheard of for
`CLIENT_SILENT_MS` is taken for crashed. Its messages then become visible again when the current
duration runs out, which is the redelivery a crashed consumer needs.

Client ids come from the caller (`x-mq-client-id`), so what they cost is bounded: only a client
holding auto-renewed messages is tracked (`_last_seen_ms`, `_by_client`); a call from any other
id is one dict lookup and keeps nothing. A new id may start holding only while fewer than
`max_clients` (`max_renewing_clients`) do (`admit`, before the receive: `Throttled`, retriable,
beyond it), and the service refuses ids over `max_client_id_length`. An id is forgotten with its
last held entry. `_last_seen_ms` is kept in order of the last call (a call moves its id to the
end), so the silent-client sweep reads from the front and stops at the first live id, and each
held entry is indexed by its client id, so dropping a client costs what it held: the sweep is
proportional to what it drops, not to ids x entries.

A client id is the caller's word, so it is bound to the caller: the first receive that makes an
id hold records its principal (`owner`, the access key; "" with auth off, where all callers are
one), and while the id holds, only that principal's calls keep it alive (`touch`), add to it
(`admit` refuses another's receive) or end it (`drop_client` refuses another's
NotifyClientTermination with `Forbidden`). Without this any signed-in user could end
another client's renewals by naming its id. The binding goes with the id's last held entry.

The table is in memory: after a server restart the handles are stale anyway (the broker's
invisibility survives, and the message is redelivered when it runs out). Its times are broker
time, like the in-flight entries it renews: a re-base of broker time (`clock.py`) moves them back
with those (`_clock_rebased`), so a held message is neither renewed late nor held past
`max_hold_ms` for the length of the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chronoq.clock import Clock
from chronoq.errors import ChronoqError, Forbidden, Throttled

if TYPE_CHECKING:
    from chronoq.broker import Broker  # the type only: the broker imports the store, the servers stay light

log = logging.getLogger(__name__)

CHECK_INTERVAL_MS = 1000
"""How often the renewal loop looks for entries near expiry; well under a third of any sane
invisible duration (the minimum is `min_invisible_duration_ms`, 1 s by default, and auto-renewed
messages use the 30 s default)."""


CLIENT_SILENT_MS = 45_000
"""A client unheard of this long is taken for gone (the official clients heartbeat every 10 s)."""


@dataclass
class Held:
    group: str
    topic: str
    client_id: str
    current_handle: str
    invisible_until_ms: int
    received_ms: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Renewals:
    def __init__(self, broker: Broker, clock: Clock, *, duration_ms: int, max_hold_ms: int, max_clients: int) -> None:
        self._broker = broker
        self._clock = clock
        self.duration_ms = duration_ms
        self._max_hold_ms = max_hold_ms
        self.max_clients = max_clients
        self._held: dict[str, Held] = {}
        self._by_client: dict[str, set[str]] = {}
        """Client id -> the handles it holds (no entry for the empty id: never taken for silent)."""
        self._last_seen_ms: dict[str, int] = {}
        """Client id (of `_by_client`) -> its last call; oldest first (a call moves it to the end)."""
        self._owners: dict[str, str] = {}
        """Client id (of `_by_client`) -> the principal it is bound to (see the module docstring)."""
        clock.add_rebase_listener(self._clock_rebased)

    def _clock_rebased(self, step_ms: int, now_ms: int) -> None:
        """Broker time moved back by `step_ms` to `now_ms`: so do the deadlines and stamps here,
        as the broker moves the in-flight entries' visible times (never before now)."""
        for held in self._held.values():
            held.invisible_until_ms = max(now_ms, held.invisible_until_ms - step_ms)
            held.received_ms -= step_ms
        for client_id in self._last_seen_ms:
            self._last_seen_ms[client_id] -= step_ms

    def __len__(self) -> int:
        return len(self._held)

    @property
    def client_count(self) -> int:
        """Client ids tracked (those holding auto-renewed messages)."""
        return len(self._by_client)

    def _check_owner(self, client_id: str, owner: str, action: str) -> None:
        bound = self._owners.get(client_id)
        if bound is not None and bound != owner:
            raise Forbidden.permission(owner, action, f"client id {client_id[:64]!r}, in use by another user")

    def admit(self, client_id: str, owner: str = "") -> None:
        """Before an auto-renew receive: a client id held by another principal is refused
        (`Forbidden`); one not yet holding may start only while fewer than `max_clients`
        do; `Throttled` (nothing received) otherwise."""
        self._check_owner(client_id, owner, "receive as")
        if client_id and client_id not in self._by_client and len(self._by_client) >= self.max_clients:
            raise Throttled(f"{len(self._by_client)} clients already hold auto-renewed messages; the limit "
                            f"(max_renewing_clients) is {self.max_clients}; retry later",
                            clients=len(self._by_client), limit=self.max_clients)

    def hold(self, handle: str, *, group: str, topic: str, client_id: str, invisible_until_ms: int,
             owner: str = "") -> None:
        now_ms = self._clock.now_ms()
        self._forget(handle)
        self._held[handle] = Held(group, topic, client_id, handle, invisible_until_ms, now_ms)
        if client_id:
            self._by_client.setdefault(client_id, set()).add(handle)
            self._owners.setdefault(client_id, owner)
            self._seen(client_id, now_ms)

    @contextlib.asynccontextmanager
    async def settle(self, handle: str) -> AsyncIterator[str]:
        """Yield the handle to give the broker for `handle`; forget the entry afterwards."""
        held = self._held.get(handle)
        if held is None:
            yield handle
            return
        async with held.lock:
            try:
                yield held.current_handle
            finally:
                self._forget(handle)

    def holds_any(self, handles: list[str]) -> bool:
        """Whether any of these handles is being renewed (an ack must then settle it first)."""
        held = self._held
        return bool(held) and any(h in held for h in handles)

    def touch(self, client_id: str, owner: str = "") -> None:
        """The client made a call: it is alive. An id holding nothing is not tracked (O(1), keeps
        nothing); a call naming an id bound to another principal does not keep it alive."""
        if client_id in self._last_seen_ms and self._owners.get(client_id) == owner:
            self._seen(client_id, self._clock.now_ms())

    def _seen(self, client_id: str, now_ms: int) -> None:
        self._last_seen_ms.pop(client_id, None)  # re-inserted at the end: the dict stays oldest first
        self._last_seen_ms[client_id] = now_ms

    def _forget(self, handle: str) -> None:
        held = self._held.pop(handle, None)
        if held is None or not held.client_id:
            return
        handles = self._by_client.get(held.client_id)
        if handles is not None:
            handles.discard(handle)
            if not handles:
                del self._by_client[held.client_id]
                self._last_seen_ms.pop(held.client_id, None)
                self._owners.pop(held.client_id, None)

    def drop_client(self, client_id: str, owner: str = "") -> int:
        """The client said goodbye: stop renewing everything `client_id` holds; returns how many
        entries that was. Only the principal the id is bound to may (`Forbidden`)."""
        self._check_owner(client_id, owner, "end the renewals of")
        return self._drop(client_id)

    def _drop(self, client_id: str) -> int:
        self._last_seen_ms.pop(client_id, None)
        self._owners.pop(client_id, None)
        handles = self._by_client.pop(client_id, set())
        for handle in handles:
            self._held.pop(handle, None)
        return len(handles)

    async def renew_due(self) -> None:
        """Renew every entry with less than a third of its duration left."""
        now_ms = self._clock.now_ms()
        threshold_ms = self.duration_ms // 3
        last_seen = self._last_seen_ms
        while last_seen:
            client_id, seen_ms = next(iter(last_seen.items()))  # the longest silent
            if now_ms - seen_ms <= CLIENT_SILENT_MS:
                break
            self._drop(client_id)
        for handle, held in list(self._held.items()):
            if now_ms - held.received_ms >= self._max_hold_ms:
                self._forget(handle)
                continue
            if held.invisible_until_ms - now_ms > threshold_ms:
                continue
            async with held.lock:
                if self._held.get(handle) is not held:
                    continue  # settled while we waited for the lock
                try:
                    held.current_handle = await self._broker.change_invisible_duration(
                        held.group, held.topic, held.current_handle, self.duration_ms)
                    held.invisible_until_ms = self._clock.now_ms() + self.duration_ms
                except ChronoqError as err:
                    log.info("auto-renew of %s/%s stopped: %s", held.topic, held.group, err)
                    self._forget(handle)

    async def run(self) -> None:
        """Renew until cancelled (the server's task group owns this loop)."""
        while True:
            # Broker time, not real time: what it renews against (`invisible_until_ms`) is broker
            # time, so while broker time is paused (a wall-clock step back) nothing comes due; a
            # re-base moves this deadline back with the rest (`Clock.sleep_until`).
            await self._clock.sleep_until(self._clock.now_ms() + CHECK_INTERVAL_MS)
            try:
                await self.renew_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("auto-renew pass failed; retrying in %d ms", CHECK_INTERVAL_MS)
