"""Probe: the fdatasync tail of small appends, alone or beside another writer on the same filesystem.

Theory of operation: the main process appends 2,000 bytes to a log file and calls fdatasync,
every 2 ms, for SECONDS, and prints the latencies' percentiles. With MB_PER_S above 0 a second
process appends 4 KiB writes, buffered, to another file at that rate (what RocksDB's WAL and the
consume queues do beside the commit log); with `srf` it also calls sync_file_range(WRITE) after
each MiB, as RocksDB's `wal_bytes_per_sync` would. With `prezeroed` the log is first written
with 256 MiB of zeros and fsynced, and then overwritten from its start, so its writes change
neither its size nor its block map (what a pre-zeroed commit-log segment would give).

    python fsync_tail.py /tmp 60 0 no               # alone
    python fsync_tail.py /tmp 60 3 no               # beside a 3 MB/s writer
    python fsync_tail.py /tmp 60 3 srf              # the writer calls sync_file_range each MiB
    python fsync_tail.py /tmp 60 3 no prezeroed     # the log pre-zeroed

(Tidied for reading after the runs in `fsync_tail.txt`; the loop is the same.)
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import sys
import tempfile
import time

SYNC_FILE_RANGE_WRITE = 2
CHUNK = 4096
MIB = 1 << 20


def writer(directory: str, stop: mp.synchronize.Event, mb_per_s: float, srf: bool) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(os.path.join(directory, "other"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    chunk = b"w" * CHUNK
    n = 0
    synced = 0
    t0 = time.monotonic()
    while not stop.is_set():
        os.write(fd, chunk)
        n += 1
        written = n * CHUNK
        if srf and written - synced >= MIB:
            libc.sync_file_range(fd, ctypes.c_longlong(synced), ctypes.c_longlong(written - synced),
                                 SYNC_FILE_RANGE_WRITE)
            synced = written
        ahead = written / (mb_per_s * 1e6) - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)


def open_log(directory: str, prezeroed: bool) -> int:
    path = os.path.join(directory, "log")
    if not prezeroed:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    zeros = b"\0" * MIB
    for _ in range(256):
        os.write(fd, zeros)
    os.fsync(fd)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def main() -> None:
    root, seconds, mb_per_s, srf = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "srf"
    prezeroed = len(sys.argv) > 5 and sys.argv[5] == "prezeroed"
    directory = tempfile.mkdtemp(dir=root)
    stop = mp.Event()
    other = None
    if mb_per_s:
        other = mp.Process(target=writer, args=(directory, stop, mb_per_s, srf))
        other.start()
    fd = open_log(directory, prezeroed)
    latencies: list[float] = []
    slow: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        os.write(fd, b"r" * 2000)
        t = time.monotonic()
        os.fdatasync(fd)
        ms = (time.monotonic() - t) * 1000
        latencies.append(ms)
        if ms > 50:
            slow.append(round(ms))
        time.sleep(0.002)
    os.close(fd)
    stop.set()
    if other is not None:
        other.join()
    latencies.sort()

    def q(f: float) -> float:
        return latencies[min(len(latencies) - 1, int(f * len(latencies)))]

    how = (" +sync_file_range/MiB" if srf else "") + (" log pre-zeroed" if prezeroed else "")
    print(f"{seconds:.0f} s, other writer {mb_per_s} MB/s{how}: {len(latencies)} fdatasyncs, p50 {q(.5):.2f} "
          f"p99 {q(.99):.2f} p999 {q(.999):.2f} max {latencies[-1]:.1f} ms; over 50 ms: {slow}", flush=True)


if __name__ == "__main__":
    main()
