"""Small metadata files: the dispatch checkpoint and the topic table.

Theory of operation: both are rewritten whole, atomically (write a temp file, fsync it, rename
over the old one, fsync the directory), so a crash leaves the old or the new version, never a
mix. Each carries magic, version and a CRC32C; `read_*` names which check failed.

The checkpoint's meaning: every consume queue holds every record below its dispatched_position,
durably, and (version 2) so does the commit log: it is never past the log's fsynced end. Both
layouts: `docs/disk-format.md` ("Checkpoint", "Topic table"), their one description.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import crc32c

from chronoq.errors import CorruptRecord
from chronoq.model import MessageType, TopicConfig
from chronoq.store import fsync

CHECKPOINT_MAGIC = b"CQCKPT01"
CHECKPOINT_VERSION = 2
CHECKPOINT_VERSIONS_READ = (1, 2)
"""Version 1 has the same layout; only its promise is weaker (see `decode_checkpoint_versioned`)."""
CHECKPOINT_SIZE = 32
TOPICS_MAGIC = b"CQTP"
TOPICS_VERSION = 1
TOPICS_HEADER = struct.Struct(">4sHII")
TOPICS_HEADER_SIZE = TOPICS_HEADER.size  # 14


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: the old or the new version survives any crash. On any error
    the temp file is removed and the old version stays; an fsync error raises FsyncFailed."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:  # a short write is retried; a full disk raises ENOSPC here
                n = os.write(fd, view)
                view = view[n:]
            fsync.fsync(fd, tmp)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync.fsync_dir(path.parent)


def encode_checkpoint(dispatched_position: int, written_ms: int) -> bytes:
    """A version-2 checkpoint: `dispatched_position` must not be past the log's fsynced end."""
    head = struct.pack(">8sIIQ", CHECKPOINT_MAGIC, CHECKPOINT_VERSION, 0, dispatched_position)
    head += struct.pack(">I", written_ms // 1000 & 0xFFFFFFFF)  # seconds: enough for a human
    return head + struct.pack(">I", crc32c.crc32c(head))


def decode_checkpoint(buf: bytes) -> int:
    return decode_checkpoint_versioned(buf)[0]


def decode_checkpoint_versioned(buf: bytes) -> tuple[int, int]:
    """(dispatched_position, version). Version 1 (same layout) was written by brokers that, with
    flush = "async", could record a position past the log's fsynced end; version 2 never does."""
    if len(buf) != CHECKPOINT_SIZE:
        raise CorruptRecord(f"checkpoint is {len(buf)} bytes, expected {CHECKPOINT_SIZE}")
    magic, version, _reserved, position = struct.unpack_from(">8sIIQ", buf)
    if magic != CHECKPOINT_MAGIC:
        raise CorruptRecord(f"bad checkpoint magic {magic!r}")
    if version not in CHECKPOINT_VERSIONS_READ:
        raise CorruptRecord(f"unknown checkpoint version {version}")
    (crc,) = struct.unpack_from(">I", buf, 28)
    if crc32c.crc32c(buf[:28]) != crc:
        raise CorruptRecord("checkpoint CRC32C mismatch")
    return int(position), int(version)


def read_checkpoint(path: Path) -> int | None:
    """The dispatched position, or None if missing or invalid (then dispatch replays from 0)."""
    found = read_checkpoint_versioned(path)
    return None if found is None else found[0]


def read_checkpoint_versioned(path: Path) -> tuple[int, int] | None:
    """(dispatched position, version), or None if missing or invalid."""
    try:
        return decode_checkpoint_versioned(path.read_bytes())
    except (FileNotFoundError, CorruptRecord):
        return None


def encode_topics(topics: list[TopicConfig]) -> bytes:
    doc = {"topics": [
        {"name": t.name, "queue_count": t.queue_count,
         "message_types": sorted(int(m) for m in t.message_types), "created_ms": t.created_ms}
        for t in sorted(topics, key=lambda t: t.name)
    ]}
    body = json.dumps(doc, separators=(",", ":")).encode()
    return TOPICS_HEADER.pack(TOPICS_MAGIC, TOPICS_VERSION, crc32c.crc32c(body), len(body)) + body


def decode_topics(buf: bytes) -> list[TopicConfig]:
    if len(buf) < TOPICS_HEADER_SIZE:
        raise CorruptRecord(f"topics file is {len(buf)} bytes, the header needs {TOPICS_HEADER_SIZE}")
    magic, version, crc, length = TOPICS_HEADER.unpack_from(buf)
    if magic != TOPICS_MAGIC:
        raise CorruptRecord(f"bad topics magic {magic!r}")
    if version != TOPICS_VERSION:
        raise CorruptRecord(f"unknown topics version {version}")
    body = buf[TOPICS_HEADER_SIZE:]
    if len(body) != length:
        raise CorruptRecord(f"topics body is {len(body)} bytes, header says {length}")
    if crc32c.crc32c(body) != crc:
        raise CorruptRecord("topics CRC32C mismatch")
    try:
        doc = json.loads(body)
        return [
            TopicConfig(name=t["name"], queue_count=int(t["queue_count"]),
                        message_types=frozenset(MessageType(m) for m in t["message_types"]),
                        created_ms=int(t["created_ms"]))
            for t in doc["topics"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptRecord(f"topics JSON is malformed: {e}") from None
