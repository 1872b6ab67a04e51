"""`apache.rocketmq.v2.MessagingService` over the in-process `Broker`.

Theory of operation: a thin asyncio shell. Each RPC decodes its request with
`chronoq.protocol.requests`, calls the broker, and encodes the answer with
`chronoq.protocol.responses`; no protocol rule lives here. Errors are converted at one point,
`_guard`: a `ChronoqError` becomes its status code, anything else becomes 50000 and a log line,
so no request, however hostile, gets an RPC failure instead of a status.

The handlers are registered by hand (`generic_handler`) rather than through the generated
`add_MessagingServiceServicer_to_server`, so that request bytes that do not parse reach the
handler as `Undecodable` and are answered with a 40000 status instead of grpc's bare INTERNAL.

Auth (`chronoq.server.auth`): every call is authenticated from its own metadata before its request
is looked at, so an unauthenticated caller learns nothing but 40100; each handler then asks the
caller's `Principal` for the permission its request needs (send: publish on every topic of the
batch; receive, ack, change-invisible, dead-letter, assignment: subscribe on the topic and the
group; route: either; recall: publish on the request's topic, which must be the handle's) before
it calls the broker, so a refusal (40300) changes nothing. Telemetry and ReceiveMessage are
authenticated when they open (their metadata comes once). With auth off every caller is
`ANONYMOUS` and nothing is checked.

`chronoq.receive.v1.Receive/ReceiveMessages` (`batch_receive_handler`, chronoq's SDK) is
ReceiveMessage answered with its messages in one response rather than one each: the same
request, checks and broker receive, the same stream's bytes regrouped by
`chronoq.protocol.batch_receive`.

Long polls: ReceiveMessage waits at most `min(long_polling_timeout, time_remaining - margin)`,
so the answer arrives before the client's deadline (Python: request_timeout + await_duration).
Auto-renewed receives (PushConsumer) are tracked in `Renewals`. The caller's `x-mq-client-id`
is read by `client_id_of`, which refuses one over `max_client_id_length`; an auto-renew receive
asks `Renewals.admit` before it receives (at most `max_renewing_clients` ids hold at once; the
check is made when the receive starts, so receives from new ids in flight together may pass it
together, each holding only what it received). With auth on a client id is bound to the
principal whose receive made it hold: another principal's calls naming it neither keep it alive
nor end it (NotifyClientTermination: 40300), nor receive under it (`Renewals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from chronoq.config import Config
from chronoq.errors import ChronoqError
from chronoq.model import TopicConfig
from chronoq.protocol import batch_receive
from chronoq.protocol import requests as rq
from chronoq.protocol import responses as rs
from chronoq.protocol.errors import InvalidField, MalformedRequest, Unsupported
from chronoq.protocol.v2 import SERVICE_NAME, service
from chronoq.server.auth import AUTH_OFF, Authenticator, Principal, RefusalLog
from chronoq.server.renewals import Renewals
from chronoq.timer.recall import decode_recall_handle

if TYPE_CHECKING:
    from chronoq.broker import Broker  # the type only: the broker imports the store, the servers stay light

log = logging.getLogger(__name__)

LONG_POLL_DEADLINE_MARGIN_MS = 1000
"""Answer a long poll this long before the client's deadline (network and encoding time)."""
CLIENT_ID_HEADER = "x-mq-client-id"


