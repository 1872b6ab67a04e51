"""The SDK's one retry policy: which failures are tried again, how often, and how long apart.

Theory of operation: a failure is tried again only when it is retriable (`ChronoqError.retriable`:
the connection, a deadline, or a retriable server code, as the code's class in `chronoq.errors`
says: 42900 throttled, 50002 the broker closing, 50401 a failed fsync; never 50001) and tries
remain (`give_up`), at most `attempts` times, backing off 100 ms, 200 ms, ... (`attempt_numbers`).
`retrying` runs one call under that rule and schedule, and tells each attempt whether an earlier
one failed without a broker verdict (`outcome_unknown`: it may have taken effect).

Who uses it, and how:
- Sends (`client/producer.py`) are retried with the same message id, so the server's dedupe
  window makes a retry idempotent, at most `send_attempts` times; only the messages whose failure
  was retriable go again.
- A consumer (`client/consumer.py`) retries a receive that failed before its first message; an
  ack (idempotent: after an attempt whose outcome is unknown, a retry's "invalid receipt handle"
  for an entry means the first attempt acked it, and is not raised); and a change_invisible only
  when the broker refused it, never after an unknown outcome (that attempt may have replaced the
  handle, and the new one never came back).
- Every client retries its other calls under the same policy and `attempts`
  (`client/admin.py`): the reads (list and describe topics, query, stats, read by offset) after
  any retriable failure; create_topic, cancel and recall only when the broker refused them (after
  a lost reply the first attempt may have done its work, and a repeat would answer "exists" or
  "not pending" for what succeeded). `ping` is one attempt: it asks whether the server is up now;
  the Spark engine's `fire_timers` is retried by Spark's own batch retry (it is idempotent).
- A request gRPC refuses as too large (`RequestTooLarge`) is not retried; `send_batch` avoids
  making one by cutting batches by encoded size (`max_batch_bytes`) as well as by count.

Apart so that the rule lives in one place, whichever client or call applies it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from chronoq import errors as core
from chronoq.client.errors import ClientError, RemoteError

DEFAULT_SEND_ATTEMPTS = 3
DEFAULT_ATTEMPTS = DEFAULT_SEND_ATTEMPTS
"""`attempts`: tries of one call other than a send (an admin call, a recall; a consumer's receive,
ack or change_invisible), see `attempt_numbers`."""
RETRY_BACKOFF_MS = 100

T = TypeVar("T")


def outcome_unknown(e: core.ChronoqError) -> bool:
    """Whether a failed call may still have taken effect: no broker verdict came back (the
    connection, a deadline, a bare gRPC status: `ClientError`, or `RemoteError`). A broker's own
    refusal (`BrokerClosed`, `FlushFailed`, `Throttled`: the `chronoq.errors` class its code names)
    says the request was not carried out."""
    return isinstance(e, (ClientError, RemoteError))


def give_up(e: core.ChronoqError, attempt: int, attempts: int) -> bool:
    """The one retry rule: a failure is tried again only when it is retriable and tries remain."""
    return not e.retriable or attempt >= attempts - 1


async def attempt_numbers(attempts: int) -> AsyncIterator[int]:
    """The one retry schedule, for every call the SDK retries: attempt numbers 0 .. attempts - 1,
    backing off 100 ms, 200 ms, 400 ms ... before each retry."""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(RETRY_BACKOFF_MS * 2 ** (attempt - 1) / 1000)
        yield attempt


async def retrying(attempts: int, call: Callable[[bool], Awaitable[T]], *, after_unknown: bool = True) -> T:
    """`call(retrying_unknown)` under the retry rule and schedule. `retrying_unknown` is True once
    an earlier attempt failed without a broker verdict (it may have taken effect). With
    `after_unknown=False` such a failure is raised, not retried: for a call whose repeat is not
    safe once the first one may have done its work."""
    retrying_unknown = False
    async with contextlib.aclosing(attempt_numbers(attempts)) as tries:
        async for attempt in tries:
            try:
                return await call(retrying_unknown)
            except core.ChronoqError as e:
                unknown = outcome_unknown(e)
                if give_up(e, attempt, attempts) or (unknown and not after_unknown):
                    raise
                retrying_unknown = retrying_unknown or unknown
    raise AssertionError("attempts is at least 1")
