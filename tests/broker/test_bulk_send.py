"""The bulk send (`Broker.send_columns`): per-row admission identical to a single send, dedupe by
id, nothing stored for a refused row, and the reply only after the group commit's fsync.

Every bad message of `test_admission.BAD` that columns can carry (topic, body, id, tag, keys,
properties, a deliver-at or a delay) is sent as one row among good ones: it gets the very error
`Broker.send` raises (class, code, text, values), the good rows are stored densely, and nothing
else changes. `prepare_columns` is checked against `prepare` row by row on generated rows.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq import errors
from chronoq.config import DAY_MS, Config
from chronoq.model import TIMER_TOPIC, OutgoingMessage, SendResult
from chronoq.store import files
from chronoq.timer.levels import DelayLevels
from chronoq.validate import prepare, prepare_columns
from tests.broker.test_admission import BAD, LIMITS, limited_broker, msg, snapshot

NOW = 1_800_000_000_000

COLUMN_FIELDS = {"topic", "body", "message_id", "tag", "keys", "properties", "deliver_at_ms", "delay_ms"}


def _columnable(m: OutgoingMessage) -> bool:
    defaults = OutgoingMessage(topic="x", body=b"x")
    return all(getattr(m, f) == getattr(defaults, f) for f in ("delay_level", "message_group", "born_ms",
                                                                "queue_id", "message_type")) \
        and not (m.deliver_at_ms is not None and m.delay_ms is not None)


COLUMN_BAD = [c for c in BAD if _columnable(c[1])]


def _columns(rows: list[OutgoingMessage]) -> dict[str, Any]:
    """`rows` (one topic, one kind of due time) as `send_columns`'s arguments."""
    kind = "deliver_at_ms" if any(r.deliver_at_ms is not None for r in rows) else \
        "delay_ms" if any(r.delay_ms is not None for r in rows) else None
    return {"topic": rows[0].topic, "ids": [r.message_id for r in rows], "bodies": [r.body for r in rows],
            "due_kind": kind, "due": [getattr(r, kind) for r in rows] if kind else None,
            "tags": [r.tag or "" for r in rows], "keys": [tuple(r.keys) for r in rows],
            "properties": [dict(r.properties) for r in rows]}


def _same_error(a: BaseException, b: BaseException) -> bool:
    return (type(a), str(a), getattr(a, "code", None), getattr(a, "details", None)) == \
        (type(b), str(b), getattr(b, "code", None), getattr(b, "details", None))


def test_every_column_field_is_covered_by_some_bad_case() -> None:
    assert len(COLUMN_BAD) >= 30
    assert {"tag", "keys", "properties", "delay_ms", "deliver_at_ms", "message_id"} <= {
        f for _, m, _ in COLUMN_BAD for f in COLUMN_FIELDS if getattr(m, f) not in (None, (), {}, "")}


@pytest.mark.parametrize(("case", "bad", "error"), COLUMN_BAD, ids=[c for c, _, _ in COLUMN_BAD])
def test_a_bad_row_gets_the_error_of_a_single_send_and_changes_nothing_else(
        case: str, bad: OutgoingMessage, error: type, make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config)
        try:
            with pytest.raises(error) as single:
                await broker.send(bad)
            before = snapshot(broker)
            # The good rows carry a valid due time of the bad row's kind (one column, one kind).
            kind = {"deliver_at_ms": broker.now_ms() + 1000} if bad.deliver_at_ms is not None else \
                {"delay_ms": 1000} if bad.delay_ms is not None else {}
            good = [msg(topic=bad.topic, message_id=f"good-{i}", **kind) for i in (1, 2)]
            out = await broker.send_columns(**_columns([good[0], bad, good[1]]))
            assert _same_error(out[1], single.value), (case, out[1], single.value)
            if error in (errors.InvalidTopicName, errors.SystemTopicForbidden, errors.MessageTypeNotAccepted):
                # A refusal that is the topic's refuses every row, as every message of a batch.
                assert all(type(o) is error for o in out), case
                assert snapshot(broker) == before, case
                return
            assert [type(o) for o in (out[0], out[2])] == [SendResult, SendResult], (case, out)
            assert (out[0].message_id, out[2].message_id) == ("good-1", "good-2")
            assert out[2].position > out[0].position
            stored = sorted([m.message_id for t in (bad.topic, TIMER_TOPIC) for q in range(2)
                             if (t, q) in broker.store.queue_keys() for m in await broker.read(t, q, 0, 10)])
            assert stored == ["good-1", "good-2"], case
        finally:
            await broker.close()

    arun(body())


