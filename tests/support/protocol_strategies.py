"""Hypothesis strategies for arbitrary RocketMQ v2 protobuf messages, built from their descriptors.

Any message type gets a strategy that sets a random subset of its fields to hostile or plausible
values: extreme integers, unknown enum numbers, odd strings (often valid names, so decoding
gets past the first check), nested messages to a bounded depth, repeated fields and maps.
Shared by the pure codec fuzz test and the server fuzz test.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from chronoq.protocol.v2 import definition, service

NAMES = st.sampled_from(["", "orders", "T", "G", "g1", "%DLQ%g", "rmq_sys_wheel_timer", "SCHEDULE_TOPIC_XXXX",
                         "*", "a||b", "TagA", "x" * 130, "bad name", "DELAY", "TIMER_DELIVER_MS", "3",
                         "01AABBCCDDEEFF0001000000010000002A", "REAL_TOPIC", "\u00e9t\u00e9", "-1"])
STRINGS = st.one_of(NAMES, st.text(max_size=40))
INT32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, -1, 16, 64, 65, 1000, 2**31 - 1, -(2**31)]),
                  st.integers(-(2**31), 2**31 - 1))
INT64 = st.one_of(INT32, st.sampled_from([1_795_000_003, 1_795_000_003_000, 10**11, 10**14, 2**63 - 1, -(2**63)]),
                  st.integers(-(2**63), 2**63 - 1))
NANOS = st.one_of(st.integers(0, 999_999_999), st.sampled_from([-1, 1_000_000_000, 2**31 - 1, -(2**31)]))

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: STRINGS,
    FieldDescriptor.TYPE_BYTES: st.one_of(st.binary(max_size=64), st.just(b"")),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True),
}


def _value(field: FieldDescriptor, depth: int, sparse: bool) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), INT32)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(field.message_type._concrete_class, depth + 1, sparse=sparse)
    if field.name == "nanos":
        return NANOS
    return _SCALARS[field.type]


DENSE = st.booleans()
SPARSE = st.sampled_from([True, False, False, False, False, False])


@st.composite
def _fill(draw: st.DrawFn, cls: type, depth: int, sparse: bool) -> Any:
    msg = cls()
    for field in cls.DESCRIPTOR.fields:
        if not draw(SPARSE if sparse else DENSE):
            continue
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if is_message and depth >= 4:
            continue
        if is_message and field.message_type.GetOptions().map_entry:
            entries = draw(st.dictionaries(STRINGS, STRINGS, max_size=5))
            getattr(msg, field.name).update(entries)
        elif field.is_repeated:
            values = draw(st.lists(_value(field, depth, sparse), max_size=3))
            container = getattr(msg, field.name)
            for v in values:
                if is_message:
                    container.add().CopyFrom(v)
                else:
                    container.append(v)
        elif is_message:
            getattr(msg, field.name).CopyFrom(draw(_value(field, depth, sparse)))
        else:
            setattr(msg, field.name, draw(_value(field, depth, sparse)))
    return msg


def message_strategy(cls: type, depth: int = 0, *, sparse: bool = False) -> st.SearchStrategy[Any]:
    return _fill(cls, depth, sparse)


# -- valid seeds, mutated: gets past the first checks so deeper rules are exercised too ---------

def _seeds() -> dict[type, list[Any]]:
    def resource(name: str) -> definition.Resource:
        return definition.Resource(name=name)

    def msg(**system: Any) -> definition.Message:
        m = definition.Message(topic=resource("orders"), body=b"payload")
        m.system_properties.message_id = "01AABBCCDDEEFF0001000000010000002A"
        m.system_properties.message_type = definition.NORMAL
        m.system_properties.body_encoding = definition.IDENTITY
        for k, v in system.items():
            if k == "delivery_seconds":
                m.system_properties.delivery_timestamp.seconds = v
            else:
                setattr(m.system_properties, k, v)
        return m

    delay_level = msg(message_type=definition.DELAY)
    delay_level.user_properties["DELAY"] = "2"
    receive = service.ReceiveMessageRequest(group=resource("g"), batch_size=4)
    receive.message_queue.topic.name = "orders"
    receive.invisible_duration.seconds = 10
    receive.long_polling_timeout.seconds = 1
    change = service.ChangeInvisibleDurationRequest(group=resource("g"), topic=resource("orders"),
                                                    receipt_handle="AAAA", message_id="m")
    change.invisible_duration.seconds = 5
    return {
        service.SendMessageRequest: [
            service.SendMessageRequest(messages=[msg(tag="A")]),
            service.SendMessageRequest(messages=[msg(message_type=definition.DELAY,
                                                     delivery_seconds=1_900_000_000_000)]),
            service.SendMessageRequest(messages=[msg(message_type=definition.DELAY, delivery_seconds=1_900_000_000)]),
            service.SendMessageRequest(messages=[delay_level, msg(message_type=definition.FIFO, message_group="q")]),
        ],
        service.ReceiveMessageRequest: [receive],
        service.AckMessageRequest: [service.AckMessageRequest(group=resource("g"), topic=resource("orders"), entries=[
            service.AckMessageEntry(message_id="m", receipt_handle="AAAA")])],
        service.ChangeInvisibleDurationRequest: [change],
        service.RecallMessageRequest: [service.RecallMessageRequest(topic=resource("orders"), recall_handle="AQAA")],
        service.ForwardMessageToDeadLetterQueueRequest: [service.ForwardMessageToDeadLetterQueueRequest(
            group=resource("g"), topic=resource("orders"), receipt_handle="AAAA", message_id="m")],
        service.QueryRouteRequest: [service.QueryRouteRequest(topic=resource("orders"))],
        service.QueryAssignmentRequest: [service.QueryAssignmentRequest(topic=resource("orders"),
                                                                        group=resource("g"))],
    }


SEEDS = _seeds()


def _merged(seed: Any, mutation: Any) -> Any:
    out = type(seed)()
    out.CopyFrom(seed)
    out.MergeFrom(mutation)
    return out


def request_strategy(cls: type) -> st.SearchStrategy[Any]:
    """Arbitrary requests of `cls`: fully random ones, and valid seeds with a few fields
    overwritten (sparse mutations), so most requests get past the first check."""
    seeds = SEEDS.get(cls)
    if not seeds:
        return message_strategy(cls)
    mutated = st.builds(_merged, st.sampled_from(seeds), message_strategy(cls, sparse=True))
    if cls is service.SendMessageRequest:
        # Mutate the messages themselves (a merge would only append random messages).
        mutated = st.builds(lambda seed, mutation: service.SendMessageRequest(
            messages=[_merged(m, mutation) for m in seed.messages]),
            st.sampled_from(seeds), message_strategy(definition.Message, sparse=True))
    return st.one_of(message_strategy(cls), st.sampled_from(seeds), mutated, mutated)
