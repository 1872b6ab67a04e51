"""Topic names that forgive typos (`chronoq/topics.py`, "Near names").

The nearness rule on its own (distances, case, short names, numbers, the order of several
candidates, system topics never suggested), then the broker: a send to a missing topic near an
existing one is refused through every door (in process, gRPC SendMessage, admin SendBatch) with
`TopicNameTooNear` naming the near topic, and nothing is created or stored; the sender's ask
(`create_near_topics`, SendBatch's `create_topic`, the SDK's `create_topics=True`) and the
server's `auto_create_topic_near_names` create it; a name near none is auto-created as before;
a consumer, a describe and a route query of a missing near name are told the near topic.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronoq import errors
from chronoq.broker import Broker
from chronoq.client.errors import from_status
from chronoq.clock import FakeClock
from chronoq.config import Config
from chronoq.model import SCHEDULE_TOPIC, SYSTEM_TOPICS, TIMER_TOPIC, OutgoingMessage
from chronoq.protocol.v2 import definition, service
from chronoq.topics import MAX_NEAR_NAMES, edit_distance, max_distance, near_names, siblings
from tests.support.brokers import open_broker
from tests.support.grpc_server import running

NOW_MS = 1_800_000_000_000


def reference_distance(a: str, b: str) -> int:
    """Optimal string alignment, the textbook full matrix: what `edit_distance` must agree with."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        d[i][0] = i
    for j in range(len(b) + 1):
        d[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


# -- the distance ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b", "distance"), [
    ("orders", "orders", 0),
    ("orders", "ordres", 1),    # neighbours swapped: one edit
    ("orders", "ordrs", 1),     # one left out
    ("orders", "orderss", 1),   # one doubled
    ("orders", "orderz", 1),    # one replaced
    ("orders", "odrres", 2),    # two swaps
    ("orders", "rodres", 2),
    ("kitten", "sitting", 3),
    ("ca", "abc", 3),           # optimal string alignment: a swapped pair is not edited again
    ("", "abc", 3),
])
def test_edit_distance_of_known_pairs(a: str, b: str, distance: int) -> None:
    assert reference_distance(a, b) == distance
    assert edit_distance(a, b, 3) == distance
    assert edit_distance(a, b, distance) == distance
    if distance:
        assert edit_distance(a, b, distance - 1) is None


def test_edit_distance_agrees_with_the_full_matrix() -> None:
    """The banded, early-stopping computation gives the full matrix's answer, or None past the limit."""
    rng = random.Random(7)
    for _ in range(5000):
        a = "".join(rng.choice("abc-") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("abc-") for _ in range(rng.randint(0, 9)))
        limit = rng.randint(0, 4)
        want = reference_distance(a, b)
        assert edit_distance(a, b, limit) == (want if want <= limit else None), (a, b, limit)


def test_max_distance_by_length() -> None:
    assert [max_distance(n) for n in range(1, 8)] == [0, 0, 1, 1, 2, 2, 2]


# -- the rule ----------------------------------------------------------------------------------------


EXISTING = ["orders", "payments", "events", "orders-eu", "shard-1", "t1", "ab", "job", "Invoices", "t-a"]


@pytest.mark.parametrize(("name", "near"), [
    ("ordres", ["orders"]),          # the typo the rule is for
    ("ordrs", ["orders"]),
    ("odrres", ["orders"]),          # two edits, 5+ characters
    ("payemnts", ["payments"]),
    ("ORDERS", ["orders"]),          # case alone
    ("invoices", ["Invoices"]),
    ("Ab", ["ab"]),                  # a short name: case alone still counts
    ("jbo", ["job"]),                # 3-4 characters: one edit
    ("ordres-eu", ["orders-eu"]),    # a typo beside a short segment
])
def test_near_names(name: str, near: list[str]) -> None:
    assert near_names(name, EXISTING) == near


@pytest.mark.parametrize(("name", "why"), [
    ("rdrss", "three edits"),
    ("jjbb", "two edits in a 3-character name"),
    ("ba", "a 1-2 character name is near only itself in other case"),
    ("a", "a 1-2 character name is near only itself in other case"),
    ("t2", "numbers differ: a series, not a typo"),
    ("shard-2", "numbers differ"),
    ("orders2", "a number added"),
    ("shard-01", "numbers differ (01 is not 1)"),
    ("refunds", "nothing alike"),
    ("orders-us", "siblings: one short segment tells them apart (regions)"),
    ("orders-uk", "siblings"),
    ("orders-ue", "siblings: the price of the sibling rule, a typo inside a short segment is not caught"),
    ("t-b", "siblings"),
])
def test_not_near(name: str, why: str) -> None:
    assert near_names(name, EXISTING) == [], why


