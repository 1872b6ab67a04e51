"""Probe: CPU (user + system, this process) and wall time of one small append + fdatasync.

What a one-message send with `flush = "sync"` cannot avoid: its group commit is one fdatasync
of a few hundred bytes appended. Run in a directory on the filesystem the broker's data is on.
`preallocated`: the same appends into a file already written and fsynced to 4 MiB, so the
fdatasync has no size or extent change to journal (not what the commit log does).

    .venv/bin/python docs/results/s28-bounds-20261127/fsync_cpu_probe.py DIR
"""

from __future__ import annotations

import os
import sys
import time

N = 2000
RECORD = b"x" * 300


def run(directory: str, preallocated: bool, sync: object) -> None:
    path = os.path.join(directory, "fsync-probe.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if preallocated:
            os.write(fd, b"\0" * (4 << 20))
            os.fsync(fd)
            os.lseek(fd, 0, os.SEEK_SET)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(N):
            os.write(fd, RECORD)
            sync(fd)  # type: ignore[operator]
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        os.close(fd)
        os.remove(path)
    print(f"| {'preallocated' if preallocated else 'appended'} | {sync.__name__} "  # type: ignore[attr-defined]
          f"| {cpu / N * 1e6:.1f} | {wall / N * 1e6:.1f} |")


if __name__ == "__main__":
    print("| file | call | CPU µs per call | wall µs per call |\n|---|---|---|---|")
    for pre in (False, True):
        for call in (os.fdatasync, os.fsync):
            run(sys.argv[1], pre, call)
