"""Every file and directory name in a chronoq data directory, in one place.

    DATA_DIR/
      LOCK                          flock'ed by the running broker
      topics                        topic table (magic CQTP, CRC32C, JSON)
      checkpoint                    dispatch checkpoint (magic CQCKPT01, CRC32C)
      reserve                       space set aside for a start on a full disk (no data; see
                                    `store/diskspace.py`)
      commitlog/<20-digit base>.log commit-log segments, named by their first position
      queues/<topic>/<qid>/<20-digit first offset>.cq   consume-queue files
      groups/                       consumer-group state (RocksDB)
      timer/                        the timer index (RocksDB; timer_engine = "rocksdb")
      timerwheel/                   the file wheel (timer_engine = "wheel"): timercheck,
                                    timerlog.<gen>, timerwheel.<gen>, timerfacts.<gen>
      trace/<20-digit number>.trace delivery-trace segments (when tracing is on), bounded by
                                    trace_retention_bytes
      trace/events.bin              version 1 of the delivery trace (one file): read, never written
      topics.damaged-<ms>, groups.damaged-<ms>   a damaged topic table or consumer-group store,
                                    moved aside (kept for inspection) when the broker started
                                    without it; chronoq never reads them again

`docs/disk-format.md` gives each file's byte layout.
"""

from __future__ import annotations

import time
from pathlib import Path

LOCK = "LOCK"
TOPICS = "topics"
CHECKPOINT = "checkpoint"
RESERVE = "reserve"
COMMITLOG_DIR = "commitlog"
SEGMENT_SUFFIX = ".log"
QUEUES_DIR = "queues"
CQ_SUFFIX = ".cq"
GROUPS_DIR = "groups"
TIMER_DIR = "timer"
TIMER_WHEEL_DIR = "timerwheel"
TRACE_DIR = "trace"
TRACE_EVENTS = "events.bin"
TRACE_SEGMENT_SUFFIX = ".trace"


def damaged_name(path: Path) -> Path:
    """Where a damaged file or directory is moved aside: `<name>.damaged-<wall-clock ms>` (the
    time only tells a person when; nothing reads it back)."""
    return path.with_name(f"{path.name}.damaged-{time.time_ns() // 1_000_000}")


def segment_name(base_position: int) -> str:
    return f"{base_position:020d}{SEGMENT_SUFFIX}"


def trace_segment_name(number: int) -> str:
    return f"{number:020d}{TRACE_SEGMENT_SUFFIX}"


def cq_file_name(first_offset: int) -> str:
    return f"{first_offset:020d}{CQ_SUFFIX}"


def queue_dir(data_dir: Path, topic: str, queue_id: int) -> Path:
    return data_dir / QUEUES_DIR / topic / str(queue_id)


def parse_numbered(name: str, suffix: str) -> int | None:
    """The number in `<20 digits><suffix>`, or None for any other name (temp files, strays)."""
    if not name.endswith(suffix):
        return None
    stem = name[: -len(suffix)]
    if len(stem) != 20 or not stem.isdigit():
        return None
    return int(stem)