def test_same_numbers_still_allow_typos_around_them() -> None:
    assert near_names("shrad-1", EXISTING) == ["shard-1"]
    assert near_names("ordres-v2", ["orders-v2", "orders-v3"]) == ["orders-v2"]


def test_siblings() -> None:
    assert siblings("orders-eu", "orders-us") and siblings("topic-a", "topic-b") and siblings("a.x.b", "a.yy.b")
    assert not siblings("orders-eu", "orders_eu")  # a separator is not a segment
    assert not siblings("orders-eu", "orders-usa")  # three characters: a typo can hide there
    assert not siblings("orders-eu-x", "orders-us-y")  # two segments differ
    assert not siblings("ordres", "orders")  # one segment, longer than two
    assert siblings("topicA", "topicB") and siblings("ordersEU", "ordersUS")  # a capital starts a word
    assert not siblings("topica", "topicb")  # one word of six characters
    assert near_names("topicB", ["topicA"]) == [] and near_names("topicb", ["topica"]) == ["topica"]
    assert near_names("orders-usa", ["orders-us"]) == ["orders-us"]


def test_the_name_itself_is_not_a_candidate() -> None:
    assert near_names("orders", EXISTING) == []


def test_several_candidates_sorted_by_distance_then_name_and_capped() -> None:
    existing = ["orderz", "orders", "Ordre", "orderx", "ordxrs", "ordes", "oders", "xrders", "ORDRES"]
    got = near_names("ordres", existing)
    # 0 (case only): ORDRES; 1: Ordre, orders; 2 ...: by distance, then by name (code point order)
    assert got[:3] == ["ORDRES", "Ordre", "orders"]
    assert len(got) == MAX_NEAR_NAMES
    distances = [edit_distance("ordres", n.casefold(), 2) for n in got]
    assert distances == sorted(distances)
    for d in set(distances):
        same = [n for n, dn in zip(got, distances, strict=True) if dn == d]
        assert same == sorted(same)


def test_system_topics_are_never_suggested() -> None:
    for system in SYSTEM_TOPICS:
        for typo in (system.upper(), system.lower(), system[:-1], system[1:] + system[0]):
            if typo != system:
                assert near_names(typo, [system]) == [], (typo, system)
    assert near_names("rmq_sys_wheel_timre", [TIMER_TOPIC, "rmq_sys_wheel_timer2"]) == []


# -- the errors --------------------------------------------------------------------------------------


def test_the_refusal_names_the_near_topics_and_how_to_create_the_name() -> None:
    err = errors.TopicNameTooNear("ordres", ["orders"])
    assert err.message == (
        "topic 'ordres' does not exist; did you mean 'orders'? (to create 'ordres', send with --create-topic "
        "(SDK: create_topics=True), create it with `chronoq topics create ordres`, or set "
        "auto_create_topic_near_names = true on the server)")
    assert err.details == {"topic": "ordres", "auto_create": True, "candidates": ["orders"]}
    assert err.code == 40402 and isinstance(err, errors.TopicNotFound) and not err.retriable
    several = errors.TopicNameTooNear("ordres", ["orders", "orderz", "Orders"])
    assert "did you mean 'orders', 'orderz' or 'Orders'?" in several.message
    # A client that sees only the code (the RocketMQ protocol) gets TopicNotFound with the message.
    assert type(from_status(40402, err.message)) is errors.TopicNotFound


def test_a_missing_topic_with_candidates_points_at_them_instead_of_creating() -> None:
    for auto_create in (None, True, False):
        err = errors.TopicNotFound("ordrs", auto_create=auto_create, candidates=["orders"])
        assert err.message == "topic 'ordrs' does not exist; did you mean 'orders'?"
        assert err.details["candidates"] == ["orders"]
    assert errors.TopicNotFound("x").details["candidates"] == []


# -- the broker --------------------------------------------------------------------------------------


def msg(topic: str, **changes: Any) -> OutgoingMessage:
    return OutgoingMessage(topic=topic, body=b"x", **changes)


def state(broker: Broker) -> tuple[int, list[str]]:
    return broker.store.log.end_position, sorted(broker.store.topics)


