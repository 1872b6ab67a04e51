"""Every on-disk format other than the commit-log record (see test_record.py), and the sizes the
layouts state.

For each codec: round trip whole; every prefix raises the codec's one error; trailing bytes are
ignored where a reader reads a fixed-size unit out of a longer file (headers, entries) and
rejected where the value is the whole file or key (checkpoint, topics, in-flight value, handle);
flipping any single byte is detected wherever the format carries a checksum; hypothesis round
trips. Sizes are asserted against the constants in code, which `docs/disk-format.md` repeats.
"""

from __future__ import annotations

import base64
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chronoq
from chronoq import trace
from chronoq.errors import CorruptRecord, InvalidRecallHandle, InvalidReceiptHandle
from chronoq.model import MessageType, TopicConfig
from chronoq.recurring import records as schedule_records
from chronoq.recurring.records import Schedule
from chronoq.recurring.spec import Recurrence, jitter_offset_ms
from chronoq.store import commitlog, consumequeue, files, groups, links, meta, record
from chronoq.timer import index_codec, recall

# -- shared checks --------------------------------------------------------------------------


def assert_prefixes_raise(decode: Callable[[Any], Any], blob: Any, error: type[Exception]) -> None:
    for n in range(len(blob)):
        with pytest.raises(error):
            decode(blob[:n])


