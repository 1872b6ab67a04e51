"""Probe: what would the batched accept cost if chronoq's rooms were one fused loop? (issue 11)

Theory of operation: issue 11's goal for the batched accept is server CPU per accepted timer at
most 2x the floor's send step. This probe puts an upper bound on what any redesign in Python
could reach. It serves, in one grpc.aio process, the floor's own SendMessage handler
(`bench/peers/floor_server.py`: each request decoded, each message held, a response built) and,
in the same handler, the work a durable timer accept cannot skip, written as one loop with no
object between steps: the id and due-time checks, a dedupe lookup and entry, a queue and offset,
the commit-log record (chronoq's 72-byte header, three system properties, CRC32C), one write and
one fdatasync of the log per request, a consume-queue entry, the three timer-index rows in one
RocksDB WriteBatch, and the recall handle. It leaves out everything else chronoq's accept does:
the group commit's thread and wake-ups, dispatch as a separate step, the read cache, metrics,
slot reservations, concurrent-duplicate waits, partial batches, per-message error results.

`bench/bench_floor_modes.py` drives it (its clients, its CPU accounting), mode `aio` being the
plain floor and `fused` this probe, in the same run:

    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/fused_floor_probe.py --modes aio,fused,aio,fused

`--in-process N` runs the fused accept alone, in this process, over N timers in batches of 100
(built before timing), and prints its process CPU a message: the figure to set beside
`accept_rooms.py run`'s for chronoq's rooms.

    PYTHONPATH=. .venv/bin/python docs/results/s29-bounds-20261127/fused_floor_probe.py --in-process 200000

Not a broker: no recovery, no reads. A bound, kept beside the figures it produced.
"""

from __future__ import annotations

import binascii
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_floor_modes  # noqa: E402

_REST = struct.Struct(">HBBB3xQQIQQHHHHIII")
_PREFIX = struct.Struct(">II")
_U16, _U32, _U64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_TIME_KEY, _ENTRY_HEAD = struct.Struct(">QQ"), struct.Struct(">BQIqIiq")
_FACTS_HEAD, _POS_HEAD = struct.Struct(">BqIq"), struct.Struct(">Bq")
_CQ_ENTRY, _RECALL_HEAD = struct.Struct(">QII"), struct.Struct(">BQ")
_URLSAFE = bytes.maketrans(b"+/", b"-_")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_TIMER_TOPIC = b"rmq_sys_wheel_timer"
MAX_DELAY_MS = 40 * 86_400_000