async def broker_with_orders(make_config: Callable[..., Config], **settings: Any) -> Broker:
    broker = await open_broker(make_config(**settings), clock=FakeClock(NOW_MS), background=False)
    await broker.create_topic("orders", 2)
    return broker


def test_a_send_to_a_near_name_is_refused_and_creates_nothing(make_config: Callable[..., Config],
                                                             arun: Callable) -> None:
    async def body() -> None:
        broker = await broker_with_orders(make_config)
        try:
            before = state(broker)
            for bad in (msg("ordres"), msg("Orders"), msg("ordrs", delay_ms=60_000), msg("ordres", queue_id=0)):
                with pytest.raises(errors.TopicNameTooNear) as info:
                    await broker.send(bad)
                assert info.value.details["candidates"] == ["orders"]
                assert info.value.details["topic"] == bad.topic
            with pytest.raises(errors.TopicNameTooNear):
                await broker.send_batch([msg("orders"), msg("ordres")])  # all-or-nothing: the good one too
            [ok, refused] = await broker.send_batch([msg("orders"), msg("ordres")], partial=True)
            assert ok.topic == "orders" and isinstance(refused, errors.TopicNameTooNear)
            assert sorted(broker.store.topics) == before[1]
            assert [t.name for t in broker.list_topics()] == ["orders"]
            # A name near none is auto-created exactly as before.
            fresh = await broker.send(msg("refunds"))
            assert fresh.topic == "refunds" and [t.name for t in broker.list_topics()] == ["orders", "refunds"]
        finally:
            await broker.close()

    arun(body())


def test_the_senders_ask_and_the_setting_create_the_near_name(make_config: Callable[..., Config],
                                                             arun: Callable) -> None:
    async def body() -> None:
        broker = await broker_with_orders(make_config)
        try:
            r = await broker.send(msg("ordres"), create_near_topics=True)
            assert r.topic == "ordres" and "ordres" in broker.store.topics
            [r2] = await broker.send_batch([msg("orderz")], create_near_topics=True)
            assert r2.topic == "orderz"
            assert [m.topic for m in await broker.read("ordres", r.queue_id, 0, 10)] == ["ordres"]
        finally:
            await broker.close()
        allowed = await open_broker(make_config(auto_create_topic_near_names=True), clock=FakeClock(NOW_MS),
                                    background=False)
        try:
            r = await allowed.send(msg("ordrs"))
            assert r.topic == "ordrs"
        finally:
            await allowed.close()

    arun(body())


