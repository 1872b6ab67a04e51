"""Authentication, authorization and recall ownership, in process.

The wire rule (`chronoq.protocol.signature`) is tested on the headers each official client
writes; the policy (`chronoq.server.auth`) on its own; then a real gRPC server over a real
broker, reached by chronoq's SDK and by raw RocketMQ stubs, checks that every refusal carries
RocketMQ's code (40100 / 40300) and changes nothing. The official clients in their own processes
are in tests/interop/test_auth_interop.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

from chronoq import errors as core
from chronoq.broker import Broker
from chronoq.client import AsyncAdmin, AsyncProducer, outgoing
from chronoq.config import Config, ConfigError
from chronoq.protocol import batch_receive, signature
from chronoq.protocol.v2 import definition, service
from chronoq.server.auth import ANONYMOUS, AuthConfig, Authenticator, RefusalLog, User, load_auth, parse_auth
from chronoq.server.grpc_service import wall_ms
from tests.support.auth_server import AUTH, SECRET, USERS, running

DATE = "20261123T093000Z"
DATE_MS = int(datetime(2026, 11, 23, 9, 30, tzinfo=UTC).timestamp() * 1000)
# HMAC-SHA1("s3cret", "20261123T093000Z"), computed independently of chronoq:
# printf '20261123T093000Z' | openssl dgst -sha1 -hmac s3cret
EXPECTED_HEX = hmac.new(b"s3cret", b"20261123T093000Z", hashlib.sha1).hexdigest()



def python_header(ak: str, sk: str, date: str = DATE) -> list[tuple[str, str]]:
    """What rocketmq-python-client 5.1.2 writes (lowercase hex), copied from its Signature.metadata."""
    sig = hmac.new(sk.encode(), date.encode(), hashlib.sha1).hexdigest()
    return [("x-mq-date-time", date),
            ("authorization", f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={sig}")]


def node_header(ak: str, sk: str, date: str = DATE) -> list[tuple[str, str]]:
    """rocketmq-client-nodejs 1.0.8 (uppercase hex); Java is the same plus a session token."""
    sig = hmac.new(sk.encode(), date.encode(), hashlib.sha1).hexdigest().upper()
    return [("x-mq-date-time", date), ("x-mq-session-token", "sts-token"),
            ("authorization", f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={sig}")]


# -- the wire rule -------------------------------------------------------------------------------


def test_sign_matches_the_clients_signature() -> None:
    assert signature.sign(SECRET, DATE) == EXPECTED_HEX
    assert signature.date_time_of(DATE_MS) == DATE
    assert signature.parse_date_time(DATE) == DATE_MS
    headers = dict(signature.sign_headers("orders-app", SECRET, DATE_MS))
    assert headers["x-mq-date-time"] == DATE
    assert headers["authorization"] == (f"MQv2-HMAC-SHA1 Credential=orders-app, SignedHeaders=x-mq-date-time, "
                                        f"Signature={EXPECTED_HEX}")


@pytest.mark.parametrize("headers", [python_header("orders-app", SECRET), node_header("orders-app", SECRET)],
                         ids=["python-lowercase", "node-java-uppercase"])
def test_each_clients_header_is_read_and_verified(headers: list[tuple[str, str]]) -> None:
    claim = signature.read_headers(headers)
    assert (claim.access_key, claim.date_time, claim.signed_at_ms) == ("orders-app", DATE, DATE_MS)
    assert signature.verify(SECRET, claim)
    assert not signature.verify("other", claim)


def test_credential_scope_after_a_slash_is_ignored_as_rocketmq_does() -> None:
    header = python_header("orders-app", SECRET)
    header[1] = ("authorization", header[1][1].replace("Credential=orders-app", "Credential=orders-app/2026/x"))
    assert signature.read_headers(header).access_key == "orders-app"


def test_python_client_without_credentials_reads_as_missing() -> None:
    # Credentials() in the Python client: ak = sk = "" and the header is sent anyway.
    with pytest.raises(core.Unauthorized) as e:
        signature.read_headers(python_header("", ""))
    assert e.value.details["cause"] == "no_credentials"
    with pytest.raises(core.Unauthorized) as e:
        signature.read_headers([("x-mq-date-time", DATE)])
    assert e.value.details["cause"] == "no_credentials"


@pytest.mark.parametrize(("authorization", "date", "fault"), [
    ("Basic dXNlcjpwYXNz", DATE, "scheme"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time", DATE, "no Signature"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=zz" + "0" * 38, DATE, "not hex"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=abcd", DATE, "hex digits"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=host, Signature=" + "0" * 40, DATE, "SignedHeaders"),
    ("MQv2-HMAC-SHA1 Credential=a, garbage, Signature=" + "0" * 40, DATE, "NAME=VALUE"),
    ("MQv2-HMAC-SHA1 SignedHeaders=x-mq-date-time, Signature=" + "0" * 40, DATE, "no Credential"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=" + "0" * 40, None, "missing"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=" + "0" * 40, "2026-11-23", "%Y"),
    ("MQv2-HMAC-SHA1 Credential=a, SignedHeaders=x-mq-date-time, Signature=" + "0" * 40, "20261399T000000Z", "real"),
    ("MQv2-HMAC-SHA1 Credential=" + "a" * 2000 + ", Signature=" + "0" * 40, DATE, "at most"),
])
def test_malformed_headers_are_named(authorization: str, date: str | None, fault: str) -> None:
    headers = [("authorization", authorization)] + ([("x-mq-date-time", date)] if date is not None else [])
    with pytest.raises(core.Unauthorized) as e:
        signature.read_headers(headers)
    assert e.value.details["cause"] == "malformed"
    assert fault in e.value.message
    assert e.value.code == 40100


# -- the policy ----------------------------------------------------------------------------------


def test_authenticator_accepts_the_right_key_and_refuses_the_others() -> None:
    auth = Authenticator(AUTH)
    principal = auth.authenticate(python_header("orders-app", SECRET), DATE_MS)
    assert principal.name == "orders-app" and not principal.admin
    assert auth.authenticate(node_header("ops", "0ps-secret"), DATE_MS).admin
    for metadata, cause in ((python_header("orders-app", "wrong"), "bad_signature"),
                            (python_header("nobody", SECRET), "unknown_access_key"), ([], "no_credentials")):
        with pytest.raises(core.Unauthorized) as e:
            auth.authenticate(metadata, DATE_MS)
        assert type(e.value) is core.Unauthorized and e.value.details["cause"] == cause, e.value.details
    assert Authenticator(AuthConfig()).authenticate([], 0) is ANONYMOUS  # auth off: headers ignored


def test_replay_window_allows_local_time_zones_and_refuses_older_headers() -> None:
    auth = Authenticator(AUTH)
    hour_ms = 3_600_000
    # Python and Go stamp local time with a literal Z: a client in UTC+14 looks 14 h ahead.
    auth.authenticate(python_header("orders-app", SECRET), DATE_MS - 14 * hour_ms)
    auth.authenticate(python_header("orders-app", SECRET), DATE_MS + 12 * hour_ms)
    with pytest.raises(core.Unauthorized) as e:
        auth.authenticate(python_header("orders-app", SECRET), DATE_MS + 25 * hour_ms)
    assert e.value.details["cause"] == "stale_signature" and e.value.details["skew_ms"] == -25 * hour_ms
    # 0: RocketMQ's behaviour, no freshness check at all.
    Authenticator(AuthConfig(True, USERS, max_time_skew_s=0)).authenticate(python_header("ops", "0ps-secret"), 0)


def test_permissions_follow_names_and_globs() -> None:
    p = Authenticator(AUTH).authenticate(python_header("orders-app", SECRET), DATE_MS)
    assert p.may_publish("orders") and p.may_publish("payments-eu") and not p.may_publish("payments")
    assert not p.may_publish("refunds") and p.may_subscribe("orders") and not p.may_subscribe("payments-eu")
    p.require_subscribe("orders", "billing")
    with pytest.raises(core.Forbidden) as e:
        p.require_subscribe("orders", "audit")
    assert type(e.value) is core.Forbidden and e.value.code == 40300
    assert e.value.details == {"access_key": "orders-app", "action": "consume as", "resource": "group 'audit'"}
    with pytest.raises(core.Forbidden):
        p.require_admin("Stats")


ISSUE_TOML = """
data_dir = "data"
port = 9999

