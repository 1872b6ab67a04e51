"""A blocking caller of chronoq's JSON admin service, for Spark tasks.

Theory of operation: Spark's Python tasks are plain blocking code, one connection per task. The
SDK's `Admin` runs an event-loop thread per client and shapes replies into its own types, which
drop fields the pipeline needs (a record's commit-log `position`). This caller sends the request
dict and returns the reply dict as the server wrote it; errors become the `chronoq.errors` class
the broker raised, through the SDK's one conversion point (`chronoq.client.wire.admin_result`).
"""

from __future__ import annotations

import json
from typing import Any

ADMIN_SERVICE = "chronoq.admin.v1.Admin"
DEFAULT_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def _decode(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"))


class JsonAdmin:
    def __init__(self, server: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import grpc

        self.server = server
        self.timeout_s = timeout_s
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.insecure_channel(server, options=options)
        self._calls: dict[str, Any] = {}

    def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        import grpc

        from chronoq.client.errors import ServerUnavailable
        from chronoq.client.wire import admin_result

        stub = self._calls.get(method)
        if stub is None:
            stub = self._channel.unary_unary(f"/{ADMIN_SERVICE}/{method}", request_serializer=_encode,
                                             response_deserializer=_decode)
            self._calls[method] = stub
        try:
            reply = stub(body, timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            raise ServerUnavailable(self.server, f"{method}: {e.code().name} {e.details()}") from None
        return admin_result(method, reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> JsonAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
