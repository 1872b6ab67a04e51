"""Consume queues on their own: dense offsets over fixed-size files, reopening, what `open`
trusts, truncates or declares damaged (the store then rebuilds from the log), retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chronoq.store import files
from chronoq.store.consumequeue import CQ_HEADER_SIZE, ENTRY_SIZE, ConsumeQueue, LoadReport

PER_FILE = 4
STRIDE = 100


def filled(directory: Path, n: int) -> ConsumeQueue:
    cq = ConsumeQueue(directory, PER_FILE)
    for i in range(n):
        assert cq.append(i * STRIDE, STRIDE, i % 3) == i
    cq.flush()
    return cq


def reopen(directory: Path, log_end: int = 10**9) -> tuple[ConsumeQueue, LoadReport]:
    return ConsumeQueue.open(directory, PER_FILE, log_start=0, log_end=log_end)


def cq_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.cq"))


def test_offsets_files_and_reads(tmp_path: Path) -> None:
    cq = filled(tmp_path, 10)
    try:
        assert (cq.min_offset, cq.next_offset) == (0, 10)
        assert [p.name for p in cq_files(tmp_path)] == [files.cq_file_name(o) for o in (0, 4, 8)]
        assert [p.stat().st_size for p in cq_files(tmp_path)] == [CQ_HEADER_SIZE + n * ENTRY_SIZE for n in (4, 4, 2)]
        assert cq.get(7) == (700, STRIDE, 1)
        assert cq.get(10) is None
        assert [e[0] for e in cq.read_range(2, 100)] == [2, 3]  # one file per call
        assert [e[0] for e in cq.read_range(4, 3)] == [4, 5, 6]
        assert cq.read_range(10, 5) == []
    finally:
        cq.close()


def test_reopen_restores_everything(tmp_path: Path) -> None:
    filled(tmp_path, 10).close()
    cq, report = reopen(tmp_path)
    try:
        assert report == LoadReport()
        assert cq.next_offset == 10 and cq.get(9) == (900, STRIDE, 0)
        assert cq.append(1000, STRIDE, 0) == 10
    finally:
        cq.close()


@pytest.mark.parametrize("per_file_now", [2, 3, 7])
def test_files_written_under_another_entries_per_file_are_read_and_appended_to(tmp_path: Path,
                                                                              per_file_now: int) -> None:
    """`consume_queue_entries_per_file` changed between runs: the files on disk hold the old
    count. Finding an offset's file by arithmetic alone read the wrong file (a negative pread
    offset, EINVAL) or nothing, and consumers stopped while the queue showed messages waiting."""
    filled(tmp_path, 10).close()  # files of 4, 4 and 2 entries
    cq, report = ConsumeQueue.open(tmp_path, per_file_now, log_start=0, log_end=10**9)
    try:
        assert report == LoadReport()
        assert [cq.get(i) for i in range(10)] == [(i * STRIDE, STRIDE, i % 3) for i in range(10)]
        assert [e[0] for e in cq.read_range(5, 100)] == [5, 6, 7]
        for i in range(10, 20):
            assert cq.append(i * STRIDE, STRIDE, i % 3) == i
        assert [cq.get(i) for i in range(20)] == [(i * STRIDE, STRIDE, i % 3) for i in range(20)]
    finally:
        cq.close()


def test_entries_past_the_log_end_are_dropped(tmp_path: Path) -> None:
    filled(tmp_path, 10).close()
    cq, report = reopen(tmp_path, log_end=850)  # records 8 and 9 were cut with a torn tail
    try:
        assert report.damaged is None and report.truncated_entries == 2
        assert cq.next_offset == 8
        assert cq_files(tmp_path)[-1].stat().st_size == CQ_HEADER_SIZE  # truncated on disk too
        assert cq.append(800, 50, 0) == 8
    finally:
        cq.close()


@pytest.mark.parametrize("damage", ["flip entry in the last file", "flip entry in a middle file", "partial entry",
                                    "flip header", "header names another offset", "missing middle file",
                                    "entries past the log before the last file"])
def test_damage_is_reported_for_a_rebuild(tmp_path: Path, damage: str) -> None:
    filled(tmp_path, 10).close()
    paths = cq_files(tmp_path)
    log_end = 10**9

    def flip(path: Path, offset: int) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    if damage == "flip entry in the last file":
        flip(paths[-1], CQ_HEADER_SIZE + 3)
    elif damage == "flip entry in a middle file":
        flip(paths[1], CQ_HEADER_SIZE + ENTRY_SIZE + 9)
    elif damage == "partial entry":
        os.truncate(paths[-1], CQ_HEADER_SIZE + ENTRY_SIZE + 5)
    elif damage == "flip header":
        flip(paths[0], 9)
    elif damage == "header names another offset":
        paths[1].rename(tmp_path / files.cq_file_name(5))
    elif damage == "missing middle file":
        paths[1].unlink()
    elif damage == "entries past the log before the last file":
        log_end = 550
    cq, report = reopen(tmp_path, log_end)
    cq.close()
    assert report.damaged, damage


def test_retention_drops_whole_files_never_the_last(tmp_path: Path) -> None:
    cq = filled(tmp_path, 10)
    try:
        assert cq.delete_files_before(300) == 0  # file 0 still holds the record at 300
        assert cq.delete_files_before(400) == 1
        assert cq.min_offset == 4 and cq.get(3) is None and cq.get(4) == (400, STRIDE, 1)
        assert cq.read_range(0, 10)[0][0] == 4
        assert cq.delete_files_before(10**9) == 1
        assert [p.name for p in cq_files(tmp_path)] == [files.cq_file_name(8)]
        assert (cq.min_offset, cq.next_offset) == (8, 10)
    finally:
        cq.close()


def test_empty_queue_start_and_first_file(tmp_path: Path) -> None:
    cq = ConsumeQueue(tmp_path / "q", PER_FILE)
    assert cq.is_empty and (cq.min_offset, cq.next_offset) == (0, 0)
    cq.set_start(42)  # rebuilt from a log whose first records for it expired
    assert (cq.min_offset, cq.next_offset) == (42, 42)
    cq.ensure_file()
    assert not cq.is_empty and [p.name for p in cq_files(tmp_path / "q")] == [files.cq_file_name(42)]
    with pytest.raises(ValueError):
        cq.set_start(1)
    assert cq.append(5, 5, 5) == 42
    cq.close()
    cq, report = reopen(tmp_path / "q")
    try:
        assert report.damaged is None and (cq.min_offset, cq.next_offset) == (42, 43)
    finally:
        cq.close()
    cq.destroy()
    assert cq_files(tmp_path / "q") == []
