"""What a server needs to know of the network before it serves: gRPC's request size limit,
how an address is written, and why a port cannot be bound.

Theory of operation: plain functions over the configuration and the socket API, with no server
of their own, so the gRPC side (`server/serve.py`, `server/admin_service.py`) and the HTTP side
(`http/server.py`) share them without importing one another.
"""

from __future__ import annotations

import errno
import socket

from chronoq.config import Config

REQUEST_OVERHEAD_BYTES = 1024 * 1024
"""Room for protobuf/JSON framing above the payload limit in one request."""


def max_request_bytes(config: Config) -> int:
    """gRPC's receive limit: one batch of messages at the message limit, base64 (admin JSON)
    included. Larger requests are refused by gRPC itself with RESOURCE_EXHAUSTED."""
    return 2 * config.max_message_size_bytes + REQUEST_OVERHEAD_BYTES


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind_failure(host: str, port: int) -> str:
    """Why a port cannot be bound, found by binding it with a plain socket the way gRPC does
    (gRPC's own error only says "Failed to bind")."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} ({exc.strerror})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"port {port} is in use (another chronoq serve, or another program); choose another --port"
                if exc.errno == errno.EACCES:
                    return f"no permission to bind port {port} (ports below 1024 need root); choose another --port"
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this machine; choose another --host"
                return exc.strerror or str(exc)
    return "gRPC could not bind it (set GRPC_VERBOSITY=debug for gRPC's own log)"
