"""Hostile input: every decoder that takes outside bytes raises only its own error.

Already fuzzed elsewhere and not repeated here: the RocketMQ request decoders and raw protobuf
bytes (test_protocol_fuzz.py), the gRPC server's unary and streaming RPCs and Telemetry
(test_server_fuzz.py), the record codec (test_record.py), the SDK's reply decoders
(test_client_wire.py). This file adds what was missing: signature headers and the authenticator,
recall and receipt handles, admin request bodies (decoder and every admin method over a real
server, with and without auth), the `[auth]` table and the TOML file behind it, the server
config, and the on-disk decoders `chronoq check` runs (segment and consume-queue headers,
consume-queue entries, checkpoint, topics file, in-flight values, timer-index values). Then
oversize requests and a connection flood against a real server.

"Only its own error" is the h11 rule: a decoder of outside bytes returns a value or raises the one
error class its caller converts (a `ChronoqError` with a code, `ConfigError`, or the timer index's
`MalformedValue`, which makes the index rebuild); anything else would be a 50000, a traceback at
start-up, or a crash in `chronoq check`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq import errors as core
from chronoq.client import AsyncConsumer, AsyncProducer
from chronoq.config import Config, ConfigError
from chronoq.protocol import admin as admin_codec
from chronoq.protocol import signature
from chronoq.protocol.errors import MalformedRequest
from chronoq.server.auth import AuthConfig, Authenticator, User, load_auth, parse_auth
from chronoq.store import commitlog, consumequeue, groups, meta, record
from chronoq.timer import index_codec
from chronoq.timer.recall import decode_recall_handle, encode_recall_handle
from tests.support.auth_server import running

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
AUTH = AuthConfig(enabled=True, users=(User("app", "secret", publish=("t*",)),))

header_text = st.one_of(
    st.text(max_size=200),
    st.builds(lambda ak, sig, extra: f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, "
                                     f"Signature={sig}{extra}",
              st.text(max_size=20), st.text(alphabet="0123456789abcdefABCDEFxyz", max_size=44), st.text(max_size=10)),
)
date_text = st.one_of(st.text(max_size=30), st.from_regex(r"\A\d{8}T\d{6}Z\Z"))


def _only(allowed: tuple[type[BaseException], ...], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except allowed:
        pass


@pytest.mark.slow
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["authorization", "x-mq-date-time", "x-mq-session-token", "other"]),
                          st.one_of(header_text, date_text, st.binary(max_size=20))), max_size=4))
def test_signature_headers_raise_only_unauthorized(metadata: list[tuple[str, Any]]) -> None:
    _only((core.Unauthorized,), lambda: signature.read_headers(metadata))
    _only((core.Unauthorized,), lambda: Authenticator(AUTH).authenticate(metadata, 0))


@FUZZ
@given(st.one_of(st.text(max_size=120), st.binary(max_size=90).map(lambda b: base64.urlsafe_b64encode(b).decode())))
def test_recall_and_receipt_handles_raise_only_their_error(text: str) -> None:
    _only((core.InvalidRecallHandle,), lambda: decode_recall_handle(text))
    _only((core.InvalidReceiptHandle,), lambda: groups.decode_handle(text))


@FUZZ
@given(st.data())
def test_near_valid_recall_handles_raise_only_their_error(data: st.DataObject) -> None:
    handle = encode_recall_handle(data.draw(st.text(min_size=1, max_size=20)), data.draw(st.integers(0, 2**62)),
                                  data.draw(st.text(min_size=1, max_size=40)))
    i = data.draw(st.integers(0, len(handle) - 1))
    mutated = handle[:i] + data.draw(st.text(max_size=3)) + handle[i + 1:]
    _only((core.InvalidRecallHandle,), lambda: decode_recall_handle(mutated))


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(["CreateTopic", "SendBatch", "CancelMessage", "QueryMessage"]),
       st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                              max_leaves=20).map(lambda d: json.dumps(d).encode())))
def test_admin_bodies_raise_only_chronoq_errors(method: str, body: bytes) -> None:
    _only((core.ChronoqError,), lambda: admin_codec.parse_request(method, body))


def test_deeply_nested_admin_json_is_a_malformed_request_not_a_crash() -> None:
    with pytest.raises(core.ChronoqError):
        admin_codec.parse_request("Stats", b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize("body", [b"1" * 5000, b'{"from_ms": ' + b"1" * 5000 + b"}",
                                  b'{"messages": [{"deliver_at_ms": -' + b"9" * 4301 + b"}]}"])
def test_an_integer_literal_over_the_conversion_limit_is_a_malformed_request(body: bytes) -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) for an integer of more than
    4,300 digits; it is an undecodable body like any other, not a 50000."""
    with pytest.raises(MalformedRequest) as caught:
        admin_codec.parse_request("SearchTimers", body)
    assert "the body is not UTF-8 JSON (ValueError: Exceeds the limit (4300 digits)" in caught.value.message


