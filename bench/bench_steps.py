"""Benchmark: server CPU per message for each RPC of the message path, through gRPC.

Theory of operation: one server process (`chronoq serve` on a fresh temporary directory, or any
command that serves `apache.rocketmq.v2.MessagingService` on a port, `--serve`) and this process
as the only client, with the generated RocketMQ v2 stubs (what the official clients send). Four
steps, each measured as the server process's CPU time (user + system, from /proc via psutil,
threads included) divided by the messages it handled:
  send     N timer messages in SendMessage requests of `--batch`, due a few seconds ahead;
  fire     nothing asked of the server while they come due: its timer loop;
  receive  once due, ReceiveMessage long polls of 32 (one streamed response per message) until
           all N arrived;
  ack      AckMessage requests of 32 entries;
  one      `--one` SendMessage requests of a single message (the unary floor of the protocol).
The client runs one request at a time, so the figures are the server's cost per message, not
its throughput. Compare a server that stores nothing (`bench/peers/floor.py`) with the same
command to see what chronoq adds to the protocol's own cost in Python here.

    .venv/bin/python bench/bench_steps.py --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil
from rocketmq.grpc_protocol import definition_pb2 as definition
from rocketmq.grpc_protocol import service_pb2 as service
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "steps"
GROUP = "steps-g"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _message(i: int, due_ms: int) -> definition.Message:
    msg = definition.Message(topic=definition.Resource(name=TOPIC), body=b"x" * 100)
    sp = msg.system_properties
    sp.message_id = f"M{i:012d}"
    sp.body_encoding = definition.IDENTITY
    sp.message_type = definition.DELAY
    sp.delivery_timestamp.seconds = due_ms  # milliseconds in `seconds`, as the Python client does
    return msg


async def run(address: str, n: int, batch: int, one: int, server: psutil.Process) -> dict[str, float]:
    out: dict[str, float] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        due_ms = int(time.time() * 1000) + 5_000 + n  # after the sends, so firing is not counted in them
        requests = [service.SendMessageRequest(messages=[_message(i, due_ms) for i in range(k, min(n, k + batch))])
                    for k in range(0, n, batch)]
        cpu = _cpu_s(server)
        for req in requests:
            resp = await stub.SendMessage(req, timeout=30)
            assert resp.status.code == definition.OK, resp.status
        out["send_us"] = (_cpu_s(server) - cpu) * 1e6 / n
        assert time.time() * 1000 < due_ms, "the sends took longer than the delay: raise it"
        cpu = _cpu_s(server)
        await asyncio.sleep(max(0.0, due_ms / 1000 - time.time()) + 1.0 + n / 20_000)
        out["fire_us"] = (_cpu_s(server) - cpu) * 1e6 / n  # the timer loop, nothing else asked of it
        handles: list[tuple[str, str]] = []
        receive = service.ReceiveMessageRequest(group=definition.Resource(name=GROUP), batch_size=32)
        receive.message_queue.topic.name = TOPIC
        receive.filter_expression.type = definition.TAG
        receive.filter_expression.expression = "*"
        receive.invisible_duration.seconds = 60
        receive.long_polling_timeout.seconds = 1
        cpu = _cpu_s(server)
        while len(handles) < n:
            async for r in stub.ReceiveMessage(receive, timeout=30):
                if r.WhichOneof("content") == "message":
                    handles.append((r.message.system_properties.message_id, r.message.system_properties.receipt_handle))
        out["receive_us"] = (_cpu_s(server) - cpu) * 1e6 / n
        cpu = _cpu_s(server)
        for k in range(0, n, 32):
            ack = service.AckMessageRequest(group=definition.Resource(name=GROUP),
                                            topic=definition.Resource(name=TOPIC))
            for mid, handle in handles[k:k + 32]:
                ack.entries.add(message_id=mid, receipt_handle=handle)
            resp = await stub.AckMessage(ack, timeout=30)
            assert resp.status.code == definition.OK, resp.status
        out["ack_us"] = (_cpu_s(server) - cpu) * 1e6 / n
        cpu = _cpu_s(server)
        for i in range(one):
            resp = await stub.SendMessage(service.SendMessageRequest(messages=[_message(n + i, due_ms + 3_600_000)]),
                                          timeout=30)
            assert resp.status.code == definition.OK, resp.status
        out["one_request_us"] = (_cpu_s(server) - cpu) * 1e6 / max(one, 1)
    out["end_to_end_us"] = out["send_us"] + out["fire_us"] + out["receive_us"] + out["ack_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--one", type=int, default=2_000)
    parser.add_argument("--serve", default=None,
                        help="a command serving on {port} instead of chronoq serve (e.g. the floor stub)")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for the server (e.g. CHRONOQ_FLUSH=async)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "steps.json")
    args = parser.parse_args()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        if args.serve:
            cmd = args.serve.format(port=port, data=tmp).split()
        else:
            cmd = [sys.executable, "-m", "chronoq", "serve", "--data-dir", f"{tmp}/data", "--port", str(port),
                   "--log-level", "WARNING"]
        import os
        env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.1)
            if not args.serve:
                subprocess.run([sys.executable, "-c", "from chronoq.cli import main; main()", "--server",
                                f"127.0.0.1:{port}", "topics", "create", TOPIC, "--queues", "4"],
                               check=False, capture_output=True)
            result = asyncio.run(run(f"127.0.0.1:{port}", args.messages, args.batch, args.one,
                                     psutil.Process(proc.pid)))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result["command"] = " ".join(sys.argv)
    for key in ("send_us", "fire_us", "receive_us", "ack_us", "end_to_end_us", "one_request_us"):
        print(f"{key:16s} {result[key]:8.1f} us/message")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
