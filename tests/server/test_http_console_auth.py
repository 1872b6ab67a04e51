"""The web console with auth on: the same users and permissions as the gRPC services.

A browser cannot sign RocketMQ's HMAC headers, so the console takes HTTP Basic credentials (the
user's access key and secret key), checked by the same `Authenticator`; the admin methods then
check that caller exactly as they check a CLI or SDK call, and cancelling from the console needs
the admin role besides. A user without the admin role gets the console's views cut to the topics
it may publish or subscribe to (`http/scope.py`): its topics, groups, chart, search and look-up,
nothing of another topic. A real broker, the real aiohttp server, a real HTTP client.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.http.server import HttpServer
from chronoq.model import OutgoingMessage, TimerState
from chronoq.server.admin_service import AdminService
from chronoq.server.auth import Authenticator
from tests.support.auth_server import AUTH, SECRET
from tests.support.brokers import open_broker

T0 = 1_800_000_000_000


def basic(access_key: str, secret_key: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{access_key}:{secret_key}".encode()).decode()}


ADMIN = basic("ops", "0ps-secret")
APP = basic("orders-app", SECRET)


@contextlib.asynccontextmanager
async def console(tmp_path: Path, clock: FakeClock | None = None, **settings: Any) -> AsyncIterator[tuple[Broker, str]]:
    config = Config(data_dir=tmp_path / "data", **settings)
    broker = await open_broker(config, clock=clock or FakeClock(T0), background=False)
    server = HttpServer(broker, config, AdminService(broker, config, Authenticator(AUTH)))
    try:
        base = f"http://127.0.0.1:{await server.start()}"
        server.starting = False  # what serve sets once its gRPC port serves
        yield broker, base
    finally:
        await server.stop()
        await broker.close()


async def call(method: str, url: str, headers: dict[str, str] | None = None, body: Any = None) -> tuple[
        int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers, json=body) as r:
        payload = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, dict(r.headers), payload


def test_console_asks_for_credentials_and_checks_them_like_the_grpc_services(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with console(tmp_path) as (broker, base):
            await broker.create_topic("orders", 2)
            await broker.create_topic("secret-plans", 2)
            sent = await broker.send(OutgoingMessage("orders", b"x", message_id="o-1", deliver_at_ms=T0 + 60_000))
            await broker.send(OutgoingMessage("secret-plans", b"x", message_id="s-1", deliver_at_ms=T0 + 60_000))

            # No or wrong credentials: 401 with the challenge that makes a browser ask.
            for headers in (None, basic("orders-app", "wrong"), basic("nobody", SECRET), {"Authorization": "Basic !!"}):
                status, reply_headers, reply = await call("GET", base + "/api/overview", headers)
                assert status == 401, (headers, reply)
                assert reply_headers["WWW-Authenticate"].startswith('Basic realm="chronoq console"')
                assert "secret" not in reply["message"].replace("secret key", "")  # never echoes the secret
            assert (await call("GET", base + "/", None))[0] == 401

            # A user sees its own topics' timers, not another topic's, nor the broker-wide views.
            status, _, reply = await call("GET", base + "/api/search?topic=orders&from=now&to=%2B1h", APP)
            assert status == 200 and [t["message_id"] for t in reply["timers"]] == ["o-1"], reply
            status, _, reply = await call("GET", base + "/api/search?topic=secret-plans&from=now&to=%2B1h", APP)
            assert status == 403 and reply["error"] == "Forbidden", reply
            # The overview is cut to the user's topics (Stats spans every topic: it is not called).
            status, _, reply = await call("GET", base + "/api/overview", APP)
            assert status == 200 and [t["name"] for t in reply["topics"]] == ["orders"], reply
            assert "secret-plans" not in str(reply)

            # Cancel from the console is for admins; a refusal cancels nothing.
            status, _, reply = await call("POST", base + "/api/cancel", APP, {"topic": "orders", "message_id": "o-1"})
            assert status == 403 and reply["error"] == "Forbidden", reply
            assert broker.query("o-1", "orders")[0].state is TimerState.PENDING

            # The admin sees everything and cancels.
            status, _, reply = await call("GET", base + "/api/overview", ADMIN)
            assert status == 200 and {t["name"] for t in reply["topics"]} >= {"orders", "secret-plans"}
            status, _, reply = await call("POST", base + "/api/cancel", ADMIN,
                                          {"topic": "orders", "message_id": sent.message_id})
            assert status == 200, reply
            assert broker.query("o-1", "orders")[0].state is TimerState.CANCELLED

    arun(body())


def test_metrics_and_the_error_chart_are_for_admins(tmp_path: Path, arun: Any) -> None:
    """/metrics names every topic and group, and the delivery-error chart spans every topic: with
    auth on both ask for an admin's HTTP Basic credentials (a Prometheus scrape's `basic_auth`),
    like the other broker-wide views. /healthz says only whether the broker is ready: open."""
    async def body() -> None:
        async with console(tmp_path) as (broker, base):
            await broker.send(OutgoingMessage("secret-payroll", b"x", deliver_at_ms=T0 + 3_600_000))
            await broker.receive("hr-group", "secret-payroll", wait_ms=0)
            for path in ("/metrics", "/chart/error.svg"):
                status, reply_headers, reply = await call("GET", base + path)
                assert status == 401, (path, reply)
                assert reply_headers["WWW-Authenticate"].startswith("Basic ")
                assert "secret-payroll" not in str(reply) and "hr-group" not in str(reply)
                status, _, reply = await call("GET", base + path, APP)
                assert status == 403 and reply["error"] == "Forbidden", (path, reply)
                assert reply["message"] == f"access key 'orders-app' may not call GET {path} (admin only)"
                assert "secret-payroll" not in str(reply)
                assert (await call("GET", base + path, ADMIN))[0] == 200, path
            status, _, text = await call("GET", base + "/metrics", ADMIN)
            assert 'topic="secret-payroll"' in text and 'group="hr-group"' in text
            assert (await call("GET", base + "/healthz"))[0] == 200

    arun(body())


def test_a_user_console_shows_its_own_topics_and_nothing_of_another(tmp_path: Path, arun: Any) -> None:
    """orders-app may publish to orders and payments-*, subscribe to orders, consume as billing.
    What its console asks for, answered for its topics only; the admin's, for every topic."""
    clock = FakeClock(T0)

    async def body() -> None:
        async with console(tmp_path, clock) as (broker, base):
            for topic in ("orders", "payments-eu", "secret-plans"):
                await broker.create_topic(topic, 2)

            async def timer(topic: str, message_id: str, due_ms: int, *keys: str) -> None:
                await broker.send(OutgoingMessage(topic, b"x", message_id=message_id, deliver_at_ms=due_ms, keys=keys))
            await timer("orders", "o-late", T0 + 1_000)  # overdue once the clock moves (no firing loop here)
            clock.advance(5_000)
            await timer("orders", "o-1", T0 + 60_000, "k-1")
            await timer("payments-eu", "p-1", T0 + 120_000, "k-shared")
            await timer("secret-plans", "s-1", T0 + 90_000, "k-shared")
            await timer("orders", "o-2", T0 + 7_200_000)
            await broker.send(OutgoingMessage("orders", b"now"))
            await broker.send(OutgoingMessage("secret-plans", b"now"))
            for group, topic in (("billing", "orders"), ("audit", "orders"), ("hr", "secret-plans")):
                await broker.receive(group, topic, wait_ms=0)

            # The drop-down's list: who the caller is and the topics it may see.
            status, _, reply = await call("GET", base + "/api/topics", APP)
            assert status == 200 and reply == {"user": "orders-app", "admin": False,
                                               "topics": ["orders", "payments-eu"]}, reply
            status, _, reply = await call("GET", base + "/api/topics", ADMIN)
            assert reply == {"user": "ops", "admin": True, "topics": ["orders", "payments-eu", "secret-plans"]}
            assert (await call("GET", base + "/api/topics"))[0] == 401

            # The overview: its topics' rows, its group on its topic, no broker-wide figure.
            status, _, reply = await call("GET", base + "/api/overview", APP)
            assert status == 200 and reply["admin"] is False
            assert [(t["name"], t["pending"], t["accepted"]) for t in reply["topics"]] == [
                ("orders", 3, 4), ("payments-eu", 1, 1)]
            assert reply["pending_total"] == 4
            assert [(g["group"], g["topic"]) for g in reply["groups"]] == [("billing", "orders")]
            assert reply["delivery_error_ms"] is None and reply["next_deadline"] is None
            assert "secret-plans" not in str(reply) and "hr" not in [g["group"] for g in reply["groups"]]
            status, _, reply = await call("GET", base + "/api/overview", ADMIN)
            assert reply["admin"] is True and reply["pending_total"] == 5
            assert {(g["group"], g["topic"]) for g in reply["groups"]} == {
                ("billing", "orders"), ("audit", "orders"), ("hr", "secret-plans")}
            assert reply["delivery_error_ms"]["count"] == 0

            # Search without a topic: across the user's topics (the admin: every topic).
            status, _, reply = await call("GET", base + "/api/search?from=now&to=%2B1h", APP)
            assert status == 200 and [t["message_id"] for t in reply["timers"]] == ["o-1", "p-1"], reply
            assert not reply["truncated"] and reply["timers"][0]["keys"] == ["k-1"]
            status, _, reply = await call("GET", base + "/api/search?from=now&to=%2B1h", ADMIN)
            assert [t["message_id"] for t in reply["timers"]] == ["o-1", "s-1", "p-1"], reply
            status, _, reply = await call("GET", base + "/api/search?topic=payments-eu&from=now&to=%2B1h", APP)
            assert [t["message_id"] for t in reply["timers"]] == ["p-1"], reply

            # Look-up by key or id without a topic: the user's topics' timers only.
            status, _, reply = await call("GET", base + "/api/message?key=k-shared", APP)
            assert status == 200 and [(s["message_id"], s["topic"]) for s in reply["statuses"]] == [
                ("p-1", "payments-eu")], reply
            status, _, reply = await call("GET", base + "/api/message?key=k-shared", ADMIN)
            assert sorted(s["message_id"] for s in reply["statuses"]) == ["p-1", "s-1"]
            status, _, reply = await call("GET", base + "/api/message?id=o-1", APP)
            assert status == 200 and reply["statuses"][0]["state"] == "pending" and reply["statuses"][0]["deliver_at"]
            status, _, reply = await call("GET", base + "/api/message?id=s-1", APP)
            assert status == 404 and "no timer message with message id 's-1'" in reply["message"], reply
            status, _, reply = await call("GET", base + "/api/message?id=bad%20id", APP)
            assert status == 400 and reply["error"] == "InvalidMessageId", reply

            # The pending chart counts the user's timers; the admin's, every topic's.
            status, _, svg = await call("GET", base + "/chart/pending.svg?horizon=10m", APP)
            assert status == 200, svg
            assert "2 due in your topics in the next 10 minutes, 10 s bars; 1 overdue; 1 later" in svg, svg
            status, _, svg = await call("GET", base + "/chart/pending.svg?horizon=10m", ADMIN)
            assert "3 due in the next 10 minutes, 10 s bars; 1 overdue; 1 later" in svg, svg

            # The admin views stay the admins': cancel and the delivery-error chart.
            assert (await call("GET", base + "/chart/error.svg", APP))[0] == 403
            status, _, reply = await call("POST", base + "/api/cancel", APP, {"topic": "orders", "message_id": "o-1"})
            assert status == 403 and broker.query("o-1", "orders")[0].state is TimerState.PENDING

    arun(body())


