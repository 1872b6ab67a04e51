"""The RocketMQ v2 codec (chronoq.protocol): requests decoded whole, responses as clients read them."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from chronoq.config import Config
from chronoq.errors import (
    ChronoqError,
    InvalidBatchSize,
    InvalidDeliveryTime,
    InvalidGroupName,
    InvalidInvisibleDuration,
    InvalidKeys,
    InvalidMessageId,
    InvalidTopicName,
    MessageTooLarge,
    TopicNotFound,
)
from chronoq.model import MessageType, OutgoingMessage, ReceivedMessage, SendResult, StoredMessage, TopicConfig
from chronoq.protocol import admin
from chronoq.protocol import requests as rq
from chronoq.protocol import responses as rs
from chronoq.protocol.errors import (
    InvalidField,
    InvalidPollingTime,
    MessageTypeConflict,
    MissingField,
    Unsupported,
)
from chronoq.protocol.v2 import Code, definition, service

CONFIG = Config(max_message_size_bytes=1024, max_send_batch=4, max_receive_batch=8, max_keys_count=2,
                max_property_count=3, max_long_poll_ms=20_000)
NOW_MS = 1_795_000_000_000


def wire_message(topic: str = "orders", body: bytes = b"hello", **system: object) -> definition.Message:
    msg = definition.Message(topic=definition.Resource(name=topic), body=body)
    msg.system_properties.message_id = "01AABBCCDDEEFF0001000000010000002A"
    msg.system_properties.body_encoding = definition.IDENTITY
    msg.system_properties.message_type = definition.NORMAL
    msg.system_properties.born_timestamp.seconds = NOW_MS // 1000
    for name, value in system.items():
        setattr(msg.system_properties, name, value)
    return msg


def delay_message(seconds: int, nanos: int = 0) -> definition.Message:
    msg = wire_message(message_type=definition.DELAY)
    msg.system_properties.delivery_timestamp.seconds = seconds
    msg.system_properties.delivery_timestamp.nanos = nanos
    return msg


# -- delivery_timestamp: the documented seconds-or-milliseconds rule ---------------------------


def test_delivery_timestamp_in_epoch_seconds_keeps_nanos():
    assert rq.delivery_time_ms(1_795_000_003, 250_000_000) == 1_795_000_003_250


def test_delivery_timestamp_in_epoch_milliseconds_as_the_python_client_writes_it():
    # The Python client copies its integer into Timestamp.seconds unchanged (docs say ms).
    assert rq.delivery_time_ms(1_795_000_003_123, 0) == 1_795_000_003_123


@pytest.mark.parametrize("seconds", [0, 10, 999_999_999, -5, 100_000_000_000, 999_999_999_999,
                                     100_000_000_000_000, 2**62])
def test_delivery_timestamp_outside_both_ranges_is_refused_with_40012(seconds):
    with pytest.raises(InvalidDeliveryTime) as info:
        rq.delivery_time_ms(seconds, 0)
    assert info.value.code == 40012
    assert "is not a date chronoq reads" in info.value.message
    assert str(seconds) in info.value.message
    # Dates for the reader, the raw value kept for programs.
    assert "between 2001-09-09T01:46:40Z and 5138-11-16T09:46:40Z" in info.value.message
    assert info.value.details["seconds"] == seconds


def test_delivery_timestamp_refusal_names_the_dates_it_would_mean():
    with pytest.raises(InvalidDeliveryTime) as info:
        rq.delivery_time_ms(1, 0)
    assert "as epoch seconds it is 1970-01-01T00:00:01Z" in info.value.message
    assert "as epoch milliseconds 1970-01-01T00:00:00.001Z" in info.value.message


def test_delivery_timestamp_in_milliseconds_with_nanos_is_ambiguous():
    with pytest.raises(InvalidDeliveryTime, match="reads as epoch milliseconds"):
        rq.delivery_time_ms(1_795_000_003_123, 5)


@pytest.mark.parametrize("nanos", [-1, 1_000_000_000])
def test_delivery_timestamp_nanos_out_of_range(nanos):
    with pytest.raises(InvalidDeliveryTime, match="nanos"):
        rq.delivery_time_ms(1_795_000_003, nanos)


# -- SendMessage ---------------------------------------------------------------------------------


def test_normal_message_decodes_every_field():
    msg = wire_message(tag="TagA")
    msg.system_properties.keys.extend(["k1", "k2"])
    msg.user_properties["color"] = "red"
    out = rq.decode_message(msg, CONFIG)
    assert out.topic == "orders"
    assert out.body == b"hello"
    assert out.message_id == "01AABBCCDDEEFF0001000000010000002A"
    assert out.tag == "TagA"
    assert out.keys == ("k1", "k2")
    assert out.properties == {"color": "red"}
    assert out.message_type is MessageType.NORMAL
    assert out.born_ms == (NOW_MS // 1000) * 1000
    assert out.deliver_at_ms is None and out.message_group is None


def test_timer_message_from_python_client_and_node_client():
    assert rq.decode_message(delay_message(1_795_000_003_000), CONFIG).deliver_at_ms == 1_795_000_003_000
    node = rq.decode_message(delay_message(1_795_000_003, 7_000_000), CONFIG)
    assert node.deliver_at_ms == 1_795_000_003_007
    assert node.message_type is MessageType.DELAY


def test_delay_level_property_passes_through_to_the_broker():
    msg = wire_message(message_type=definition.DELAY)
    msg.user_properties["DELAY"] = "3"
    out = rq.decode_message(msg, CONFIG)
    assert out.properties == {"DELAY": "3"}
    assert out.deliver_at_ms is None


def test_fifo_message_keeps_its_group():
    out = rq.decode_message(wire_message(message_type=definition.FIFO, message_group="g1"), CONFIG)
    assert out.message_group == "g1" and out.message_type is MessageType.FIFO


def test_unspecified_type_and_absent_id_are_left_to_the_broker():
    msg = wire_message(message_type=definition.MESSAGE_TYPE_UNSPECIFIED)
    msg.system_properties.ClearField("message_id")
    out = rq.decode_message(msg, CONFIG)
    assert out.message_type is None and out.message_id is None


@pytest.mark.parametrize(("build", "error"), [
    (lambda: wire_message(topic=""), MissingField),
    (lambda: wire_message(topic="bad topic"), InvalidTopicName),
    (lambda: wire_message(topic="x" * 200), InvalidTopicName),
    # An identity body over the limit is admission's refusal (the whole record counts), the same
    # through every door: tests/test_admission_doors.py. A GZIP body is bounded here, below.
    (lambda: wire_message(message_id="has space"), InvalidMessageId),
    (lambda: wire_message(message_id="A" * 129), InvalidMessageId),
    (lambda: wire_message(message_type=definition.LITE), Unsupported),
    (lambda: wire_message(message_type=definition.TRANSACTION), Unsupported),
    (lambda: wire_message(message_type=77), InvalidField),
    (lambda: wire_message(body_encoding=9), InvalidField),
    (lambda: wire_message(lite_topic="lt"), Unsupported),
    (lambda: wire_message(priority=3), Unsupported),
    (lambda: wire_message(message_type=definition.DELAY), MessageTypeConflict),
    (lambda: wire_message(message_type=definition.FIFO), MessageTypeConflict),
])
def test_bad_messages_are_refused_with_a_specific_error(build, error):
    with pytest.raises(error) as info:
        rq.decode_message(build(), CONFIG)
    assert info.value.code >= 40000


def test_delivery_time_on_a_normal_message_conflicts_with_its_type():
    msg = delay_message(1_795_000_003)
    msg.system_properties.message_type = definition.NORMAL
    with pytest.raises(MessageTypeConflict) as info:
        rq.decode_message(msg, CONFIG)
    assert info.value.code == 40014


def test_timer_message_with_a_message_group_conflicts():
    msg = delay_message(1_795_000_003)
    msg.system_properties.message_group = "g"
    with pytest.raises(MessageTypeConflict, match="message group"):
        rq.decode_message(msg, CONFIG)


def test_namespace_is_refused():
    msg = wire_message()
    msg.topic.resource_namespace = "ns"
    with pytest.raises(Unsupported, match="namespaces"):
        rq.decode_message(msg, CONFIG)


def test_too_many_keys_and_properties():
    msg = wire_message()
    msg.system_properties.keys.extend(["a", "b", "c"])
    with pytest.raises(InvalidKeys):
        rq.decode_message(msg, CONFIG)
    msg = wire_message()
    msg.user_properties.update({f"p{i}": "v" for i in range(4)})
    with pytest.raises(ChronoqError) as info:
        rq.decode_message(msg, CONFIG)
    assert info.value.code == 43101


def test_gzip_body_is_inflated_and_bounded():
    out = rq.decode_message(wire_message(body=gzip.compress(b"abc" * 10), body_encoding=definition.GZIP), CONFIG)
    assert out.body == b"abc" * 10
    bomb = gzip.compress(b"\0" * 100_000)
    assert len(bomb) < 1024
    with pytest.raises(MessageTooLarge):
        rq.decode_message(wire_message(body=bomb, body_encoding=definition.GZIP), CONFIG)
    with pytest.raises(InvalidField, match="does not inflate"):
        rq.decode_message(wire_message(body=b"not gzip", body_encoding=definition.GZIP), CONFIG)
    with pytest.raises(InvalidField, match="truncated"):
        rq.decode_message(wire_message(body=gzip.compress(b"abc" * 100)[:-12], body_encoding=definition.GZIP),
                          CONFIG)


def test_send_request_is_all_or_nothing():
    good, bad = wire_message(), wire_message(topic="bad topic")
    assert len(rq.decode_send(service.SendMessageRequest(messages=[good, good]), CONFIG).messages) == 2
    with pytest.raises(InvalidTopicName):
        rq.decode_send(service.SendMessageRequest(messages=[good, bad]), CONFIG)
    with pytest.raises(MissingField):
        rq.decode_send(service.SendMessageRequest(), CONFIG)
    with pytest.raises(InvalidBatchSize):
        rq.decode_send(service.SendMessageRequest(messages=[good] * 5), CONFIG)


# -- consumer requests -----------------------------------------------------------------------------


def receive_request(**fields: object) -> service.ReceiveMessageRequest:
    req = service.ReceiveMessageRequest(group=definition.Resource(name="g"), batch_size=4)
    req.message_queue.topic.name = "orders"
    req.message_queue.id = 3
    req.filter_expression.type = definition.TAG
    req.filter_expression.expression = "TagA||TagB"
    req.invisible_duration.seconds = 15
    req.long_polling_timeout.seconds = 20
    for name, value in fields.items():
        setattr(req, name, value)
    return req


def test_receive_decodes_as_the_python_simple_consumer_sends_it():
    cmd = rq.decode_receive(receive_request(), CONFIG)
    assert cmd == rq.ReceiveCommand(group="g", topic="orders", filter_expression="TagA||TagB", batch_size=4,
                                    invisible_duration_ms=15_000, auto_renew=False, long_polling_ms=20_000)


def test_receive_auto_renew_without_duration_lets_the_server_choose():
    req = receive_request(auto_renew=True)
    req.ClearField("invisible_duration")
    assert rq.decode_receive(req, CONFIG).invisible_duration_ms is None
    req.auto_renew = False
    assert rq.decode_receive(req, CONFIG).invisible_duration_ms == CONFIG.default_invisible_duration_ms


def test_receive_long_poll_is_clamped_and_empty_filter_means_all():
    req = receive_request()
    req.long_polling_timeout.seconds = 3600
    req.filter_expression.expression = "  "
    cmd = rq.decode_receive(req, CONFIG)
    assert cmd.long_polling_ms == CONFIG.max_long_poll_ms
    assert cmd.filter_expression == "*"


def test_receive_refusals():
    with pytest.raises(InvalidBatchSize):
        rq.decode_receive(receive_request(batch_size=0), CONFIG)
    with pytest.raises(InvalidBatchSize):
        rq.decode_receive(receive_request(batch_size=9), CONFIG)
    req = receive_request()
    req.invisible_duration.seconds = 0
    with pytest.raises(InvalidInvisibleDuration) as info:
        rq.decode_receive(req, CONFIG)
    assert info.value.code == 40011
    req = receive_request()
    req.long_polling_timeout.seconds = -1
    with pytest.raises(InvalidPollingTime) as info:
        rq.decode_receive(req, CONFIG)
    assert info.value.code == 40018
    req = receive_request()
    req.filter_expression.type = definition.SQL
    with pytest.raises(Unsupported, match="SQL92"):
        rq.decode_receive(req, CONFIG)
    req = receive_request()
    req.group.name = "bad group!"
    with pytest.raises(InvalidGroupName):
        rq.decode_receive(req, CONFIG)
    req = receive_request()
    req.invisible_duration.nanos = -3
    with pytest.raises(InvalidField, match="invisible_duration"):
        rq.decode_receive(req, CONFIG)


def test_ack_change_recall_and_dead_letter():
    ack = service.AckMessageRequest(group=definition.Resource(name="g"), topic=definition.Resource(name="orders"),
                                    entries=[service.AckMessageEntry(message_id="m1", receipt_handle="h1")])
    assert rq.decode_ack(ack, CONFIG).entries == (rq.AckEntry("m1", "h1"),)
    ack.entries.add(message_id="m2")
    with pytest.raises(MissingField, match="receipt_handle"):
        rq.decode_ack(ack, CONFIG)
    change = service.ChangeInvisibleDurationRequest(
        group=definition.Resource(name="g"), topic=definition.Resource(name="orders"), receipt_handle="h",
        message_id="m")
    with pytest.raises(MissingField, match="invisible_duration"):
        rq.decode_change_invisible(change, CONFIG)
    change.invisible_duration.seconds = 5
    assert rq.decode_change_invisible(change, CONFIG).invisible_duration_ms == 5000
    recall = service.RecallMessageRequest(topic=definition.Resource(name="orders"))
    with pytest.raises(MissingField, match="recall_handle"):
        rq.decode_recall(recall, CONFIG)
    recall.recall_handle = "rh"
    assert rq.decode_recall(recall, CONFIG) == rq.RecallCommand("orders", "rh")
    dlq = service.ForwardMessageToDeadLetterQueueRequest(
        group=definition.Resource(name="g"), topic=definition.Resource(name="orders"), receipt_handle="h",
        message_id="m", delivery_attempt=16)
    assert rq.decode_dead_letter(dlq, CONFIG) == rq.DeadLetterCommand("g", "orders", "h", "m")


def test_route_query_reads_the_access_point():
    req = service.QueryRouteRequest(topic=definition.Resource(name="orders"))
    assert rq.decode_route(req, CONFIG).access_point is None
    req.endpoints.addresses.add(host="localhost", port=18082)
    assert rq.decode_route(req, CONFIG).access_point == rq.Endpoint("localhost", 18082)


# -- responses ---------------------------------------------------------------------------------


def test_route_lists_readable_writable_queues_of_broker_zero():
    topic = TopicConfig("orders", 2, frozenset({MessageType.NORMAL, MessageType.DELAY}), 0)
    res = rs.route_response(topic, rq.Endpoint("127.0.0.1", 8081))
    assert res.status.code == Code.OK
    assert [q.id for q in res.message_queues] == [0, 1]
    for queue in res.message_queues:
        assert queue.permission == definition.READ_WRITE
        assert queue.broker.id == 0
        assert queue.broker.endpoints.scheme == definition.IPv4
        assert [(a.host, a.port) for a in queue.broker.endpoints.addresses] == [("127.0.0.1", 8081)]
        assert list(queue.accept_message_types) == [definition.NORMAL, definition.DELAY]
    assert rs.endpoints(rq.Endpoint("broker.example", 1)).scheme == definition.DOMAIN_NAME
    assert rs.endpoints(rq.Endpoint("::1", 1)).scheme == definition.IPv6


def stored(body: bytes = b"payload", deliver_at_ms: int | None = None) -> StoredMessage:
    system = {"TIMER_OUT_MS": str(deliver_at_ms)} if deliver_at_ms else {}
    return StoredMessage(message_id="M1", topic="orders", queue_id=1, queue_offset=7, message_type=MessageType.DELAY,
                         tag="TagA", keys=("k",), properties={"p": "v"}, system_properties=system, body=body,
                         born_ms=NOW_MS - 5, store_ms=NOW_MS - 4, position=0, size=100)


def test_received_message_carries_handle_attempt_and_uppercase_md5():
    received = ReceivedMessage(stored(deliver_at_ms=NOW_MS), "HANDLE", 2, NOW_MS + 30_000)
    raw = rs.receive_responses([received], 30_000, NOW_MS + 1)
    stream = [service.ReceiveMessageResponse.FromString(b) for b in raw]
    assert [r.WhichOneof("content") for r in stream] == ["status", "message", "delivery_timestamp"]
    assert stream[0].status.code == Code.OK
    sp = stream[1].message.system_properties
    assert sp.receipt_handle == "HANDLE" and sp.delivery_attempt == 2
    assert sp.body_digest.type == definition.MD5
    assert sp.body_digest.checksum == hashlib.md5(b"payload").hexdigest().upper()
    assert sp.body_digest.checksum == sp.body_digest.checksum.upper()
    assert sp.delivery_timestamp.seconds * 1000 + sp.delivery_timestamp.nanos // 1_000_000 == NOW_MS
    assert sp.invisible_duration.seconds == 30
    assert (sp.queue_id, sp.queue_offset, sp.tag, list(sp.keys)) == (1, 7, "TagA", ["k"])
    assert stream[1].message.body == b"payload"
    assert dict(stream[1].message.user_properties) == {"p": "v"}


def test_empty_receive_is_a_single_40401():
    stream = [service.ReceiveMessageResponse.FromString(b) for b in rs.receive_responses([], 30_000, NOW_MS)]
    assert len(stream) == 1 and stream[0].status.code == Code.MESSAGE_NOT_FOUND


def test_send_response_echoes_the_clients_id_and_recall_handle():
    res = service.SendMessageResponse.FromString(
        rs.send_response([SendResult("CLIENT-ID", "orders", 0, 3, 99, NOW_MS, "RH", False)]))
    assert res.status.code == Code.OK
    assert [(e.message_id, e.offset, e.recall_handle, e.status.code) for e in res.entries] == [
        ("CLIENT-ID", 3, "RH", Code.OK)]


def test_ack_response_mixed_outcomes_is_multiple_results():
    bad = TopicNotFound("orders")
    ok_entry, bad_entry = ("m", "h", Code.OK, "OK"), ("n", "i", bad.code, bad.message)

    def top(*entries: tuple[str, str, int, str]) -> int:
        return service.AckMessageResponse.FromString(rs.ack_response(entries)).status.code

    assert top(ok_entry) == Code.OK
    assert top(bad_entry) == 40402
    assert top(ok_entry, bad_entry) == Code.MULTIPLE_RESULTS


def test_error_status_uses_the_error_code_and_message():
    status = rs.error_status(MessageTooLarge(5000, 1024))
    assert (status.code, status.message) == (41301, MessageTooLarge(5000, 1024).message)


def producer_settings(max_body_size: int = 0) -> definition.Settings:
    settings = definition.Settings(client_type=definition.PRODUCER)
    settings.publishing.topics.add(name="orders")
    settings.publishing.max_body_size = max_body_size
    settings.metric.on = True
    return settings


def test_settings_reply_for_a_producer_has_a_real_body_limit_and_exponential_backoff():
    reply = rs.settings_reply(producer_settings(), CONFIG)
    assert reply.status.code == Code.OK
    assert reply.settings.WhichOneof("pub_sub") == "publishing"
    assert reply.settings.publishing.max_body_size == CONFIG.max_message_size_bytes
    assert [t.name for t in reply.settings.publishing.topics] == ["orders"]
    assert reply.settings.backoff_policy.WhichOneof("strategy") == "exponential_backoff"
    assert reply.settings.backoff_policy.max_attempts >= 1
    assert reply.settings.backoff_policy.exponential_backoff.multiplier > 1
    assert not reply.settings.metric.on


def test_settings_reply_for_a_push_consumer():
    settings = definition.Settings(client_type=definition.PUSH_CONSUMER)
    settings.subscription.group.name = "g"
    settings.subscription.long_polling_timeout.seconds = 3600
    reply = rs.settings_reply(settings, CONFIG).settings
    assert reply.subscription.group.name == "g"
    assert reply.subscription.long_polling_timeout.seconds * 1000 == CONFIG.max_long_poll_ms
    assert 0 < reply.subscription.receive_batch_size <= CONFIG.max_receive_batch
    assert reply.backoff_policy.WhichOneof("strategy") == "customized_backoff"
    assert reply.backoff_policy.max_attempts == CONFIG.max_delivery_attempts
    assert [d.seconds for d in reply.backoff_policy.customized_backoff.next][:3] == [1, 5, 10]


# -- admin JSON codec ----------------------------------------------------------------------------


def test_admin_request_parsing():
    assert admin.parse_request("Stats", b"") == {}
    assert admin.parse_request("Stats", b'{"a": 1}') == {"a": 1}
    for junk in (b"\xff", b"[1]", b"{", b'"s"'):
        with pytest.raises(ChronoqError) as info:
            admin.parse_request("Stats", junk)
        assert info.value.code == 40000


def test_admin_message_from_json():
    msg = admin.message_from_json({"topic": "orders", "body_b64": "aGk=", "delay_ms": 5, "keys": "k",
                                   "properties": {"a": "b"}}, CONFIG)
    assert (msg.topic, msg.body, msg.delay_ms, msg.keys, dict(msg.properties)) == (
        "orders", b"hi", 5, ("k",), {"a": "b"})
    for bad in ({"topic": "orders"}, {"topic": "orders", "body_b64": "!!"},
                {"topic": "orders", "body_b64": "", "delay_ms": "5"},
                {"topic": "orders", "body_b64": "", "delay_ms": True},
                {"topic": "bad topic", "body_b64": ""}, [], {"topic": "orders", "body_b64": "", "keys": [1]}):
        with pytest.raises(ChronoqError):
            admin.message_from_json(bad, CONFIG)


def test_admin_plain_timer_entry_decodes_like_the_general_path():
    """The usual entry (topic, body, id, due time) takes a shorter path; it must decode to the
    same message, and anything malformed must still get the general path's specific error."""
    doc = {"topic": "orders", "body_b64": "aGk=", "message_id": "m-1", "deliver_at_ms": 1_800_000_000_000}
    msg = admin.message_from_json(doc, CONFIG)
    assert msg == OutgoingMessage(topic="orders", body=b"hi", message_id="m-1", deliver_at_ms=1_800_000_000_000)
    assert admin.message_from_json({"topic": "orders", "body_b64": "aGk="}, CONFIG) == OutgoingMessage("orders", b"hi")
    cases = [({**doc, "body_b64": "aGk"}, "body_b64"), ({**doc, "body_b64": "a!k="}, "body_b64"),
             ({**doc, "deliver_at_ms": 1.5}, "deliver_at_ms"), ({**doc, "deliver_at_ms": True}, "deliver_at_ms"),
             ({**doc, "message_id": 7}, "message_id"), ({**doc, "topic": "bad topic"}, "bad topic"),
             ({**doc, "topic": "orders\n"}, "orders")]
    for bad, named in cases:
        with pytest.raises(ChronoqError) as info:
            admin.message_from_json(bad, CONFIG)
        assert named in str(info.value), (bad, str(info.value))