def assert_flips_detected(decode: Callable[[bytes], Any], blob: bytes, error: type[Exception]) -> None:
    for i in range(len(blob)):
        for mask in (0x01, 0x10, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= mask
            with pytest.raises(error):
                decode(bytes(bad))


# -- sizes ----------------------------------------------------------------------------------


def test_sizes_the_layouts_state() -> None:
    """The list reported to the lead for docs/disk-format.md."""
    assert record.HEADER_SIZE == 72
    assert len(record.encode_record(
        position=0, message_id="", topic="", queue_id=0, queue_offset=0, message_type=MessageType.NORMAL,
        tag="", keys=(), properties={}, system_properties={}, body=b"", born_ms=0, store_ms=0)) == 72
    assert commitlog.SEGMENT_HEADER_SIZE == 24 == len(commitlog.encode_segment_header(0))
    assert consumequeue.CQ_HEADER_SIZE == 24 == len(consumequeue.encode_cq_header(0))
    assert consumequeue.ENTRY_SIZE == 20 == len(consumequeue.encode_entry(0, 0, 0))
    assert meta.CHECKPOINT_SIZE == 32 == len(meta.encode_checkpoint(0, 0))
    assert meta.TOPICS_HEADER_SIZE == 14 == len(meta.encode_topics([])) - len(b'{"topics":[]}')
    assert groups._INFLIGHT.size == 35 == len(groups._encode_inflight(inflight()))
    assert groups._HANDLE.size + 4 == 21
    assert len(groups.encode_handle(0, 0, 0)) == 28  # 21 bytes in unpadded URL-safe base64
    assert (record.RECORD_MAGIC, record.RECORD_VERSION) == (0xC4A0, 1)
    assert (commitlog.SEGMENT_MAGIC, commitlog.SEGMENT_VERSION) == (b"CHRONOQL", 1)
    assert (consumequeue.CQ_MAGIC, consumequeue.CQ_VERSION) == (b"CHRONOQQ", 1)
    assert (meta.CHECKPOINT_MAGIC, meta.CHECKPOINT_VERSION, meta.CHECKPOINT_VERSIONS_READ) == (b"CQCKPT01", 2, (1, 2))
    assert (meta.TOPICS_MAGIC, meta.TOPICS_VERSION) == (b"CQTP", 1)
    assert groups.GROUPS_FORMAT_VERSION == groups.HANDLE_VERSION == 1
    assert files.segment_name(4096) == "00000000000000004096.log"
    assert files.cq_file_name(7) == "00000000000000000007.cq"
    assert trace.SEGMENT_HEADER_SIZE == 24 == len(trace.encode_segment_header(0))
    assert (trace.SEGMENT_MAGIC, trace.TRACE_VERSION) == (b"CHRONOQT", 3)
    assert files.trace_segment_name(3) == "00000000000000000003.trace"
    assert (links.LINKS_VERSION, links.LINKS_HEAD.size, links.LINK_BYTES, consumequeue.LINKED) == (1, 7, 30, 1 << 31)
    assert index_codec.ENTRY_HEAD.size == 37 and index_codec.TIME_VALUE_VERSION == 2


DOC = Path(chronoq.__file__).resolve().parents[1] / "docs" / "disk-format.md"
DOC_STATES = [  # (what docs/disk-format.md says, with the size as group 1; the size in code)
    (r"Header, version 1, (\d+) bytes:\s+\|", commitlog.SEGMENT_HEADER_SIZE),
    (r"Version 1, (\d+)-byte fixed header", record.HEADER_SIZE),
    (r"Header, version 1, (\d+) bytes: magic `b\"CHRONOQQ\"`", consumequeue.CQ_HEADER_SIZE),
    (r"Entry, (\d+) bytes:", consumequeue.ENTRY_SIZE),
    (r"(\d+) bytes, version 2, rewritten atomically", meta.CHECKPOINT_SIZE),
    (r"Header (\d+) bytes: magic `b\"CQTP\"`", meta.TOPICS_HEADER_SIZE),
    (r"In-flight value, (\d+) bytes:", groups._INFLIGHT.size),
    (r"crc32c u32 of the first 17 bytes \((\d+) bytes\)", groups._HANDLE.size + 4),
    (r"deliver_at_ms u64 · position u64 \((\d+) bytes\)", index_codec.TIME_KEY.size),
    (r"\(a (\d+)-byte\s+head\)\s+\|\s+topic\s+UTF-8", recall.RECALL_HEAD.size),
    (r"each a (\d+)-byte\s+head\s+\|\s+topic\s+UTF-8", trace.EVENT_HEAD.size),
    (r"Segment header, (\d+) bytes: magic `b\"CHRONOQT\"`", trace.SEGMENT_HEADER_SIZE),
    (r"have exactly `(\d+) \S count` bytes of columns", links.LINK_BYTES),
    (r"top bit set \(`LINKED`, 2\^(\d+)\)", 31),
]


def test_docs_state_the_same_sizes() -> None:
    text = DOC.read_text()
    for pattern, size in DOC_STATES:
        found = re.search(pattern, text)
        assert found, f"docs/disk-format.md no longer says {pattern!r}"
        assert int(found.group(1)) == size, (pattern, size)


def test_every_name_in_the_data_directory_has_its_section() -> None:
    """docs/disk-format.md is complete: every name `store/files.py` defines is in its directory
    tree, and every file that holds bytes has a section of its own."""
    text = DOC.read_text()
    tree = text[text.index("DATA_DIR/"):text.index("```", text.index("DATA_DIR/"))]
    names = [v for k, v in vars(files).items() if k.isupper() and isinstance(v, str) and not v.startswith(".")]
    for name in names:
        assert name in tree, f"{name!r} (store/files.py) is missing from the directory tree in docs/disk-format.md"
    for heading in ("(`commitlog/*.log`)", "(`queues/<topic>/<qid>/*.cq`)", "(`checkpoint`)", "(`topics`)",
                    "(`groups/`", "(`timer/`", "(`timerwheel/`", "(`trace/*.trace`", "## Recall handle",
                    "### Link record", "### Schedule record"):
        assert heading in text, f"docs/disk-format.md has no section {heading}"


def test_schedule_records_as_the_document_states() -> None:
    """The three schedule records docs/disk-format.md shows are what the encoder writes for the
    schedule it describes, and replay reads them as it says: put, then progress, then delete."""
    text = DOC.read_text()
    section = text[text.index("### Schedule record"):]
    block = section[section.index("```\n") + 4:section.index("\n```", section.index("```\n"))]
    put, progress, delete = (line.encode() for line in block.splitlines())
    made, first = 1_795_824_000_000, 1_795_899_600_000  # 2026-11-28T00:00Z; 05:00 in Shanghai that day
    s = Schedule(name="wake", topic="alarms", body=b"hi",
                 recurrence=Recurrence(cron="0 0 5 * * *", zone="Asia/Shanghai"), catch_up="latest",
                 jitter_ms=30_000, tag="morning", properties={"k": "v"}, created_ms=made, updated_ms=made,
                 after_ms=made)
    assert s.recurrence.next_after(made) == first
    assert schedule_records.put_record(s) == put
    due = first + jitter_offset_ms("wake", first, 30_000)
    s.after_ms, s.count, s.pending = first, 1, (first, due, 1)
    assert due == first + 8_292
    assert schedule_records.progress_record(s) == progress
    assert schedule_records.delete_record(s) == delete
    replayed = schedule_records.replay([(10, put), (20, progress)])
    assert replayed.schedules["wake"] == s and replayed.positions == {"wake": 10}
    replayed = schedule_records.replay([(30, delete)], replayed)
    assert replayed.schedules == {} and replayed.deleted == {"wake": ("alarms", (first, due, 1))}
    for bad in (put.replace(b'"v":1', b'"v":2'), progress.replace(b'"op":"progress"', b'"op":"grow"')):
        with pytest.raises(ValueError, match="schedule record at position 5"):
            schedule_records.replay([(5, bad)])


def _journal(data_dir: Path, *, segment_size_bytes: int = 64 * 1024,
             retention_bytes: int = 1024 * 1024) -> trace.TraceJournal:
    return trace.TraceJournal(data_dir, segment_size_bytes=segment_size_bytes, retention_bytes=retention_bytes)


def _trace_segment(data_dir: Path, number: int) -> Path:
    return data_dir / "trace" / files.trace_segment_name(number)


def test_trace_events_as_the_document_states(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.record(trace.FIRED, "tp", "M1", 7, 5)
    journal.close()
    blob = _trace_segment(tmp_path, 0).read_bytes()
    head = b"CHRONOQT" + struct.pack(">IQ", 3, 0)
    assert blob[:24] == head + struct.pack(">I", crc32c.crc32c(head))
    assert blob[24:] == bytes([2]) + struct.pack(">QQHH", 7, 5, 2, 2) + b"tpM1"
    _trace_segment(tmp_path, 0).write_bytes(blob + blob[24:-1])  # a torn last event
    assert list(trace.read_events(tmp_path)) == [(2, 7, 5, "tp", "M1")]


@pytest.mark.parametrize("cut", range(1, 24))
def test_a_trace_cut_mid_event_is_trimmed_before_the_next_run_appends(tmp_path: Path, cut: int) -> None:
    """A run that ended mid-event (a full disk, a power loss): the next run appended after the
    cut event, and every later event was misread from it (a UnicodeDecodeError, or the next run's
    events silently lost). The journal is cut back to its last whole event at open."""
    journal = _journal(tmp_path)
    journal.record(trace.ACCEPTED, "tp", "M1", 1, 5)
    journal.record(trace.FIRED, "tp", "M1", 6, 5)
    journal.close()
    path = _trace_segment(tmp_path, 0)
    path.write_bytes(path.read_bytes()[:-cut])  # the second event cut short
    journal = _journal(tmp_path)
    for i in range(3):
        journal.record(trace.RECEIVED, "tp", f"N{i}", 10 + i, 5)
    journal.close()
    assert list(trace.read_events(tmp_path)) == [(1, 1, 5, "tp", "M1")] + [
        (3, 10 + i, 5, "tp", f"N{i}") for i in range(3)]


def test_recall_handle() -> None:
    handle = recall.encode_recall_handle("tp", 1 << 40, "M1")
    raw = base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))
    body = struct.pack(">BQ", 1, 1 << 40) + b"tp\x00M1"
    assert raw[:-4] == body and struct.unpack(">I", raw[-4:])[0] == crc32c.crc32c(body)
    assert "=" not in handle
    assert recall.decode_recall_handle(handle) == ("tp", 1 << 40, "M1")
    for n in range(1, len(handle)):
        with pytest.raises(InvalidRecallHandle):
            recall.decode_recall_handle(handle[:n])
    with pytest.raises(InvalidRecallHandle):
        recall.decode_recall_handle(handle + "A" * 1024)


