"""Fuzzing the running server: hostile requests over real gRPC against a real Broker.

Each example sends one request to one RPC, either arbitrary bytes or an arbitrary protobuf
message of the RPC's request type (see `protocol_strategies`), and checks: the call completes as
an RPC (no gRPC error), every response carries a non-zero status, and a request answered with an
error status stored nothing (the commit log did not grow). The broker runs without background
tasks, so timers never fire on their own and the log grows only by accepted sends. Bounded:
`max_examples` per test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq.protocol.v2 import Code, service
from tests.support.grpc_server import Harness, running
from tests.support.protocol_strategies import message_strategy, request_strategy

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
OK_CODES = {Code.OK, Code.MULTIPLE_RESULTS, Code.MESSAGE_NOT_FOUND}

_METHODS = service.DESCRIPTOR.services_by_name["MessagingService"].methods
UNARY = [(m.name, getattr(service, m.input_type.name), getattr(service, m.output_type.name))
         for m in _METHODS if not m.client_streaming and not m.server_streaming]
SERVER_STREAMING = [(m.name, getattr(service, m.input_type.name), getattr(service, m.output_type.name))
                    for m in _METHODS if m.server_streaming and not m.client_streaming]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[asyncio.AbstractEventLoop, Harness]]:
    loop = asyncio.new_event_loop()
    context = running(Path(tmp_path_factory.mktemp("fuzz")), background=False, max_send_batch=8,
                      max_message_size_bytes=64 * 1024)
    harness = loop.run_until_complete(context.__aenter__())
    try:
        yield loop, harness
    finally:
        loop.run_until_complete(context.__aexit__(None, None, None))
        loop.close()


def _payload(data: st.DataObject, request_type: type) -> bytes:
    if data.draw(st.booleans(), label="raw bytes?"):
        return data.draw(st.binary(max_size=200), label="bytes")
    return data.draw(request_strategy(request_type), label=request_type.__name__).SerializeToString()


def _log_end(h: Harness) -> int:
    return h.broker.store.log.end_position


def _check(responses: list[Any], before: int, h: Harness, what: str) -> None:
    assert responses, f"{what}: no response at all"
    codes = [r.status.code for r in responses if r.HasField("status")]
    assert codes, f"{what}: no status in {responses}"
    assert all(code != 0 for code in codes), f"{what}: status code 0"
    if any(code not in OK_CODES for code in codes):
        assert _log_end(h) == before, f"{what}: refused ({codes}) but the commit log grew"


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_unary_rpcs_answer_hostile_requests_with_a_status_and_store_nothing_on_error(live, data) -> None:
    loop, h = live
    name, request_type, response_type = data.draw(st.sampled_from(UNARY), label="rpc")
    payload = _payload(data, request_type)

    async def call() -> None:
        before = _log_end(h)
        try:
            raw = await h.raw(name, payload)
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"{name} failed as an RPC: {exc.code()} {exc.details()}") from None
        _check([response_type.FromString(raw)], before, h, name)

    loop.run_until_complete(call())


# slow: a long fuzz run (seconds); plain pytest stays under 2 minutes, scripts/test.sh runs it
@pytest.mark.slow
@FUZZ
@given(st.data())
def test_streaming_rpcs_answer_hostile_requests_with_a_status(live, data) -> None:
    loop, h = live
    name, request_type, response_type = data.draw(st.sampled_from(SERVER_STREAMING), label="rpc")
    payload = _payload(data, request_type)

    async def call() -> None:
        before = _log_end(h)
        # Deadline just above the long-poll margin: the server must answer, not time out.
        stream = h.channel.unary_stream(f"/apache.rocketmq.v2.MessagingService/{name}")(payload, timeout=1.2)
        try:
            responses = [response_type.FromString(r) async for r in stream]
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"{name} failed as an RPC: {exc.code()} {exc.details()}") from None
        statuses = [r for r in responses if r.WhichOneof("content") == "status"]
        assert len(statuses) == 1, responses
        _check(statuses, before, h, name)

    loop.run_until_complete(call())


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=100).map(lambda b: ("raw", b)),
                          message_strategy(service.TelemetryCommand).map(lambda m: ("msg", m.SerializeToString()))),
                min_size=1, max_size=3))
def test_telemetry_answers_every_settings_and_survives_garbage(live, commands) -> None:
    loop, h = live

    async def call() -> None:
        async def requests():
            for _, payload in commands:
                yield payload

        stream = h.channel.stream_stream("/apache.rocketmq.v2.MessagingService/Telemetry")(requests(), timeout=5)
        try:
            replies = [service.TelemetryCommand.FromString(r) async for r in stream]
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"Telemetry failed as an RPC: {exc.code()} {exc.details()}") from None
        assert all(r.status.code != 0 for r in replies)
        expected = 0
        for _, payload in commands:
            try:
                parsed = service.TelemetryCommand.FromString(payload)
            except Exception:
                expected += 1  # undecodable: answered with a 40000 status
                continue
            expected += parsed.HasField("settings")
        assert len(replies) == expected

    loop.run_until_complete(call())


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_send_columns_answers_hostile_frames_and_stores_only_rows_it_reports_stored(live, data) -> None:
    """Admin SendColumns (`protocol/bulk.py`): arbitrary bytes, or a valid frame with a byte
    changed, get the JSON error object or the result columns, never a failed RPC nor an internal
    error; the log grows only when some row is reported stored."""
    from chronoq.protocol import bulk

    loop, h = live
    rows = data.draw(st.integers(1, 4), label="rows")
    frame = bytearray(bulk.encode_request(
        data.draw(st.sampled_from(["fuzzed", "bad topic", "rmq_sys_wheel_timer"]), label="topic"),
        data.draw(st.lists(st.text(max_size=6), min_size=rows, max_size=rows), label="ids"),
        data.draw(st.lists(st.binary(max_size=8), min_size=rows, max_size=rows), label="bodies"),
        due_kind=bulk.DUE_DELAY, due=data.draw(st.lists(st.integers(-10, 10**10), min_size=rows, max_size=rows))))
    if data.draw(st.booleans(), label="raw bytes?"):
        frame = bytearray(data.draw(st.binary(max_size=200), label="bytes"))
    elif data.draw(st.booleans(), label="change a byte?"):
        frame[data.draw(st.integers(0, len(frame) - 1))] ^= data.draw(st.integers(1, 255))

    async def call() -> None:
        before = _log_end(h)
        try:
            raw = await h.channel.unary_unary(f"/chronoq.admin.v1.Admin/{bulk.METHOD}")(bytes(frame), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise AssertionError(f"SendColumns failed as an RPC: {exc.code()} {exc.details()}") from None
        if raw[:1] == b"{":
            import json

            reply = json.loads(raw)
            assert reply["code"] != 20000 and reply["error"] != "InternalError", reply
            assert _log_end(h) == before
            return
        reply = bulk.decode_reply(raw, len(raw) and int.from_bytes(raw[4:8], "little"))
        if all(s & 0x0F != bulk.STORED for s in reply.status):
            assert _log_end(h) == before, reply
        for _, error in reply.errors:
            assert error["error"] != "InternalError", error

    loop.run_until_complete(call())
