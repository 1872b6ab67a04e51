"""Every fsync the store makes, in one place, and what an error from one means.

Theory of operation: an fsync that fails may already have cost data. On Linux the writeback that
failed leaves its pages marked clean (or drops them) and reports the error once; the next fsync
of the same file returns 0 having written nothing (PostgreSQL's "fsyncgate", 2018). So a failed
fsync is never retried and never followed by a checkpoint: it raises `FsyncFailed`, and the owner
of the file (the commit log, for everything under the data directory) fails for good and stops
acknowledging. A restart recovers from what is on disk: the commit log up to its last good fsync
(senders after it were refused), derived state from the checkpoint before it.

Creating, renaming or removing a file changes its directory, and that change is durable only once
the directory is fsynced: `fsync_dir` after every such change, and `make_dirs` for directories,
which fsyncs the parent of each directory it creates.

Every call goes through `os.fsync` / `os.fdatasync` looked up at call time, so a test can inject
a real-looking EIO at the system-call boundary (as `strace -e inject=` does from outside).
"""

from __future__ import annotations

import os
from pathlib import Path

from chronoq.errors import FsyncFailed


def fsync(fd: int, path: str | Path) -> None:
    """fsync `fd` (data and metadata), or FsyncFailed."""
    try:
        os.fsync(fd)
    except OSError as e:
        raise FsyncFailed(str(path), e.errno, e.strerror or str(e)) from e


def fdatasync(fd: int, path: str | Path) -> None:
    """fdatasync `fd` (data, and the size when it changed), or FsyncFailed."""
    try:
        os.fdatasync(fd)
    except OSError as e:
        raise FsyncFailed(str(path), e.errno, e.strerror or str(e)) from e


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` (creations, renames, removals) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise FsyncFailed(str(path), e.errno, e.strerror or str(e)) from e
    try:
        fsync(fd, path)
    finally:
        os.close(fd)


def make_dirs(path: str | Path) -> None:
    """`mkdir -p path`, durably: each directory created is fsynced into its parent. A directory
    that already exists is taken as durable (it was made by this function, or by an earlier
    start that got past it)."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
        fsync_dir(d.parent)