toml_scalar = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=12),
                        st.floats(allow_nan=False))
toml_value = st.recursive(toml_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.text(min_size=1, max_size=8), c, max_size=3), max_leaves=12)


@pytest.mark.slow
@FUZZ
@given(st.one_of(toml_value, st.fixed_dictionaries({
    "enabled": toml_value, "users": st.lists(st.dictionaries(
        st.sampled_from(["access_key", "secret_key", "publish", "subscribe", "groups", "admin", "x"]), toml_value),
        max_size=3)})))
def test_auth_table_raises_only_config_error(doc: Any) -> None:
    _only((ConfigError,), lambda: parse_auth(doc))


@FUZZ
@given(st.binary(max_size=300))
def test_auth_file_raises_only_config_error(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_bytes(raw)
    _only((ConfigError,), lambda: load_auth(path))


@pytest.mark.slow
@FUZZ
@given(st.dictionaries(st.sampled_from(["port", "flush", "max_send_batch", "timer_congest_num_each_slot",
                                        "delay_levels", "host", "auto_create_topics", "clock_catchup_ppm",
                                        "default_queue_count", "retention_ms", "nonsense"]), toml_scalar, max_size=4))
def test_server_config_raises_only_config_error(tmp_path_factory: pytest.TempPathFactory, doc: dict) -> None:
    """What `chronoq serve --config` reads: the CLI turns ConfigError into one line and exit 2;
    anything else would be a traceback."""
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in doc.items()))
    try:
        tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError:
        return  # json.dumps of a float can be "1e+300", which TOML spells otherwise: not our input
    _only((ConfigError,), lambda: Config.load(path))


DISK_DECODERS: list[tuple[str, Callable[[bytes], Any]]] = [
    ("segment header", commitlog.decode_segment_header),
    ("consume-queue header", consumequeue.decode_cq_header),
    ("consume-queue entry", lambda b: consumequeue.decode_entry(b, 0)),
    ("checkpoint", meta.decode_checkpoint),
    ("topics file", meta.decode_topics),
    ("in-flight value", lambda b: groups._decode_inflight("g", "t", 0, 0, b)),
    ("properties", record.decode_properties),  # (decode_keys is only called under decode_record's guard)
    ("timer entry", lambda b: index_codec.decode_entry(b[:12], b[12:])),
    ("timer status", lambda b: index_codec.decode_status(b[:16], b[16:], b[:9])),
    ("timer pos", index_codec.decode_pos_pending),
    ("timer minute slots", index_codec.decode_minute_slots),
    ("timer facts keys", index_codec.facts_keys),
    ("timer fired history", index_codec.decode_fired_history),
]


@FUZZ
@given(st.sampled_from(DISK_DECODERS), st.binary(max_size=400))
def test_on_disk_decoders_raise_only_corruption_errors(decoder: tuple[str, Callable[[bytes], Any]],
                                                       raw: bytes) -> None:
    _only((core.ChronoqError, index_codec.MalformedValue), lambda: decoder[1](raw))


# -- a real server: admin methods, oversize requests, a connection flood -------------------------


ADMIN_METHODS = ["CreateTopic", "ListTopics", "DescribeTopic", "QueryMessage", "CancelMessage", "ReadMessages",
                 "Stats", "SendBatch", "FireTimers", "ArmTimers"]