[auth]
enabled = true
[[auth.users]]
access_key = "orders-app"
secret_key = "s3cret"
publish = ["orders", "payments-*"]   # topic names or globs
subscribe = ["orders"]
groups = ["billing"]
admin = false
"""


def test_the_issues_toml_loads_for_both_the_server_and_auth(tmp_path: Path) -> None:
    path = tmp_path / "chronoq.toml"
    path.write_text(ISSUE_TOML)
    assert Config.load(path).port == 9999  # the [auth] table is not an unknown setting
    auth = load_auth(path)
    assert auth.enabled and auth.users == (User("orders-app", "s3cret", ("orders", "payments-*"), ("orders",),
                                                  ("billing",), False),)
    assert load_auth(None).enabled is False


@pytest.mark.parametrize(("doc", "fault"), [
    ({"enabled": "yes"}, "auth.enabled"),
    ({"enabled": True}, "no [[auth.users]]"),
    ({"colour": 1}, "unknown keys colour"),
    ({"users": [{"access_key": "a"}]}, "secret_key"),
    ({"users": [{"access_key": "a b", "secret_key": "x"}]}, "without spaces"),
    ({"users": [{"access_key": "a", "secret_key": "x", "publish": "orders"}]}, "list of non-empty strings"),
    ({"users": [{"access_key": "a", "secret_key": "x", "admin": 1}]}, "admin must be"),
    ({"users": [{"access_key": "a", "secret_key": "x"}, {"access_key": "a", "secret_key": "y"}]}, "twice"),
    ({"max_time_skew_s": -1}, "max_time_skew_s"),
    ({"users": {"access_key": "a"}}, "array of tables"),
])
def test_bad_auth_config_is_refused_with_the_key(doc: dict[str, Any], fault: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_auth(doc)
    assert fault in str(e.value)


# -- a real server -------------------------------------------------------------------------------


def test_sends_need_credentials_and_publish_permission(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path) as srv:
            async with srv.producer() as p:
                await p.send("orders", b"x")
                await p.send("payments-eu", b"x")
                with pytest.raises(core.Forbidden) as e:
                    await p.send("refunds", b"x")
                assert e.value.code == 40300
                with pytest.raises(core.Forbidden):  # SendBatch: one forbidden topic refuses the batch
                    await p.send_batch([outgoing("orders", b"y"), outgoing("refunds", b"y")])
            for ak, sk in ((None, None), ("orders-app", "wrong"), ("nobody", SECRET)):
                async with srv.producer(ak, sk) as p:
                    with pytest.raises(core.Unauthorized) as e:
                        await p.send("orders", b"x")
                    assert e.value.code == 40100
                    with pytest.raises(core.Unauthorized):
                        await p.send_batch([outgoing("orders", b"y")])
            assert (srv.stored("orders"), srv.stored("payments-eu"), srv.stored("refunds")) == (1, 1, 0)
    arun(body())


def test_consumers_need_subscribe_and_group_permission(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path) as srv:
            async with srv.producer() as p:
                await p.send("orders", b"x")
                await p.send("payments-eu", b"x")
            async with srv.consumer("billing", "orders") as c:
                got = await c.receive(8, wait=2000)
                assert len(got) == 1
                await c.ack(*got)
            async with srv.consumer("audit", "orders") as c:
                with pytest.raises(core.Forbidden) as e:  # 40300 through the RocketMQ protocol
                    await c.receive(8)
                assert e.value.code == 40300 and "group 'audit'" in e.value.message
            async with srv.consumer("billing", "payments-eu") as c:
                with pytest.raises(core.Forbidden) as e:
                    await c.receive(8)
                assert e.value.code == 40300 and "topic 'payments-eu'" in e.value.message
            async with srv.consumer("billing", "orders", sk="wrong") as c:
                with pytest.raises(core.Unauthorized):
                    await c.receive(8)
            # Nothing was taken by the refused receives: an admin still finds the message.
            async with srv.consumer("billing", "payments-eu", ak="ops", sk="0ps-secret") as c:
                assert len(await c.receive(8, wait=2000)) == 1
    arun(body())


def test_admin_calls_need_the_admin_role(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path) as srv:
            async with AsyncAdmin(srv.address, access_key="ops", secret_key="0ps-secret") as admin:
                await admin.create_topic("secret-topic")
                await admin.create_topic("orders")
                assert "topics" in await admin.stats()
            async with AsyncAdmin(srv.address, access_key="orders-app", secret_key=SECRET) as a:
                for call in (a.stats(), a.create_topic("mine"), a.query_key("k"), a.read("secret-topic", 0, 0)):
                    with pytest.raises(core.Forbidden):
                        await call
                assert [t.name for t in await a.list_topics()] == ["orders"]  # only what it may see
                await a.ping()
                await a.describe_topic("orders")
            async with AsyncAdmin(srv.address) as anonymous:
                with pytest.raises(core.Unauthorized) as refused:
                    await anonymous.list_topics()
                assert refused.value.details["cause"] == "no_credentials", refused.value.details
            assert "mine" not in {t.name for t in srv.broker.list_topics()}
    arun(body())


def test_streams_are_refused_when_they_open(tmp_path: Path, arun: Any) -> None:
    """ReceiveMessage (long poll; and chronoq's batched twin) and Telemetry: authenticated from the
    metadata of their opening."""
    async def body() -> None:
        async with running(tmp_path) as srv, grpc.aio.insecure_channel(srv.address) as channel:
            stub = service_grpc.MessagingServiceStub(channel)
            req = service.ReceiveMessageRequest(group=definition.Resource(name="billing"), batch_size=1)
            req.message_queue.topic.name = "orders"
            req.long_polling_timeout.seconds = 20
            replies = [r async for r in stub.ReceiveMessage(req, timeout=5)]
            assert [r.status.code for r in replies] == [40100]
            call = stub.Telemetry(metadata=python_header("orders-app", "wrong"), timeout=5)
            await call.write(service.TelemetryCommand())
            replies = [r async for r in call]
            assert [r.status.code for r in replies] == [40100]
            now_header = list(signature.sign_headers("orders-app", SECRET, wall_ms()))
            replies = [r async for r in stub.ReceiveMessage(req, timeout=5, metadata=now_header)]
            assert [r.status.code for r in replies] == [40402]  # past auth: no such topic yet
            # chronoq's batched receive: the same check, from the same metadata.
            batched = channel.unary_stream(batch_receive.PATH,
                                           request_serializer=service.ReceiveMessageRequest.SerializeToString,
                                           response_deserializer=batch_receive.ReceiveMessagesResponse.FromString)
            assert [r.status.code async for r in batched(req, timeout=5)] == [40100]
            assert [r.status.code async for r in batched(req, timeout=5, metadata=now_header)] == [40402]
    arun(body())


def test_an_undecodable_request_from_a_stranger_gets_40100_not_40000(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path) as srv, grpc.aio.insecure_channel(srv.address) as channel:
            raw = await channel.unary_unary("/apache.rocketmq.v2.MessagingService/SendMessage")(b"\xff\xff", timeout=5)
            assert service.SendMessageResponse.FromString(raw).status.code == 40100
            raw = await channel.unary_unary("/chronoq.admin.v1.Admin/Stats")(b"not json", timeout=5)
            assert json.loads(raw)["code"] == 40100
    arun(body())


# -- part 3: recall and cancel check ownership ---------------------------------------------------


async def _timer(p: AsyncProducer, topic: str) -> Any:
    return await p.send(topic, b"t", delay=600_000)


def _state(broker: Broker, receipt: Any) -> str:
    return str(broker.query(receipt.message_id, receipt.topic)[0].state.value)


def test_a_recall_naming_another_topic_cancels_nothing(tmp_path: Path, arun: Any) -> None:
    """Auth off, as the old code ran: the handle of a message on topic A, recalled naming B, was
    accepted and cancelled A's message."""
    async def body() -> None:
        async with running(tmp_path, AuthConfig()) as srv, srv.producer(None, None) as p:
            a = await _timer(p, "topic-a")
            await p.send("topic-b", b"x")
            with pytest.raises(core.BadRequest) as e:  # 40000 on the RocketMQ protocol (no class name)
                await p.recall("topic-b", a.recall_handle)
            assert e.value.code == 40000 and "belongs to topic 'topic-a'" in e.value.message
            with pytest.raises(core.RecallTopicMismatch):  # the admin door, by handle and topic
                await srv.broker.cancel(recall_handle=a.recall_handle, topic="topic-b")
            assert _state(srv.broker, a) == "pending"
            assert await p.recall("topic-a", a.recall_handle) == a.message_id
            assert _state(srv.broker, a) == "cancelled"
    arun(body())


def test_recall_and_cancel_need_publish_on_the_handles_topic(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path) as srv:
            async with srv.producer("ops", "0ps-secret") as ops:
                secret = await _timer(ops, "ledger")
            async with srv.producer() as p:
                mine = await _timer(p, "orders")
                with pytest.raises(core.BadRequest) as e:  # naming its own topic: the handle's is another
                    await p.recall("orders", secret.recall_handle)
                assert e.value.code == 40000
                with pytest.raises(core.Forbidden) as e:  # naming the handle's topic: not its to publish
                    await p.recall("ledger", secret.recall_handle)
                assert e.value.code == 40300
                for call in (p.cancel_handle(secret.recall_handle), p.cancel("ledger", secret.message_id)):
                    with pytest.raises(core.Forbidden):
                        await call
                with pytest.raises(core.InvalidRecallHandle):  # admin door: handle of orders, topic named ledger
                    await p._admin("CancelMessage", {"recall_handle": mine.recall_handle, "topic": "payments-x"})
                assert _state(srv.broker, secret) == "pending" and _state(srv.broker, mine) == "pending"
                assert await p.cancel_handle(mine.recall_handle) == mine.message_id
            assert _state(srv.broker, secret) == "pending" and _state(srv.broker, mine) == "cancelled"
    arun(body())


def test_a_client_id_is_bound_to_the_user_whose_receive_made_it_hold(tmp_path: Path, arun: Any) -> None:
    """Before, any signed-in user (even one with no permission) ended another client's
    auto-renewals by naming its `x-mq-client-id` in NotifyClientTermination."""
    nobody = User("nobody", "n-secret")
    auth = AuthConfig(enabled=True, users=(*USERS, nobody))

    def as_user(ak: str, sk: str, client_id: str = "victim@host#1") -> list[tuple[str, str]]:
        return [*signature.sign_headers(ak, sk, wall_ms()), ("x-mq-client-id", client_id)]

    async def body() -> None:
        async with running(tmp_path, auth) as srv, grpc.aio.insecure_channel(srv.address) as channel:
            stub = service_grpc.MessagingServiceStub(channel)
            await srv.broker.send(outgoing("orders", b"x"))
            await srv.broker.send(outgoing("orders", b"y"))
            req = service.ReceiveMessageRequest(group=definition.Resource(name="billing"), batch_size=1,
                                                auto_renew=True)
            req.message_queue.topic.name = "orders"
            got = [r async for r in stub.ReceiveMessage(req, metadata=as_user("orders-app", SECRET), timeout=10)]
            assert sum(r.HasField("message") for r in got) == 1 and len(srv.messaging.renewals) == 1

            bye = service.NotifyClientTerminationRequest()
            for ak, sk in (("nobody", "n-secret"), ("ops", "0ps-secret")):  # not even an admin
                reply = await stub.NotifyClientTermination(bye, metadata=as_user(ak, sk), timeout=10)
                assert reply.status.code == 40300, reply
                assert reply.status.message == (f"access key {ak!r} may not end the renewals of client id "
                                                "'victim@host#1', in use by another user")
                assert len(srv.messaging.renewals) == 1
            # Nor may another user receive under that id (its holds would join the victim's).
            got = [r async for r in stub.ReceiveMessage(req, metadata=as_user("ops", "0ps-secret"), timeout=10)]
            assert [r.status.code for r in got] == [40300] and len(srv.messaging.renewals) == 1
            # Another id is the other user's own; the owner ends its own renewals.
            got = [r async for r in stub.ReceiveMessage(req, metadata=as_user("ops", "0ps-secret", "ops@host#1"),
                                                        timeout=10)]
            assert sum(r.HasField("message") for r in got) == 1 and len(srv.messaging.renewals) == 2
            reply = await stub.NotifyClientTermination(bye, metadata=as_user("orders-app", SECRET), timeout=10)
            assert reply.status.code == 20000 and len(srv.messaging.renewals) == 1
    arun(body())


def test_refusals_are_logged_once_a_minute_per_peer_call_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refusals = RefusalLog(logging.getLogger("chronoq.test.refusals"), interval_s=60, clock=lambda: now[0])
    wrong = core.Unauthorized.bad_signature("orders-app")
    with caplog.at_level(logging.WARNING, logger="chronoq.test.refusals"):
        refusals.note("QueryRoute", "ipv4:127.0.0.1:5001", wrong)
        refusals.note("QueryRoute", "ipv4:127.0.0.1:5002", wrong)  # the same host on another port: the same refusal
        refusals.note("SendMessage", "ipv4:127.0.0.1:5001", wrong)  # another call
        refusals.note("QueryRoute", "ipv4:10.0.0.9:5001", wrong)  # another host
        refusals.note("QueryRoute", "ipv4:127.0.0.1:5001", core.TopicNotFound("orders"))  # not a refusal: not logged
        now[0] += 59.9
        refusals.note("QueryRoute", "ipv4:127.0.0.1:5003", wrong)
        now[0] += 0.2
        refusals.note("QueryRoute", "ipv4:127.0.0.1:5004", wrong)  # a minute on: logged again
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused QueryRoute from ipv4:127.0.0.1:5001: 40100 signature mismatch for access key 'orders-app' "
        "(wrong secret key?)",
        "refused SendMessage from ipv4:127.0.0.1:5001: 40100 signature mismatch for access key 'orders-app' "
        "(wrong secret key?)",
        "refused QueryRoute from ipv4:10.0.0.9:5001: 40100 signature mismatch for access key 'orders-app' "
        "(wrong secret key?)",
        "refused QueryRoute from ipv4:127.0.0.1:5004: 40100 signature mismatch for access key 'orders-app' "
        "(wrong secret key?)",
    ], lines
    assert all(r.levelno == logging.WARNING for r in caplog.records)