def test_with_auto_create_off_the_ask_creates_nothing_and_the_error_points_at_the_near_topic(
        make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await broker_with_orders(make_config, auto_create_topics=False, auto_create_topic_near_names=True)
        try:
            before = state(broker)
            for create in (False, True):
                with pytest.raises(errors.TopicNotFound) as info:
                    await broker.send(msg("ordres"), create_near_topics=create)
                assert type(info.value) is errors.TopicNotFound
                assert info.value.message == "topic 'ordres' does not exist; did you mean 'orders'?"
            assert state(broker) == before
        finally:
            await broker.close()

    arun(body())


def test_receive_and_describe_of_a_near_name_point_at_the_near_topic(make_config: Callable[..., Config],
                                                                    arun: Callable) -> None:
    async def body() -> None:
        broker = await broker_with_orders(make_config)
        try:
            await broker.create_topic("orderz", 1)
            before = state(broker)
            with pytest.raises(errors.TopicNotFound) as info:
                await broker.receive("g", "ordrs")
            assert info.value.message == "topic 'ordrs' does not exist; did you mean 'orders' or 'orderz'?"
            with pytest.raises(errors.TopicNotFound) as info:
                broker.get_topic("Orders")
            assert info.value.details["candidates"] == ["orders", "orderz"]
            with pytest.raises(errors.TopicNotFound) as info:  # near nothing: as before
                await broker.receive("g", "refunds")
            assert "chronoq topics create refunds" in info.value.message
            assert state(broker) == before
        finally:
            await broker.close()

    arun(body())


def test_a_schedule_to_a_near_name_is_refused_at_creation(make_config: Callable[..., Config],
                                                         arun: Callable) -> None:
    """A schedule's messages are sends: its topic is judged when it is created, like a send's."""
    async def body() -> None:
        broker = await broker_with_orders(make_config)
        try:
            before = state(broker)
            with pytest.raises(errors.TopicNameTooNear):
                await broker.create_schedule("s", "ordres", b"x", every_ms=3_600_000)
            assert state(broker)[1] == before[1]
        finally:
            await broker.close()

    arun(body())


# -- every door --------------------------------------------------------------------------------------


def wire_message(topic: str, message_id: str) -> definition.Message:
    m = definition.Message(topic=definition.Resource(name=topic), body=b"x")
    m.system_properties.message_id = message_id
    m.system_properties.body_encoding = definition.IDENTITY
    return m


def test_every_door_refuses_a_near_name_alike_and_stores_nothing(tmp_path: Path, arun: Any) -> None:
    async def body() -> None:
        async with running(tmp_path, clock=FakeClock(NOW_MS), background=False) as h:
            await h.broker.create_topic("orders", 2)
            before = state(h.broker)
            with pytest.raises(errors.TopicNameTooNear) as info:
                await h.broker.send(msg("ordres"))
            expected = (info.value.code, info.value.message)

            reply = await h.stub.SendMessage(service.SendMessageRequest(messages=[wire_message("ordres", "m1")]),
                                             timeout=10)
            assert (reply.status.code, reply.status.message) == expected

            admin = await h.admin("SendBatch", {"messages": [{"topic": "ordres", "body_b64": "eA=="}]})
            refusal = admin["results"][0]["error"]
            assert (refusal["error"], refusal["code"], refusal["message"]) == ("TopicNameTooNear", *expected)
            assert refusal["details"]["candidates"] == ["orders"]
            assert state(h.broker) == before

            # A route query creates nothing and refuses nothing: the send or receive after it names the topic.
            route = await h.stub.QueryRoute(service.QueryRouteRequest(topic=definition.Resource(name="ordres")),
                                            timeout=10)
            assert route.status.code == 20000
            assert state(h.broker) == before

            # SendBatch's `create_topic` is the sender's ask; anything but a boolean is refused.
            bad = await h.admin("SendBatch", {"messages": [{"topic": "ordres", "body_b64": "eA=="}],
                                              "create_topic": "yes"})
            assert bad["code"] == 40000 and "create_topic" in bad["message"]
            assert state(h.broker) == before
            asked = await h.admin("SendBatch", {"messages": [{"topic": "ordres", "body_b64": "eA=="}],
                                                "create_topic": True})
            assert "error" not in asked["results"][0], asked
            assert "ordres" in h.broker.store.topics

    arun(body())


def test_the_sdk_producer_asks_with_create_topics(tmp_path: Path, arun: Any) -> None:
    from chronoq.client import AsyncProducer, BatchSendError, outgoing

    async def body() -> None:
        async with running(tmp_path, clock=FakeClock(NOW_MS), background=False) as h:
            await h.broker.create_topic("orders", 2)
            before = state(h.broker)
            for via in ("grpc", "admin"):
                async with AsyncProducer(h.address, batch_via=via) as p:
                    with pytest.raises(errors.TopicNotFound) as info:
                        await p.send("ordres", b"x")
                    assert "did you mean 'orders'?" in info.value.message
                    # SendMessage refuses the request; SendBatch reports the message's error.
                    with pytest.raises((errors.TopicNotFound, BatchSendError)) as batch:
                        await p.send_batch([outgoing("ordres", b"x")])
                    assert "did you mean 'orders'?" in str(batch.value)
            assert state(h.broker) == before
            async with AsyncProducer(h.address, create_topics=True, batch_via="grpc") as p:
                receipt = await p.send("ordres", b"x")
                [other] = await p.send_batch([outgoing("orderz", b"y")])
            assert (receipt.topic, other.topic) == ("ordres", "orderz")
            assert {"ordres", "orderz"} <= set(h.broker.store.topics)

    arun(body())


def test_the_sdk_setting_is_checked() -> None:
    from chronoq.client import AsyncProducer, InvalidArgument

    with pytest.raises(InvalidArgument):
        AsyncProducer("127.0.0.1:1", create_topics="yes")  # type: ignore[arg-type]


def test_system_topics_stay_forbidden_whatever_the_ask(make_config: Callable[..., Config], arun: Callable) -> None:
    async def body() -> None:
        broker = await broker_with_orders(make_config)
        try:
            for system in (TIMER_TOPIC, SCHEDULE_TOPIC):
                with pytest.raises(errors.SystemTopicForbidden):
                    await broker.send(msg(system), create_near_topics=True)
        finally:
            await broker.close()

    arun(body())