class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(request_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return request_type.FromString(data)
        except Exception as exc:  # DecodeError, or any parser complaint about hostile bytes
            return Undecodable(f"{type(exc).__name__}: {exc}")
    return parse


def _bytes_or_serialized(response: Any) -> bytes:
    """A stream response already serialized (the hot path writes them by hand) or a message."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def wall_ms() -> int:
    """The wall clock, for signature freshness only (a client's date is wall-clock time)."""
    return time.time_ns() // 1_000_000


def authenticate(authenticator: Authenticator, context: grpc.aio.ServicerContext) -> Principal:
    """The caller of one call (ANONYMOUS with auth off, without reading the metadata)."""
    if not authenticator.enabled:
        return authenticator.authenticate(None, 0)
    return authenticator.authenticate(context.invocation_metadata(), wall_ms())


def client_id_of(context: grpc.aio.ServicerContext, config: Config) -> str:
    """The caller's `x-mq-client-id` ("" without one); longer than `max_client_id_length` is refused."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_HEADER:
            client_id = str(value)
            if len(client_id) > config.max_client_id_length:
                raise InvalidField(CLIENT_ID_HEADER, f"{len(client_id)} characters; the limit "
                                                     f"(max_client_id_length) is {config.max_client_id_length}")
            return client_id
    return ""


class MessagingService:
    """The servicer. `advertised` is the address routes name; None (server bound to a wildcard
    address) means "the address the client says it used"."""

    def __init__(self, broker: Broker, config: Config, *, advertised: rq.Endpoint | None, port: int,
                 authenticator: Authenticator | None = None) -> None:
        self.broker = broker
        self.config = config
        self.auth = authenticator or Authenticator(AUTH_OFF)
        self.refusals = RefusalLog(log)
        self.advertised = advertised
        self.port = port
        self.renewals = Renewals(broker, broker.clock, duration_ms=config.default_invisible_duration_ms,
                                 max_hold_ms=config.max_invisible_duration_ms, max_clients=config.max_renewing_clients)

    # -- plumbing --------------------------------------------------------------------------------

    async def _guard(self, rpc: str, response_type: Any, request: Any, context: grpc.aio.ServicerContext,
                     body: Callable[[Any, Any, Principal], Awaitable[Any]]) -> Any:
        try:
            caller = authenticate(self.auth, context)
            self.renewals.touch(client_id_of(context, self.config), caller.name)
            if isinstance(request, Undecodable):
                raise MalformedRequest(rpc, request.reason)
            return await body(request, context, caller)
        except ChronoqError as err:
            self.refusals.note(rpc, context.peer(), err)
            return rs.with_status(response_type, rs.error_status(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("%s failed", rpc)
            return rs.with_status(response_type, rs.internal_status(err))

    def generic_handler(self) -> grpc.GenericRpcHandler:
        unary = {
            "QueryRoute": (service.QueryRouteRequest, service.QueryRouteResponse, self._query_route),
            "Heartbeat": (service.HeartbeatRequest, service.HeartbeatResponse, self._ok),
            "SendMessage": (service.SendMessageRequest, service.SendMessageResponse, self._send),
            "QueryAssignment": (service.QueryAssignmentRequest, service.QueryAssignmentResponse,
                                self._query_assignment),
            "AckMessage": (service.AckMessageRequest, service.AckMessageResponse, self._ack),
            "ForwardMessageToDeadLetterQueue": (service.ForwardMessageToDeadLetterQueueRequest,
                                                service.ForwardMessageToDeadLetterQueueResponse, self._dead_letter),
            "UpdateOffset": (service.UpdateOffsetRequest, service.UpdateOffsetResponse, self._unsupported),
            "GetOffset": (service.GetOffsetRequest, service.GetOffsetResponse, self._unsupported),
            "QueryOffset": (service.QueryOffsetRequest, service.QueryOffsetResponse, self._unsupported),
            "EndTransaction": (service.EndTransactionRequest, service.EndTransactionResponse, self._unsupported),
            "NotifyClientTermination": (service.NotifyClientTerminationRequest,
                                        service.NotifyClientTerminationResponse, self._client_termination),
            "ChangeInvisibleDuration": (service.ChangeInvisibleDurationRequest,
                                        service.ChangeInvisibleDurationResponse, self._change_invisible),
            "RecallMessage": (service.RecallMessageRequest, service.RecallMessageResponse, self._recall),
            "SyncLiteSubscription": (service.SyncLiteSubscriptionRequest, service.SyncLiteSubscriptionResponse,
                                     self._unsupported),
        }
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name, (request_type, response_type, body) in unary.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                self._unary(name, response_type, body), request_deserializer=_deserializer(request_type),
                response_serializer=_bytes_or_serialized)
        handlers["ReceiveMessage"] = grpc.unary_stream_rpc_method_handler(
            self.receive_message, request_deserializer=_deserializer(service.ReceiveMessageRequest),
            response_serializer=_bytes_or_serialized)
        handlers["PullMessage"] = grpc.unary_stream_rpc_method_handler(
            self.pull_message, request_deserializer=_deserializer(service.PullMessageRequest),
            response_serializer=service.PullMessageResponse.SerializeToString)
        handlers["Telemetry"] = grpc.stream_stream_rpc_method_handler(
            self.telemetry, request_deserializer=_deserializer(service.TelemetryCommand),
            response_serializer=service.TelemetryCommand.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def batch_receive_handler(self) -> grpc.GenericRpcHandler:
        """`chronoq.receive.v1.Receive`: ReceiveMessage with the messages in one response."""
        return grpc.method_handlers_generic_handler(batch_receive.SERVICE_NAME, {
            batch_receive.METHOD: grpc.unary_stream_rpc_method_handler(
                self.receive_messages, request_deserializer=_deserializer(service.ReceiveMessageRequest))})

    def _unary(self, rpc: str, response_type: Any,
               body: Callable[[Any, Any, Principal], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await self._guard(rpc, response_type, request, context, body)
        handler.__name__ = rpc
        return handler

    def _endpoint(self, access_point: rq.Endpoint | None) -> rq.Endpoint:
        if self.advertised is not None:
            return self.advertised
        return access_point or rq.Endpoint("127.0.0.1", self.port)

    async def _topic(self, name: str) -> TopicConfig:
        """The topic; for a new one with auto-create on, the route it will have. A route query
        creates nothing (consumers ask too, and a mistyped topic must not appear): the first
        send creates the topic, with these queues."""
        return self.broker.topic_for_send(name)

    # -- unary RPCs -------------------------------------------------------------------------------

    async def _ok(self, request: Any, context: Any, caller: Principal) -> Any:
        return service.HeartbeatResponse(status=rs.ok_status())

    async def _unsupported(self, request: Any, context: Any, caller: Principal) -> Any:
        raise Unsupported(f"{type(request).DESCRIPTOR.name.removesuffix('Request')} (chronoq serves "
                          "Producer, SimpleConsumer and PushConsumer clients)")

    async def _query_route(self, request: service.QueryRouteRequest, context: Any, caller: Principal) -> Any:
        query = rq.decode_route(request, self.config)
        caller.require_see(query.topic)
        return rs.route_response(await self._topic(query.topic), self._endpoint(query.access_point))

    async def _query_assignment(self, request: service.QueryAssignmentRequest, context: Any,
                                caller: Principal) -> Any:
        query = rq.decode_assignment(request, self.config)
        caller.require_subscribe(query.topic, query.group)
        access_point = None
        if request.endpoints.addresses:
            first = request.endpoints.addresses[0]
            if first.host and 0 < first.port < 65536:
                access_point = rq.Endpoint(first.host, first.port)
        return rs.assignment_response(await self._topic(query.topic), self._endpoint(access_point))

    async def _send(self, request: service.SendMessageRequest, context: Any, caller: Principal) -> Any:
        command = rq.decode_send(request, self.config)
        caller.require_publish({m.topic for m in command.messages})
        # One message or many, the same call: all-or-nothing, the first bad message refused.
        return rs.send_response(await self.broker.send_batch(command.messages))

    async def _ack(self, request: service.AckMessageRequest, context: Any, caller: Principal) -> Any:
        command = rq.decode_ack(request, self.config)
        caller.require_subscribe(command.topic, command.group)
        handles = [e.receipt_handle for e in command.entries]
        if not self.renewals.holds_any(handles):
            errors = await self.broker.ack_many(command.group, command.topic, handles)
        else:
            # Every entry is settled (its renewal stopped) around one batched ack: one RocksDB
            # write per request rather than one per entry.
            async with contextlib.AsyncExitStack() as settled:
                current: dict[str, str] = {}  # a repeated handle is settled once (its lock is not reentrant)
                for handle in handles:
                    if handle not in current:
                        current[handle] = await settled.enter_async_context(self.renewals.settle(handle))
                errors = await self.broker.ack_many(command.group, command.topic, [current[h] for h in handles])
        outcomes = [(entry.message_id, entry.receipt_handle, 20000, "OK") if err is None
                    else (entry.message_id, entry.receipt_handle, err.code, err.message)
                    for entry, err in zip(command.entries, errors, strict=True)]
        return rs.ack_response(outcomes)

    async def _change_invisible(self, request: service.ChangeInvisibleDurationRequest, context: Any,
                                caller: Principal) -> Any:
        command = rq.decode_change_invisible(request, self.config)
        caller.require_subscribe(command.topic, command.group)
        async with self.renewals.settle(command.receipt_handle) as handle:
            new_handle = await self.broker.change_invisible_duration(
                command.group, command.topic, handle, command.invisible_duration_ms)
        return rs.change_invisible_response(new_handle)

    async def _recall(self, request: service.RecallMessageRequest, context: Any, caller: Principal) -> Any:
        command = rq.decode_recall(request, self.config)
        decode_recall_handle(command.recall_handle)  # a malformed handle is a 40000 before a 40300
        caller.require_publish([command.topic])
        message_id = await self.broker.cancel(recall_handle=command.recall_handle, topic=command.topic)
        return rs.recall_response(message_id)

    async def _dead_letter(self, request: service.ForwardMessageToDeadLetterQueueRequest, context: Any,
                           caller: Principal) -> Any:
        command = rq.decode_dead_letter(request, self.config)
        caller.require_subscribe(command.topic, command.group)
        async with self.renewals.settle(command.receipt_handle) as handle:
            await self.broker.forward_to_dlq(command.group, command.topic, handle)
        return service.ForwardMessageToDeadLetterQueueResponse(status=rs.ok_status())

    async def _client_termination(self, request: Any, context: grpc.aio.ServicerContext, caller: Principal) -> Any:
        client_id = client_id_of(context, self.config)
        if client_id:
            self.renewals.drop_client(client_id, caller.name)  # after `touch` in the handler: gone for good
        return service.NotifyClientTerminationResponse(status=rs.ok_status())

    # -- streaming RPCs ---------------------------------------------------------------------------

    def _wait_ms(self, requested_ms: int, context: grpc.aio.ServicerContext) -> int:
        remaining_s = context.time_remaining()
        if remaining_s is None:
            return requested_ms
        return max(0, min(requested_ms, int(remaining_s * 1000) - LONG_POLL_DEADLINE_MARGIN_MS))

    async def _receive(self, request: Any, context: grpc.aio.ServicerContext) -> list[Any]:
        caller = authenticate(self.auth, context)
        client_id = client_id_of(context, self.config)
        self.renewals.touch(client_id, caller.name)
        if isinstance(request, Undecodable):
            raise MalformedRequest("ReceiveMessage", request.reason)
        command = rq.decode_receive(request, self.config)
        caller.require_subscribe(command.topic, command.group)
        if command.auto_renew:
            self.renewals.admit(client_id, caller.name)  # before anything is taken invisible
        invisible_ms = command.invisible_duration_ms or self.renewals.duration_ms
        received = await self.broker.receive(
            command.group, command.topic, filter_expression=command.filter_expression,
            batch_size=command.batch_size, invisible_duration_ms=invisible_ms,
            wait_ms=self._wait_ms(command.long_polling_ms, context))
        if command.auto_renew:
            for r in received:
                self.renewals.hold(r.receipt_handle, group=command.group, topic=command.topic, client_id=client_id,
                                   invisible_until_ms=r.invisible_until_ms, owner=caller.name)
        return rs.receive_responses(received, invisible_ms, self.broker.now_ms())

    async def _receive_stream(self, request: Any, context: grpc.aio.ServicerContext) -> list[Any]:
        """ReceiveMessage's whole stream, an error as its one status response."""
        try:
            return await self._receive(request, context)
        except ChronoqError as err:
            self.refusals.note("ReceiveMessage", context.peer(), err)
            return rs.receive_error(rs.error_status(err))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("ReceiveMessage failed")
            return rs.receive_error(rs.internal_status(err))

    async def receive_message(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        for response in await self._receive_stream(request, context):
            yield response

    async def receive_messages(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """chronoq's batched ReceiveMessage (`chronoq.protocol.batch_receive`): the same stream,
        regrouped into as few responses as `max_receive_response_bytes` allows (usually one)."""
        stream = [_bytes_or_serialized(r) for r in await self._receive_stream(request, context)]
        for response in batch_receive.batch(stream, self.config.max_receive_response_bytes):
            yield response

    async def pull_message(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        yield service.PullMessageResponse(status=rs.error_status(Unsupported("PullMessage (use ReceiveMessage)")))

    async def telemetry(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Answer each Settings with the server's Settings; other commands need no reply. An
        unauthenticated stream gets one status and ends (its client reopens it, and is refused again)."""
        try:
            caller = authenticate(self.auth, context)
            client_id = client_id_of(context, self.config)
        except ChronoqError as err:
            self.refusals.note("Telemetry", context.peer(), err)
            yield service.TelemetryCommand(status=rs.error_status(err))
            return
        async for command in requests:
            self.renewals.touch(client_id, caller.name)
            if isinstance(command, Undecodable):
                yield service.TelemetryCommand(status=rs.error_status(MalformedRequest("Telemetry", command.reason)))
                continue
            if command.HasField("settings"):
                try:
                    yield rs.settings_reply(command.settings, self.config)
                except ChronoqError as err:
                    yield service.TelemetryCommand(status=rs.error_status(err))