# -- segment header ---------------------------------------------------------------------------


def test_segment_header() -> None:
    blob = commitlog.encode_segment_header(1 << 40)
    assert blob[:8] == b"CHRONOQL"
    assert struct.unpack(">IQ", blob[8:20]) == (1, 1 << 40)
    assert commitlog.decode_segment_header(blob) == 1 << 40
    assert commitlog.decode_segment_header(blob + b"records follow") == 1 << 40
    assert_prefixes_raise(commitlog.decode_segment_header, blob, CorruptRecord)
    assert_flips_detected(commitlog.decode_segment_header, blob, CorruptRecord)


# -- consume queue ----------------------------------------------------------------------------


def test_cq_header() -> None:
    blob = consumequeue.encode_cq_header(300_000)
    assert blob[:8] == b"CHRONOQQ"
    assert struct.unpack(">IQ", blob[8:20]) == (1, 300_000)
    assert consumequeue.decode_cq_header(blob) == 300_000
    assert consumequeue.decode_cq_header(blob + consumequeue.encode_entry(1, 2, 3)) == 300_000
    assert_prefixes_raise(consumequeue.decode_cq_header, blob, CorruptRecord)
    assert_flips_detected(consumequeue.decode_cq_header, blob, CorruptRecord)


def test_cq_entry() -> None:
    th = consumequeue.tag_hash("paid")
    blob = consumequeue.encode_entry(2**40 + 5, 1234, th)
    assert struct.unpack(">QII", blob[:16]) == (2**40 + 5, 1234, th)
    assert consumequeue.decode_entry(blob) == (2**40 + 5, 1234, th)
    assert consumequeue.decode_entry(blob + b"\x00" * 7) == (2**40 + 5, 1234, th)
    assert consumequeue.decode_entry(b"xx" + blob, 2) == (2**40 + 5, 1234, th)
    assert_prefixes_raise(consumequeue.decode_entry, blob, CorruptRecord)
    assert_flips_detected(consumequeue.decode_entry, blob, CorruptRecord)
    assert consumequeue.tag_hash("") == 0  # CRC32C of nothing; untagged messages share it