def test_a_user_search_and_chart_stop_at_the_scan_bound_and_say_so(tmp_path: Path, arun: Any) -> None:
    """Another topic's timers first in due order fill the bounded scan: the user's search and
    chart stop there and say so rather than read on."""
    async def body() -> None:
        async with console(tmp_path, timer_search_max_scanned=4) as (broker, base):
            for topic in ("orders", "secret-plans"):
                await broker.create_topic(topic, 1)
            for i in range(6):
                await broker.send(OutgoingMessage("secret-plans", b"x", deliver_at_ms=T0 + 1_000 + i))
            await broker.send(OutgoingMessage("orders", b"x", message_id="o-1", deliver_at_ms=T0 + 5_000))
            status, _, reply = await call("GET", base + "/api/search?from=now&to=%2B1m", APP)
            assert status == 200 and reply["timers"] == [] and reply["truncated"] is True, reply
            status, _, reply = await call("GET", base + "/api/search?from=%2B4s&to=%2B1m", APP)
            assert [t["message_id"] for t in reply["timers"]] == ["o-1"] and not reply["truncated"]
            status, _, svg = await call("GET", base + "/chart/pending.svg?horizon=10m", APP)
            assert status == 200, svg
            assert "0 due in your topics in the next 10 minutes, 10 s bars; 0 overdue; scan stopped " \
                "(timer_search_max_scanned): bars from 2027-01-15 08:00:01.003Z may be short" in svg, svg
            assert "later" not in svg

    arun(body())


