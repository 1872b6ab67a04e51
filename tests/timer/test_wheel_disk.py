"""The file wheel on disk stays bounded while timers keep firing.

Its TimerLog and facts journal are append-only; a rewrite into a new generation (`rewrite()`)
keeps only what the engine still knows (pending timers, finished ones until pruned). Here timers
are added, fired and pruned round after round, as a broker with retention does, and the files'
size is measured after each round: it must level off, not grow with the timers ever indexed.
"""

from __future__ import annotations

from pathlib import Path

from chronoq.timer.engine import IndexBatch, TimerEntry
from chronoq.timer.wheel import WheelTimerEngine

T0 = 1_700_000_000_000


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if not p.name.startswith("timerwheel."))


def test_files_level_off_while_timers_keep_firing(tmp_path: Path) -> None:
    engine = WheelTimerEngine.open(tmp_path / "w", slots=3600, checkpoint_bytes=256 << 10)
    position, now, sizes, generations = 100, T0, [], set()
    try:
        for _round in range(200):
            adds = []
            for i in range(500):
                adds.append(TimerEntry(now + 1_000 + i, position, 200, f"id-{position}", "orders", now))
                position += 100
            engine.apply(IndexBatch(adds=adds, indexed_position=position))
            now += 2_000
            due = engine.due(now, 10_000)
            assert len(due) == 500
            engine.apply(IndexBatch(fired=[(e.position, now) for e in due], indexed_position=position + 100))
            position += 100
            engine.prune_history(now - 10_000)  # a retention of 10 s: ~5 rounds of fired timers kept
            sizes.append(_disk_bytes(tmp_path / "w"))
            generations.add(engine.generation)
        # 100,000 timers went through; without rewrites the files would hold ~25 MB of them.
        assert len(generations) > 5
        assert max(sizes[100:]) < 2 * max(sizes[:100]), sizes[::20]
        assert max(sizes) < 4 << 20
        assert engine.pending_total == 0
    finally:
        engine.close()
    reopened = WheelTimerEngine.open(tmp_path / "w", slots=3600, checkpoint_bytes=256 << 10)
    try:
        assert reopened.pending_total == 0 and reopened.indexed_position == position
        assert reopened.lookup("orders", f"id-{position - 200}") is not None  # fired, not yet pruned
    finally:
        reopened.close()


def test_rolls_move_on_a_chunk_a_step_and_fire_in_order(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Far timers (beyond a 10 s window) wait in the window's last slot with ROLL and are linked
    again a chunk (here 3) per `due()`; whatever the chunking, `due()` hands timers out in due
    order, none early, and a step with rolls left returns only what precedes them."""
    from chronoq.timer import wheel as wheel_module

    monkeypatch.setattr(wheel_module, "_RELINK_CHUNK", 3)
    engine = WheelTimerEngine.open(tmp_path / "w", slot_ms=1000, slots=10)
    try:
        dues = [T0 + 500 + 7_919 * i % 40_000 for i in range(25)]
        adds = [TimerEntry(d, 100 * (i + 1), 100, f"id-{i}", "orders", T0) for i, d in enumerate(dues)]
        engine.apply(IndexBatch(adds=adds, indexed_position=100 * 30))
        got: list[int] = []
        now, position = T0, 100 * 30
        while len(got) < len(dues):
            due = engine.due(now, 4)
            assert all(e.deliver_at_ms <= now for e in due)
            if due:
                got.extend(e.deliver_at_ms for e in due)
                position += 100
                engine.apply(IndexBatch(fired=[(e.position, now) for e in due], indexed_position=position))
            else:
                now += 250
        assert got == sorted(dues)
    finally:
        engine.close()
