"""The chronoq server process: one `grpc.aio` server over one `Broker`.

Theory of operation: `serve(config)` opens the broker, binds the gRPC port (TLS when a certificate
and key are configured), and registers three services: `apache.rocketmq.v2.MessagingService`
(the official clients), `chronoq.admin.v1.Admin` (JSON admin), and the standard
`grpc.health.v1.Health` (SERVING while the broker is open). It then waits for `stop` (SIGTERM or
SIGINT when run from the CLI). Shutdown runs in the reverse order of start: health says
NOT_SERVING, the server refuses new calls and gives running ones `SHUTDOWN_GRACE_S` (long polls
are cancelled; their messages stay unreceived), the auto-renew loop stops, and the broker closes
last, so every acknowledged send is durable before the process exits. If a broker background task
dies (the broker then refuses all work), a watchdog stops the server the same way and `serve`
returns 1.

The server owns the real clock; everything below gets it through the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chronoq.config import Config, ConfigError
from chronoq.protocol import admin as admin_codec
from chronoq.protocol.requests import Endpoint
from chronoq.protocol.v2 import SERVICE_NAME
from chronoq.server.admin_service import AdminService
from chronoq.server.grpc_service import MessagingService

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
WATCHDOG_INTERVAL_S = 1.0
REQUEST_OVERHEAD_BYTES = 1024 * 1024
"""Room for protobuf/JSON framing above the payload limit in one request."""


def max_request_bytes(config: Config) -> int:
    """gRPC's receive limit: one batch of messages at the message limit, base64 (admin JSON)
    included. Larger requests are refused by gRPC itself with RESOURCE_EXHAUSTED."""
    return 2 * config.max_message_size_bytes + REQUEST_OVERHEAD_BYTES


def server_options(config: Config) -> list[tuple[str, int]]:
    limit = max_request_bytes(config)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    if not config.tls_cert_file and not config.tls_key_file:
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise ConfigError("TLS needs both tls_cert_file and tls_key_file")
    try:
        cert = Path(config.tls_cert_file).read_bytes()
        key = Path(config.tls_key_file).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file: {exc}") from None
    return grpc.ssl_server_credentials([(key, cert)])


async def serve(config: Config, *, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None) -> int:
    """Run until `stop` is set (returns 0) or the broker fails (returns 1). `on_ready` gets the
    line "chronoq serving on HOST:PORT" once the port accepts calls."""
    from chronoq.broker import Broker  # the broker pulls in the store; keep `import serve` light

    stop = stop or asyncio.Event()
    credentials = server_credentials(config)
    broker = await Broker.open(config)
    server: grpc.aio.Server | None = None
    try:
        advertised = None if config.host in WILDCARD_HOSTS else Endpoint(config.host, config.port)
        messaging = MessagingService(broker, config, advertised=advertised, port=config.port)
        server = grpc.aio.server(options=server_options(config))
        server.add_generic_rpc_handlers((messaging.generic_handler(),
                                         AdminService(broker, config).generic_handler()))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = bind_address(config.host, config.port)
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ConfigError(f"cannot bind {address}: {exc}") from None
        if port == 0:
            raise ConfigError(f"cannot bind {address}")
        await server.start()
        for name in ("", SERVICE_NAME, admin_codec.SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if on_ready is not None:
            on_ready(f"chronoq serving on {bind_address(config.host, port)}" + (" (TLS)" if credentials else ""))
        async with asyncio.TaskGroup() as tasks:
            renewals = tasks.create_task(messaging.renewals.run(), name="auto-renew")
            watchdog = tasks.create_task(_watch_broker(broker, stop), name="broker-watchdog")
            await stop.wait()
            log.info("shutting down")
            await health_servicer.enter_graceful_shutdown()
            await server.stop(SHUTDOWN_GRACE_S)
            renewals.cancel()
            watchdog.cancel()
        return 1 if broker.fatal is not None else 0
    finally:
        if server is not None:
            await server.stop(0)  # no-op after a clean stop; closes the port after a failure
        await broker.close()


async def _watch_broker(broker: object, stop: asyncio.Event) -> None:
    """A broker whose background task died refuses all work; stop serving so a supervisor sees
    the exit (code 1) instead of a server that answers 50001 forever."""
    while getattr(broker, "fatal", None) is None:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    log.error("broker failed (%r); stopping the server", broker.fatal)  # type: ignore[attr-defined]
    stop.set()


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