@settings(deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.data())
def test_cq_entry_property(position: int, size: int, th: int, data: st.DataObject) -> None:
    blob = consumequeue.encode_entry(position, size, th)
    assert consumequeue.decode_entry(blob) == (position, size, th)
    i = data.draw(st.integers(0, len(blob) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]))
    with pytest.raises(CorruptRecord):
        consumequeue.decode_entry(blob[:i] + bytes([value]) + blob[i + 1:])


@settings(deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_headers_property(first: int) -> None:
    assert consumequeue.decode_cq_header(consumequeue.encode_cq_header(first)) == first
    assert commitlog.decode_segment_header(commitlog.encode_segment_header(first)) == first


# -- checkpoint -------------------------------------------------------------------------------


def test_checkpoint() -> None:
    blob = meta.encode_checkpoint(987_654_321, 1_700_000_123_456)
    assert blob[:8] == b"CQCKPT01"
    assert struct.unpack(">IIQI", blob[8:28]) == (2, 0, 987_654_321, 1_700_000_123)
    assert meta.decode_checkpoint(blob) == 987_654_321
    assert meta.decode_checkpoint_versioned(blob) == (987_654_321, 2)
    head = blob[:8] + struct.pack(">I", 1) + blob[12:28]  # version 1: the same layout, still read
    assert meta.decode_checkpoint_versioned(head + struct.pack(">I", crc32c.crc32c(head))) == (987_654_321, 1)
    head = blob[:8] + struct.pack(">I", 3) + blob[12:28]
    with pytest.raises(CorruptRecord, match="unknown checkpoint version 3"):
        meta.decode_checkpoint(head + struct.pack(">I", crc32c.crc32c(head)))
    with pytest.raises(CorruptRecord, match="32"):
        meta.decode_checkpoint(blob + b"\x00")  # the file is exactly one checkpoint
    assert_prefixes_raise(meta.decode_checkpoint, blob, CorruptRecord)
    assert_flips_detected(meta.decode_checkpoint, blob, CorruptRecord)


def test_read_checkpoint_treats_missing_or_bad_as_none(tmp_path) -> None:
    path = tmp_path / files.CHECKPOINT
    assert meta.read_checkpoint(path) is None
    meta.write_atomic(path, meta.encode_checkpoint(42, 0))
    assert meta.read_checkpoint(path) == 42
    path.write_bytes(path.read_bytes()[:-1])
    assert meta.read_checkpoint(path) is None


@settings(deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**62), st.data())
def test_checkpoint_property(position: int, written_ms: int, data: st.DataObject) -> None:
    blob = meta.encode_checkpoint(position, written_ms)
    assert meta.decode_checkpoint(blob) == position
    i = data.draw(st.integers(0, len(blob) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]))
    with pytest.raises(CorruptRecord):
        meta.decode_checkpoint(blob[:i] + bytes([value]) + blob[i + 1:])


