"""The web console with auth on: the same users and permissions as the gRPC services.

A browser cannot sign RocketMQ's HMAC headers, so the console takes HTTP Basic credentials (the
user's access key and secret key), checked by the same `Authenticator`; the admin methods then
check that caller exactly as they check a CLI or SDK call, and cancelling from the console needs
the admin role besides. A real broker, the real aiohttp server, a real HTTP client.
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
async def console(tmp_path: Path) -> AsyncIterator[tuple[Broker, str]]:
    config = Config(data_dir=tmp_path / "data")
    broker = await open_broker(config, clock=FakeClock(T0), background=False)
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
            assert (await call("GET", base + "/api/overview", APP))[0] == 403  # Stats spans every topic

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
