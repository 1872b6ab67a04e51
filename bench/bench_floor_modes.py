"""Benchmark: would another grpcio server mode move the floor's batched SendMessage?

Theory of operation: issue 11 asks, where the floor itself stands between chronoq and a goal, what
would move the floor. The batched-accept goal (at least 1.0x Redis pipelined) is one: the floor, which
stores nothing, reaches about half of Redis here. This script serves the floor's SendMessage
handler (`bench/peers/floor_server.py`'s: each request decoded, each message held on a heap, a
response built per call) in a server process of each mode, and drives it with `--producers`
client processes that each keep `--window` calls of `--batch` messages in flight for
`--seconds`. The requests are encoded once before timing, so the clients spend little; server
CPU is the server process's user + system time over the timed span (psutil).

Modes: `aio` (grpc.aio, as the floor and chronoq run), `sync` (grpcio's thread-pool server,
`--threads` workers), `sync-1` (the same with one worker: no lock hand-offs between workers), and
`redis`, the benchmark's Redis peer (`bench/peers/redis_zset.py`: AOF fsynced every second) driven
the same way, each client pipelining `--batch` ZADDs per round trip with redis-py, as that peer's
producer does, so the rows compare servers under clients of similar cost.

    PYTHONPATH=. .venv/bin/python bench/bench_floor_modes.py --modes aio,sync,sync-1,redis
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"
OK = 20000
"""apache.rocketmq.v2.Code.OK."""
SERVICE = "apache.rocketmq.v2.MessagingService"


def serve(mode: str, port: int, threads: int, ready: Any) -> None:
    import grpc
    from rocketmq.grpc_protocol import service_pb2 as svc

    from bench.peers.floor_server import FloorService

    send = FloorService("127.0.0.1", port).send_message  # the floor's own handler body
    if mode == "aio":
        serve_aio(send, port, ready)
        return
    sync_handler = grpc.unary_unary_rpc_method_handler(
        lambda request, context: send(request), request_deserializer=svc.SendMessageRequest.FromString,
        response_serializer=svc.SendMessageResponse.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1 if mode == "sync-1" else threads))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"SendMessage": sync_handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def serve_aio(send: Any, port: int, ready: Any) -> None:
    """Serve `send` (a SendMessageRequest to its response) as SendMessage on grpc.aio until killed."""
    import grpc
    from rocketmq.grpc_protocol import service_pb2 as svc

    async def run() -> None:
        async def send_async(request: Any, context: Any) -> Any:
            return send(request)

        handler = grpc.unary_unary_rpc_method_handler(
            send_async, request_deserializer=svc.SendMessageRequest.FromString,
            response_serializer=svc.SendMessageResponse.SerializeToString)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"SendMessage": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(run())


def encoded_requests(n: int, batch: int, producer: int) -> list[bytes]:
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as svc

    due_s = int(time.time()) + 3600
    out = []
    for r in range(n):
        msgs = []
        for i in range(batch):
            m = pb.Message(body=b"x" * 48)
            m.topic.name = "floor-modes"
            sp = m.system_properties
            sp.message_id = f"p{producer}r{r}m{i}"
            sp.message_type = pb.DELAY
            sp.body_encoding = pb.IDENTITY
            sp.delivery_timestamp.seconds = due_s
            sp.born_timestamp.seconds = due_s - 3600
            msgs.append(m)
        out.append(svc.SendMessageRequest(messages=msgs).SerializeToString())
    return out


def produce(port: int, batch: int, window: int, seconds: float, producer: int, start: Any, out: Any,
            redis: bool = False) -> None:
    if redis:
        produce_redis(port, batch, seconds, producer, start, out)
        return
    import grpc
    from rocketmq.grpc_protocol import service_pb2 as svc

    def stored(reply: bytes) -> int:
        """What a reply says was stored: a sent message counts only once its OK entry is back."""
        entries = svc.SendMessageResponse.FromString(reply).entries
        return sum(1 for e in entries if e.status.code == OK)

    requests = encoded_requests(400, batch, producer)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(METHOD)  # bytes in, bytes out: the client decodes nothing
    call(requests[0], timeout=10)  # connected before timing
    start.wait()
    sent = 0
    deadline = time.monotonic() + seconds
    i = 0
    inflight: list[Any] = []
    while time.monotonic() < deadline:
        while len(inflight) < window:
            inflight.append(call.future(requests[i % len(requests)], timeout=30))
            i += 1
        sent += stored(inflight.pop(0).result())
    for f in inflight:
        sent += stored(f.result())
    channel.close()
    out.put(sent)


def produce_redis(port: int, batch: int, seconds: float, producer: int, start: Any, out: Any) -> None:
    import redis

    from bench.peers.redis_zset import KEY

    due_ms = int(time.time() * 1000) + 3_600_000
    pad = b"x" * 40
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    client.ping()
    start.wait()
    sent = 0
    deadline = time.monotonic() + seconds
    r = 0
    while time.monotonic() < deadline:
        pipe = client.pipeline(transaction=False)
        for i in range(batch):  # members unique over the run, so every ZADD adds one
            pipe.zadd(KEY, {b"p%dr%dm%d" % (producer, r, i) + pad: due_ms})
        sent += sum(1 for added in pipe.execute() if added == 1)  # ZADD's count of new members
        r += 1
    client.close()
    out.put(sent)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import psutil

    from bench.harness.procs import free_port
    from bench.peers.base import load_peer

    ctx = multiprocessing.get_context("spawn")
    ready, start, out = ctx.Event(), ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="floor-modes-") as tmp:
        if mode == "redis":
            peer = load_peer("redis")
            reason = peer.check()
            if reason is not None:
                return {"mode": mode, "error": reason}
            server = peer.start(Path(tmp) / "data", Path(tmp) / "logs")
            port, procs, stop = server.addr["port"], server.tree(), server.stop
        else:
            port = free_port()
            child = ctx.Process(target=serve, args=(mode, port, args.threads, ready), daemon=True)
            child.start()
            if not ready.wait(30):
                child.kill()
                raise RuntimeError(f"{mode} server did not start")
            procs = [psutil.Process(child.pid)]

            def stop() -> None:
                child.kill()
                child.join(5)
        try:
            time.sleep(0.3)
            clients = [ctx.Process(target=produce, args=(port, args.batch, args.window, args.seconds, p, start, out,
                                                         mode == "redis"))
                       for p in range(args.producers)]
            for c in clients:
                c.start()
            time.sleep(3)  # the clients encode their requests and connect
            c0 = sum(t.user + t.system for t in (p.cpu_times() for p in procs))
            t0 = time.monotonic()
            start.set()
            sent = sum(out.get(timeout=args.seconds + 60) for _ in clients)
            wall = time.monotonic() - t0
            cpu = sum(t.user + t.system for t in (p.cpu_times() for p in procs)) - c0
            for c in clients:
                c.join(10)
            return {"mode": mode, "messages": sent, "wall_s": round(wall, 2), "msgs_per_s": round(sent / wall),
                    "server_cpu_us_per_msg": round(cpu * 1e6 / sent, 2)}
        finally:
            stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="aio,sync,sync-1,redis")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=8, help="workers of the `sync` mode's thread pool")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "floor_modes.json"))
    args = ap.parse_args(argv)
    rows = [run_mode(m, args) for m in args.modes.split(",")]
    print("| mode | messages/s | server CPU µs per message |\n|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | not run: {r['error']} | |")
        else:
            print(f"| {r['mode']} | {r['msgs_per_s']:,} | {r['server_cpu_us_per_msg']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "command": " ".join(sys.argv), "args": vars(args), "rows": rows}, indent=2))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