# -- topics -----------------------------------------------------------------------------------

TOPICS = [
    TopicConfig("orders", 4, frozenset({MessageType.NORMAL, MessageType.DELAY}), 1_700_000_000_000),
    TopicConfig("%DLQ%g1", 1, frozenset(MessageType), 5),
]


def test_topics_file() -> None:
    blob = meta.encode_topics(TOPICS)
    magic, version, _crc, length = struct.unpack_from(">4sHII", blob)
    assert (magic, version, length) == (b"CQTP", 1, len(blob) - 14)
    assert sorted(meta.decode_topics(blob), key=lambda t: t.name) == sorted(TOPICS, key=lambda t: t.name)
    assert meta.decode_topics(meta.encode_topics([])) == []
    with pytest.raises(CorruptRecord):
        meta.decode_topics(blob + b"\n")  # the length field covers the whole rest of the file
    assert_prefixes_raise(meta.decode_topics, blob, CorruptRecord)
    assert_flips_detected(meta.decode_topics, blob, CorruptRecord)


def test_topics_file_with_valid_crc_but_bad_json_is_corrupt() -> None:
    import crc32c

    for body in (b"{", b"[]", b'{"topics": [{"name": "x"}]}', b'{"topics": [{"name": "x", "queue_count": 1, '
                                                              b'"message_types": [9], "created_ms": 0}]}', b"\xff"):
        blob = struct.pack(">4sHII", b"CQTP", 1, crc32c.crc32c(body), len(body)) + body
        with pytest.raises(CorruptRecord):
            meta.decode_topics(blob)


topic_configs = st.builds(
    TopicConfig,
    name=st.from_regex(r"[A-Za-z0-9_%|-]{1,20}", fullmatch=True),
    queue_count=st.integers(1, 256),
    message_types=st.frozensets(st.sampled_from(list(MessageType)), min_size=1),
    created_ms=st.integers(0, 2**62),
)


@settings(deadline=None, max_examples=50)
@given(st.lists(topic_configs, max_size=5, unique_by=lambda t: t.name), st.data())
def test_topics_property(topics: list[TopicConfig], data: st.DataObject) -> None:
    blob = meta.encode_topics(topics)
    assert sorted(meta.decode_topics(blob), key=lambda t: t.name) == sorted(topics, key=lambda t: t.name)
    i = data.draw(st.integers(0, len(blob) - 1))
    value = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]))
    with pytest.raises(CorruptRecord):
        meta.decode_topics(blob[:i] + bytes([value]) + blob[i + 1:])


# -- consumer-group in-flight value -------------------------------------------------------------


def inflight(**changes: Any) -> groups.InFlight:
    fields = dict(group="g", topic="t", queue_id=2, offset=9, attempt=3, visible_ms=1_700_000_030_000,
                  nonce=0xDEADBEEF, position=4096, size=200, first_delivery_ms=1_700_000_000_000)
    return groups.InFlight(**{**fields, **changes})  # type: ignore[arg-type]


def decode_inflight(raw: bytes) -> groups.InFlight:
    return groups._decode_inflight("g", "t", 2, 9, raw)


def test_inflight_value() -> None:
    entry = inflight()
    blob = groups._encode_inflight(entry)
    assert struct.unpack(">BHQIQIQ", blob) == (1, 3, 1_700_000_030_000, 0xDEADBEEF, 4096, 200, 1_700_000_000_000)
    assert decode_inflight(blob) == entry
    assert_prefixes_raise(decode_inflight, blob, CorruptRecord)
    with pytest.raises(CorruptRecord):
        decode_inflight(blob + b"\x00")  # a value is exactly one entry
    for version in (0, 2, 255):
        with pytest.raises(CorruptRecord, match="version"):
            decode_inflight(bytes([version]) + blob[1:])
    # No checksum of its own: RocksDB checksums the blocks and WAL records holding it.


