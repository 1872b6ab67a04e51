"""The values the SDK hands back: send receipts, received messages, timer status, topics.

Theory of operation: plain dataclasses, built by `chronoq.client.wire` from what the server
sent, with no I/O. They differ from `chronoq.model`'s nouns because a remote client sees less
than the broker does (no commit-log position, no record size) and a little more (the digest
check, the time the client received the message). Outgoing messages *are* shared: a batch is a
sequence of `chronoq.model.OutgoingMessage`, built with `chronoq.client.wire.outgoing()`.

`ReceivedMessage` is the one mutable value: `change_invisible` replaces its receipt handle in
place (as the official clients do) so a later `ack(msg)` uses the handle that is still valid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chronoq.timer.recall import encode_recall_handle


@dataclass(slots=True)
class SendReceipt:
    """The server's acknowledgement of one stored message. A value; not `frozen` because frozen
    dataclasses construct ~5x slower and a batch send builds one per message (see `chronoq.model`)."""

    message_id: str
    topic: str
    offset: int
    """Queue offset the message was stored at (for timer messages: its offset in the timer topic)."""
    recall_handle: str | None = None
    """Set for timer messages: pass to `recall(topic, handle)` to cancel before it fires."""
    deliver_at_ms: int | None = None
    """When a timer message is due (ms since the epoch), as the server fixed it: a `delay` added
    to the server's clock, a time rounded up to its `timer_precision_ms`. Read from the recall
    handle (SendMessage) or the reply (SendBatch). A delay-level message has no handle: sent with
    `send(delay_level=)` (SendBatch) it holds the due time the server computed from its level
    table; in a `send_batch(batch_via="grpc")` it is None. None for a normal message, and the
    requested `deliver_at` for a timer sent to a server whose handles are not chronoq's."""
    queue_id: int | None = None
    duplicate: bool = False
    """True when the server had already stored this message id (an idempotent retry)."""


@dataclass(slots=True)
class ReceivedMessage:
    message_id: str
    topic: str
    body: bytes
    tag: str
    keys: tuple[str, ...]
    properties: Mapping[str, str]
    queue_id: int
    queue_offset: int
    born_ms: int | None
    store_ms: int | None
    deliver_at_ms: int | None
    """The due time of a timer message; None for a normal message."""
    receipt_handle: str
    delivery_attempt: int
    invisible_duration_ms: int | None
    received_ms: int
    """The client's clock when the message arrived: `received_ms - deliver_at_ms` is how late it was."""
    body_digest_ok: bool | None = None
    """True/False: the body matched/did not match the server's digest; None: no digest was sent."""

    @property
    def lateness_ms(self) -> int | None:
        """How long after its due time a timer message reached this client (None if not a timer)."""
        if self.deliver_at_ms is None:
            return None
        return self.received_ms - self.deliver_at_ms


@dataclass(frozen=True, slots=True)
class TimerInfo:
    """What the server knows about one timer message (`query`)."""

    message_id: str
    topic: str
    state: str
    """pending, delivered or cancelled."""
    deliver_at_ms: int
    accepted_ms: int
    fired_ms: int | None = None
    cancelled_ms: int | None = None


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    queue_count: int
    message_types: tuple[str, ...]
    created_ms: int


@dataclass(frozen=True, slots=True)
class QueueInfo:
    queue_id: int
    min_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class TopicDescription:
    topic: TopicInfo
    queues: tuple[QueueInfo, ...]


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """One message read by offset (`read`), as the commit log holds it."""

    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    tag: str
    keys: tuple[str, ...]
    properties: Mapping[str, str]
    system_properties: Mapping[str, str]
    body: bytes
    born_ms: int
    store_ms: int
    deliver_at_ms: int | None
    position: int | None = None
    """Its commit-log position (what `fire_timers` takes for a timer record), when the server
    reports it."""


@dataclass(frozen=True, slots=True)
class ReadResult:
    messages: tuple[StoredRecord, ...]
    next_offset: int


@dataclass(frozen=True, slots=True)
class FireOutcome:
    """`fire_timers`: how many of the positions fired now, and how many were skipped (not pending:
    fired before, cancelled, unknown; or not due yet)."""

    fired: int
    skipped: int


@dataclass(frozen=True, slots=True)
class ArmResult:
    """`arm_timers`, one timer: `result` is "armed" or "already_armed" (the broker fires it at its
    due time), or a refusal with its `reason`: "fired", "cancelled", "damaged", "unknown"."""

    position: int
    result: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ArmOutcome:
    """`arm_timers`: one result per timer, in request order."""

    results: tuple[ArmResult, ...]

    def count(self, result: str) -> int:
        return sum(1 for r in self.results if r.result == result)


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """Per-message results of `send_batch`, in request order: a receipt or the error for it."""

    results: tuple[SendReceipt | Exception, ...] = field(default_factory=tuple)

    @property
    def receipts(self) -> list[SendReceipt]:
        return [r for r in self.results if isinstance(r, SendReceipt)]

    @property
    def errors(self) -> list[tuple[int, Exception]]:
        return [(i, r) for i, r in enumerate(self.results) if isinstance(r, Exception)]


@dataclass(slots=True)
class BulkOutcome:
    """Per-row results of `send_columns`, in row order, as columns: `status[i]` is "stored",
    "duplicate" (the server already held the id: stored once, not again) or "refused" (the
    reason in `errors[i]`, a `chronoq.errors` exception carrying its values)."""

    topic: str
    message_ids: Sequence[str]
    status: list[str]
    queue_ids: list[int]
    """-1 for a refused row."""
    offsets: list[int]
    """The queue offset each row was stored at (-1 for a refused row)."""
    deliver_at_ms: list[int | None]
    """The due time the server fixed (a delay added to its clock, rounded up to its precision)."""
    recallable: list[bool]
    """A timer in the server's time index (`recall_handle(i)` recalls it)."""
    errors: dict[int, Exception] = field(default_factory=dict)

    @property
    def stored(self) -> int:
        """Rows stored by this call."""
        return self.status.count("stored")

    @property
    def duplicates(self) -> int:
        return self.status.count("duplicate")

    @property
    def refused(self) -> int:
        return len(self.errors)

    def recall_handle(self, i: int) -> str | None:
        """Row `i`'s recall handle (made here, as the server makes it: the handle codec is pure)."""
        due = self.deliver_at_ms[i]
        if not self.recallable[i] or due is None:
            return None
        return encode_recall_handle(self.topic, due, self.message_ids[i])

    def receipt(self, i: int) -> SendReceipt | Exception:
        """Row `i` as `send` would have answered it: a receipt, or its error."""
        if i in self.errors:
            return self.errors[i]
        return SendReceipt(self.message_ids[i], self.topic, self.offsets[i], self.recall_handle(i),
                           self.deliver_at_ms[i], self.queue_ids[i], self.status[i] == "duplicate")