def test_refused_rows_store_nothing_and_a_refused_request_changes_nothing(make_config: Callable[..., Config],
                                                                         arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config, max_bulk_send_rows=8)
        try:
            before = snapshot(broker)
            out = await broker.send_columns("plain", ["a", "", "b b", "c"], [b"1", b"2", b"3", b""])
            assert [type(o).__name__ for o in out] == ["SendResult", "InvalidMessageId", "InvalidMessageId",
                                                       "MessageBodyEmpty"]
            stored = [m.message_id for q in range(2) for m in await broker.read("plain", q, 0, 10)]
            assert stored == ["a"]
            middle = snapshot(broker)
            assert middle[0] > before[0]
            with pytest.raises(errors.InvalidBatchSize):
                await broker.send_columns("plain", [f"x{i}" for i in range(9)], [b"x"] * 9)
            assert snapshot(broker) == middle
        finally:
            await broker.close()

    arun(body())


def test_duplicates_in_the_request_across_requests_and_against_other_doors(make_config: Callable[..., Config],
                                                                           arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config)
        try:
            now = broker.now_ms()
            first = await broker.send(msg(message_id="sent-alone", deliver_at_ms=now + 5000))
            due = [now + 5000, now + 6000, now + 7000, now + 6000]
            out = await broker.send_columns("orders", ["sent-alone", "new", "new-2", "new"], [b"a", b"b", b"c", b"d"],
                                            due_kind="deliver_at_ms", due=due)
            assert [o.duplicate for o in out] == [True, False, False, True]
            assert out[0].queue_offset == first.queue_offset and out[0].recall_handle == first.recall_handle
            assert out[3].queue_offset == out[1].queue_offset
            again = await broker.send_columns("orders", ["new-2"], [b"other"], due_kind="deliver_at_ms",
                                              due=[now + 9000])
            assert again[0].duplicate and again[0].deliver_at_ms == now + 7000
            batch = await broker.send_batch([msg(message_id="new", deliver_at_ms=now + 6000)])
            assert batch[0].duplicate and batch[0].queue_offset == out[1].queue_offset
            assert broker.pending_total() == 3
        finally:
            await broker.close()

    arun(body())


