"""The floor: a RocketMQ v2 MessagingService that stores nothing durable, to measure the protocol.

Theory of operation: this is the least a server speaking chronoq's protocol in Python with
grpc.aio can do per message, so the benchmark can say how far chronoq is from that limit. Each
request protobuf is decoded and each response protobuf built per call, exactly as a real server
must; between the two there is only a list and a heap in memory:
* SendMessage and the admin SendBatch (JSON) push each message onto a heap keyed by its due time;
* one fire task sleeps until the earliest due time and moves what is due to a ready deque (the
  "fire": `Stats` counts what is still on the heap as pending timers, as chronoq does);
* ReceiveMessage long-polls the ready deque and streams status OK, one response per message (the
  protocol has no batch response), then the delivery timestamp; or a single 40401 when nothing
  came within the poll;
* AckMessage answers OK for every entry and forgets: a message handed to a consumer is gone (no
  invisible duration, no redelivery), and ChangeInvisibleDuration answers OK with a new handle
  and changes nothing;
* QueryRoute (one queue, READ_WRITE, DELAY accepted), Heartbeat, NotifyClientTermination, and the
  admin CreateTopic, ListTopics and Stats answer what the chronoq SDK needs to work.
Everything else is UNIMPLEMENTED (no handler). There is no disk, no dedupe, no validation beyond
what decoding does, no metrics; a restart loses everything.

What it may touch: grpc, the generated `rocketmq.grpc_protocol` message modules and the standard
library. It imports nothing from chronoq (it must measure the protocol, not chronoq's code) nor
from the bench harness, so `python -m bench.peers.floor_server` is the whole server.

The core (`Floor`) does no I/O and never reads the clock (times arrive as `now_ms`); the grpc
shell (`FloorService`) owns the clock, the fire task and the long-poll wakeups. The handlers keep
what a request carried as decoded (the SendMessage protobuf itself) and convert only at delivery,
so the floor pays no conversion a leaner server could skip.

Where its CPU goes (py-spy and strace -c, on 2 cores): nearly all in grpc.aio, not
in the handlers (a few per cent). A unary call costs the server about 38 system calls (futex,
epoll_wait, write/read/recvfrom hand-offs between grpc's poller thread and the asyncio loop, one
sendmsg), about 600 us of CPU on 2 cores; each streamed ReceiveMessage response is its own sendmsg plus
its own hand-off, about 9 system calls and 140 us. So the floor per message is mostly calls per
message: full calls are cheap per message, a receive carrying a few messages is not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import hashlib
import heapq
import itertools
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as svc

SERVICE = "apache.rocketmq.v2.MessagingService"
ADMIN_SERVICE = "chronoq.admin.v1.Admin"
READY_LINE = "floor serving on"
OK = 20000
BAD_REQUEST = 40000
MESSAGE_NOT_FOUND = 40401
PROP_TIMER_DELAY_MS = "TIMER_DELAY_MS"
"""The user property chronoq's SDK sends a relative delay in (`delay=`); the server's clock adds it."""
MAX_RECEIVE_BATCH = 64
"""chronoq's default `max_receive_batch`, so both servers stream the same number per call."""
DEFAULT_RECEIVE_BATCH = 32
LONG_POLL_DEADLINE_MARGIN_MS = 1000
"""Answer a long poll this long before the client's deadline, as chronoq does."""
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
SHUTDOWN_GRACE_S = 1.0
ALL_TYPES = ("NORMAL", "FIFO", "DELAY", "TRANSACTION")


@dataclass(slots=True)
class Entry:
    """A message from the admin SendBatch, decoded from its JSON object."""

    topic: str
    body: bytes
    message_id: str
    tag: str
    keys: list[str]
    properties: dict[str, str]


@dataclass(slots=True)
class Held:
    """One accepted message. `message` is what the request carried, kept as decoded: the
    SendMessage protobuf itself, or an `Entry` from SendBatch; a delivery builds its response
    from it (no conversion at accept time that a delivery could do instead)."""

    message: Any
    due_ms: int
    store_ms: int
    offset: int
    timer: bool