@settings(deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_inflight_property(attempt: int, visible_ms: int, nonce: int, position: int, size: int, first: int) -> None:
    entry = inflight(attempt=attempt, visible_ms=visible_ms, nonce=nonce, position=position, size=size,
                     first_delivery_ms=first)
    assert decode_inflight(groups._encode_inflight(entry)) == entry


# -- receipt handle ---------------------------------------------------------------------------


def raw_handle(handle: str) -> bytes:
    return base64.urlsafe_b64decode(handle + "=" * (-len(handle) % 4))


def test_receipt_handle() -> None:
    handle = groups.encode_handle(7, 2**40, 0xCAFEBABE)
    raw = raw_handle(handle)
    assert struct.unpack(">BIQI", raw[:17]) == (1, 7, 2**40, 0xCAFEBABE)
    assert groups.decode_handle(handle) == (7, 2**40, 0xCAFEBABE)
    assert_prefixes_raise(groups.decode_handle, handle, InvalidReceiptHandle)
    for trailer in ("A", "AAAA", "=", " "):
        with pytest.raises(InvalidReceiptHandle):
            groups.decode_handle(handle + trailer)

    def decode_raw(blob: bytes) -> tuple[int, int, int]:
        return groups.decode_handle(base64.urlsafe_b64encode(blob).decode().rstrip("="))

    assert_flips_detected(decode_raw, raw, InvalidReceiptHandle)
    for bad in (None, 5, "", "x" * 65, "!!!!", "A" * 28):
        with pytest.raises(InvalidReceiptHandle):
            groups.decode_handle(bad)  # type: ignore[arg-type]
    wrong_version = bytes([2]) + raw[1:17]
    with pytest.raises(InvalidReceiptHandle, match="version"):
        groups.decode_handle(base64.urlsafe_b64encode(wrong_version + struct.pack(">I", _crc(wrong_version)))
                             .decode().rstrip("="))


def _crc(blob: bytes) -> int:
    import crc32c

    return crc32c.crc32c(blob)


@settings(deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.data())
def test_receipt_handle_property(qid: int, offset: int, nonce: int, data: st.DataObject) -> None:
    handle = groups.encode_handle(qid, offset, nonce)
    assert groups.decode_handle(handle) == (qid, offset, nonce)
    # Any one changed, added or removed character is refused: a handle has one spelling and can
    # never silently point at another in-flight entry.
    i = data.draw(st.integers(0, len(handle) - 1))
    c = data.draw(st.characters(codec="ascii").filter(lambda c: c != handle[i]))
    for bad in (handle[:i] + c + handle[i + 1:], handle[:i] + c + handle[i:], handle[:i] + handle[i + 1:]):
        with pytest.raises(InvalidReceiptHandle):
            groups.decode_handle(bad)


def test_a_timer_sent_again_for_another_time_is_its_own_trace_row(tmp_path: Path) -> None:
    """Cancelled and sent again under its id for another time: one row per id measured the new
    delivery against the cancelled one's due time (an hour "early", in a report whose early
    count must stay zero)."""
    journal = _journal(tmp_path)
    journal.record(trace.ACCEPTED, "tp", "M1", 1, 3_600_000)  # cancelled later
    journal.record(trace.ACCEPTED, "tp", "M1", 2, 1_000)  # sent again, due in a second
    journal.record(trace.FIRED, "tp", "M1", 1_001, 1_000)
    journal.received("tp", "M1", 1_002, 1_000)
    journal.close()
    rows = {r["due_ms"]: r for r in trace.export_rows(tmp_path)}
    assert rows[1_000]["first_received_ms"] - rows[1_000]["due_ms"] == 2  # late by 2 ms, not early
    assert rows[3_600_000]["fired_ms"] is None


def test_the_trace_remembers_a_bounded_number_of_first_receives(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(trace, "RECEIVED_REMEMBERED", 3)
    journal = _journal(tmp_path)
    for i in range(10):
        journal.received("tp", f"M{i}", 10 + i, 5)
    journal.received("tp", "M9", 30, 5)  # a second group's first receive: still remembered
    assert len(journal._received) == 3
    journal.close()
    assert [e[3:] for e in trace.read_events(tmp_path)] == [("tp", f"M{i}") for i in range(10)]