def test_timers_are_routed_indexed_and_recallable_as_single_sends(make_config: Callable[..., Config],
                                                                  arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config, timer_precision_ms=1000)
        try:
            now = broker.now_ms()
            out = await broker.send_columns("orders", ["t1", "t2"], [b"a", b"b"], due_kind="delay_ms",
                                            due=[1500, 0])
            assert [o.deliver_at_ms for o in out] == [-(-(now + 1500) // 1000) * 1000, -(-now // 1000) * 1000]
            assert all(o.recall_handle for o in out)
            [status] = broker.query("t1", "orders")
            assert status.state.value == "pending" and status.deliver_at_ms == out[0].deliver_at_ms
            await broker.cancel(recall_handle=out[0].recall_handle)
            assert broker.query("t1", "orders")[0].state.value == "cancelled"
        finally:
            await broker.close()

    arun(body())


def test_the_reply_waits_for_the_fsync(make_config: Callable[..., Config], arun: Callable,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The group commit's fdatasync of the segment is held: the bulk send does not return, and
    its records are past the log's durable end and not indexed, until it completes."""
    held, release, armed = threading.Event(), threading.Event(), threading.Event()
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if armed.is_set() and os.readlink(f"/proc/self/fd/{fd}").endswith(files.SEGMENT_SUFFIX):
            armed.clear()
            held.set()
            assert release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)

    async def body() -> None:
        broker = await limited_broker(make_config)
        try:
            now = broker.now_ms()
            armed.set()
            sender = asyncio.create_task(broker.send_columns("orders", ["d1", "d2"], [b"x", b"y"],
                                                             due_kind="deliver_at_ms", due=[now + 1, now + 2]))
            while not held.is_set():
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            assert not sender.done()
            assert broker.store.log.flushed_position < broker.store.log.end_position
            assert broker.query("d1", "orders") == []  # not indexed before it is durable
            release.set()
            out = await asyncio.wait_for(sender, 5)
            assert broker.store.log.flushed_position >= out[1].position + 1
            assert broker.query("d1", "orders")[0].state.value == "pending"
        finally:
            release.set()
            await broker.close()

    arun(body())


_TEXT = st.text(st.characters(codec="utf-8"), max_size=6)
_ROW = st.fixed_dictionaries({
    "message_id": st.one_of(st.sampled_from(["id-1", "id-2", "x" * 41, "", "a b", "é"]), _TEXT),
    "body": st.one_of(st.binary(max_size=8), st.just(b"x" * 1800)),
    "tag": st.one_of(st.just(""), st.sampled_from(["A", "a|b", "  ", "t" * 17]), _TEXT),
    "keys": st.one_of(st.just(()), st.lists(st.one_of(st.just("k"), _TEXT), max_size=4).map(tuple)),
    "properties": st.one_of(st.just({}), st.dictionaries(st.one_of(st.just("p"), _TEXT, st.just("DELAY")),
                                                         st.one_of(st.just("v"), _TEXT), max_size=5)),
    "due": st.one_of(st.integers(-5, 5), st.integers(NOW - DAY_MS, NOW + 2 * DAY_MS),
                     st.integers(1_000_000_000, 1_800_000_000)),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ROW, min_size=1, max_size=6), st.sampled_from(["deliver_at_ms", "delay_ms", None]),
       st.sampled_from(["orders", "bad topic", TIMER_TOPIC]), st.booleans())
def test_prepare_columns_answers_as_prepare_row_by_row(rows: list[dict[str, Any]], kind: str | None, topic: str,
                                                       timers_on: bool) -> None:
    config = Config(**LIMITS, timer_wheel_enable=timers_on, timer_precision_ms=7)
    levels = DelayLevels.from_config(config)
    got = prepare_columns(topic, [r["message_id"] for r in rows], [r["body"] for r in rows], config, NOW, levels,
                          due_kind=kind, due=[r["due"] for r in rows] if kind else None,
                          tags=[r["tag"] for r in rows], keys=[r["keys"] for r in rows],
                          properties=[r["properties"] for r in rows])
    singles = [OutgoingMessage(topic=topic, body=r["body"], message_id=r["message_id"], tag=r["tag"] or None,
                               keys=r["keys"], properties=r["properties"], **({kind: r["due"]} if kind else {}))
               for r in rows]
    _assert_answers_as_prepare(singles, got, config, levels)


def _assert_answers_as_prepare(singles: list[OutgoingMessage], got: list[Any], config: Config,
                               levels: DelayLevels) -> None:
    """Each row's outcome is what `prepare` gives the same message alone: its result, or its error."""
    for single, outcome in zip(singles, got, strict=True):
        try:
            expected: Any = prepare(single, config, NOW, levels)
        except errors.ChronoqError as e:
            assert isinstance(outcome, errors.ChronoqError), (single, outcome, e)
            assert _same_error(outcome, e), (single, outcome, e)
            continue
        assert not isinstance(outcome, errors.ChronoqError), (single, outcome)
        assert outcome == expected


_USUAL_ROW = st.fixed_dictionaries({
    # Mostly rows that pass, so whole batches take the column-at-a-time check; now and then a
    # row at or past a limit, so the check must see it and leave the batch to the row loop.
    "message_id": st.one_of(st.from_regex(r"[A-Za-z0-9_.:-]{1,12}", fullmatch=True),
                            st.sampled_from(["x" * 40, "x" * 41, "", "a b", "é", "\x7f", "~!"])),
    "body": st.one_of(st.binary(min_size=1, max_size=8), st.sampled_from([b"", b"x" * 1800, b"x" * 5000])),
    "due": st.one_of(st.integers(NOW - DAY_MS, NOW + 2 * DAY_MS), st.integers(-3, 3),
                     st.sampled_from([999_999_999, 1_000_000_000, 99_999_999_999, 100_000_000_000,
                                      NOW + 3 * DAY_MS, 2 * DAY_MS, 3 * DAY_MS, True])),
})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_USUAL_ROW, min_size=1, max_size=6), st.sampled_from(["deliver_at_ms", "delay_ms", None]),
       st.booleans(), st.sampled_from([1, 7, 1000]), st.sampled_from([None, "empty"]))
