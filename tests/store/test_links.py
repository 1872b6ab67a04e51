"""Link records (`chronoq/store/links.py`): the body's codec, and what the store does with them.

The codec: a round trip, the byte layout docs/disk-format.md states, and a decoder that raises
`CorruptRecord` and nothing else on a prefix, a flipped byte, trailing bytes or arbitrary bytes
(recovery and `chronoq check` read link records from disk). The store: a link record's links
become queue entries that name the link record (`LINKED`), read back as the linked records;
recovery replays them idempotently, a rebuild makes them again, a torn link record takes its
entries with it, and `chronoq check` holds the queues to the links.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.config import Config
from chronoq.errors import CorruptRecord
from chronoq.model import ALL_MESSAGE_TYPES, LINKS_TOPIC, MessageType, StoredMessage
from chronoq.store import files
from chronoq.store.check import check_data_dir
from chronoq.store.consumequeue import ENTRY, LINKED, tag_hash
from chronoq.store.links import LINK_BYTES, LinkBatch, decode_links, encode_links, queue_entries
from chronoq.store.messagestore import MessageStore, PreparedMessage

NOW_MS = 1_700_000_000_000


def _batch(links: list[tuple[int, int, str, int | None, int | None, int]]) -> LinkBatch:
    batch = LinkBatch()
    for link in links:
        batch.add(*link)
    return batch


# --- the body's codec ---------------------------------------------------------------------------


def test_the_body_layout_is_the_documented_one() -> None:
    """docs/disk-format.md, "Link record": head, topic names, then six columns."""
    batch = _batch([(100, 80, "orders", None, None, 7), (300, 90, "pay", 2, None, 0)])
    body = encode_links(batch, [1, 2], [40, 0])
    assert LINK_BYTES == 30
    assert body == (
        struct.pack(">BIH", 1, 2, 2) + b"\x00\x06orders" + b"\x00\x03pay"
        + struct.pack(">QQ", 100, 300) + struct.pack(">II", 80, 90) + struct.pack(">QQ", 40, 0)
        + struct.pack(">II", 1, 2) + struct.pack(">II", 7, 0) + struct.pack(">HH", 0, 1))
    links = decode_links(body, 400)
    assert links.topics == ["orders", "pay"] and len(links) == 2
    assert [links.target(i) for i in range(2)] == [(100, 80), (300, 90)]
    assert (list(links.queue_ids), list(links.queue_offsets), list(links.tag_hashes)) == ([1, 2], [40, 0], [7, 0])


_link = st.tuples(st.integers(0, 2**40), st.integers(72, 2**31 - 1), st.sampled_from(["a", "b", "ü-topic"]),
                  st.integers(0, 255), st.integers(0, 2**40), st.integers(0, 2**32 - 1))


@given(st.lists(_link, max_size=40))
def test_a_body_decodes_to_what_was_encoded(links: list[tuple[int, int, str, int, int, int]]) -> None:
    batch = _batch([(p, s, t, None, None, th) for p, s, t, _q, _o, th in links])
    body = encode_links(batch, [q for _p, _s, _t, q, _o, _th in links], [o for *_, o, _th in links])
    got = decode_links(body)
    assert len(got) == len(links)
    for i, (p, s, t, q, o, th) in enumerate(links):
        assert (got.positions[i], got.sizes[i], got.topics[got.topic_indexes[i]]) == (p, s, t)
        assert (got.queue_ids[i], got.queue_offsets[i], got.tag_hashes[i]) == (q, o, th)


def _sample_body() -> bytes:
    batch = _batch([(100, 80, "orders", None, None, 7), (300, 90, "pay", 2, None, 0)])
    return encode_links(batch, [1, 2], [40, 0])


def test_every_prefix_and_trailing_bytes_are_refused() -> None:
    body = _sample_body()
    for n in range(len(body)):
        with pytest.raises(CorruptRecord):
            decode_links(body[:n])
    with pytest.raises(CorruptRecord):
        decode_links(body + b"\x00")


def test_each_flipped_byte_decodes_or_raises_corrupt_record_only() -> None:
    body = _sample_body()
    for i in range(len(body)):
        for bit in (0x01, 0x80):
            flipped = body[:i] + bytes([body[i] ^ bit]) + body[i + 1:]
            try:
                decode_links(flipped, 400)
            except CorruptRecord:
                pass


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_corrupt_record_only(raw: bytes) -> None:
    try:
        decode_links(raw, 1 << 40)
    except CorruptRecord:
        pass


def test_a_link_that_points_forward_or_names_a_missing_topic_is_refused() -> None:
    body = _sample_body()
    with pytest.raises(CorruptRecord, match="points forward"):
        decode_links(body, 300)  # a link record at 300 cannot name the record at 300
    bad_topic = body[:-2] + struct.pack(">H", 5)
    with pytest.raises(CorruptRecord, match="names topic 5"):
        decode_links(bad_topic)
    with pytest.raises(CorruptRecord, match="version 9"):
        decode_links(b"\x09" + body[1:])


# --- in the store -------------------------------------------------------------------------------


def _open(data: Path, **overrides: object) -> MessageStore:
    store, _ = MessageStore.open(Config(data_dir=data, **overrides), opened_ms=NOW_MS)  # type: ignore[arg-type]
    return store


def _seed(store: MessageStore) -> list[StoredMessage]:
    """Two topics, a "waiting" topic holding three records, and a link record entering them into
    `orders` (queue 1 named, then two by round robin) and `pay`."""
    for name, queues in (("waiting", 1), ("orders", 2), ("pay", 1), (LINKS_TOPIC, 1)):
        store.create_topic(name, queues, ALL_MESSAGE_TYPES, NOW_MS)
    waiting = store.append([PreparedMessage("waiting", f"w{i}", MessageType.NORMAL, b"body-%d" % i, NOW_MS,
                                            tag="t" if i else "") for i in range(3)], NOW_MS)
    batch = LinkBatch()
    batch.add(waiting[0].position, waiting[0].size, "orders", 1, None, tag_hash(waiting[0].tag))
    batch.add(waiting[1].position, waiting[1].size, "orders", None, None, tag_hash(waiting[1].tag))
    batch.add(waiting[2].position, waiting[2].size, "pay", None, None, tag_hash(waiting[2].tag))
    store.append([PreparedMessage(LINKS_TOPIC, "", MessageType.NORMAL, b"", NOW_MS, queue_id=0, links=batch)],
                 NOW_MS + 5)
    return waiting


def _queue(store: MessageStore, topic: str, qid: int) -> list[tuple[str, int, int]]:
    """(message id, queue offset, store time) of each message the queue holds, as read."""
    cq = store.queue(topic, qid)
    out = []
    for off, position, size, _ in cq.read_range(cq.min_offset, cq.next_offset - cq.min_offset):
        m = store.readable_entry(topic, qid, off, position, size)
        assert m is not None and (m.topic, m.queue_id, m.queue_offset) == (topic, qid, off)
        out.append((m.message_id, off, m.store_ms))
    return out


def test_links_enter_records_into_other_queues_as_entries_that_name_the_link_record(tmp_path: Path) -> None:
    async def body() -> None:
        store = _open(tmp_path / "data")
        try:
            waiting = _seed(store)
            await store.log.flush_now()
            [link] = [m for m in store.scan(0) if m.topic == LINKS_TOPIC]
            # The chosen queue, then the round robin; each at its queue's next offset; stored
            # there when linked (the link record's time).
            assert _queue(store, "orders", 1) == [("w0", 0, NOW_MS + 5)]
            assert _queue(store, "orders", 0) == [("w1", 0, NOW_MS + 5)]
            assert _queue(store, "pay", 0) == [("w2", 0, NOW_MS + 5)]
            entry = store.queue("orders", 1).get(0)
            assert entry == (link.position, LINKED | 0, tag_hash(""))  # names the link record
            assert [e[3:5] for e in queue_entries(link)][1:] == [(link.position, LINKED | i) for i in range(3)]
            # Read as the linked record: its body, its position.
            m = store.readable_entry("pay", 0, 0, *store.queue("pay", 0).get(0)[:2])
            assert m is not None and (m.body, m.position) == (b"body-2", waiting[2].position)
        finally:
            store.close()

    asyncio.run(body())


@pytest.mark.parametrize("how", ["replay", "rebuild"])
def test_recovery_and_rebuild_bring_the_links_back_once(tmp_path: Path, how: str) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        store = _open(data)
        _seed(store)
        await store.log.flush_now()
        expected = {(t, q): _queue(store, t, q) for t, q in (("orders", 0), ("orders", 1), ("pay", 0))}
        store.close()
        if how == "replay":
            (data / files.CHECKPOINT).unlink()  # replay the whole log over the queues it made
        else:
            MessageStore.wipe_derived(data)  # no queues: rebuilt from the log
        store = _open(data)
        try:
            assert {(t, q): _queue(store, t, q) for t, q in expected} == expected
        finally:
            store.close()
        assert check_data_dir(data).ok

    asyncio.run(body())


def test_a_torn_link_record_takes_its_entries_with_it(tmp_path: Path) -> None:
    """The link record's queue entries name it, not the records it links: a torn tail that took
    the link record drops them at recovery, as it drops a lost record's own entry (an entry
    naming the older linked record would have outlived the link that put it there)."""
    async def body() -> None:
        data = tmp_path / "data"
        store = _open(data)
        _seed(store)
        await store.log.flush_now()
        [link] = [m for m in store.scan(0) if m.topic == LINKS_TOPIC]
        store.close()
        seg = sorted((data / files.COMMITLOG_DIR).iterdir())[0]
        with open(seg, "r+b") as f:
            f.truncate(24 + link.position + link.size // 2)
        store = _open(data)
        try:
            assert store.log.end_position == link.position
            assert [store.queue(t, q).next_offset for t, q in (("orders", 0), ("orders", 1), ("pay", 0))] == [0, 0, 0]
            assert store.queue("waiting", 0).next_offset == 3
        finally:
            store.close()

    asyncio.run(body())


def test_check_holds_the_queues_to_the_links(tmp_path: Path) -> None:
    async def body() -> None:
        data = tmp_path / "data"
        store = _open(data)
        _seed(store)
        await store.log.flush_now()
        store.close()
        assert check_data_dir(data).ok
        # A link entry that names another link of the record: check says the queue and log differ.
        qfile = next((data / files.QUEUES_DIR / "pay" / "0").iterdir())
        raw = bytearray(qfile.read_bytes())
        position, size, th = struct.unpack_from(">QII", raw, 24)
        entry = ENTRY.pack(position, size ^ 1, th)
        raw[24:44] = entry + struct.pack(">I", crc32c.crc32c(entry))
        qfile.write_bytes(bytes(raw))
        report = check_data_dir(data)
        assert any("pay/0 offset 0 says" in p for p in report.problems), report.problems

    asyncio.run(body())


def test_a_batch_too_big_for_one_record_splits_into_records_that_fit() -> None:
    """A fire step of thousands of links becomes several link records, each within the largest
    record the broker writes, in order, every link kept once."""
    batch = _batch([(i * 100, 80, f"topic-{i % 7}", None, None, i) for i in range(1_000)])
    parts = batch.split(4096, 65_535)
    assert len(parts) > 1 and [p for part in parts for p in part.positions] == batch.positions
    for part in parts:
        body = encode_links(part, [0] * len(part), list(range(len(part))))
        assert 72 + len(LINKS_TOPIC) + len(body) <= 4096
    assert batch.split(1 << 20, 65_535)[0].positions == batch.positions  # one record when it fits
    # At most `max_links` a record too (`timer_links_per_record`), whatever room is left.
    parts = batch.split(1 << 20, 128)
    assert [len(part) for part in parts] == [128] * 7 + [104]
    assert [p for part in parts for p in part.positions] == batch.positions
    assert [len(part) for part in batch.split(4096, 50)] == [50] * 20
