"""`serve()` and `chronoq serve`: readiness line, health, TLS, config layers, SIGTERM shutdown."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import chronoq
from chronoq.cli import COMMAND_MODULES
from chronoq.cli import serve as serve_cli
from chronoq.client.testing import free_port
from chronoq.config import Config, ConfigError
from chronoq.protocol.v2 import SERVICE_NAME
from chronoq.server.serve import GC_OLDER_THRESHOLDS, serve, settle_heap
from tests.support.brokers import open_broker

ROOT = Path(chronoq.__file__).resolve().parent.parent


async def health_status(channel: grpc.aio.Channel, service_name: str = "") -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service_name),
                                                            timeout=5)
    return reply.status


async def start_serving(config: Config) -> tuple[asyncio.Task[int], asyncio.Event, str]:
    """Run `serve` as a task until it reports ready: (the task, its stop event, the ready line)."""
    stop = asyncio.Event()
    ready: list[str] = []
    task = asyncio.create_task(serve(config, stop=stop, on_ready=ready.append))
    while not ready:
        assert not task.done(), task
        await asyncio.sleep(0.05)
    return task, stop, ready[0]


def test_serve_reports_ready_is_healthy_and_stops_cleanly(tmp_path: Path) -> None:
    async def body() -> None:
        port = free_port()
        config = Config(data_dir=tmp_path / "data", port=port)
        task, stop, ready = await start_serving(config)
        assert ready == f"chronoq serving on 127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name in ("", "apache.rocketmq.v2.MessagingService", "chronoq.admin.v1.Admin"):
                assert await health_status(channel, name) == health_pb2.HealthCheckResponse.SERVING
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_status(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        broker = await open_broker(config)  # the data directory's lock was released
        await broker.close()
    asyncio.run(body())


def _openssl_cert(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_serves_secure_clients_only(tmp_path: Path) -> None:
    cert, key = _openssl_cert(tmp_path)

    async def body() -> None:
        port = free_port()
        config = Config(data_dir=tmp_path / "data", port=port, tls_cert_file=str(cert), tls_key_file=str(key))
        task, stop, ready = await start_serving(config)
        assert ready.endswith("(TLS)")
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_status(channel)
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    asyncio.run(body())


def _args(**values: object) -> argparse.Namespace:
    base = {"data_dir": None, "port": None, "host": None, "config": None, "tls_cert": None, "tls_key": None,
            "log_level": "WARNING"}
    base.update(values)
    return argparse.Namespace(**base)


def test_config_layers_toml_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "chronoq.toml"
    toml.write_text('[chronoq]\nport = 9001\nmax_long_poll_ms = 5000\ndefault_queue_count = 2\n')
    monkeypatch.setenv("CHRONOQ_MAX_LONG_POLL_MS", "7000")
    monkeypatch.setenv("CHRONOQ_PORT", "9002")
    config = serve_cli.load_config(_args(config=str(toml), data_dir=str(tmp_path / "d")))
    assert (config.port, config.max_long_poll_ms, config.default_queue_count) == (9002, 7000, 2)
    assert config.data_dir == tmp_path / "d"
    config = serve_cli.load_config(_args(config=str(toml), port=9003, tls_cert="c.pem", tls_key="k.pem"))
    assert (config.port, config.tls_cert_file, config.tls_key_file) == (9003, "c.pem", "k.pem")


def test_bad_configuration_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("no_such_setting = 1\n")
    assert serve_cli.run(_args(config=str(toml), data_dir=str(tmp_path / "d"))) == 2
    assert "no_such_setting" in capsys.readouterr().err
    assert serve_cli.run(_args(data_dir=str(tmp_path / "d"), tls_cert=str(tmp_path / "missing.pem"),
                               tls_key=str(tmp_path / "missing.key"), port=free_port())) == 2
    err = capsys.readouterr().err
    assert f"cannot read the TLS certificate (tls_cert_file, --tls-cert) {tmp_path / 'missing.pem'}: No such file " \
           "or directory" in err and "[Errno" not in err, err


def _start_cli(data_dir: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    module = ["chronoq", "serve"] if "chronoq.cli.serve" in COMMAND_MODULES else ["chronoq.cli.serve", "serve"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-m", *module, "--data-dir", str(data_dir), "--port", str(port),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _admin(address: str, method: str, body: dict) -> dict:
    with grpc.insecure_channel(address) as channel:
        return json.loads(channel.unary_unary(f"/chronoq.admin.v1.Admin/{method}")(json.dumps(body).encode(),
                                                                                   timeout=10))


@pytest.mark.slow
def test_cli_serve_sigterm_is_a_clean_shutdown_and_data_survives(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = _start_cli(tmp_path / "data", port)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().strip() == f"chronoq serving on {address}"
        sent = _admin(address, "SendBatch", {"messages": [{"topic": "keep", "body_b64": "a2VlcA==",
                                                           "message_id": "KEEP-1"}]})
        queue_id = sent["results"][0]["queue_id"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc = _start_cli(tmp_path / "data", port)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        read = _admin(address, "ReadMessages", {"topic": "keep", "queue_id": queue_id, "offset": 0,
                                                "max_messages": 10})
        assert [m["message_id"] for m in read["messages"]] == ["KEEP-1"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


FIRST_CALL_DEADLINE_S = 0.1
"""The deadline of the call made the instant a probe says ready: ample for a server that serves
(a few ms here), far below what importing and starting the HTTP side takes (~0.25 s here), so a
port that opened before that would fail it."""


def _first_ready(proc: subprocess.Popen[bytes], port: int, http_port: int) -> str:
    """Poll every 1 ms, from the process start, the two probes a deployment may use: a TCP connect
    to the gRPC port (Kubernetes `tcpSocket`) and GET /healthz; return the one that said ready first."""
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return "tcp"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=10) as reply:
                if reply.status == 200:
                    return "healthz"
        except urllib.error.HTTPError as not_ready:
            assert not_ready.code == 503, not_ready
        except (urllib.error.URLError, ConnectionError):
            pass  # not bound yet
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "chronoq serve did not open its ports in 60 s"
        time.sleep(0.001)


@pytest.mark.slow
def test_the_grpc_port_serves_the_instant_a_probe_says_ready_with_http_port(tmp_path: Path) -> None:
    """A client that connects the instant the gRPC port accepts TCP, or /healthz says ready, is
    served at once: a health check with a short deadline and no wait_for_ready says SERVING for the
    messaging service. The HTTP side already accepts then: it starts before the gRPC port opens
    (`serve`'s start order). Several starts of a real `chronoq serve --http-port`."""
    for start in range(3):
        port, http_port = free_port(), free_port()
        proc = _start_cli(tmp_path / f"data{start}", port, "--http-port", str(http_port))
        try:
            probe = _first_ready(proc, port, http_port)
            with socket.socket() as http_probe:
                http_accepts = http_probe.connect_ex(("127.0.0.1", http_port)) == 0
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=FIRST_CALL_DEADLINE_S)
                except grpc.RpcError as failed:
                    pytest.fail(f"start {start}: ready by {probe}, then {failed.code().name}: {failed.details()}")
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert http_accepts, f"start {start}: the gRPC port opened before the HTTP side"
            assert proc.stdout is not None
            assert proc.stdout.readline().decode().strip() == f"chronoq serving on 127.0.0.1:{port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_an_http_port_in_use_stops_the_start_before_the_grpc_port_is_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP side starts first, so a taken HTTP port stops the start with its one clear line
    before the gRPC port was ever bound (no probe sees a port that then closes)."""
    bound: list[str] = []
    make_server = grpc.aio.server

    def spying_server(*args: object, **kwargs: object) -> grpc.aio.Server:
        server = make_server(*args, **kwargs)  # type: ignore[arg-type]
        add_port = server.add_insecure_port

        def add_insecure_port(address: str) -> int:
            bound.append(address)
            return add_port(address)

        server.add_insecure_port = add_insecure_port  # type: ignore[method-assign]
        return server

    monkeypatch.setattr(grpc.aio, "server", spying_server)

    async def body() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            http_port = taken.getsockname()[1]
            config = Config(data_dir=tmp_path / "data", port=free_port(), http_port=http_port)
            with pytest.raises(ConfigError) as refused:
                await serve(config, on_ready=pytest.fail)
        assert str(refused.value) == (f"cannot bind the HTTP port {http_port}: port {http_port} is in use (another "
                                      "chronoq serve, or another program); choose another --http-port")
        assert bound == []
        broker = await open_broker(config)  # the data directory's lock was released
        await broker.close()
    asyncio.run(body())


def _auth_toml(*users: tuple[str, str]) -> str:
    entries = "".join(f'\n[[auth.users]]\naccess_key = "{ak}"\nsecret_key = "{sk}"\nadmin = true\n' for ak, sk in users)
    return f"[auth]\nenabled = true\n{entries}"


@pytest.mark.slow
def test_sighup_reloads_the_auth_table_and_keeps_it_when_the_file_is_bad(tmp_path: Path) -> None:
    """Keys are added and removed without a restart: SIGHUP reads `[auth]` again. A file that does
    not load changes nothing (the error is logged) and the table in use stays."""
    from chronoq import errors as core
    from chronoq.client import AsyncAdmin

    port = free_port()
    address = f"127.0.0.1:{port}"
    toml = tmp_path / "chronoq.toml"
    toml.write_text(_auth_toml(("ops", "s1")))
    log_path = tmp_path / "serve.log"
    module = ["chronoq", "serve"] if "chronoq.cli.serve" in COMMAND_MODULES else ["chronoq.cli.serve", "serve"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", *module, "--data-dir", str(tmp_path / "data"), "--port",
                                 str(port), "--config", str(toml)], stdout=subprocess.PIPE, stderr=log_file, env=env)

    async def topics(ak: str, sk: str) -> object:
        async with AsyncAdmin(address, access_key=ak, secret_key=sk, timeout_ms=5000) as admin:
            try:
                return await admin.list_topics()
            except core.ChronoqError as e:
                return e

    def _unknown_key(outcome: object) -> bool:
        return isinstance(outcome, core.Unauthorized) and outcome.details.get("cause") == "unknown_access_key"

    def reload_and_wait(line: str) -> None:
        seen = log_path.read_text().count(line)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while log_path.read_text().count(line) == seen:
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)

    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().strip() == f"chronoq serving on {address}"
        assert isinstance(asyncio.run(topics("ops", "s1")), list)
        assert _unknown_key(asyncio.run(topics("dev", "s2")))
        toml.write_text(_auth_toml(("dev", "s2")))  # dev added, ops removed
        reload_and_wait("SIGHUP: reloaded [auth]")
        assert isinstance(asyncio.run(topics("dev", "s2")), list)
        assert _unknown_key(asyncio.run(topics("ops", "s1")))
        toml.write_text(_auth_toml(("dev", "s2")) + "\n[[auth.users]]\naccess_key = 7\n")  # a bad entry
        reload_and_wait("was not reloaded")
        assert "access_key" in log_path.read_text().rsplit("was not reloaded", 1)[1].splitlines()[0]
        assert isinstance(asyncio.run(topics("dev", "s2")), list)  # the table in use stayed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_settle_heap_freezes_start_up_and_collects_as_gc_young_objects_says(tmp_path: Path) -> None:
    before = gc.get_threshold()
    try:
        settle_heap(Config(data_dir=tmp_path, gc_young_objects=12_345))
        assert gc.get_threshold() == (12_345, *GC_OLDER_THRESHOLDS)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    with pytest.raises(ConfigError, match="gc_young_objects"):
        Config(data_dir=tmp_path, gc_young_objects=0)