class Floor:
    """The in-memory core: accept, fire, take. No I/O, no clock."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Held]] = []
        self.ready: collections.deque[Held] = collections.deque()
        self.topics: dict[str, int] = {}
        """Topic name -> creation time (ms)."""
        self._offsets = itertools.count()
        self.accepted = 0
        self.delivered = 0

    def accept(self, message: Any, due_ms: int | None, now_ms: int) -> tuple[int, bool]:
        """Hold one message; returns its offset and whether it is now the earliest pending timer."""
        offset = next(self._offsets)
        due = due_ms if due_ms is not None else now_ms
        earliest = not self.heap or due < self.heap[0][0]
        heapq.heappush(self.heap, (due, offset, Held(message, due, now_ms, offset, due_ms is not None)))
        self.accepted += 1
        return offset, earliest

    def next_due_ms(self) -> int | None:
        return self.heap[0][0] if self.heap else None

    def fire(self, now_ms: float) -> int:
        """Move every message due at `now_ms` from the heap to the ready deque."""
        moved = 0
        heap = self.heap
        while heap and heap[0][0] <= now_ms:
            self.ready.append(heapq.heappop(heap)[2])
            moved += 1
        return moved

    def take(self, n: int) -> list[Held]:
        got = [self.ready.popleft() for _ in range(min(n, len(self.ready)))]
        self.delivered += len(got)
        return got

    def create_topic(self, name: str, now_ms: int) -> bool:
        if name in self.topics:
            return False
        self.topics[name] = now_ms
        return True


# -- protobuf and JSON helpers (pure) -------------------------------------------------------------


def _ts(ms: int) -> dict[str, int]:
    seconds, rest = divmod(ms, 1000)
    return {"seconds": seconds, "nanos": rest * 1_000_000}


def _ms(ts: Any) -> int:
    return int(ts.seconds) * 1000 + int(ts.nanos) // 1_000_000


def _status(code: int = OK, message: str = "OK") -> dict[str, Any]:
    return {"code": code, "message": message}


def _set_ms(target: Any, ms: int) -> None:
    target.seconds, rest = divmod(ms, 1000)
    target.nanos = rest * 1_000_000


def due_ms_of(m: pb.Message, now_ms: int) -> int | None:
    """A SendMessage message's due time: its delivery timestamp, or now + the SDK's delay property."""
    sp = m.system_properties
    if sp.HasField("delivery_timestamp"):
        return _ms(sp.delivery_timestamp)
    delay = m.user_properties.get(PROP_TIMER_DELAY_MS)
    return now_ms + int(delay) if delay and delay.isdigit() else None


def delivered_message(held: Held, invisible_ms: int) -> svc.ReceiveMessageResponse:
    """The response carrying one message, built per delivery with what the official clients need:
    a receipt handle, a delivery attempt and an MD5 body digest (shared/notes/rocketmq-grpc-facts.md).
    A SendMessage message is copied as it came (upb copies in C) and the delivery fields set on the
    copy; a SendBatch entry is built in one constructor call from plain dicts."""
    m = held.message
    if isinstance(m, Entry):
        system: dict[str, Any] = {
            "message_id": m.message_id, "keys": m.keys, "body_encoding": pb.IDENTITY,
            "message_type": pb.DELAY if held.timer else pb.NORMAL, "born_timestamp": _ts(held.store_ms),
        }
        if m.tag:
            system["tag"] = m.tag
        if held.timer:
            system["delivery_timestamp"] = _ts(held.due_ms)
        resp = svc.ReceiveMessageResponse(message={"topic": {"name": m.topic}, "user_properties": m.properties,
                                                   "system_properties": system, "body": m.body})
    else:
        resp = svc.ReceiveMessageResponse(message=m)
        if held.timer and not m.system_properties.HasField("delivery_timestamp"):  # a delay the server added
            _set_ms(resp.message.system_properties.delivery_timestamp, held.due_ms)
    sp = resp.message.system_properties
    sp.receipt_handle = f"{held.offset:x}"
    sp.queue_offset = held.offset
    sp.delivery_attempt = 1
    sp.store_host = "floor"
    sp.body_digest.type = pb.MD5
    sp.body_digest.checksum = hashlib.md5(resp.message.body).hexdigest().upper()
    _set_ms(sp.store_timestamp, held.store_ms)
    _set_ms(sp.invisible_duration, invisible_ms)
    return resp


def topic_json(name: str, created_ms: int) -> dict[str, Any]:
    return {"name": name, "queue_count": 1, "message_types": list(ALL_TYPES), "created_ms": created_ms}


def admin_error(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "error": "BadRequest", "retriable": False}


class FloorService:
    """The grpc.aio shell: decodes, calls `Floor`, encodes; owns the clock and the fire task."""

    def __init__(self, host: str, port: int) -> None:
        self.floor = Floor()
        self.host, self.port = host, port
        self.readable = asyncio.Event()
        """Set while the ready deque holds messages: what a long poll waits for."""
        self.earlier = asyncio.Event()
        """Set when a send makes the earliest due time earlier: the fire task sleeps too long."""
        self.calls: collections.Counter[str] = collections.Counter()
        """Requests per RPC, and messages or entries they carried ("<rpc> items"), for `Stats`: how
        full the calls were decides much of the cost per message."""

    @staticmethod
    def now_ms() -> int:
        return int(time.time() * 1000)

    # -- registration ---------------------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        unary: dict[str, tuple[Any, Any, Callable[[Any], Any]]] = {
            "QueryRoute": (svc.QueryRouteRequest, svc.QueryRouteResponse, self.query_route),
            "Heartbeat": (svc.HeartbeatRequest, svc.HeartbeatResponse, self.heartbeat),
            "SendMessage": (svc.SendMessageRequest, svc.SendMessageResponse, self.send_message),
            "AckMessage": (svc.AckMessageRequest, svc.AckMessageResponse, self.ack_message),
            "ChangeInvisibleDuration": (svc.ChangeInvisibleDurationRequest, svc.ChangeInvisibleDurationResponse,
                                        self.change_invisible),
            "NotifyClientTermination": (svc.NotifyClientTerminationRequest, svc.NotifyClientTerminationResponse,
                                        self.client_termination),
        }
        messaging: dict[str, grpc.RpcMethodHandler] = {
            name: grpc.unary_unary_rpc_method_handler(_unary(self.calls, name, body),
                                                      request_deserializer=req.FromString,
                                                      response_serializer=resp.SerializeToString)
            for name, (req, resp, body) in unary.items()
        }
        messaging["ReceiveMessage"] = grpc.unary_stream_rpc_method_handler(
            self.receive_message, request_deserializer=svc.ReceiveMessageRequest.FromString,
            response_serializer=svc.ReceiveMessageResponse.SerializeToString)
        admin_methods = {"CreateTopic": self.create_topic, "ListTopics": self.list_topics, "Stats": self.stats,
                         "SendBatch": self.send_batch}
        admin = {name: grpc.unary_unary_rpc_method_handler(_admin(self.calls, name, body))
                 for name, body in admin_methods.items()}
        return [grpc.method_handlers_generic_handler(SERVICE, messaging),
                grpc.method_handlers_generic_handler(ADMIN_SERVICE, admin)]

    # -- MessagingService -----------------------------------------------------------------------

    def query_route(self, request: svc.QueryRouteRequest) -> svc.QueryRouteResponse:
        self.floor.create_topic(request.topic.name, self.now_ms())
        endpoints = {"scheme": pb.IPv4, "addresses": [{"host": self.host, "port": self.port}]}
        queue = {"topic": {"name": request.topic.name}, "id": 0, "permission": pb.READ_WRITE,
                 "broker": {"name": "floor", "id": 0, "endpoints": endpoints},
                 "accept_message_types": [pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION]}
        return svc.QueryRouteResponse(status=_status(), message_queues=[queue])

    def heartbeat(self, request: Any) -> svc.HeartbeatResponse:
        return svc.HeartbeatResponse(status=_status())

    def client_termination(self, request: Any) -> svc.NotifyClientTerminationResponse:
        return svc.NotifyClientTerminationResponse(status=_status())

    def send_message(self, request: svc.SendMessageRequest) -> svc.SendMessageResponse:
        now = self.now_ms()
        self.calls["SendMessage items"] += len(request.messages)
        entries = []
        ok = _status()
        for m in request.messages:
            offset = self._accept(m, due_ms_of(m, now), now)
            entries.append({"status": ok, "message_id": m.system_properties.message_id, "offset": offset})
        return svc.SendMessageResponse(status=ok, entries=entries)

    def _accept(self, message: Any, due_ms: int | None, now_ms: int) -> int:
        offset, earliest = self.floor.accept(message, due_ms, now_ms)
        if earliest:
            self.earlier.set()
        return offset

    def ack_message(self, request: svc.AckMessageRequest) -> svc.AckMessageResponse:
        self.calls["AckMessage items"] += len(request.entries)
        entries = [{"message_id": e.message_id, "receipt_handle": e.receipt_handle, "status": _status()}
                   for e in request.entries]
        return svc.AckMessageResponse(status=_status(), entries=entries)

    def change_invisible(self, request: svc.ChangeInvisibleDurationRequest) -> svc.ChangeInvisibleDurationResponse:
        return svc.ChangeInvisibleDurationResponse(status=_status(), receipt_handle=request.receipt_handle + ".")

    async def receive_message(self, request: svc.ReceiveMessageRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[svc.ReceiveMessageResponse]:
        self.calls["ReceiveMessage"] += 1
        batch = min(request.batch_size or DEFAULT_RECEIVE_BATCH, MAX_RECEIVE_BATCH)
        wait_ms = _ms(request.long_polling_timeout)
        remaining_s = context.time_remaining()
        if remaining_s is not None:
            wait_ms = max(0, min(wait_ms, int(remaining_s * 1000) - LONG_POLL_DEADLINE_MARGIN_MS))
        deadline = time.monotonic() + wait_ms / 1000
        while not self.floor.ready:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left_s):
                    await self.readable.wait()
        got = self.floor.take(batch)
        self.calls["ReceiveMessage items"] += len(got)
        if not self.floor.ready:
            self.readable.clear()
        if not got:
            yield svc.ReceiveMessageResponse(status=_status(MESSAGE_NOT_FOUND, "no new message"))
            return
        invisible_ms = _ms(request.invisible_duration) or 30_000
        yield svc.ReceiveMessageResponse(status=_status())
        for held in got:
            yield delivered_message(held, invisible_ms)
        yield svc.ReceiveMessageResponse(delivery_timestamp=_ts(self.now_ms()))

    # -- the fire task --------------------------------------------------------------------------

    async def fire_loop(self) -> None:
        while True:
            self.earlier.clear()
            now = time.time() * 1000
            if self.floor.fire(now):
                self.readable.set()
            nxt = self.floor.next_due_ms()
            timeout_s = None if nxt is None else max(0.0, (nxt - now) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.earlier.wait()

    # -- admin (JSON) ---------------------------------------------------------------------------

    def create_topic(self, doc: dict[str, Any]) -> dict[str, Any]:
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            return admin_error(BAD_REQUEST, "'name' must be a non-empty string")
        self.floor.create_topic(name, self.now_ms())
        return {"code": OK, "message": "OK", "topic": topic_json(name, self.floor.topics[name])}

    def list_topics(self, doc: dict[str, Any]) -> dict[str, Any]:
        return {"code": OK, "message": "OK", "topics": [topic_json(n, c) for n, c in self.floor.topics.items()]}

    def stats(self, doc: dict[str, Any]) -> dict[str, Any]:
        f = self.floor
        return {"code": OK, "message": "OK", "now_ms": self.now_ms(), "accepted": f.accepted,
                "delivered": f.delivered, "calls": dict(self.calls),
                "timer": {"pending_total": len(f.heap), "ready": len(f.ready), "latencies": None}}

    def send_batch(self, doc: dict[str, Any]) -> dict[str, Any]:
        entries = doc.get("messages")
        if not isinstance(entries, list) or not entries:
            return admin_error(BAD_REQUEST, "'messages' must be a non-empty list")
        now = self.now_ms()
        self.calls["SendBatch items"] += len(entries)
        results: list[dict[str, Any]] = []
        for e in entries:
            try:
                due = e.get("deliver_at_ms")
                if due is None and e.get("delay_ms") is not None:
                    due = now + int(e["delay_ms"])
                entry = Entry(str(e["topic"]), base64.b64decode(e["body_b64"]), str(e.get("message_id") or ""),
                              str(e.get("tag") or ""), list(e.get("keys") or ()), dict(e.get("properties") or {}))
                offset = self._accept(entry, int(due) if due is not None else None, now)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                results.append({"error": admin_error(BAD_REQUEST, f"{type(exc).__name__}: {exc}")})
                continue
            if not entry.message_id:
                entry.message_id = f"floor-{offset}"
            results.append({"message_id": entry.message_id, "topic": entry.topic, "queue_id": 0,
                            "queue_offset": offset, "deliver_at_ms": due, "recall_handle": None,
                            "duplicate": False})
        return {"code": OK, "message": "OK", "results": results}


def _unary(calls: collections.Counter[str], name: str, body: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        calls[name] += 1
        return body(request)
    return handler


def _admin(calls: collections.Counter[str], name: str,
           body: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[bytes, Any], Any]:
    async def handler(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        calls[name] += 1
        try:
            doc = json.loads(data) if data else {}
        except ValueError as exc:
            return json.dumps(admin_error(BAD_REQUEST, f"not JSON: {exc}")).encode()
        reply = body(doc if isinstance(doc, dict) else {})
        return json.dumps(reply, separators=(",", ":")).encode()
    return handler


async def serve(host: str, port: int) -> None:
    service = FloorService(host, port)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(service.handlers())
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise SystemExit(f"cannot bind {host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{READY_LINE} {host}:{port}", flush=True)
    async with asyncio.TaskGroup() as tasks:
        fire = tasks.create_task(service.fire_loop(), name="fire")
        await stop.wait()
        await server.stop(SHUTDOWN_GRACE_S)
        fire.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.floor_server", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
