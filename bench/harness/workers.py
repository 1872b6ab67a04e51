"""Producer and consumer worker processes: one loop each, the same for every system.

Theory of operation: the harness starts each worker with multiprocessing's spawn context (a fresh
interpreter, nothing inherited from the harness's threads) and hands it a plain dict spec; the
worker writes its result as JSON to `out_path` and exits, so a worker that dies leaves no result
rather than a half-truth. Producers connect, then wait at a barrier shared with the harness so
process start-up is not counted, stamp each message's due time as it is sent (now + its delay, or
the one absolute `due_at_ms` of a burst), and optionally pace themselves to a fixed rate. The
consumer stamps the receive time as the batch arrives, before it acks, and stops when it has seen
every expected id, when its deadline passes, on SIGTERM (it still writes what it has), or when its
client fails (the server died): it records the error and exits. It also reports its own CPU from
the moment its client is open (`cpu_s`, threads included): a consumer shares the host's
cores with the server, so what the client spends per message bounds delivery as much as the
server does.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bench.harness.workload import decode_body, encode_body, iter_delays_ms, message_id, producer_share
from bench.peers.base import Msg, load_peer

RECEIVE_WAIT_S = 0.2
START_BARRIER_TIMEOUT_S = 120.0


def now_ms() -> float:
    return time.time() * 1000.0


def producer_main(system: str, addr: dict[str, Any], spec: dict[str, Any], out_path: str, start: Any) -> None:
    result = asyncio.run(_produce(system, addr, spec, start))
    Path(out_path).write_text(json.dumps(result))


async def _produce(system: str, addr: dict[str, Any], spec: dict[str, Any], start: Any) -> dict[str, Any]:
    peer = load_peer(system)
    client = peer.producer(addr)
    count = producer_share(spec["delays"], spec["producer"], spec["producers"])
    delays = iter_delays_ms(spec["delays"], spec["producer"], spec["producers"])
    tag, index, mode = spec["tag"], spec["producer"], spec["mode"]
    chunk = int(spec["chunk"])
    max_chunk = int(spec.get("max_chunk") or chunk)
    rate = float(spec.get("rate") or 0.0)
    max_s = float(spec.get("max_seconds") or 0.0)
    due_at_ms = spec.get("due_at_ms")
    sent = 0
    progress: list[tuple[float, int]] = []
    error = None
    await client.open()
    start.wait(START_BARRIER_TIMEOUT_S)  # every producer and the harness; nothing else runs on this loop yet
    t0 = time.time()
    try:
        while sent < count:
            if max_s and time.time() - t0 >= max_s:
                break
            size = chunk
            if rate:
                # Pace by the schedule, not by sleeps: when a call took longer than its share, the
                # next one carries everything now due (up to max_chunk), so a system whose calls are
                # slow but batch well still sustains the rate.
                ahead_s = t0 + sent / rate - time.time()
                if ahead_s > 0:
                    await asyncio.sleep(ahead_s)
                due_now = int((time.time() - t0) * rate) + 1
                size = min(max(chunk, due_now - sent), max_chunk)
            base_ms = now_ms()
            msgs = []
            for i in range(sent, min(sent + size, count)):
                mid = message_id(tag, index, i)
                due = int(due_at_ms) if due_at_ms is not None else int(base_ms + next(delays))
                msgs.append(Msg(mid, due, encode_body(mid, due)))
            if mode == "sync":
                for m in msgs:
                    # The time cap holds within a chunk too: at 200 ms a send, one chunk is a minute.
                    if max_s and time.time() - t0 >= max_s:
                        break
                    await client.send_one(m)
                    sent += 1  # in order, so the first `sent` ids are the acknowledged ones
            else:
                await client.send_many(msgs)
                sent += len(msgs)
            progress.append((round(time.time() - t0, 3), sent))
    except Exception:
        error = traceback.format_exc(limit=4)
    t1 = time.time()
    try:
        await client.close()
    except Exception:
        pass
    return {"producer": index, "tag": tag, "mode": mode, "sent": sent, "t_start_s": t0, "t_end_s": t1,
            "progress": progress, "error": error}


def consumer_main(system: str, addr: dict[str, Any], spec: dict[str, Any], out_path: str) -> None:
    result = asyncio.run(_consume(system, addr, spec))
    Path(out_path).write_text(json.dumps(result))


async def _consume(system: str, addr: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    peer = load_peer(system)
    # A plain signal handler, not the loop's: a blocking client never yields to the event loop, and
    # the flag must still be seen after its current call returns.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())
    expected = int(spec["expected"])
    deadline_s = float(spec["deadline_s"])
    seen: set[str] = set()
    received: list[tuple[str, int, float]] = []
    error = None
    client = peer.consumer(addr)
    cpu_start_s: float | None = None
    try:
        await client.open()
        cpu_start_s = _cpu_s()
        while not stop.is_set() and len(seen) < expected and time.time() < deadline_s:
            got = await client.receive(RECEIVE_WAIT_S)
            t = now_ms()
            for body, _token in got:
                mid, due = decode_body(body)
                seen.add(mid)
                received.append((mid, due, round(t, 3)))
            if got:
                await client.ack([token for _body, token in got])
    except Exception:
        error = traceback.format_exc(limit=4)
    try:
        await asyncio.wait_for(client.close(), 5)
    except Exception:
        pass
    cpu_s = None if cpu_start_s is None else round(_cpu_s() - cpu_start_s, 3)
    return {"received": received, "error": error, "stopped_by_signal": stop.is_set(),
            "client_stats": {**(client.stats() or {}), "cpu_s": cpu_s}}


def _cpu_s() -> float:
    """This process's CPU (user + system, every thread: the gRPC client's poller included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
