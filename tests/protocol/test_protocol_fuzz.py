"""Fuzzing the pure codec: every decoder, on arbitrary requests, returns a command or raises a
`ChronoqError` (which the server turns into a status); nothing else escapes. Encoders never fail
on the values decoders accept. Bounded: `max_examples` per decoder."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import message_strategy, request_strategy

from chronoq.config import Config
from chronoq.errors import ChronoqError, MessageTooLarge
from chronoq.model import topic_name_problem
from chronoq.protocol import admin
from chronoq.protocol import requests as rq
from chronoq.protocol import responses as rs
from chronoq.protocol.v2 import definition, service
from chronoq.timer.levels import DelayLevels
from chronoq.validate import check_message_id, prepare

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