@pytest.mark.parametrize("auth", [AuthConfig(), AUTH], ids=["auth-off", "auth-on"])
def test_every_admin_method_answers_garbage_with_a_json_code(tmp_path: Path, arun: Any, auth: AuthConfig) -> None:
    bodies = [b"", b"\xff", b"[]", b"null", b'{"name": 5}', b'{"messages": [{}]}', b'{"positions": [-1]}',
              b'{"recall_handle": "AAAA"}', b'{"topic": "t", "queue_id": "x", "max_messages": 1e99}',
              b'{"max_messages": 9999999999999999999999}', b'{"timers": [{"position": -1}, 5]}',
              b"[" * 5000, b'{"from_ms": ' + b"1" * 5000 + b"}"]

    async def body() -> None:
        async with running(tmp_path, auth) as srv, grpc.aio.insecure_channel(srv.address) as channel:
            for method in ADMIN_METHODS:
                call = channel.unary_unary(f"/chronoq.admin.v1.Admin/{method}")
                for raw in bodies:
                    reply = json.loads(await call(raw, timeout=10))
                    assert isinstance(reply["code"], int), (method, raw, reply)
                    assert reply["code"] != 50000, (method, raw, reply)  # a named error, never "internal"
                    if auth.enabled:
                        assert reply["code"] == 40100
    arun(body())


def test_an_oversize_request_gets_resource_exhausted_and_the_server_serves_on(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path, AuthConfig()) as srv, grpc.aio.insecure_channel(
                srv.address, options=[("grpc.max_send_message_length", 64 * 2**20)]) as channel:
            call = channel.unary_unary("/apache.rocketmq.v2.MessagingService/SendMessage")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(b"\x0a" + b"\xff" * (20 * 2**20), timeout=20)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            async with AsyncProducer(srv.address, timeout_ms=5000) as p:
                await p.send("t", b"after")
    arun(body())


FLOOD_IDLE_SOCKETS = 300
FLOOD_LONG_POLLS = 100
FLOOD_HALF_OPEN = 50
SERVED_WITHIN_S = 5.0
"""Generous: a send and a receive take milliseconds; the machine is shared."""


def test_a_connection_flood_does_not_starve_other_clients(tmp_path: Path, arun: Any) -> None:
    """Idle sockets that never speak, sockets that send the HTTP/2 preface and then never read
    (slow readers), and many long polls held open: a normal client still sends and receives."""
    async def body() -> None:
        async with running(tmp_path, AuthConfig()) as srv:
            host, port = srv.address.rsplit(":", 1)
            idle = [socket.create_connection((host, int(port))) for _ in range(FLOOD_IDLE_SOCKETS)]
            half_open = []
            for _ in range(FLOOD_HALF_OPEN):
                s = socket.create_connection((host, int(port)))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                half_open.append(s)
            pollers = [AsyncConsumer(f"flood{i % 10}", "flood", server=srv.address, timeout_ms=30_000)
                       for i in range(10)]
            async with AsyncProducer(srv.address) as p:
                await p.send("flood", b"create the topic")
            polls = [asyncio.create_task(pollers[i % 10].receive(1, wait=20_000)) for i in range(FLOOD_LONG_POLLS)]
            await asyncio.sleep(1.0)  # let the polls park on the server
            try:
                started = time.monotonic()
                async with AsyncProducer(srv.address, timeout_ms=10_000) as p, \
                        AsyncConsumer("normal", "normal", server=srv.address, timeout_ms=10_000) as c:
                    await p.send("normal", b"served")
                    got = await c.receive(1, wait=5000)
                elapsed = time.monotonic() - started
                assert [m.body for m in got] == [b"served"]
                assert elapsed < SERVED_WITHIN_S, f"a normal client waited {elapsed:.1f} s behind the flood"
            finally:
                for t in polls:
                    t.cancel()
                await asyncio.gather(*polls, return_exceptions=True)
                for consumer in pollers:
                    await consumer.close()
                for s in idle + half_open:
                    s.close()
    arun(body())
