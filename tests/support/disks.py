"""A real small disk for the full-disk tests: a tmpfs mounted for one test, and a filler file on it
that takes its free space away and gives it back.

Theory of operation: a full disk is caused for real, never mocked. `mount_tmpfs`
mounts a tmpfs of a few MiB (mounting needs root; without it the test skips), and `Disk.fill`
takes its free space with `posix_fallocate` and then byte writes into the filler's last page, so
the next write of the broker's own files meets ENOSPC (or RocksDB's "No space left on device").
The `mount` fixture (tests/conftest.py) unmounts whatever a test mounted.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from chronoq.store.diskspace import free_bytes

MiB = 1024 * 1024
PAGE = 4096


class Disk:
    """A tmpfs mounted for one test, and a filler file to take its free space away."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def free(self) -> int:
        return free_bytes(self.root)

    def fill(self, leave_bytes: int = 0) -> None:
        """Take free space until `leave_bytes` are left (all of it by default)."""
        want = self.free() - leave_bytes
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if want > 0:
                os.posix_fallocate(fd, size, want)
            if leave_bytes == 0:  # the filler's own last page, and anything freed meanwhile
                os.lseek(fd, 0, os.SEEK_END)
                for chunk in (b"\0" * PAGE, b"\0"):
                    try:
                        while True:
                            os.write(fd, chunk)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        assert self.free() <= leave_bytes

    def give_back(self, nbytes: int) -> None:
        """Free `nbytes` (whole pages) from the filler."""
        size = self.filler.stat().st_size
        os.truncate(self.filler, max(0, (size - nbytes) // PAGE * PAGE))

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)


def mount_tmpfs(path: Path, size_bytes: int) -> Disk:
    """Mount a tmpfs of `size_bytes` at `path` (made if missing); skip the test without root."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    return Disk(path)


def unmount(path: Path) -> None:
    """Unmount `path`, lazily if something still holds it."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
