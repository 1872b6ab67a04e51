"""The chronoq server process: one `grpc.aio` server over one `Broker`.

Theory of operation: `serve(config)` opens the broker and builds a gRPC server with four services:
`apache.rocketmq.v2.MessagingService` (the official clients), `chronoq.receive.v1.Receive` (the
same receive with the messages in one response, `chronoq.protocol.batch_receive`; chronoq's SDK),
`chronoq.admin.v1.Admin` (JSON admin), and the standard `grpc.health.v1.Health` (SERVING while
the broker is open). With `pulsar_port` the Pulsar door (`chronoq/pulsar/door.py`: Apache
Pulsar's binary protocol, its own asyncio server) serves first, as soon as the broker is open,
before the gRPC side's modules are even imported; with `http_port` set the HTTP side then starts
on the same loop (`chronoq/http/`: /metrics, /healthz, the web console). Only then
does it bind the gRPC port (TLS when a certificate and key are configured) and serve on it, in
one step (`listen`). The order is for readiness probes: gRPC core listens from `add_*_port` on,
so from the bind the kernel accepts connections and a probe that only connects (Kubernetes
`tcpSocket`) says ready; whatever ran between the bind and `start` (an import, an await, a
collection) would leave a client that connected at once unanswered, a quarter of a second for
importing and starting the HTTP side.
So the port opens when it serves: health says SERVING before it opens, and /healthz says
"starting" (503) until it does, so no probe says ready early. It prints "chronoq serving on
HOST:PORT" and a line saying whether auth is on ("chronoq auth on: N users" / "chronoq auth off: ...";
with the HTTP side, a line naming its URL; with `pulsar_port`, one naming the Pulsar door's,
"chronoq pulsar door on pulsar://HOST:PORT") once all serve, then waits for
`stop` (SIGTERM or SIGINT when run from the CLI). Shutdown runs in the reverse order of start:
health says NOT_SERVING, the server refuses new calls and gives running ones `SHUTDOWN_GRACE_S`
(long polls are cancelled; their messages stay unreceived), the auto-renew loop stops, and the
broker closes last, so every acknowledged send is durable before the process exits. If a broker
background task dies (the broker then refuses all work), a watchdog stops the server the same
way and `serve` returns 1.

Start-up failures a person can fix are `ConfigError`s that say what to fix, checked before the
broker opens or read back from the failure: a data directory that is a file; TLS files that are
not a PEM certificate and its private key (swapped, a key that belongs to another certificate),
checked with Python's `ssl` because gRPC only says "cannot bind"; a port that cannot be bound,
whose cause (in use, permission, no such address) a plain socket bind names. The HTTP port is
bound first, so when it is taken the start stops before the gRPC port was ever bound.

Run as the process (`chronoq serve`), just before its gRPC port opens it freezes start-up's objects
out of the garbage collector's view (`settle_heap`: a collection of tens of ms that a first call
would otherwise wait out), and on SIGHUP it reads the `[auth]` table of its `--config` file again
(`reload_auth`; a file that does not load changes nothing).

The server owns the real clock; everything below gets it through the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from chronoq.config import Config, ConfigError
from chronoq.server.auth import AUTH_OFF, AuthConfig, Authenticator, load_auth
from chronoq.server.net import bind_address, bind_failure, max_request_bytes

if TYPE_CHECKING:
    from chronoq.broker import Broker
    from chronoq.pulsar.door import PulsarDoor

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "[::1]", "localhost"})
NO_AUTH_WARNING = ("auth is off and chronoq listens on {address}, beyond loopback: anyone who can reach the port "
                   "may send, receive, cancel and administer. Turn it on with [auth] enabled = true and "
                   "[[auth.users]] in the --config file (README, \"Authentication\").")
def server_options(config: Config) -> list[tuple[str, int]]:
    limit = max_request_bytes(config)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0)]


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    if not config.tls_cert_file and not config.tls_key_file:
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise ConfigError("TLS needs both tls_cert_file and tls_key_file (--tls-cert and --tls-key)")
    files = {}
    for what, path in (("certificate (tls_cert_file, --tls-cert)", config.tls_cert_file),
                       ("private key (tls_key_file, --tls-key)", config.tls_key_file)):
        try:
            files[what] = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None
    cert, key = files.values()
    check_tls_pair(config.tls_cert_file, cert, config.tls_key_file, key)
    return grpc.ssl_server_credentials([(key, cert)])


def check_tls_pair(cert_path: str, cert: bytes, key_path: str, key: bytes) -> None:
    """Refuse TLS files gRPC would refuse with only "cannot bind", saying which file is wrong."""
    cert_has_cert, key_has_key = b"-----BEGIN CERTIFICATE-----" in cert, b"PRIVATE KEY-----" in key
    if not cert_has_cert and not key_has_key and b"PRIVATE KEY-----" in cert and b"BEGIN CERTIFICATE" in key:
        raise ConfigError(f"the TLS files are swapped: {cert_path} (--tls-cert) holds a private key and {key_path} "
                          "(--tls-key) a certificate")
    if not cert_has_cert:
        raise ConfigError(f"{cert_path} (--tls-cert) holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if not key_has_key:
        raise ConfigError(f"{key_path} (--tls-key) holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback that gives none: an encrypted key fails here instead of prompting.
        context.load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ConfigError(f"{key_path} (--tls-key) is not the private key of the certificate in {cert_path} "
                              "(--tls-cert)") from None
        raise ConfigError(f"cannot use {cert_path} and {key_path} for TLS: {exc.reason or exc} (an encrypted "
                          "key is not supported: decrypt it with `openssl pkey -in KEY -out PLAIN-KEY`)") from None


def check_data_dir_path(data_dir: Path) -> None:
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"data directory {data_dir} is a file, not a directory; give --data-dir a directory "
                          "(it is created if missing)")


def auth_line(auth: AuthConfig) -> str:
    """The ready line's companion: whether calls are authenticated, so the operator sees it at start
    rather than from the first refused (or accepted) call. A line of its own: the ready line stays
    "chronoq serving on HOST:PORT", which scripts wait for and parse."""
    if auth.enabled:
        count = len(auth.users)
        return f"chronoq auth on: {count} user{'s' if count != 1 else ''}"
    return "chronoq auth off: any caller may send, receive and administer ([auth] in --config turns it on)"


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


async def serve(config: Config, *, stop: asyncio.Event | None = None,
                on_ready: Callable[[str], None] | None = None, auth: AuthConfig = AUTH_OFF,
                own_process: bool = False, auth_file: str | Path | None = None) -> int:
    """Run until `stop` is set (returns 0) or the broker fails (returns 1). `on_ready` gets the
    line "chronoq serving on HOST:PORT" once the port accepts calls. `auth`: the `[auth]` table
    (`chronoq.server.auth.load_auth`); off by default, with a warning beyond loopback.
    `own_process`: the server is the process (`chronoq serve`), so before its port opens it may
    take start-up's objects out of the garbage collector's view (`settle_heap`), and, given the
    `auth_file` the table came from, it reads that table again on SIGHUP (`reload_auth`); a test
    or an embedding program that runs `serve` among other work leaves its heap and its signals
    alone."""
    from chronoq.broker import Broker  # the broker pulls in the store; keep `import serve` light

    stop = stop or asyncio.Event()
    credentials = server_credentials(config)
    check_data_dir_path(config.data_dir)
    broker = await Broker.open(config)
    server: grpc.aio.Server | None = None
    http = None
    pulsar = None
    try:
        authenticator = Authenticator(auth)
        if config.pulsar_port:
            from chronoq.pulsar.door import PulsarDoor  # the Pulsar protocol's modules: only when asked for

            pulsar = PulsarDoor(broker, config, authenticator=authenticator)
            pulsar_port = await start_pulsar(pulsar, config)
        # The gRPC side's modules (RocketMQ's protocol classes among them: ~0.4 s of imports) load
        # after the Pulsar door serves, so a restart keeps Pulsar clients waiting for less.
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from chronoq.protocol import admin as admin_codec
        from chronoq.protocol import batch_receive
        from chronoq.protocol.requests import Endpoint
        from chronoq.protocol.v2 import SERVICE_NAME
        from chronoq.server.admin_service import AdminService
        from chronoq.server.grpc_service import MessagingService

        advertised = None if config.host in WILDCARD_HOSTS else Endpoint(config.host, config.port)
        messaging = MessagingService(broker, config, advertised=advertised, port=config.port,
                                     authenticator=authenticator)
        admin = AdminService(broker, config, authenticator)
        server = grpc.aio.server(options=server_options(config))
        server.add_generic_rpc_handlers((messaging.generic_handler(), messaging.batch_receive_handler(),
                                          admin.generic_handler()))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", SERVICE_NAME, batch_receive.SERVICE_NAME, admin_codec.SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)  # no one can ask yet
        if config.http_port:
            from chronoq.http.server import HttpServer  # aiohttp and prometheus_client: only when asked for

            http = HttpServer(broker, config, admin)
            http_port = await http.start()  # its /healthz says "starting" until gRPC serves
        if own_process:
            settle_heap(config)
        port = await listen(server, config, credentials)
        if http is not None:
            http.grpc_port = port
            http.starting = False  # /healthz may say ready now
        if not auth.enabled and not is_loopback(config.host):
            log.warning(NO_AUTH_WARNING.format(address=bind_address(config.host, port)))
        if own_process and auth_file is not None:
            with contextlib.suppress(NotImplementedError):  # no SIGHUP on Windows
                asyncio.get_running_loop().add_signal_handler(
                    signal.SIGHUP, reload_auth, authenticator, auth_file, config.host, port)
        if on_ready is not None:
            on_ready(f"chronoq serving on {bind_address(config.host, port)}" + (" (TLS)" if credentials else ""))
            on_ready(auth_line(auth))
            if http is not None:
                on_ready(f"chronoq console, /metrics and /healthz on {http_url(config.host, http_port)}")
            if pulsar is not None:
                on_ready(f"chronoq pulsar door on pulsar://{bind_address(shown_host(config.host), pulsar_port)}")
        async with asyncio.TaskGroup() as tasks:
            renewals = tasks.create_task(messaging.renewals.run(), name="auto-renew")
            watchdog = tasks.create_task(_watch_broker(broker, stop), name="broker-watchdog")
            sampler = tasks.create_task(http.run(), name="console-sampler") if http is not None else None
            await stop.wait()
            log.info("shutting down")
            if http is not None:
                http.stopping = True  # /healthz says so while gRPC drains
            await health_servicer.enter_graceful_shutdown()
            if pulsar is not None:
                await pulsar.stop()
            await server.stop(SHUTDOWN_GRACE_S)
            renewals.cancel()
            watchdog.cancel()
            if sampler is not None:
                sampler.cancel()
        return 1 if broker.fatal is not None else 0
    finally:
        if pulsar is not None:
            await pulsar.stop()  # no-op after a clean stop
        if http is not None:
            await http.stop()
        if server is not None:
            await server.stop(0)  # no-op after a clean stop; closes the port after a failure
        await broker.close()


async def listen(server: grpc.aio.Server, config: Config, credentials: grpc.ServerCredentials | None) -> int:
    """Bind the gRPC port and serve on it; returns the bound port. gRPC core listens at
    `add_*_port`, before `start`: from the bind on, connections are accepted by the kernel and
    wait unanswered until gRPC serves. So nothing runs between the two (no import, no other await,
    no collection), and a client that connects the instant the port opens is served."""
    address = bind_address(config.host, config.port)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"cannot bind {address}: {bind_failure(config.host, config.port)}")
    await server.start()
    return port


async def start_pulsar(door: PulsarDoor, config: Config) -> int:
    """Bind the Pulsar door's port (before the gRPC port, like the HTTP side: a port in use stops
    the start before anything serves); returns the bound port."""
    try:
        return await door.start(config.host, config.pulsar_port)
    except OSError:
        raise ConfigError(f"cannot bind {bind_address(config.host, config.pulsar_port)} for the Pulsar door "
                          f"(--pulsar-port): {bind_failure(config.host, config.pulsar_port)}") from None


def reload_auth(authenticator: Authenticator, auth_file: str | Path, host: str, port: int) -> bool:
    """Read the `[auth]` table of `auth_file` again and use it from the next call on; a file
    that does not load (bad TOML, a bad user entry, unreadable) changes nothing and is logged with
    its reason. Returns whether the new table is in use."""
    try:
        table = load_auth(auth_file)
    except (ConfigError, OSError, ValueError) as exc:
        log.error("SIGHUP: the [auth] table was not reloaded, the one in use stays: %s", exc)
        return False
    authenticator.reload(table)
    log.info("SIGHUP: reloaded [auth] from %s: auth %s, %d user%s", auth_file, "on" if table.enabled else "off",
             len(table.users), "" if len(table.users) == 1 else "s")
    if not table.enabled and not is_loopback(host):
        log.warning(NO_AUTH_WARNING.format(address=bind_address(host, port)))
    return True


GC_OLDER_THRESHOLDS = (2, 10)
"""The cyclic collector's thresholds for its middle and oldest generations (CPython's: 10, 10):
young collections before a middle one, middle ones before a full one. A middle collection walks
every object the young ones kept, so with young collections `gc_young_objects` apart it comes
every 2 of them: at most ~100,000 objects, a pause of a few ms (7.7 ms at most, where 10 let
it reach 32 ms and 20 60 ms, with 1.5 M objects kept: design.md, "The garbage collector"). A
full collection comes as in CPython 3.11: once a quarter of the old objects are new. (CPython
3.14's incremental collector reads these numbers differently.)"""


def settle_heap(config: Config) -> None:
    """Collect start-up's garbage, then take what start-up built (modules, gRPC and protobuf
    types, the broker's rooms) out of the cyclic collector's view (`gc.freeze`): each full
    collection while serving then walks only objects made since, a shorter pause on the one event
    loop every message goes through. What is frozen lives as long as the process, or is freed by
    its reference count as usual. Then collect less often (`gc_young_objects`,
    `GC_OLDER_THRESHOLDS`): a fire step or a batch of sends makes thousands of short-lived
    objects, and a collection every 700 of them cost a fired timer 6 % of its instructions."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(config.gc_young_objects, *GC_OLDER_THRESHOLDS)


def http_url(host: str, port: int) -> str:
    """The console's address as a person would open it (a wildcard host: this machine's loopback)."""
    return f"http://{bind_address(shown_host(host), port)}/"


def shown_host(host: str) -> str:
    """A host to name in an address a person or client opens (a wildcard: this machine's loopback)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


async def _watch_broker(broker: Broker, stop: asyncio.Event) -> None:
    """A broker whose background task died refuses all work; stop serving so a supervisor sees
    the exit (code 1) instead of a server that answers 50002 (BrokerClosed) forever."""
    why = await broker.wait_failed()
    log.error("broker failed (%r); stopping the server", why)
    stop.set()


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
