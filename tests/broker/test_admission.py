"""Bad input gets its specific error and stores nothing.

Every rule of `chronoq/validate.py` (and the broker's topic-dependent rules) is exercised through
`Broker.send`, `send_batch` (all-or-nothing) and `send_batch(partial=True)` (per-message). After
each refusal the commit log's end, the topic table and every queue are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronoq import errors
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import DAY_MS, Config
from chronoq.model import (
    SCHEDULE_TOPIC,
    SYS_REAL_TOPIC,
    TIMER_TOPIC,
    MessageType,
    OutgoingMessage,
)
from chronoq.store.messagestore import MessageStore
from chronoq.timer.levels import DelayLevels
from chronoq.validate import prepare
from tests.support.brokers import open_broker

LIMITS = dict(max_message_size_bytes=2048, max_properties_size_bytes=512, max_property_count=4, max_keys_count=3,
              max_tag_length=16, max_message_id_length=40, max_topic_name_length=20, timer_max_delay_ms=DAY_MS)


def msg(**changes: Any) -> OutgoingMessage:
    fields: dict[str, Any] = {"topic": "orders", "body": b"ok"}
    return OutgoingMessage(**{**fields, **changes})


BAD: list[tuple[str, OutgoingMessage, type[errors.ChronoqError]]] = [
    ("empty topic name", msg(topic=""), errors.InvalidTopicName),
    ("topic name too long", msg(topic="t" * 21), errors.InvalidTopicName),
    ("topic name with a space", msg(topic="a b"), errors.InvalidTopicName),
    ("topic name ending in a newline", msg(topic="ab\n"), errors.InvalidTopicName),
    ("topic name with a slash", msg(topic="a/b"), errors.InvalidTopicName),
    ("topic name not text", msg(topic=5), errors.InvalidTopicName),
    ("timer system topic", msg(topic=TIMER_TOPIC), errors.SystemTopicForbidden),
    ("schedule system topic", msg(topic=SCHEDULE_TOPIC), errors.SystemTopicForbidden),
    ("body not bytes", msg(body="text"), errors.InvalidProperty),
    ("empty body", msg(body=b""), errors.MessageBodyEmpty),
    ("oversized body", msg(body=b"x" * 2048), errors.MessageTooLarge),
    ("body just over the limit", msg(body=b"x" * (2048 - 72 - 256 - 6 - 31)), errors.MessageTooLarge),
    ("multi-byte tag pushes the record over", msg(body=b"x" * 1650, tag="€" * 16), errors.MessageTooLarge),
    ("huge message group", msg(message_group="g" * 3000), errors.MessageTooLarge),
    ("message group not text", msg(message_group=7), errors.InvalidProperty),
    ("empty message id", msg(message_id=""), errors.InvalidMessageId),
    ("message id too long", msg(message_id="i" * 41), errors.InvalidMessageId),
    ("message id with a space", msg(message_id="a b"), errors.InvalidMessageId),
    ("message id with a control character", msg(message_id="a\x01"), errors.InvalidMessageId),
    ("tag too long", msg(tag="t" * 17), errors.InvalidTag),
    ("tag with a bar", msg(tag="a|b"), errors.InvalidTag),
    ("tag with a newline", msg(tag="a\nb"), errors.InvalidTag),
    ("blank tag", msg(tag="  "), errors.InvalidTag),
    ("too many keys", msg(keys=("a", "b", "c", "d")), errors.InvalidKeys),
    ("empty key", msg(keys=("",)), errors.InvalidKeys),
    ("key with NUL", msg(keys=("a\x00b",)), errors.InvalidKeys),
    ("keys too long for the record format", msg(keys=("k" * 40_000, "k" * 40_000)), errors.InvalidKeys),
    ("too many properties", msg(properties={f"p{i}": "v" for i in range(5)}), errors.PropertiesTooLarge),
    ("properties too large", msg(properties={"p": "v" * 600}), errors.PropertiesTooLarge),
    ("empty property key", msg(properties={"": "v"}), errors.InvalidProperty),
    ("property key with a control character", msg(properties={"a\tb": "v"}), errors.InvalidProperty),
    ("property value with NUL", msg(properties={"a": "v\x00"}), errors.InvalidProperty),
    ("property value not text", msg(properties={"a": 1}), errors.InvalidProperty),
    ("reserved property", msg(properties={SYS_REAL_TOPIC: "x"}), errors.ReservedProperty),
    ("reserved property prefix", msg(properties={"__CHRONOQ_X": "x"}), errors.ReservedProperty),
    # A lone surrogate (JSON's "\\ud800") is text to Python but not UTF-8: the record's
    # encoding failed after admission (an internal error; a timer's slot stayed reserved).
    ("tag with a lone surrogate", msg(tag="a\ud800"), errors.InvalidTag),
    ("key with a lone surrogate", msg(keys=("k\udfff",)), errors.InvalidKeys),
    ("property key with a lone surrogate", msg(properties={"\ud800": "v"}), errors.InvalidProperty),
    ("property value with a lone surrogate", msg(properties={"a": "\ud800"}), errors.InvalidProperty),
    ("message group with a lone surrogate", msg(message_group="g\ud800"), errors.InvalidProperty),
    ("message group with a control character", msg(message_group="g\n"), errors.InvalidProperty),
    ("negative born time", msg(born_ms=-1), errors.InvalidProperty),
    ("born time past u63", msg(born_ms=2**63), errors.InvalidProperty),
    # Microseconds where ms belong: the year 58869, which no date holds (the Spark reader failed
    # on every read of the topic, for good).
    ("born time past the year 9999", msg(born_ms=1_795_560_000_000_000), errors.InvalidProperty),
    ("two delivery times", msg(delay_ms=5, deliver_at_ms=10), errors.ConflictingDelivery),
    ("delay field and delay property", msg(delay_ms=5, properties={"TIMER_DELAY_SEC": "3"}),
     errors.ConflictingDelivery),
    ("delay property not a number", msg(properties={"TIMER_DELAY_MS": "soon"}), errors.InvalidProperty),
    ("deliver-at before the epoch", msg(deliver_at_ms=-1), errors.InvalidDeliveryTime),
    ("negative delay", msg(delay_ms=-1), errors.NegativeDelay),
    ("delay beyond timer_max_delay_ms", msg(delay_ms=DAY_MS + 1), errors.DeliveryTimeTooFar),
    ("delay seconds beyond the limit", msg(properties={"TIMER_DELAY_SEC": str(DAY_MS // 1000 + 1)}),
     errors.DeliveryTimeTooFar),
    ("delay level 0", msg(delay_level=0), errors.InvalidDelayLevel),
    ("queue id past the topic's queues", msg(queue_id=2), errors.InvalidQueueId),
    ("negative queue id", msg(queue_id=-1), errors.InvalidQueueId),
    ("message type the topic refuses", msg(topic="plain", delay_ms=1000), errors.MessageTypeNotAccepted),
    ("FIFO on a NORMAL-only topic", msg(topic="plain", message_group="g1"), errors.MessageTypeNotAccepted),
]


def snapshot(broker: Broker) -> tuple:
    store = broker.store
    queues = sorted((k, store.queue(*k).next_offset) for k in store.queue_keys())
    return store.log.end_position, dict(store.topics), queues


async def limited_broker(make_config: Callable[..., Config], **overrides: Any) -> Broker:
    broker = await open_broker(make_config(**{**LIMITS, **overrides}), clock=FakeClock(), background=False)
    await broker.create_topic("plain", 2, [MessageType.NORMAL])
    return broker


@pytest.mark.parametrize(("case", "bad", "error"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_message_is_refused_and_stores_nothing(case: str, bad: OutgoingMessage, error: type,
                                                   make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config)
        try:
            before = snapshot(broker)
            with pytest.raises(error) as info:
                await broker.send(bad)
            assert type(info.value) is error, f"{case}: {type(info.value).__name__} is too general"
            assert info.value.code >= 40000 and str(info.value)
            assert snapshot(broker) == before, case
            # All-or-nothing batch: the good message before it is not stored either.
            with pytest.raises(error):
                await broker.send_batch([msg(message_id="good-1"), bad])
            assert snapshot(broker) == before, case
            # Per-message batch: the bad one gets its error, the good ones are stored densely.
            out = await broker.send_batch([msg(message_id="good-2", queue_id=0), bad,
                                           msg(message_id="good-3", queue_id=0)], partial=True)
            assert type(out[1]) is error
            assert [r.queue_offset for r in (out[0], out[2])] == [0, 1]
            assert [m.message_id for m in await broker.read("orders", 0, 0, 10)] == ["good-2", "good-3"]
        finally:
            await broker.close()

    arun(body())


def test_unknown_topic_with_auto_create_off(make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config, auto_create_topics=False)
        try:
            before = snapshot(broker)
            for call in (broker.send(msg(topic="nope")), broker.send(msg(topic="nope", queue_id=9)),
                         broker.send(msg(topic="nope", delay_ms=1000)),
                         broker.receive("g", "nope")):
                with pytest.raises(errors.TopicNotFound):
                    await call
            with pytest.raises(errors.TopicNotFound):
                broker.get_topic("nope")
            assert snapshot(broker) == before
            assert [t.name for t in broker.list_topics()] == ["plain"]
        finally:
            await broker.close()

    arun(body())


def test_timer_disabled(make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config, timer_wheel_enable=False)
        try:
            before = snapshot(broker)
            for bad in (msg(delay_ms=1000), msg(topic="fresh", delay_level=2), msg(deliver_at_ms=10**12),
                        msg(properties={"TIMER_DELIVER_MS": "1"})):
                with pytest.raises(errors.TimerDisabled):
                    await broker.send(bad)
            assert snapshot(broker) == before
            await broker.send(msg())  # normal messages still go through
        finally:
            await broker.close()

    arun(body())


def test_batch_too_large(make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config, max_send_batch=3)
        try:
            before = snapshot(broker)
            with pytest.raises(errors.InvalidBatchSize):
                await broker.send_batch([msg(message_id=f"m{i}") for i in range(4)])
            assert snapshot(broker) == before
            assert len(await broker.send_batch([msg(message_id=f"m{i}") for i in range(3)])) == 3
        finally:
            await broker.close()

    arun(body())


def test_refused_batches_leave_queue_offsets_dense_across_restart(make_config: Callable[..., Config],
                                                                   arun: Callable,
                                                                   assert_queues_match_log: Callable) -> None:
    async def body() -> None:
        broker = await limited_broker(make_config)
        for i, (_case, bad, _error) in enumerate(BAD):
            await broker.send_batch([msg(message_id=f"a{i}", queue_id=1), bad, msg(message_id=f"b{i}", queue_id=1)],
                                    partial=True)
        await broker.close()
        store, report = MessageStore.open(make_config(**LIMITS))
        try:
            assert report.rebuilt_queues == []
            assert assert_queues_match_log(store) == 2 * len(BAD)
            assert store.queue("orders", 1).next_offset == 2 * len(BAD)
        finally:
            store.close()

    arun(body())


# -- the size limit is about encoded bytes ------------------------------------------------------

texts = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=40)


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(body_len=st.integers(1, 2048), tag=texts, message_id=st.text(st.characters(
    blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp", "Cf", "Co", "Cn")), min_size=1, max_size=40),
       keys=st.lists(texts.filter(bool), max_size=3), props=st.dictionaries(texts.filter(bool), texts, max_size=4),
       group=st.none() | texts.filter(bool))
def test_accepted_messages_fit_the_size_limit(body_len: int, tag: str, message_id: str, keys: list[str],
                                              props: dict[str, str], group: str | None) -> None:
    """Whatever admission accepts encodes to at most max_message_size_bytes."""
    config = Config(**{**LIMITS, "max_tag_length": 40})
    out = msg(body=b"x" * body_len, tag=tag, message_id=message_id, keys=tuple(keys), properties=props,
              message_group=group)
    try:
        prepared, _ = prepare(out, config, 1_700_000_000_000, DelayLevels.from_config(config))
    except errors.BadRequest:
        return
    blob = MessageStore._encode(prepared, 255, 2**40, 2**50, 1_700_000_000_000)
    assert len(blob) <= config.max_message_size_bytes


def test_a_batch_that_fails_unexpectedly_gives_back_its_timer_slots(make_config: Callable[..., Config],
                                                                    arun: Callable, monkeypatch: Any) -> None:
    """With `timer_congest_num_each_slot` on, each timer of a batch reserves its place in its
    second while the batch is admitted. An error that is not a refusal (an unexpected exception
    in admission, raised here) used to leave the places taken: that second refused every later
    timer as congested."""
    import chronoq.accept

    async def body() -> None:
        broker = await limited_broker(make_config, timer_congest_num_each_slot=1)
        try:
            due = broker.clock.now_ms() + 60_000
            real_prepare = chronoq.accept.prepare

            def prepare_fails_on_the_second(m: OutgoingMessage, *args: Any) -> Any:
                if m.message_id == "second":
                    raise RuntimeError("injected: an admission bug")
                return real_prepare(m, *args)

            monkeypatch.setattr(chronoq.accept, "prepare", prepare_fails_on_the_second)
            with pytest.raises(RuntimeError, match="injected"):
                await broker.send_batch([msg(message_id="first", deliver_at_ms=due),
                                         msg(message_id="second", deliver_at_ms=due)])
            monkeypatch.setattr(chronoq.accept, "prepare", real_prepare)
            sent = await broker.send(msg(message_id="later", deliver_at_ms=due))
            assert sent.deliver_at_ms == due
        finally:
            await broker.close()

    arun(body())
