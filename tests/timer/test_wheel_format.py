"""The file wheel's bytes, as docs/disk-format.md ("File wheel") states them.

A wheel is written through the engine (a timer placed, one rolled beyond the window, one
cancelled, one fired, a delay level's progress, a link copy), closed, and its files are read
back with nothing but `struct` and `crc32c`, field by field, against the document's layouts.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from crc32c import crc32c

import chronoq
from chronoq.timer import wheel_files as wf
from chronoq.timer.engine import IndexBatch, TimerEntry
from chronoq.timer.wheel import WheelTimerEngine

T0 = 1_700_000_000_000
SLOT_MS, SLOTS = 1000, 64
DOC = Path(chronoq.__file__).resolve().parents[1] / "docs" / "disk-format.md"


def _entry(position: int, due: int, message_id: str, keys: tuple[str, ...] = ()) -> TimerEntry:
    return TimerEntry(due, position, 120, message_id, "orders", T0, keys, tag_hash=7, queue_id=2, group_hash=None)


def test_the_files_hold_what_the_document_says(tmp_path: Path) -> None:
    engine = WheelTimerEngine.open(tmp_path / "w", slot_ms=SLOT_MS, slots=SLOTS)
    near = _entry(100, T0 + 2_500, "near", keys=("k1",))
    far = _entry(200, T0 + 100_000, "far")  # beyond the 64 s window: a ROLL placement
    gone = _entry(300, T0 + 3_000, "gone")
    engine.apply(IndexBatch(adds=[near, far, gone], level_progress={3: 9},
                            link_copies=[(350, T0, b"link-body")], indexed_position=400))
    engine.apply(IndexBatch(cancels=[("orders", "gone", T0 + 10, 400, T0 + 3_000)], indexed_position=500))
    assert engine.due(T0 + 2_500, 10) == [near]
    engine.apply(IndexBatch(fired=[(100, T0 + 2_501)], indexed_position=600))
    engine.close()
    d = tmp_path / "w"

    # checkpoint: magic, crc32c of the rest, then the fixed fields.
    raw = (d / "timercheck").read_bytes()
    assert len(raw) == 72 and raw[:8] == b"CQWHEEL1"
    assert struct.unpack(">I", raw[8:12])[0] == crc32c(raw[12:])
    version, gen, indexed, log_end, facts_end, zero, read_slot, slot_ms, slots = struct.unpack(">IIQQQQqqI", raw[12:])
    assert (version, gen, indexed, zero, slot_ms, slots) == (1, 0, 600, 0, SLOT_MS, SLOTS)
    assert read_slot == T0 + 2_000  # the earliest slot still holding a pending timer ("far", rolled)... or now

    # TimerLog: 52-byte units, in the order they were written.
    log = (d / "timerlog.0").read_bytes()
    assert len(log) == log_end and log_end % 52 == 0
    units = [struct.unpack(">iqiqiqiiq", log[i:i + 52]) for i in range(0, len(log), 52)]
    topic_hash = struct.unpack(">i", struct.pack(">I", crc32c(b"orders")))[0]
    assert all(u[0] == 52 and u[7] == topic_hash and u[6] == 120 for u in units)
    by = {(u[5], u[2]): u for u in units}
    n = by[(100, 1)]  # DEFAULT placement of "near": slot T0+2000, delay 500
    assert (n[1], n[3], n[4]) == (-1, T0 + 2_000, 500)
    f = by[(200, 2)]  # ROLL: the window's last slot, delay to its real due time
    assert f[3] == T0 + 63_000 and f[3] + f[4] == T0 + 100_000
    c = by[(300, 4)]  # DELETE, chained after "gone"'s placement in slot T0+3000, reserved = cancelled ms
    assert c[3] == T0 + 3_000 and c[8] == T0 + 10 and c[1] == log.index(struct.pack(">iq", 52, -1) + struct.pack(
        ">i", 1) + struct.pack(">q", T0 + 3_000))
    done = by[(100, 8)]  # DONE, chained after "near"'s placement, reserved = fired ms
    assert done[3] == T0 + 2_000 and done[8] == T0 + 2_501 and done[1] == units.index(n) * 52

    # TimerWheel: 32-byte slots, slot i for (t // slot_ms) % slots.
    table = (d / "timerwheel.0").read_bytes()
    assert len(table) == 32 * SLOTS
    i = (T0 + 2_000) // SLOT_MS % SLOTS
    assert struct.unpack(">qqqii", table[32 * i:32 * i + 32]) == (T0 + 2_000, units.index(n) * 52,
                                                                   units.index(done) * 52, 2, 0)

    # facts journal: length · crc32c · kind · payload.
    facts = (d / "timerfacts.0").read_bytes()
    assert len(facts) == facts_end
    records, at = [], 0
    while at < len(facts):
        length, crc = struct.unpack(">II", facts[at:at + 8])
        body = facts[at + 8:at + 8 + length]
        assert crc32c(body) == crc
        records.append((at, body[0], body[1:]))
        at += 8 + length
    kinds = [k for _, k, _ in records]
    assert kinds == [1, 1, 1, 2, 4]
    at_near, _, payload = records[0]
    assert n[8] == at_near  # a placement's reserved field points at its facts record
    fixed = struct.unpack(">QIQqIiqq", payload[:52])
    assert fixed == (100, 120, T0 + 2_500, T0, 7, 2, -1, -1)
    rest = payload[52:]
    assert rest == b"\x00\x06orders" + b"\x00\x04near" + b"\x00\x01" + b"\x00\x02k1"
    assert records[3][2] == struct.pack(">HQ", 3, 9)
    assert records[4][2] == struct.pack(">QQ", 350, T0) + b"link-body"


def test_the_document_states_the_sizes_in_code() -> None:
    text = DOC.read_text()
    section = text[text.index("## File wheel"):text.index("## Recall handle")]
    assert re.search(r"append-only units, each (\d+) bytes", section).group(1) == str(wf.UNIT_SIZE)
    assert re.search(r"slots of (\d+) bytes", section).group(1) == str(wf.SLOT_SIZE)
    assert re.search(r"\(`timercheck`, RocketMQ's name\), (\d+) bytes", section).group(1) == str(
        len(wf.Checkpoint(0, 0, 0, 0, 0, 1, 1).encode()))
    for value, name in ((1, "DEFAULT"), (2, "ROLL"), (4, "DELETE"), (8, "DONE"), (16, "DAMAGED")):
        assert f"{value} {name}" in section
