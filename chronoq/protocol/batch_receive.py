"""chronoq's batched receive: one ReceiveMessage's messages in one gRPC response, not one each.

Theory of operation: RocketMQ 5's ReceiveMessage streams one `ReceiveMessageResponse` per
message, and with grpc.aio each streamed response costs ~150 µs of CPU on the server and about
as much on the client, whatever it carries: at 2,000 deliveries/s that is most of a core spent
on framing. chronoq serves the same call a second way, `chronoq.receive.v1.Receive/ReceiveMessages`:
the same `ReceiveMessageRequest`, the same broker receive, and a stream of
`ReceiveMessagesResponse { Status status = 1; repeated Message messages = 2; Timestamp
delivery_timestamp = 3; }` that usually holds a single response.

The field numbers are `ReceiveMessageResponse`'s (`status` 1, `message` 2, `delivery_timestamp`
3), so the bytes of a standard stream laid end to end are a valid `ReceiveMessagesResponse`:
`batch` only regroups what `responses.receive_responses` already wrote, with no encoding of its
own. A response holds at most `limit` bytes of messages, or one message if that one is larger
(the server passes `max_receive_response_bytes`, 4 MiB by default, so no response is larger
than the standard stream's largest by more than that, and each stays within both sides' gRPC
limits); the status travels in the first, the delivery timestamp in the last.

The official clients never call this service and are served the standard stream as before.
chronoq's SDK calls it first and falls back to the standard stream for good when a server
answers UNIMPLEMENTED (a RocketMQ proxy, an older chronoq), so it works against either.

The message type is built here from a descriptor (no .proto to compile), on top of the
`apache.rocketmq.v2` files `chronoq.protocol.v2` loads, and added to protobuf's default pool
once, when this module is first imported.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.timestamp_pb2 import Timestamp

from chronoq.protocol.v2 import definition, service

SERVICE_NAME = "chronoq.receive.v1.Receive"
METHOD = "ReceiveMessages"
PATH = f"/{SERVICE_NAME}/{METHOD}"

_PACKAGE = "chronoq.receive.v1"
_FILE = "chronoq/receive/v1/receive.proto"


def _response_class() -> type:
    pool = descriptor_pool.Default()
    try:
        descriptor = pool.FindMessageTypeByName(f"{_PACKAGE}.ReceiveMessagesResponse")
    except KeyError:
        proto = descriptor_pb2.FileDescriptorProto(
            name=_FILE, package=_PACKAGE, syntax="proto3",
            dependency=[definition.DESCRIPTOR.name, Timestamp.DESCRIPTOR.file.name])
        message = proto.message_type.add(name="ReceiveMessagesResponse")
        field = descriptor_pb2.FieldDescriptorProto
        standard = service.ReceiveMessageResponse.DESCRIPTOR.fields_by_name
        for name, number, label, type_name in (
            ("status", standard["status"].number, field.LABEL_OPTIONAL, ".apache.rocketmq.v2.Status"),
            ("messages", standard["message"].number, field.LABEL_REPEATED, ".apache.rocketmq.v2.Message"),
            ("delivery_timestamp", standard["delivery_timestamp"].number, field.LABEL_OPTIONAL,
             ".google.protobuf.Timestamp"),
        ):
            message.field.add(name=name, number=number, label=label, type=field.TYPE_MESSAGE, type_name=type_name)
        pool.Add(proto)
        descriptor = pool.FindMessageTypeByName(f"{_PACKAGE}.ReceiveMessagesResponse")
    return message_factory.GetMessageClass(descriptor)


ReceiveMessagesResponse = _response_class()
"""`status` (first response only), `messages`, `delivery_timestamp` (last response only)."""


def batch(stream: Sequence[bytes], limit: int) -> Iterator[bytes]:
    """Regroup one ReceiveMessage call's serialized stream (status, messages..., timestamp, as
    `responses.receive_responses` or `receive_error` wrote it) into `ReceiveMessagesResponse`s of
    at most `limit` bytes of messages each, or one message when it alone is larger. A stream that
    is a status alone (nothing received, an error) is one response, that status."""
    if len(stream) <= 1:
        yield from stream
        return
    status, messages, stamp = stream[0], stream[1:-1], stream[-1]
    parts = [status]
    size = 0
    for message in messages:
        if size and size + len(message) > limit:
            yield b"".join(parts)
            parts, size = [], 0
        parts.append(message)
        size += len(message)
    parts.append(stamp)
    yield b"".join(parts)
