"""A real chronoq gRPC server with auth, in process, for the auth and hostile-input tests.

Real parts only: a RocksDB-backed `Broker` in a temp directory, a `grpc.aio` server on a free
loopback port with both services behind one `Authenticator`, and chronoq's SDK as the client.
`USERS` is the table the tests share: `orders-app` (publish orders and payments-*, subscribe
orders, group billing) and `ops` (admin).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from chronoq.broker import Broker
from chronoq.client import AsyncConsumer, AsyncProducer
from chronoq.config import Config
from chronoq.server.admin_service import AdminService
from chronoq.server.auth import AuthConfig, Authenticator, User
from chronoq.server.grpc_service import MessagingService
from chronoq.server.serve import server_options
from tests.support.brokers import open_broker

SECRET = "s3cret"
USERS = (
    User("orders-app", SECRET, publish=("orders", "payments-*"), subscribe=("orders",), groups=("billing",)),
    User("ops", "0ps-secret", admin=True),
)
AUTH = AuthConfig(enabled=True, users=USERS)


class Server:
    def __init__(self, broker: Broker, address: str, messaging: MessagingService) -> None:
        self.broker, self.address, self.messaging = broker, address, messaging

    def producer(self, ak: str | None = "orders-app", sk: str | None = SECRET) -> AsyncProducer:
        return AsyncProducer(self.address, access_key=ak or "", secret_key=sk or "", timeout_ms=5000, send_attempts=1)

    def consumer(self, group: str, topic: str, ak: str = "orders-app", sk: str = SECRET) -> AsyncConsumer:
        return AsyncConsumer(group, topic, server=self.address, access_key=ak, secret_key=sk, timeout_ms=5000)

    def stored(self, topic: str) -> int:
        if topic not in {t.name for t in self.broker.list_topics()}:
            return 0
        return sum(self.broker.queue_offsets(topic, q)[1] for q in range(self.broker.get_topic(topic).queue_count))


@contextlib.asynccontextmanager
async def running(tmp_path: Path, auth: AuthConfig = AUTH) -> AsyncIterator[Server]:
    config = Config(data_dir=tmp_path / "data")
    broker = await open_broker(config)
    server = grpc.aio.server(options=server_options(config))
    try:
        port = server.add_insecure_port("127.0.0.1:0")
        authenticator = Authenticator(auth)
        messaging = MessagingService(broker, config, advertised=None, port=port, authenticator=authenticator)
        server.add_generic_rpc_handlers((messaging.generic_handler(), messaging.batch_receive_handler(),
                                         AdminService(broker, config, authenticator).generic_handler()))
        await server.start()
        yield Server(broker, f"127.0.0.1:{port}", messaging)
    finally:
        await server.stop(0)
        await broker.close()