def test_the_range_error_speaks_the_form_s_words_and_human_times(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with console(tmp_path) as (broker, base):
            await broker.create_topic("orders", 1)
            status, _, reply = await call("GET", base + "/api/search?topic=orders&from=%2B1h&to=now", APP)
            assert status == 400 and reply["error"] == "ConsoleInputError"
            assert reply["message"] == (
                "the range's end, to 'now' (2027-01-15 08:00:00 UTC), is before its start, due from '+1h' "
                "(2027-01-15 09:00:00 UTC): the range must end after it starts")
            assert "to_ms" not in reply["message"] and "1800000000000" not in reply["message"]
            status, _, reply = await call("GET", base + "/api/search?from=2027-01-15T08:00Z&to=1800000000000", APP)
            assert status == 400 and reply["message"].startswith(
                "the range's end, to '1800000000000' (2027-01-15 08:00:00 UTC), is its start, due from "
                "'2027-01-15T08:00Z' (2027-01-15 08:00:00 UTC)"), reply
            status, _, reply = await call("GET", base + "/api/search?from=now&to=%2B40d", APP)
            assert status == 400 and reply["message"] == (
                "the range due from 'now' (2027-01-15 08:00:00 UTC) to '+40d' (2027-02-24 08:00:00 UTC) covers "
                "40 days, more than timer_search_max_range_ms (31 days); search a narrower one")

    arun(body())
