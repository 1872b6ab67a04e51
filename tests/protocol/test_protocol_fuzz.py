"""Fuzzing the pure codec: every decoder, on arbitrary requests, returns a command or raises a
`ChronoqError` (which the server turns into a status); nothing else escapes. Encoders never fail
on the values decoders accept. Bounded: `max_examples` per decoder."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq.config import Config
from chronoq.errors import ChronoqError, MessageTooLarge
from chronoq.model import topic_name_problem
from chronoq.protocol import admin
from chronoq.protocol import requests as rq
from chronoq.protocol import responses as rs
from chronoq.protocol.v2 import definition, service
from chronoq.timer.levels import DelayLevels
from chronoq.validate import check_message_id, prepare
from tests.support.protocol_strategies import message_strategy, request_strategy

CONFIG = Config(max_message_size_bytes=4096, max_send_batch=8)
NOW_MS = 1_800_000_000_000
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DECODERS = [
    (service.SendMessageRequest, rq.decode_send),
    (service.QueryRouteRequest, rq.decode_route),
    (service.QueryAssignmentRequest, rq.decode_assignment),
    (service.ReceiveMessageRequest, rq.decode_receive),
    (service.AckMessageRequest, rq.decode_ack),
    (service.ChangeInvisibleDurationRequest, rq.decode_change_invisible),
    (service.RecallMessageRequest, rq.decode_recall),
    (service.ForwardMessageToDeadLetterQueueRequest, rq.decode_dead_letter),
]


def _decode_or_error(decoder, request) -> object:
    try:
        return decoder(request, CONFIG)
    except ChronoqError as err:
        assert isinstance(err.code, int) and err.code >= 40000
        assert err.message
        rs.error_status(err).SerializeToString()  # the status it becomes is encodable
        return err


# slow: a long property run (seconds); plain pytest stays under 2 minutes, scripts/test.sh runs it
@pytest.mark.slow
@FUZZ
@given(st.data())
def test_every_decoder_returns_a_command_or_a_chronoq_error(data):
    for request_type, decoder in DECODERS:
        _decode_or_error(decoder, data.draw(request_strategy(request_type), label=request_type.__name__))


@pytest.mark.slow
@FUZZ
@given(message_strategy(definition.Message))
def test_accepted_messages_respect_the_limits(message):
    out = _decode_or_error(rq.decode_message, message)
    if isinstance(out, ChronoqError):
        return
    if len(out.body) > CONFIG.max_message_size_bytes:  # refused by admission, the next room
        with pytest.raises(MessageTooLarge):
            prepare(out, CONFIG, NOW_MS, DelayLevels(CONFIG.delay_levels_ms))
    assert topic_name_problem(out.topic, CONFIG.max_topic_name_length) is None
    if out.message_id is not None:  # what the decoder let through, admission lets through
        assert check_message_id(out.message_id, CONFIG) == out.message_id
    if out.deliver_at_ms is not None:
        assert rq.EPOCH_SECONDS_MIN * 1000 <= out.deliver_at_ms < rq.EPOCH_MILLIS_END


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_either_parse_or_raise_decode_error_only(data):
    # The server maps a parse failure to a 40000 status; here: parsing never fails otherwise.
    from google.protobuf.message import DecodeError

    for request_type, decoder in DECODERS:
        try:
            request = request_type.FromString(data)
        except DecodeError:
            continue
        _decode_or_error(decoder, request)


@pytest.mark.slow
@FUZZ
@given(message_strategy(definition.Settings))
def test_settings_reply_is_always_a_valid_ok_command(settings_msg):
    reply = rs.settings_reply(settings_msg, CONFIG)
    assert reply.status.code == 20000
    assert service.TelemetryCommand.FromString(reply.SerializeToString()) == reply
    if reply.settings.WhichOneof("pub_sub") == "publishing":
        assert reply.settings.publishing.max_body_size == CONFIG.max_message_size_bytes


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


@pytest.mark.slow
@FUZZ
@given(st.one_of(JSON, st.fixed_dictionaries({"topic": st.sampled_from(["orders", "bad name", ""]),
                                              "body_b64": st.sampled_from(["", "aGk=", "!"])},
                                             optional={"delay_ms": JSON, "keys": JSON, "properties": JSON,
                                                       "message_id": JSON, "tag": JSON, "deliver_at_ms": JSON})))
def test_admin_message_decoder_on_arbitrary_json(doc):
    try:
        admin.message_from_json(doc, CONFIG)
    except ChronoqError as err:
        assert err.code >= 40000


def _usual_message(message_id: str, normal: bool, nanos: int, born: int | None, tag: str) -> definition.Message:
    m = definition.Message(body=b"payload")
    m.topic.name = "orders"
    sp = m.system_properties
    sp.message_id = message_id
    sp.body_encoding = definition.IDENTITY
    sp.tag = tag
    if normal:
        sp.message_type = definition.NORMAL
    else:
        sp.message_type = definition.DELAY
        sp.delivery_timestamp.seconds = 1_800_000_000
        sp.delivery_timestamp.nanos = nanos
    if born is not None:
        sp.born_timestamp.seconds = born
    return m


_USUAL = st.builds(_usual_message, st.sampled_from(["m-1", "01AABBCCDDEEFF", "Z" * 64]), st.booleans(),
                   st.sampled_from([0, 7_000_000, 999_999_999]), st.sampled_from([None, 0, 1_799_999_000]),
                   st.sampled_from(["", "TagA"]))


_SECONDS = [rq.EPOCH_SECONDS_MIN - 1, rq.EPOCH_SECONDS_MIN, rq.EPOCH_SECONDS_END - 1, rq.EPOCH_SECONDS_END,
            rq.EPOCH_MILLIS_MIN, 1_800_000_000_000, -1, 0, 5]
_NANOS = [1, 999_999, 1_000_000, 999_999_999, 1_000_000_000, -1]
_PERTURBATIONS: list[tuple[str, object]] = [
    *(("topic", name) for name in ("other", "", "bad name", "x" * 300)),
    ("namespace", "ns"),
    *(("message_id", i) for i in ("", "has space", "é", "x" * 200, "01AABBCCDDEEFF")),
    *(("message_type", t) for t in (definition.NORMAL, definition.FIFO, definition.MESSAGE_TYPE_UNSPECIFIED,
                                    definition.TRANSACTION, definition.PRIORITY)),
    *(("body_encoding", e) for e in (definition.ENCODING_UNSPECIFIED, definition.GZIP)),
    *(("delivery_seconds", v) for v in _SECONDS),
    *(("delivery_nanos", v) for v in _NANOS),
    ("no_delivery", None), ("no_born", None),
    *(("born_seconds", v) for v in (0, -1)),
    *(("born_nanos", v) for v in _NANOS),
    ("tag", "TagA"), ("tag", "bad\ntag"), ("body", b""),
    ("keys", "k1"), ("user_properties", "1000"), ("message_group", "g"), ("lite_topic", "l"), ("priority", 3),
]


def _perturbed(m: definition.Message, changes: list[tuple[str, object]]) -> definition.Message:
    sp = m.system_properties
    for name, value in changes:
        if name == "topic":
            m.topic.name = value
        elif name == "namespace":
            m.topic.resource_namespace = value
        elif name == "body":
            m.body = value
        elif name == "delivery_seconds":
            sp.delivery_timestamp.seconds = value
        elif name == "delivery_nanos":
            sp.delivery_timestamp.nanos = value
        elif name == "no_delivery":
            sp.ClearField("delivery_timestamp")
        elif name == "no_born":
            sp.ClearField("born_timestamp")
        elif name == "born_seconds":
            sp.born_timestamp.seconds = value
        elif name == "born_nanos":
            sp.born_timestamp.nanos = value
        elif name == "keys":
            sp.keys.append(value)
        elif name == "user_properties":
            m.user_properties["TIMER_DELAY_MS"] = value
        else:
            setattr(sp, name, value)
    return m


def _near_usual_message() -> st.SearchStrategy[definition.Message]:
    """The usual message (`rq._decode_usual`), as is or with up to three fields moved to a value
    around or past one of its conditions, so both paths and their borders are hit."""
    return st.builds(_perturbed, _USUAL, st.one_of(st.just([]), st.lists(st.sampled_from(_PERTURBATIONS), max_size=3)))


def _assert_both_paths_agree(message: definition.Message, checked: set[str]) -> None:
    """`decode_message` with `topics_ok` (the usual path may answer) decides what it decides
    without (the general path): the same value, field by field and type by type (`MessageType` is
    an IntEnum: a bare int would compare equal and fail later, in admission), or the same error.
    `checked` is what earlier messages of the request put in `topics_ok`; only names that pass
    the topic check get there."""
    general = _decode_or_error(rq.decode_message, message)
    topics_ok = {name for name in checked if topic_name_problem(name, CONFIG.max_topic_name_length) is None}
    try:
        fast: object = rq.decode_message(message, CONFIG, topics_ok)
    except ChronoqError as err:
        fast = err
    if isinstance(general, ChronoqError):
        assert type(fast) is type(general) and fast.message == general.message
        return
    assert fast == general
    for name in general.__slots__:
        assert type(getattr(fast, name)) is type(getattr(general, name)), name
    assert general.topic in topics_ok  # a decoded message's topic is checked for the rest of the request


@pytest.mark.parametrize("normal", [False, True], ids=["delay", "normal"])
@pytest.mark.parametrize("change", _PERTURBATIONS, ids=lambda c: f"{c[0]}={c[1]!r}"[:40])
def test_each_border_of_the_usual_path_decodes_as_the_general_path_does(change, normal):
    """Each condition of `_decode_usual`, moved to a value around or past it, on a usual DELAY and
    a usual NORMAL message whose topic the request has checked."""
    _assert_both_paths_agree(_perturbed(_usual_message("m-1", normal, 7_000_000, 1_799_999_000, "TagA"),
                                        [change]), {"orders"})


@FUZZ
@given(_near_usual_message(), st.sampled_from([set(), {"orders"}, {"orders", "other"}]))
def test_usual_messages_decode_as_the_general_path_does(message, checked):
    """Combinations of those moves, with the topic checked or not."""
    _assert_both_paths_agree(message, checked)


@pytest.mark.slow
@FUZZ
@given(message_strategy(definition.Message))
def test_arbitrary_messages_decode_alike_with_their_topic_checked(message):
    """Arbitrary messages, their own topic taken as checked when it is a valid name."""
    _assert_both_paths_agree(message, {message.topic.name})


def test_the_usual_path_takes_usual_messages():
    """The equivalence above would hold trivially if the usual path never answered: it does,
    for a DELAY message with an epoch-seconds due time and for a NORMAL one, and builds what the
    general path builds."""
    delay = definition.Message(body=b"b")
    delay.topic.name = "orders"
    delay.system_properties.message_id = "m1"
    delay.system_properties.message_type = definition.DELAY
    delay.system_properties.delivery_timestamp.seconds = 1_800_000_000
    delay.system_properties.delivery_timestamp.nanos = 7_000_000
    delay.system_properties.born_timestamp.seconds = 1_799_999_000
    normal = definition.Message(body=b"b")
    normal.topic.name = "orders"
    normal.system_properties.message_id = "m2"
    normal.system_properties.message_type = definition.NORMAL
    normal.system_properties.tag = "TagA"
    for message in (delay, normal):
        usual = rq._decode_usual(message, CONFIG, {"orders"})
        assert usual is not None and usual == rq.decode_message(message, CONFIG)
        assert rq._decode_usual(message, CONFIG, set()) is None  # the topic not yet checked
    assert rq.decode_message(delay, CONFIG, {"orders"}).deliver_at_ms == 1_800_000_000_007
