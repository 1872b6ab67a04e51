"""One store, two doors; and the Pulsar door's trust: the official Pulsar client
(tests/interop/pulsar_cases.py, its own process) beside chronoq's SDK, against a real `chronoq
serve`. A message sent through either door is received through the other with its body, key
and properties, its delay honoured; with `[auth]` on, `AuthenticationBasic` is checked against
chronoq's users and permissions; with a certificate, the door speaks `pulsar+ssl://`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chronoq.client import Consumer, Producer
from chronoq.client.testing import ServerProcess, free_port
from tests.support.extras import missing

pytestmark = [pytest.mark.interop, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
CASE_TIMEOUT_S = 90
DELAY_MS = 2000
AUTH_TOML = """
[auth]
enabled = true

[[auth.users]]
access_key = "orders-app"
secret_key = "s3cret"
publish = ["orders"]
subscribe = ["orders"]
groups = ["billing"]

[[auth.users]]
access_key = "ops"
secret_key = "0ps-secret"
admin = true
"""


def case(name: str, url: str, topic: str, **opts: object) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(HERE / "pulsar_cases.py"), name, url, topic, json.dumps(opts)],
                          capture_output=True, timeout=CASE_TIMEOUT_S, env=env, check=False)
    lines = done.stdout.decode().strip().splitlines()
    assert lines, f"case printed nothing (exit {done.returncode}); stderr:\n{done.stderr.decode()[-3000:]}"
    return json.loads(lines[-1])


def need_pulsar() -> None:
    if importlib.util.find_spec("pulsar") is None:
        missing("test", "the pulsar-client package is not installed")


def test_a_message_crosses_between_the_grpc_and_pulsar_doors_both_ways(tmp_path: Path) -> None:
    need_pulsar()
    pulsar_port = free_port()
    with ServerProcess(tmp_path / "data", args=["--pulsar-port", str(pulsar_port)]) as server:
        url = f"pulsar://127.0.0.1:{pulsar_port}"
        # SDK -> Pulsar: a delayed and a plain message, received by a Shared subscription.
        with Producer(server.address) as p:
            sent_ms = int(time.time() * 1000)
            p.send("to-pulsar", b"sdk-delayed", delay=DELAY_MS, keys="order-7", properties={"origin": "sdk"})
            p.send("to-pulsar", b"sdk-plain", keys="order-8", properties={"origin": "sdk"})
        r = case("produce_consume", url, "to-pulsar", expect=2)
        assert "fatal" not in r, r["fatal"]
        got = {m["body"]: m for m in r["received"]}
        assert set(got) == {"sdk-delayed", "sdk-plain"}
        assert got["sdk-delayed"]["at_ms"] >= sent_ms + DELAY_MS
        assert (got["sdk-delayed"]["key"], got["sdk-delayed"]["props"]) == ("order-7", {"origin": "sdk"})
        assert (got["sdk-plain"]["key"], got["sdk-plain"]["props"]) == ("order-8", {"origin": "sdk"})
        # Pulsar -> SDK: the same the other way, received by a chronoq consumer group.
        before_ms = int(time.time() * 1000)
        r = case("produce_consume", url, "to-sdk", send=[
            {"body": "pulsar-delayed", "key": "k-1", "props": {"origin": "pulsar"}, "delay_ms": DELAY_MS},
            {"body": "pulsar-plain", "key": "k-2", "props": {"origin": "pulsar"}}])
        assert "fatal" not in r, r["fatal"]
        received = {}
        with Consumer("sdk-group", "to-sdk", server=server.address) as c:
            end = time.monotonic() + 15
            while len(received) < 2 and time.monotonic() < end:
                for m in c.receive(wait=1000):
                    received[m.body] = (m, int(time.time() * 1000))
                    c.ack(m)
        assert set(received) == {b"pulsar-delayed", b"pulsar-plain"}
        delayed, at_ms = received[b"pulsar-delayed"]
        assert at_ms >= before_ms + DELAY_MS and delayed.deliver_at_ms is not None
        assert delayed.keys == ("k-1",) and delayed.properties["origin"] == "pulsar"
        assert received[b"pulsar-plain"][0].keys == ("k-2",)
        assert received[b"pulsar-plain"][0].properties["origin"] == "pulsar"


def test_basic_auth_checks_chronoqs_users_and_permissions(tmp_path: Path) -> None:
    need_pulsar()
    pulsar_port = free_port()
    config = tmp_path / "auth.toml"
    config.write_text(AUTH_TOML)
    with ServerProcess(tmp_path / "data", args=["--pulsar-port", str(pulsar_port), "--config", str(config)],
                       access_key="ops", secret_key="0ps-secret") as server:
        url = f"pulsar://127.0.0.1:{pulsar_port}"
        ok = case("produce_consume", url, "orders", auth=["orders-app", "s3cret"], subscription="billing",
                  send=[{"body": "paid"}], expect=1)
        assert "fatal" not in ok, ok["fatal"]
        assert [m["body"] for m in ok["received"]] == ["paid"]
        # Refused credentials fail the client's first call with AuthenticationError, at once (the
        # cases' operation timeout is 10 s: a TimeOut would mean the refusal never reached it).
        started = time.monotonic()
        wrong = case("produce_consume", url, "orders", auth=["orders-app", "guess"], send=[{"body": "x"}])
        assert "AuthenticationError" in wrong.get("fatal", ""), wrong
        nobody = case("produce_consume", url, "orders", send=[{"body": "x"}])
        assert "AuthenticationError" in nobody.get("fatal", ""), nobody
        assert time.monotonic() - started < 10, "a refusal waited for the client's operation timeout"

        served_log = server.log_path.read_text()
        assert "wrong secret key for access key 'orders-app'" in served_log
        assert "auth method 'none'" in served_log
        forbidden = case("produce_consume", url, "payments", auth=["orders-app", "s3cret"], send=[{"body": "x"}])
        assert "AuthorizationError" in forbidden.get("fatal", ""), forbidden
        other_group = case("produce_consume", url, "orders", auth=["orders-app", "s3cret"], subscription="audit",
                           expect=1, timeout_s=2)
        assert "AuthorizationError" in other_group.get("fatal", ""), other_group


def test_the_door_serves_pulsar_ssl_with_the_servers_certificate(tmp_path: Path) -> None:
    need_pulsar()
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    pulsar_port = free_port()
    with ServerProcess(tmp_path / "data", args=["--pulsar-port", str(pulsar_port)],
                       settings={"tls_cert_file": cert, "tls_key_file": key}, tls_root_certificates=cert.read_bytes()):
        r = case("produce_consume", f"pulsar+ssl://127.0.0.1:{pulsar_port}", "secure", trust=str(cert),
                 send=[{"body": "over tls", "delay_ms": 500}], expect=1)
        assert "fatal" not in r, r["fatal"]
        assert [m["body"] for m in r["received"]] == ["over tls"]
        plain = case("produce_consume", f"pulsar://127.0.0.1:{pulsar_port}", "secure", send=[{"body": "x"}])
        assert "fatal" in plain, "a plain-text client was served on the TLS port"
