"""Encoding: chronoq results and errors -> RocketMQ v2 response messages.

Theory of operation: pure functions from chronoq's model (`TopicConfig`, `SendResult`,
`ReceivedMessage`, `ChronoqError`) to protobuf responses; no I/O, no clock (times arrive as
arguments). The responses of the hot RPCs (SendMessage, AckMessage, each delivered message of
ReceiveMessage) come out serialized, written by hand in `chronoq.protocol.fastwire`, their one
encoder; the rest are built through the generated classes. Every response carries a `Status`:
the official clients treat a missing or zero code as an illegal response, 20000 as OK and 40401
as "no message". Errors are converted in exactly one place, `error_status`, because
`ChronoqError.code` already holds the protocol's number.

Facts of the official clients that shape the encoding (measured in
`shared/notes/rocketmq-grpc-facts.md`):
* Routes: the clients use only queues with broker id 0 and a readable/writable permission, open a
  channel to `broker.endpoints` (empty endpoints become an empty channel target), and refuse
  locally to send a type the queue does not list in `accept_message_types`.
* Delivered messages need a receipt handle, a delivery attempt, and a body digest. MD5 in
  upper-case hex is the one digest Python, Node and Java all verify alike.
* Telemetry: the Python producer copies `publishing.max_body_size` from the reply unconditionally
  (0 would make it refuse every message), the Node producer asserts an exponential backoff, and
  the Python PushConsumer takes its retry delays from a customized backoff if one is given.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import TypeVar

from chronoq.config import Config
from chronoq.errors import ChronoqError
from chronoq.model import ReceivedMessage, SendResult, TopicConfig
from chronoq.protocol import fastwire
from chronoq.protocol.requests import Endpoint
from chronoq.protocol.v2 import (
    MODEL_TO_WIRE_TYPE,
    Code,
    definition,
    service,
    set_duration_ms,
    set_timestamp_ms,
)

BROKER_NAME = "chronoq"
PRODUCER_MAX_ATTEMPTS = 3
"""Send attempts a producer makes (it retries with the same message id; the broker dedupes)."""
PRODUCER_BACKOFF_INITIAL_MS = 10
PRODUCER_BACKOFF_MAX_MS = 1000
PRODUCER_BACKOFF_MULTIPLIER = 2.0
CONSUMER_RETRY_FIRST_LEVEL = 1
"""A PushConsumer's retry delays are the delay-level table (`Config.delay_levels`) from this level
on, one per failed attempt: 1 s, 5 s, 10 s, ... by default; the last level repeats."""
DEFAULT_PUSH_BATCH = 32

Response = TypeVar("Response")


# -- statuses ------------------------------------------------------------------------------------


def ok_status(message: str = "OK") -> definition.Status:
    return definition.Status(code=Code.OK, message=message)


def error_status(error: ChronoqError) -> definition.Status:
    """The one conversion from a chronoq error to the wire."""
    return definition.Status(code=error.code, message=error.message)


def internal_status(error: BaseException) -> definition.Status:
    """An unexpected exception: the client gets 50000 and the exception's type, never a trace."""
    return definition.Status(code=Code.INTERNAL_ERROR,
                             message=f"internal error ({type(error).__name__}); see the server log")


def with_status(response_type: type[Response], status: definition.Status) -> Response:
    """A status-only response of any unary RPC (they all have a `status` field)."""
    return response_type(status=status)  # type: ignore[call-arg]


# -- routes --------------------------------------------------------------------------------------


def endpoints(endpoint: Endpoint) -> definition.Endpoints:
    try:
        version = ipaddress.ip_address(endpoint.host).version
        scheme = definition.IPv4 if version == 4 else definition.IPv6
    except ValueError:
        scheme = definition.DOMAIN_NAME
    return definition.Endpoints(scheme=scheme, addresses=[definition.Address(host=endpoint.host, port=endpoint.port)])


def message_queue(topic: TopicConfig, queue_id: int, endpoint: Endpoint) -> definition.MessageQueue:
    return definition.MessageQueue(
        topic=definition.Resource(name=topic.name),
        id=queue_id,
        permission=definition.READ_WRITE,
        broker=definition.Broker(name=BROKER_NAME, id=0, endpoints=endpoints(endpoint)),
        accept_message_types=sorted(MODEL_TO_WIRE_TYPE[t] for t in topic.message_types),
    )


def route_response(topic: TopicConfig, endpoint: Endpoint) -> service.QueryRouteResponse:
    return service.QueryRouteResponse(
        status=ok_status(),
        message_queues=[message_queue(topic, q, endpoint) for q in range(topic.queue_count)],
    )


def assignment_response(topic: TopicConfig, endpoint: Endpoint) -> service.QueryAssignmentResponse:
    return service.QueryAssignmentResponse(
        status=ok_status(),
        assignments=[definition.Assignment(message_queue=message_queue(topic, q, endpoint))
                     for q in range(topic.queue_count)],
    )


