"""One rule set, every door: a bad message is refused alike through each.

A message reaches admission through gRPC's SendMessage (`protocol/requests.py` decodes it), the
admin service's SendBatch (`protocol/admin.py`), its bulk send SendColumns (`protocol/bulk.py`,
admitted by `validate.prepare_columns`), or `Broker.send` in process. Each rule lives once, in
`chronoq/validate.py`, and the decoders call its checkers; this test pushes every bad message
through all four doors of one real server and expects the same error class, code and text from
each, and nothing stored. (Before the rule set was one, a message id such as "日本"
was stored through SendBatch and refused over gRPC.)
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from chronoq import errors
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS
from chronoq.model import SCHEDULE_TOPIC, SYS_REAL_TOPIC, TIMER_TOPIC, OutgoingMessage, TimerState, new_message_id
from chronoq.protocol import bulk
from chronoq.protocol.v2 import definition, service
from tests.support.grpc_server import Harness, running

NOW_MS = 1_800_000_000_000
LIMITS = dict(max_message_size_bytes=2048, max_properties_size_bytes=512, max_property_count=4, max_keys_count=3,
              max_tag_length=16, max_message_id_length=40, max_topic_name_length=20, timer_max_delay_ms=DAY_MS)


@dataclass(frozen=True)
class Bad:
    """A message expressible through every door: the fields all three carry."""

    topic: str = "orders"
    body: bytes = b"ok"
    message_id: str | None = None
    tag: str | None = None
    keys: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    deliver_at_ms: int | None = None

    def in_process(self) -> OutgoingMessage:
        return OutgoingMessage(self.topic, self.body, message_id=self.message_id, tag=self.tag, keys=self.keys,
                               properties=dict(self.properties), deliver_at_ms=self.deliver_at_ms)

    def wire(self) -> definition.Message:
        """As the official clients send it: the id set, no message type (admission derives it)."""
        msg = definition.Message(topic=definition.Resource(name=self.topic), body=self.body,
                                 user_properties=self.properties)
        sp = msg.system_properties
        sp.body_encoding = definition.IDENTITY
        if self.message_id is not None:
            sp.message_id = self.message_id
        if self.tag is not None:
            sp.tag = self.tag
        sp.keys.extend(self.keys)
        if self.deliver_at_ms is not None:
            sp.delivery_timestamp.seconds, rest_ms = divmod(self.deliver_at_ms, 1000)
            sp.delivery_timestamp.nanos = rest_ms * 1_000_000
        return msg

    def columns(self, default_id: str) -> bytes:
        """A SendColumns request of this one row (the bulk send carries an id for every row)."""
        return bulk.encode_request(self.topic, [self.message_id or default_id], [self.body],
                                   due_kind=bulk.DUE_AT if self.deliver_at_ms is not None else bulk.DUE_NONE,
                                   due=[self.deliver_at_ms] if self.deliver_at_ms is not None else None,
                                   tags=[self.tag or ""], keys=[self.keys], properties=[dict(self.properties)])

    def json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"topic": self.topic, "body_b64": base64.b64encode(self.body).decode()}
        for name in ("message_id", "tag", "deliver_at_ms"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        if self.keys:
            doc["keys"] = list(self.keys)
        if self.properties:
            doc["properties"] = self.properties
        return doc


BAD: list[tuple[str, Bad, type[errors.ChronoqError]]] = [
    ("topic name too long", Bad(topic="t" * 21), errors.InvalidTopicName),
    ("topic name with a slash", Bad(topic="a/b"), errors.InvalidTopicName),
    ("topic name not ASCII", Bad(topic="zamówienia"), errors.InvalidTopicName),
    ("timer system topic", Bad(topic=TIMER_TOPIC), errors.SystemTopicForbidden),
    ("schedule system topic", Bad(topic=SCHEDULE_TOPIC), errors.SystemTopicForbidden),
    ("empty body", Bad(body=b""), errors.MessageBodyEmpty),
    ("body over the message limit", Bad(body=b"x" * 5000), errors.MessageTooLarge),
    ("body just over the limit with its record", Bad(body=b"x" * 1800), errors.MessageTooLarge),
    ("message id too long", Bad(message_id="i" * 41), errors.InvalidMessageId),
    ("message id with a space", Bad(message_id="a b"), errors.InvalidMessageId),
    ("message id with a control character", Bad(message_id="a\x01"), errors.InvalidMessageId),
    ("message id not ASCII (the drift: stored through SendBatch, refused over gRPC)", Bad(message_id="日本"),
     errors.InvalidMessageId),
    ("tag too long", Bad(tag="t" * 17), errors.InvalidTag),
    ("tag with a bar", Bad(tag="a|b"), errors.InvalidTag),
    ("blank tag", Bad(tag="  "), errors.InvalidTag),
    ("too many keys", Bad(keys=("a", "b", "c", "d")), errors.InvalidKeys),
    ("empty key", Bad(keys=("",)), errors.InvalidKeys),
    ("too many properties", Bad(properties={f"p{i}": "v" for i in range(5)}), errors.PropertiesTooLarge),
    ("properties too large", Bad(properties={"p": "v" * 600}), errors.PropertiesTooLarge),
    ("property key with a control character", Bad(properties={"a\tb": "v"}), errors.InvalidProperty),
    ("reserved property", Bad(properties={SYS_REAL_TOPIC: "x"}), errors.ReservedProperty),
    ("reserved property prefix", Bad(properties={"__CHRONOQ_X": "x"}), errors.ReservedProperty),
    ("delay property not a number", Bad(properties={"TIMER_DELAY_MS": "soon"}), errors.InvalidProperty),
    ("delay seconds beyond timer_max_delay_ms", Bad(properties={"TIMER_DELAY_SEC": str(DAY_MS // 1000 + 1)}),
     errors.DeliveryTimeTooFar),
    ("deliver-at beyond timer_max_delay_ms", Bad(deliver_at_ms=NOW_MS + 2 * DAY_MS), errors.DeliveryTimeTooFar),
    ("deliver-at and a delay property", Bad(deliver_at_ms=NOW_MS + 5000, properties={"TIMER_DELAY_SEC": "3"}),
     errors.ConflictingDelivery),
]


async def send_columns(h: Harness, frame: bytes) -> bulk.BulkReply:
    raw = await h.channel.unary_unary(f"/chronoq.admin.v1.Admin/{bulk.METHOD}")(frame, timeout=10)
    assert raw[:4] == bulk.REPLY_MAGIC, raw[:300]
    return bulk.decode_reply(raw, 1)


@pytest.mark.parametrize(("case", "bad", "error"), BAD, ids=[c for c, _, _ in BAD])
def test_each_door_refuses_alike_and_stores_nothing(case: str, bad: Bad, error: type[errors.ChronoqError],
                                                    tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path, clock=FakeClock(NOW_MS), background=False, **LIMITS) as h:
            await h.broker.create_topic("orders", 2)
            end = h.broker.store.log.end_position

            with pytest.raises(error) as info:
                await h.broker.send(bad.in_process())
            in_process = info.value
            assert type(in_process) is error, f"{case}: {type(in_process).__name__}"

            reply = await h.stub.SendMessage(service.SendMessageRequest(messages=[bad.wire()]), timeout=10)
            assert (reply.status.code, reply.status.message) == (in_process.code, in_process.message), case

            admin = await h.admin("SendBatch", {"messages": [bad.json()]})
            refusal = admin["results"][0]["error"]
            assert (refusal["error"], refusal["code"], refusal["message"]) == (
                error.__name__, in_process.code, in_process.message), case

            # A row without an id takes one as long as those the broker makes (34 characters),
            # so a message refused for its size counts the same bytes through this door.
            columns = await send_columns(h, bad.columns("D" * len(new_message_id())))
            assert columns.status[0] == bulk.REFUSED, case
            [(_, refusal)] = columns.errors
            assert (refusal["error"], refusal["code"], refusal["message"]) == (
                error.__name__, in_process.code, in_process.message), case

            assert h.broker.store.log.end_position == end, f"{case}: something was stored"
            assert [t.name for t in h.broker.list_topics()] == ["orders"], case

    arun(body())


def test_a_good_message_passes_every_door(tmp_path: Path, arun: Any) -> None:
    """The control: the same four doors store a well-formed message (ASCII id, tag, keys,
    properties, a due time), so the refusals above are the rules', not the doors'."""
    async def body() -> None:
        async with running(tmp_path, clock=FakeClock(NOW_MS), background=False, **LIMITS) as h:
            good = Bad(tag="t", keys=("k1",), properties={"p": "v"}, deliver_at_ms=NOW_MS + 60_000)
            await h.broker.send(Bad(**{**good.__dict__, "message_id": "id-1"}).in_process())
            reply = await h.stub.SendMessage(service.SendMessageRequest(
                messages=[Bad(**{**good.__dict__, "message_id": "id-2"}).wire()]), timeout=10)
            assert reply.status.code == 20000, reply.status
            admin = await h.admin("SendBatch", {"messages": [Bad(**{**good.__dict__, "message_id": "id-3"}).json()]})
            assert "error" not in admin["results"][0], admin
            columns = await send_columns(h, good.columns("id-4"))
            assert columns.status[0] == bulk.STORED | bulk.HAS_HANDLE, columns
            for message_id in ("id-1", "id-2", "id-3", "id-4"):
                [status] = h.broker.query(message_id, "orders")
                assert status.state is TimerState.PENDING, status

    arun(body())



SECONDS = 1_795_838_000
"""Epoch SECONDS (2026-11-28) where ms belong: as ms, 1970-01-21, which would be due at once."""
SECONDS_REASON = ("looks like seconds since the epoch (2026-11-28T03:53:20Z as seconds, 1970-01-21T18:50:38Z as ms); "
                  "give milliseconds (1795838000000)")


def test_a_deliver_at_in_epoch_seconds_is_refused_naming_the_unit(tmp_path: Path, arun: Any) -> None:
    """A deliver-at in ms that is plausibly epoch seconds is refused with a message naming the unit
    and the value in ms: in process and through SendBatch (`validate.check_deliver_at_unit`), for
    the `TIMER_DELIVER_MS` property too, and by the SDK before sending, on either batch path. (Before,
    the in-process and SendBatch doors stored it as due at once, and the SDK's send was refused as
    `delivery_timestamp.seconds=1795838`, a field its caller never wrote.) Over gRPC
    `delivery_timestamp.seconds` in that range is read as seconds, as the protocol rule says."""
    from chronoq.client import AsyncProducer, InvalidArgument
    from chronoq.client.wire import outgoing

    async def body() -> None:
        async with running(tmp_path, clock=FakeClock(NOW_MS), background=False, **LIMITS) as h:
            await h.broker.create_topic("orders", 2)
            end = h.broker.store.log.end_position
            expected = f"invalid delivery time: deliver_at_ms={SECONDS} {SECONDS_REASON}"
            with pytest.raises(errors.InvalidDeliveryTime) as info:
                await h.broker.send(Bad(deliver_at_ms=SECONDS).in_process())
            assert info.value.message == expected
            admin = await h.admin("SendBatch", {"messages": [Bad(deliver_at_ms=SECONDS).json()]})
            assert admin["results"][0]["error"]["message"] == expected, admin
            with pytest.raises(errors.InvalidDeliveryTime) as info:
                await h.broker.send(Bad(properties={"TIMER_DELIVER_MS": str(SECONDS)}).in_process())
            assert info.value.message == f"invalid delivery time: TIMER_DELIVER_MS={SECONDS} {SECONDS_REASON}"

            sdk = f"invalid deliver_at {SECONDS}: {SECONDS_REASON}"
            for via in ("grpc", "admin"):
                async with AsyncProducer(h.address, batch_via=via) as p:
                    with pytest.raises(InvalidArgument) as sent:
                        await p.send("orders", b"x", deliver_at=SECONDS)
                    assert str(sent.value) == sdk
                    with pytest.raises(InvalidArgument) as batch:
                        await p.send_batch([outgoing("orders", b"x", deliver_at=SECONDS)])
                    assert str(batch.value) == sdk
            assert h.broker.store.log.end_position == end, "something was stored"

            # The same number as gRPC's delivery_timestamp.seconds is a time in seconds, and due.
            wire = definition.Message(topic=definition.Resource(name="orders"), body=b"x")
            wire.system_properties.message_id = "in-seconds"
            wire.system_properties.body_encoding = definition.IDENTITY
            wire.system_properties.delivery_timestamp.seconds = SECONDS
            reply = await h.stub.SendMessage(service.SendMessageRequest(messages=[wire]), timeout=10)
            assert reply.status.code == 20000, reply.status

    arun(body())