class FusedAccept:
    """The essential durable work of a batch of timers, in one loop."""

    def __init__(self, data: Path) -> None:
        import crc32c
        from rocksdict import Options, Rdict, WriteBatch, WriteOptions

        self.crc, self.WriteBatch = crc32c.crc32c, WriteBatch
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        self.db = Rdict(str(data / "index"), opts, column_families={"time": Options(raw_mode=True),
                                                                      "id": Options(raw_mode=True),
                                                                      "pos": Options(raw_mode=True)})
        self.cf = [self.db.get_column_family_handle(n) for n in ("time", "id", "pos")]
        self.write_opt = WriteOptions()
        self.log = os.open(data / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.cq = os.open(data / "cq", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.dedupe: dict[str, tuple[Any, ...]] = {}
        self.position = 0
        self.offsets = [0, 0, 0, 0]
        self.round_robin = 0

    def accept(self, batch: list[tuple[str, str, bytes, int]], now_ms: int) -> list[tuple[Any, ...]]:
        crc, cf_time, cf_id, cf_pos = self.crc, *self.cf
        wb = self.WriteBatch(raw_mode=True)
        put = wb.put
        blobs: list[bytes] = []
        cq: list[bytes] = []
        results: list[tuple[Any, ...]] = []
        position, offsets, dedupe = self.position, self.offsets, self.dedupe
        now_text = str(now_ms).encode()
        for topic, mid, body, due_ms in batch:
            if not mid or len(mid) > 128 or not _ID_CHARS.issuperset(mid):
                raise ValueError(f"bad message id {mid!r}")
            if due_ms - now_ms > MAX_DELAY_MS:
                raise ValueError(f"due {due_ms} too far")
            name = topic + "\x00" + mid
            known = dedupe.get(name)
            if known is not None:
                results.append(known)
                continue
            tp = topic.encode()
            queue = self.round_robin % 4
            self.round_robin += 1
            offset = offsets[queue]
            offsets[queue] = offset + 1
            m = mid.encode()
            due_text = str(due_ms).encode()
            sysprops = b"".join((b"\x00\x0aREAL_TOPIC", _U32.pack(len(tp)), tp,
                                 b"\x00\x0cTIMER_OUT_MS", _U32.pack(len(due_text)), due_text,
                                 b"\x00\x10TIMER_ENQUEUE_MS", _U32.pack(len(now_text)), now_text))
            rest = b"".join((_REST.pack(0xC4A0, 1, 1, 5, position, offset, queue, now_ms, now_ms, len(m),
                                        len(_TIMER_TOPIC), 0, 0, 0, len(sysprops), len(body)),
                             m, _TIMER_TOPIC, sysprops, body))
            blob = _PREFIX.pack(8 + len(rest), crc(rest)) + rest
            blobs.append(blob)
            size = len(blob)
            entry = _CQ_ENTRY.pack(position, size, 0)
            cq.append(entry + _U32.pack(crc(entry)))
            id_key = _U16.pack(len(m)) + m + _U16.pack(len(tp)) + tp + _U64.pack(position)
            put(_TIME_KEY.pack(due_ms, position),
                _ENTRY_HEAD.pack(2, position, size, now_ms, 0, -1, -1) + id_key[:-8] + b"\x00\x00", cf_time)
            put(id_key, _FACTS_HEAD.pack(2, due_ms, size, now_ms) + b"\x00\x00", cf_id)
            put(_U64.pack(position), _POS_HEAD.pack(1, due_ms) + id_key, cf_pos)
            raw = _RECALL_HEAD.pack(1, due_ms) + tp + b"\x00" + m
            handle = binascii.b2a_base64(raw + _U32.pack(crc(raw)), newline=False).translate(_URLSAFE)
            result = (mid, queue, offset, handle.rstrip(b"=").decode())
            dedupe[name] = result
            results.append(result)
            position += size
        os.write(self.log, b"".join(blobs))
        os.fdatasync(self.log)
        os.write(self.cq, b"".join(cq))
        self.db.write(wb, self.write_opt)
        self.position = position
        return results


def serve(mode: str, port: int, threads: int, ready: Any) -> None:
    """`bench_floor_modes.serve`, plus mode `fused`: the floor's handler and the fused accept."""
    if mode != "fused":
        bench_floor_modes.serve(mode, port, threads, ready)
        return
    from rocketmq.grpc_protocol import service_pb2 as svc

    from bench.peers.floor_server import FloorService

    floor = FloorService("127.0.0.1", port)
    fused = FusedAccept(Path(tempfile.mkdtemp(prefix="fused-probe-")))

    def send(request: Any) -> Any:
        now = floor.now_ms()
        floor.send_message(request)  # the floor's own work: each message decoded and held
        batch = []
        for m in request.messages:
            sp = m.system_properties
            ts = sp.delivery_timestamp
            batch.append((m.topic.name, sp.message_id, m.body, ts.seconds * 1000 + ts.nanos // 1_000_000))
        ok = {"code": bench_floor_modes.OK, "message": "OK"}
        return svc.SendMessageResponse(status=ok, entries=[
            {"status": ok, "message_id": mid, "offset": offset, "recall_handle": handle}
            for mid, _queue, offset, handle in fused.accept(batch, now)])

    bench_floor_modes.serve_aio(send, port, ready)


def in_process(n: int) -> None:
    now_ms = 1_800_000_000_000
    batches = [[("orders", f"m{i:08d}", b"b" * 100, now_ms + 60_000 + i) for i in range(start, min(n, start + 100))]
               for start in range(0, n, 100)]
    with tempfile.TemporaryDirectory(prefix="fused-probe-") as tmp:
        fused = FusedAccept(Path(tmp))
        cpu = time.process_time()
        for batch in batches:
            fused.accept(batch, now_ms)
        cpu = time.process_time() - cpu
    print(f"fused accept in process: {n} timers in batches of 100, process CPU {cpu / n * 1e6:.2f} µs a message")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--in-process":
        in_process(int(sys.argv[2]))
        raise SystemExit(0)
    bench_floor_modes.serve = serve  # run_mode starts `serve` by this name, in a spawned child
    raise SystemExit(bench_floor_modes.main())