# -- send ------------------------------------------------------------------------------------------


def send_response(results: Sequence[SendResult]) -> bytes:
    """The serialized `SendMessageResponse`: OK, one entry per result in order (written by hand,
    `fastwire.send_response`)."""
    return fastwire.send_response([(r.message_id, r.queue_offset, r.recall_handle, r.duplicate) for r in results])


# -- receive ---------------------------------------------------------------------------------------


_NOT_FOUND = service.ReceiveMessageResponse(
    status=definition.Status(code=Code.MESSAGE_NOT_FOUND, message="no new message")).SerializeToString()
_OK = service.ReceiveMessageResponse(status=ok_status()).SerializeToString()


def receive_responses(received: Sequence[ReceivedMessage], invisible_duration_ms: int, now_ms: int) -> list[bytes]:
    """The server stream of one ReceiveMessage call, serialized: status first, then one response
    per message, then the delivery timestamp; or a single 40401 when nothing was received. Each
    message is written by hand (`fastwire.received_response`, ~15 µs against ~80 µs through the
    protobuf API)."""
    if not received:
        return [_NOT_FOUND]
    out = [_OK]
    out.extend(fastwire.received_response(r, invisible_duration_ms, BROKER_NAME) for r in received)
    stamp = service.ReceiveMessageResponse()
    set_timestamp_ms(stamp.delivery_timestamp, now_ms)
    out.append(stamp.SerializeToString())
    return out


def receive_error(status: definition.Status) -> list[service.ReceiveMessageResponse]:
    return [service.ReceiveMessageResponse(status=status)]


# -- ack, change invisible, recall --------------------------------------------------------------


def ack_response(entries: Sequence[tuple[str, str, int, str]]) -> bytes:
    """The serialized `AckMessageResponse` for (message_id, receipt_handle, code, message) per
    acked handle (written by hand, `fastwire.ack_response`). The top status is the first entry's
    if every entry has its code, else MULTIPLE_RESULTS (30000), as the Apache proxy answers."""
    codes = {code for _, _, code, _ in entries}
    top = (entries[0][2], entries[0][3]) if len(codes) == 1 else (Code.MULTIPLE_RESULTS,
                                                                 "entries have different results")
    return fastwire.ack_response(list(entries), top)


def change_invisible_response(receipt_handle: str) -> service.ChangeInvisibleDurationResponse:
    return service.ChangeInvisibleDurationResponse(status=ok_status(), receipt_handle=receipt_handle)


def recall_response(message_id: str) -> service.RecallMessageResponse:
    return service.RecallMessageResponse(status=ok_status(), message_id=message_id)


# -- telemetry -----------------------------------------------------------------------------------


def settings_reply(client: definition.Settings, config: Config) -> service.TelemetryCommand:
    """Echo the client's Settings with the server's values filled in."""
    settings = definition.Settings()
    settings.CopyFrom(client)
    settings.metric.Clear()
    settings.metric.on = False  # on=True would start an OTLP exporter toward us
    case = client.WhichOneof("pub_sub")
    if case == "subscription" or client.client_type in (definition.PUSH_CONSUMER, definition.SIMPLE_CONSUMER):
        _fill_subscription(settings, config)
    else:
        _fill_publishing(settings, config)
    return service.TelemetryCommand(status=ok_status(), settings=settings)


def _fill_publishing(settings: definition.Settings, config: Config) -> None:
    settings.publishing.max_body_size = config.max_message_size_bytes
    settings.publishing.validate_message_type = True
    policy = settings.backoff_policy
    policy.Clear()
    policy.max_attempts = PRODUCER_MAX_ATTEMPTS
    set_duration_ms(policy.exponential_backoff.initial, PRODUCER_BACKOFF_INITIAL_MS)
    set_duration_ms(policy.exponential_backoff.max, PRODUCER_BACKOFF_MAX_MS)
    policy.exponential_backoff.multiplier = PRODUCER_BACKOFF_MULTIPLIER


def _fill_subscription(settings: definition.Settings, config: Config) -> None:
    subscription = settings.subscription
    polling_ms = subscription.long_polling_timeout.seconds * 1000 + subscription.long_polling_timeout.nanos // 1_000_000
    set_duration_ms(subscription.long_polling_timeout, min(max(polling_ms, 0), config.max_long_poll_ms))
    batch = subscription.receive_batch_size
    subscription.receive_batch_size = min(batch if batch > 0 else DEFAULT_PUSH_BATCH, config.max_receive_batch)
    policy = settings.backoff_policy
    policy.Clear()
    policy.max_attempts = config.max_delivery_attempts
    for delay_ms in config.delay_levels_ms[CONSUMER_RETRY_FIRST_LEVEL - 1:] or config.delay_levels_ms[-1:]:
        set_duration_ms(policy.customized_backoff.next.add(), delay_ms)