def test_a_batch_judged_a_column_at_a_time_answers_as_prepare_row_by_row(
        rows: list[dict[str, Any]], kind: str | None, timers_on: bool, precision: int, extras: str | None) -> None:
    """The common bulk send (bytes bodies, text ids, no tags, keys or properties, the optional
    columns absent or all empty) is judged by whole-column checks; its answer is what `prepare`
    gives each row, and a batch with any row outside a rule gets each row's own error."""
    config = Config(**LIMITS, timer_wheel_enable=timers_on, timer_precision_ms=precision)
    levels = DelayLevels.from_config(config)
    n = len(rows)
    got = prepare_columns("orders", [r["message_id"] for r in rows], [r["body"] for r in rows], config, NOW, levels,
                          due_kind=kind, due=[r["due"] for r in rows] if kind else None,
                          tags=[""] * n if extras else None, keys=[()] * n if extras else None,
                          properties=[{}] * n if extras else None)
    singles = [OutgoingMessage(topic="orders", body=r["body"], message_id=r["message_id"],
                               **({kind: r["due"]} if kind else {})) for r in rows]
    _assert_answers_as_prepare(singles, got, config, levels)


def test_the_column_at_a_time_check_takes_a_batch_that_passes_and_leaves_one_that_does_not() -> None:
    """The lane is taken when it may be (so the test above covers it), and a single bad row, last
    of 4,096, leaves the batch to the row loop, which refuses that row alone."""
    from chronoq.store.record import HEADER_SIZE
    from chronoq.validate import _usual_columns

    config = Config(**LIMITS)
    ids = [f"r{i}" for i in range(4096)]
    bodies = [b"pay"] * 4096
    due = [NOW + 60_000 + i for i in range(4096)]
    args = (config, NOW, "deliver_at_ms")
    fixed_size = HEADER_SIZE + len("orders") + 256
    assert _usual_columns("orders", fixed_size, ids, bodies, *args, due, None, None, None) is not None
    for bad_ids, bad_bodies, bad_due in (([*ids[:-1], "a b"], bodies, due), (ids, [*bodies[:-1], b""], due),
                                         (ids, bodies, [*due[:-1], NOW + 40 * DAY_MS]),
                                         (ids, bodies, [*due[:-1], 1_700_000_000])):
        assert _usual_columns("orders", fixed_size, bad_ids, bad_bodies, *args, bad_due, None, None, None) is None
        got = prepare_columns("orders", bad_ids, bad_bodies, config, NOW, DelayLevels.from_config(config),
                              due_kind="deliver_at_ms", due=bad_due)
        assert [isinstance(o, errors.ChronoqError) for o in got] == [False] * 4095 + [True]
