"""The HTTP side: /metrics, /healthz and the console's JSON endpoints.

Real parts: a RocksDB-backed broker on a FakeClock (so due times and lateness are exact), the
aiohttp server of `chronoq/http/server.py` on a free loopback port, and an HTTP client; the
Prometheus text is parsed with prometheus_client's own parser. One slow test runs the real
`chronoq serve --http-port` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import chronoq
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.config import Config, ConfigError
from chronoq.errors import ConsoleInputError
from chronoq.http.console import MAX_EPOCH_MS, Access, ErrorHistory, Forbidden, Role, format_utc, parse_time_ms
from chronoq.http.metrics import histogram_buckets
from chronoq.http.server import HttpServer
from chronoq.model import OutgoingMessage
from chronoq.recurring.records import ScheduleChange
from chronoq.server.admin_service import AdminService
from chronoq.server.auth import ANONYMOUS, Principal
from chronoq.timer.metrics import LatencyHistogram
from tests.support.brokers import open_broker

arun = asyncio.run
T0 = 1_800_000_000_000
TOPIC = "orders"


@contextlib.asynccontextmanager
async def http_broker(tmp_path: Path, access: Access | None = None,
                      **settings: Any) -> AsyncIterator[tuple[Broker, FakeClock, str]]:
    clock = FakeClock(T0)
    config = Config(data_dir=tmp_path / "data", http_port=0, **settings)
    broker = await open_broker(config, clock=clock, background=False)
    server = HttpServer(broker, config, AdminService(broker, config), access)
    try:
        # http_port=0 in the config means "off" for serve; here the site binds port 0 (any free one).
        port = await server.start()
        server.starting = False  # what serve sets once its gRPC port serves
        yield broker, clock, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()
        await broker.close()


async def get(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as reply:
        return reply.status, reply.headers.get("Content-Type", ""), await reply.text()


async def post_json(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as reply:
        return reply.status, await reply.json()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def send(broker: Broker, body: str, deliver_at_ms: int | None = None, keys: tuple[str, ...] = ()) -> str:
    result = await broker.send(OutgoingMessage(topic=TOPIC, body=body.encode(), deliver_at_ms=deliver_at_ms,
                                               keys=keys))
    return result.message_id


def test_metrics_names_labels_and_values(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, clock, base):
            await broker.create_topic(TOPIC)
            await send(broker, "now")
            for i in range(3):  # due in 2 s, 90 s and 2 h
                await send(broker, f"t{i}", T0 + (2_000, 90_000, 7_200_000)[i])
            clock.advance(2_250)  # the first timer fires 250 ms late
            await broker.run_due()
            received = await broker.receive("g1", TOPIC, batch_size=8)
            assert len(received) == 2
            status, ctype, text = await get(base + "/metrics")
            assert status == 200 and ctype.startswith("text/plain")
            m = samples(text)
            assert m[("chronoq_timer_pending", (("topic", TOPIC),))] == 2
            assert m[("rocketmq_timing_messages", (("topic", TOPIC),))] == 2
            assert m[("chronoq_messages_accepted_total", (("topic", TOPIC),))] == 4
            assert m[("chronoq_messages_delivered_total", (("topic", TOPIC),))] == 2
            assert m[("rocketmq_timer_enqueue_total", (("topic", TOPIC),))] == 3
            assert m[("rocketmq_timer_dequeue_total", (("topic", TOPIC),))] == 1
            # RocketMQ's due-time snapshot: 90 s is in the 300 s bucket, 2 h in 14400 s.
            assert m[("rocketmq_timer_message_snapshot", (("timer_bound_s", "300"),))] == 1
            assert m[("rocketmq_timer_message_snapshot", (("timer_bound_s", "14400"),))] == 1
            assert m[("rocketmq_timer_message_snapshot", (("timer_bound_s", "5"),))] == 0
            # Fired minus due: one observation of 250 ms.
            assert m[("chronoq_timer_delivery_error_ms_count", ())] == 1
            assert m[("chronoq_timer_delivery_error_ms_sum", ())] == 250
            assert m[("chronoq_timer_delivery_error_ms_bucket", (("le", "100"),))] == 0
            assert m[("chronoq_timer_delivery_error_ms_bucket", (("le", "250"),))] == 1
            assert m[("chronoq_consumer_inflight", (("group", "g1"), ("topic", TOPIC)))] == 2
            assert m[("chronoq_consumer_lag", (("group", "g1"), ("topic", TOPIC)))] == 0
            assert m[("chronoq_commitlog_bytes", ())] > 0
            assert m[("chronoq_commitlog_fsync_latency_seconds_count", ())] >= 1
            assert m[("rocketmq_timer_dequeue_latency", ())] == 0
            assert m[("chronoq_ready", ())] == 1
            # The delivery trace is off by default: neither configured nor recording, never stopped.
            assert m[("chronoq_trace_enabled", ())] == 0 and m[("chronoq_trace_active", ())] == 0
            assert not [name for name, _ in m if name == "chronoq_trace_stopped"]
            # The delays asked for (2 s, 90 s, 2 h), in seconds; the message without one is not a timer.
            delay = "rocketmq_delay_message_latency"
            topic = (("topic", TOPIC),)
            assert m[(delay + "_count", topic)] == 3 and m[(delay + "_sum", topic)] == 7_292
            assert [m[(delay + "_bucket", (("le", le), *topic))] for le in ("1", "5", "60", "300", "3600", "7200",
                                                                               "+Inf")] == [0, 1, 1, 2, 2, 3, 3]
            assert m[("rocketmq_timer_enqueue_lag", ())] == 0  # every timer is indexed once acknowledged
            # The Grafana dashboard in docs/ uses only metrics the server exports.
            dashboard = (Path(chronoq.__file__).resolve().parent.parent / "docs" / "grafana-chronoq.json").read_text()
            exprs = [t["expr"] for panel in json.loads(dashboard)["panels"] for t in panel["targets"]]
            used = {name for e in exprs for name in re.findall(r"\b(?:chronoq|rocketmq)_[a-z_]+", e)}
            assert used and used <= {name for name, _ in m}, used - {name for name, _ in m}
            await send(broker, "late", T0 + 2_000)  # due already: overdue until the next run_due
            clock.advance(1_000)
            m = samples((await get(base + "/metrics"))[2])
            assert m[("rocketmq_timer_dequeue_lag", ())] == 1
            assert m[("rocketmq_timer_dequeue_latency", ())] == 1_250
    arun(main())


def test_pending_gauges_read_zero_for_a_known_topic_and_the_total_is_not_named_as_a_counter(tmp_path: Path) -> None:
    """A topic whose last timer fired read no `chronoq_timer_pending` at all (the graph kept its
    last value); it reads 0. The all-topics gauge is `chronoq_timer_pending_all_topics`, a gauge's
    name; its former name, `_total` as a counter's, stays one release with the same value."""
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, clock, base):
            await broker.create_topic(TOPIC)
            await broker.create_topic("idle")
            await send(broker, "soon", T0 + 1_000)
            m = samples((await get(base + "/metrics"))[2])
            assert m[("chronoq_timer_pending", (("topic", TOPIC),))] == 1
            assert m[("chronoq_timer_pending", (("topic", "idle"),))] == 0
            assert m[("chronoq_timer_pending_all_topics", ())] == 1
            assert m[("chronoq_timer_pending_total", ())] == 1
            clock.advance(1_000)
            await broker.run_due()
            text = (await get(base + "/metrics"))[2]
            m = samples(text)
            for name in ("chronoq_timer_pending", "rocketmq_timing_messages"):
                assert m[(name, (("topic", TOPIC),))] == 0 and m[(name, (("topic", "idle"),))] == 0
            assert m[("chronoq_timer_pending_all_topics", ())] == 0
            types = {f.name: f.type for f in text_string_to_metric_families(text)}
            assert types["chronoq_timer_pending_all_topics"] == "gauge"
            assert "# HELP chronoq_timer_pending_total Deprecated: chronoq_timer_pending_all_topics" in text
    arun(main())


def test_schedule_metrics_count_states_occurrences_and_their_lateness(tmp_path: Path) -> None:
    """`chronoq_schedules{state}`, the occurrence counters and the issue lag, scraped over HTTP; an
    occurrence's delivery is a timer's, in `chronoq_timer_delivery_error_ms`."""
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, clock, base):
            await broker.create_topic(TOPIC)
            m = samples((await get(base + "/metrics"))[2])
            assert [m[("chronoq_schedules", (("state", s),))] for s in ("active", "paused", "finished")] == [0, 0, 0]
            assert m[("chronoq_schedule_occurrences_issued_total", ())] == 0
            await broker.create_schedule("every-minute", TOPIC, b"x", every_ms=60_000)
            await broker.create_schedule("once", TOPIC, b"x", every_ms=60_000, limit=1)
            await broker.create_schedule("held", TOPIC, b"x", every_ms=60_000)
            await broker.pause_schedule("held")  # withdraws its first occurrence
            clock.advance(60_030)  # the first occurrences fire 30 ms late
            await broker.run_due()
            # every-minute's second is issued in the first half of the gap, at its own point: 30 ms late too.
            wake = broker.schedules.next_wake_ms()
            assert wake is not None and clock.now_ms() < wake <= clock.now_ms() - 30 + 30_000
            clock.set(wake + 30)
            await broker.run_due()
            status, _, text = await get(base + "/metrics")
            assert status == 200
            m = samples(text)
            states = {s: m[("chronoq_schedules", (("state", s),))] for s in ("active", "paused", "finished")}
            assert states == {"active": 1, "paused": 1, "finished": 1}, states
            # every-minute's first two, once's one, held's first (withdrawn by the pause).
            assert m[("chronoq_schedule_occurrences_issued_total", ())] == 4
            assert m[("chronoq_schedule_occurrences_withdrawn_total", ())] == 1
            assert m[("chronoq_schedule_occurrences_late_total", ())] == 0
            assert m[("chronoq_schedule_occurrences_skipped_total", ())] == 0
            assert m[("chronoq_schedule_issue_failures_total", ())] == 0
            # The step that issued every-minute's second occurrence came 30 ms after the time planned
            # for it (once, finished, had no next to issue); both first occurrences were delivered
            # 30 ms late: a schedule's occurrence is a timer, its lateness the timer delivery error's.
            assert m[("chronoq_schedule_issue_lag_ms_count", ())] == 1
            assert m[("chronoq_schedule_issue_lag_ms_sum", ())] == 30
            assert m[("chronoq_schedule_issue_lag_ms_bucket", (("le", "10"),))] == 0
            assert m[("chronoq_schedule_issue_lag_ms_bucket", (("le", "50"),))] == 1
            assert m[("chronoq_timer_delivery_error_ms_count", ())] == 2
            assert m[("chronoq_timer_delivery_error_ms_sum", ())] == 60
            assert m[("chronoq_timer_delivery_error_ms_bucket", (("le", "25"),))] == 0
            assert m[("chronoq_timer_delivery_error_ms_bucket", (("le", "50"),))] == 2
            types = {f.name: f.type for f in text_string_to_metric_families(text)}
            assert types["chronoq_schedules"] == "gauge" and types["chronoq_schedule_issue_lag_ms"] == "histogram"
            assert types["chronoq_schedule_occurrences_issued"] == "counter"
            # Resumed after four of its occurrences passed (60, 120, 180, 240 s), catch-up skip (the
            # default): each is skipped, its next issued; a catch-up `latest` delivers one of four, late.
            clock.advance(180_000)
            await broker.resume_schedule("held")
            await broker.update_schedule("every-minute", ScheduleChange(catch_up="latest"))
            await broker.pause_schedule("every-minute")
            clock.advance(300_000)
            await broker.resume_schedule("every-minute")
            await broker.delete_schedule("once")
            m = samples((await get(base + "/metrics"))[2])
            states = {s: m[("chronoq_schedules", (("state", s),))] for s in ("active", "paused", "finished")}
            assert states == {"active": 2, "paused": 0, "finished": 0}, states
            assert m[("chronoq_schedule_occurrences_skipped_total", ())] == 4 + 4
            assert m[("chronoq_schedule_occurrences_late_total", ())] == 1
    arun(main())


def test_histogram_export_is_cumulative_and_exact_below_256ms() -> None:
    hist = LatencyHistogram()
    for v in (-3, 0, 1, 7, 250, 251, 999, 1000, 99_999_999):
        hist.record(v)
    buckets = dict(histogram_buckets(hist, (1, 250, 1000)))
    # Above 256 ms a bucket is up to 1/128 of its value wide and is counted under the edge at or
    # above its top: 999 (bucket 996..999) is under 1000; 1000 (bucket 1000..1003) is not, so
    # the export never shows a timer as less late than it was.
    assert buckets == {"1": 3.0, "250": 5.0, "1000": 7.0, "+Inf": 9.0}


def test_healthz_ready_then_reasons(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, _clock, base):
            status, _, body = await get(base + "/healthz")
            assert status == 200 and json.loads(body) == {"ready": True, "reason": "serving"}
            broker.fatal = RuntimeError("timer loop died")
            status, _, body = await get(base + "/healthz")
            assert status == 503 and "timer loop died" in json.loads(body)["reason"]
            broker.fatal = None
    arun(main())


def test_healthz_disk_full_reason(tmp_path: Path) -> None:
    async def main() -> None:
        # A floor no disk here has: the broker refuses sends, so it is not ready, and says why.
        async with http_broker(tmp_path, disk_min_free_bytes=1 << 62, disk_reserve_file_bytes=0) as (_b, _c, base):
            status, _, body = await get(base + "/healthz")
            assert status == 503 and json.loads(body)["reason"].startswith("disk full")
    arun(main())


def test_console_api_search_lookup_cancel(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, clock, base):
            await broker.create_topic(TOPIC)
            ids = [await send(broker, f"t{i}", T0 + (i + 1) * 60_000, keys=(f"k{i}",)) for i in range(3)]
            status, _, body = await get(base + "/api/search?topic=orders&from=now&to=%2B2m30s")
            assert status == 400 and "cannot read" in json.loads(body)["message"]
            status, _, body = await get(base + "/api/search?topic=orders&from=now&to=%2B150s")
            found = json.loads(body)
            assert status == 200 and [t["message_id"] for t in found["timers"]] == ids[:2]
            assert not found["truncated"]
            status, _, body = await get(base + "/api/message?key=k2")
            assert status == 200 and json.loads(body)["statuses"][0]["state"] == "pending"
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": ids[2]})
            assert status == 200 and reply["cancelled"] == ids[2]
            status, _, body = await get(base + f"/api/message?id={ids[2]}")
            assert json.loads(body)["statuses"][0]["state"] == "cancelled"
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": ids[2]})
            assert status == 400 and reply["error"] == "TimerAlreadyCancelled"
            status, _, body = await get(base + "/api/overview")
            overview = json.loads(body)
            assert [t["name"] for t in overview["topics"]] == [TOPIC] and overview["pending_total"] == 2
            status, ctype, svg = await get(base + "/chart/pending.svg?horizon=10m")
            assert status == 200 and ctype.startswith("image/svg+xml") and svg.count('class="bar"') == 2
            clock.advance(30_000)
    arun(main())


def test_console_cancel_of_one_timer_of_a_reused_id_cancels_that_timer(tmp_path: Path) -> None:
    """An id sent again after the dedupe window names two pending timers; the console lists each
    with its own cancel button. The button sent only (topic, id), which the broker refuses for
    such an id (TimerIdAmbiguous), so neither timer could be cancelled from the console. The
    button sends the row's due time too, and cancels that timer only."""
    async def main() -> None:
        async with http_broker(tmp_path, dedupe_window_ms=60_000) as (broker, clock, base):
            await broker.create_topic(TOPIC)
            first = await broker.send(OutgoingMessage(TOPIC, b"one", message_id="X", deliver_at_ms=T0 + 7_200_000))
            clock.advance(60_001)
            second = await broker.send(OutgoingMessage(TOPIC, b"two", message_id="X", deliver_at_ms=T0 + 10_800_000))
            assert not second.duplicate
            status, _, body = await get(base + "/api/search?topic=orders&from=now&to=%2B4h")
            rows = json.loads(body)["timers"]
            assert [(t["message_id"], t["deliver_at_ms"]) for t in rows] == [
                ("X", first.deliver_at_ms), ("X", second.deliver_at_ms)]
            # What the console's cancel button posts for the first row.
            script = (resources.files("chronoq.http") / "static" / "console.js").read_text()
            assert "deliver_at_ms: due_ms" in script
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": "X",
                                                                  "deliver_at_ms": rows[0]["deliver_at_ms"]})
            assert status == 200 and reply["cancelled"] == "X", reply
            states = [(s.deliver_at_ms, s.state.value) for s in broker.query("X", TOPIC)]
            assert states == [(first.deliver_at_ms, "cancelled"), (second.deliver_at_ms, "pending")]
            # Without a due time the broker still guesses nothing; a due time that is not an
            # integer is refused as bad input.
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": "X",
                                                                  "deliver_at_ms": "soon"})
            assert status == 400 and reply["error"] == "ConsoleInputError"
    arun(main())


@pytest.mark.parametrize(("query", "status", "says"), [
    ("/api/message?id=no-such-id", 404, "no timer message with message id 'no-such-id'"),
    ("/api/message", 400, "give a message id or a key"),
    ("/api/search?topic=orders&from=yesterday&to=now", 400, "cannot read 'yesterday' as a time"),
    ("/api/search?topic=orders&from=%2B1h&to=now", 400, "the range must end after it starts"),
    ("/api/search?topic=orders&from=now&to=%2B400d", 400, "more than timer_search_max_range_ms (31 days)"),
    ("/api/search?topic=orders&from=now&to=99999999999999999999", 400,
     "'99999999999999999999' is after 9999-12-31 23:59:59.999Z (epoch ms 253402300799999)"),
    # Far-future times that a day's range keeps narrow: the reply could not show them (was a 500).
    ("/api/search?topic=orders&from=%2B999999998d&to=%2B999999999d", 400,
     "from: '+999999998d' is after 9999-12-31 23:59:59.999Z"),
    ("/api/search?topic=orders&from=9999-12-31T23:00:00-14:00&to=9999-12-31T23:59:00-14:00", 400,
     "the last time the console can show"),
    ("/api/search?topic=orders&from=-999999d&to=now", 400, "from: '-999999d' is before 1970-01-01T00:00:00Z"),
    ("/api/search?topic=nosuch&from=now&to=%2B1h", 404, "topic 'nosuch' does not exist"),
    ("/api/search?topic=orders&from=now&to=" + "9" * 80, 400, "too long for a time"),
    ("/chart/pending.svg?horizon=1y", 400, "is not one of 10m, 1h, 1d, 7d, 30d"),
])
def test_console_bad_input_is_a_clear_message(tmp_path: Path, query: str, status: int, says: str) -> None:
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, _clock, base):
            await broker.create_topic(TOPIC)
            got, ctype, body = await get(base + query)
            assert got == status and ctype.startswith("application/json")
            reply = json.loads(body)
            assert says in reply["message"] and "Traceback" not in body
    arun(main())


def test_cancel_bad_bodies(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path) as (broker, _clock, base):
            await broker.create_topic(TOPIC)
            async with aiohttp.ClientSession() as session:
                json_type = {"Content-Type": "application/json"}
                async with session.post(base + "/api/cancel", data=b"not json", headers=json_type) as reply:
                    assert reply.status == 400 and "must be JSON" in (await reply.json())["message"]
                # What a cross-site form can send without a CORS preflight: refused, nothing cancelled.
                body = json.dumps({"topic": TOPIC, "message_id": "x"}).encode()
                async with session.post(base + "/api/cancel", data=body, headers={"Content-Type": "text/plain"}) \
                        as reply:
                    assert reply.status == 400 and "application/json" in (await reply.json())["message"]
                async with session.post(base + "/api/cancel", data=b"x" * 10_000, headers=json_type) as reply:
                    assert reply.status == 413  # larger than MAX_CANCEL_BODY_BYTES: refused unread
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": "nope"})
            assert status == 404 and reply["error"] == "TimerNotFound"
            assert reply["details"] == {"topic": TOPIC, "message_id": "nope"}
            status, reply = await post_json(base + "/api/cancel", ["a list"])
            assert status == 400 and "names the topic and the message id" in reply["message"]
    arun(main())


def test_search_stops_at_its_row_limit(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path, timer_search_max_rows=3) as (broker, _clock, base):
            await broker.create_topic(TOPIC)
            for i in range(5):
                await send(broker, f"t{i}", T0 + 10_000 + i)
            reply = json.loads((await get(base + "/api/search?topic=orders&from=now&to=%2B1m"))[2])
            assert len(reply["timers"]) == 3 and reply["truncated"]
    arun(main())


def test_parse_time_ms() -> None:
    now = T0
    assert parse_time_ms("now", now, "f") == now
    assert parse_time_ms("+10m", now, "f") == now + 600_000
    assert parse_time_ms("now - 1h", now, "f") == now - 3_600_000
    assert parse_time_ms("2027-01-15T08:00:00Z", now, "f") == 1_800_000_000_000
    assert parse_time_ms("1970-01-01T00:00:01", now, "f") == 1000  # no zone: UTC
    assert parse_time_ms("1970-01-01T01:00:01+01:00", now, "f") == 1000
    assert parse_time_ms("12345", now, "f") == 12345
    last = "9999-12-31T23:59:59.999Z"
    assert parse_time_ms(last, now, "f") == MAX_EPOCH_MS and format_utc(MAX_EPOCH_MS) == "9999-12-31 23:59:59.999Z"
    for far in ("+999999998d", "9999-12-31T23:00:00-14:00", str(MAX_EPOCH_MS + 1), "-999999d", "0001-01-01T00:00Z"):
        with pytest.raises(ConsoleInputError):
            parse_time_ms(far, now, "f")


def test_error_history_reports_each_interval_alone() -> None:
    hist = LatencyHistogram()
    history = ErrorHistory(hist, max_samples=3)
    for v in (5, 5, 5, 900):
        hist.record(v)
    first = history.sample(1000)
    assert (first.count, first.p50_ms) == (4, 5) and 900 <= first.max_ms <= 900 + 900 // 128
    hist.record(20)
    second = history.sample(2000)
    assert (second.count, second.p50_ms, second.p99_ms, second.max_ms) == (1, 20, 20, 20)
    assert history.sample(3000).count == 0
    history.sample(4000)
    assert [s.at_ms for s in history.samples] == [2000, 3000, 4000]


def test_http_port_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="http_port"):
        Config(http_port=70000)


@pytest.mark.slow
def test_serve_http_port_process(tmp_path: Path) -> None:
    """`chronoq serve --http-port`: the real process serves /healthz, /metrics and the page."""
    from chronoq.client import Producer
    from chronoq.client.testing import ServerProcess, free_port

    http_port = free_port()
    with ServerProcess(tmp_path / "data", settings={"http_port": http_port}) as server:
        with Producer(server.address) as producer:
            producer.create_topic(TOPIC)
            producer.send(TOPIC, "hello")
        base = f"http://127.0.0.1:{http_port}"
        with urllib.request.urlopen(base + "/healthz", timeout=10) as reply:
            assert json.loads(reply.read()) == {"ready": True, "reason": "serving"}
        with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
            m = samples(reply.read().decode())
        assert m[("chronoq_messages_accepted_total", (("topic", TOPIC),))] == 1
        with urllib.request.urlopen(base + "/", timeout=10) as reply:
            assert b"chronoq console" in reply.read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/api/message?id=nope", timeout=10)
        assert refused.value.code == 404
        assert "chronoq console, /metrics and /healthz on http://127.0.0.1:" in server.log()


class ReadOnly(Access):
    """What the trust work will plug in: a caller without the admin role."""

    def __init__(self) -> None:
        self.asked: list[Role] = []

    def check(self, request: Any, role: Role) -> Principal:
        self.asked.append(role)
        if role == "admin":
            raise Forbidden("cancelling needs the admin role")
        return ANONYMOUS


def test_every_console_call_goes_through_the_access_check(tmp_path: Path) -> None:
    async def main() -> None:
        access = ReadOnly()
        async with http_broker(tmp_path, access=access) as (broker, _clock, base):
            await broker.create_topic(TOPIC)
            message_id = await send(broker, "t", T0 + 60_000)
            for path in ("/", "/api/overview", f"/api/message?id={message_id}", "/api/search?from=now&to=%2B1h",
                         "/chart/pending.svg"):
                assert (await get(base + path))[0] == 200, path
            assert set(access.asked) == {"read"} and len(access.asked) >= 5
            # The broker-wide views that call no admin method ask for the admin role themselves.
            for path in ("/metrics", "/chart/error.svg"):
                access.asked.clear()
                assert (await get(base + path))[0] == 403, path
                assert access.asked == ["admin"], path
            status, reply = await post_json(base + "/api/cancel", {"topic": TOPIC, "message_id": message_id})
            assert status == 403 and reply["message"] == "cancelling needs the admin role"
            assert broker.query(message_id)[0].state.value == "pending"
    arun(main())


def test_healthz_says_starting_until_the_grpc_port_serves(tmp_path: Path) -> None:
    """`serve` starts the HTTP side before it opens the gRPC port: an HTTP readiness probe asking
    in between must not hear "ready"."""
    async def main() -> None:
        config = Config(data_dir=tmp_path / "data")
        broker = await open_broker(config, clock=FakeClock(T0), background=False)
        server = HttpServer(broker, config, AdminService(broker, config))
        try:
            base = f"http://127.0.0.1:{await server.start()}"
            status, _, body = await get(base + "/healthz")
            assert status == 503
            assert json.loads(body) == {"ready": False, "reason": "starting: the gRPC port does not serve yet"}
            server.starting = False  # what serve sets once its gRPC port serves
            status, _, body = await get(base + "/healthz")
            assert status == 200 and json.loads(body) == {"ready": True, "reason": "serving"}
        finally:
            await server.stop()
            await broker.close()
    arun(main())


def test_healthz_while_shutting_down(tmp_path: Path) -> None:
    async def main() -> None:
        clock = FakeClock(T0)
        config = Config(data_dir=tmp_path / "data")
        broker = await open_broker(config, clock=clock, background=False)
        server = HttpServer(broker, config, AdminService(broker, config))
        try:
            base = f"http://127.0.0.1:{await server.start()}"
            server.stopping = True  # what serve sets when the stop begins, while gRPC drains
            status, _, body = await get(base + "/healthz")
            assert status == 503 and json.loads(body) == {"ready": False, "reason": "shutting down"}
        finally:
            await server.stop()
            await broker.close()
    arun(main())


def test_search_stops_at_its_scan_bound_when_filtering(tmp_path: Path) -> None:
    async def main() -> None:
        async with http_broker(tmp_path, timer_search_max_scanned=4) as (broker, _clock, base):
            await broker.create_topic(TOPIC)
            await broker.create_topic("other")
            for i in range(6):  # six timers of another topic come first in due order
                await broker.send(OutgoingMessage(topic="other", body=b"x", deliver_at_ms=T0 + 1_000 + i))
            await send(broker, "mine", T0 + 5_000)
            reply = json.loads((await get(base + "/api/search?topic=orders&from=now&to=%2B1m"))[2])
            assert reply["timers"] == [] and reply["truncated"]
            reply = json.loads((await get(base + "/api/search?topic=orders&from=%2B4s&to=%2B1m"))[2])
            assert [t["topic"] for t in reply["timers"]] == [TOPIC] and not reply["truncated"]
    arun(main())


def test_http_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    import socket

    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            config = Config(data_dir=tmp_path / "data", http_port=port)
            broker = await open_broker(config, clock=FakeClock(T0), background=False)
            try:
                with pytest.raises(ConfigError, match=f"cannot bind the HTTP port {port}: port {port} is in use"):
                    await HttpServer(broker, config, AdminService(broker, config)).start()
            finally:
                await broker.close()
    arun(main())


def test_admin_search_and_chart_over_grpc(tmp_path: Path) -> None:
    """SearchTimers and PendingByDue are admin methods: the console's data, for programs too."""
    from tests.support.grpc_server import running

    async def main() -> None:
        clock = FakeClock(T0)
        async with running(tmp_path, clock=clock, background=False, timer_chart_max_bars=10) as h:
            await h.broker.create_topic(TOPIC)
            for offset_ms in (5_000, 65_000, 65_500, 4_000_000):
                await send(h.broker, "t", T0 + offset_ms)
            reply = await h.admin("PendingByDue", {"bar_s": 60, "bars": 3})
            assert (reply["counts"], reply["before"], reply["after"], reply["total"]) == ([1, 2, 0], 0, 1, 4)
            reply = await h.admin("PendingByDue", {"bar_s": 60, "bars": 11})
            assert reply["error"] == "InvalidField" and "timer_chart_max_bars" in reply["message"]
            reply = await h.admin("SearchTimers", {"topic": TOPIC, "from_ms": T0 + 60_000, "to_ms": T0 + 70_000})
            assert [t["deliver_at_ms"] for t in reply["timers"]] == [T0 + 65_000, T0 + 65_500]
            reply = await h.admin("SearchTimers", {"topic": TOPIC, "from_ms": T0, "to_ms": T0 + 40 * 86_400_000})
            assert reply["error"] == "InvalidField" and "timer_search_max_range_ms" in reply["message"]
            reply = await h.admin("SearchTimers", {"topic": TOPIC, "from_ms": T0, "to_ms": T0 + 1, "limit": 501})
            assert reply["error"] == "InvalidField" and "timer_search_max_rows" in reply["message"]
    arun(main())


def test_timer_enqueue_lag_counts_timer_records_written_but_not_yet_indexed(tmp_path: Path) -> None:
    """Between a write and its group commit a timer record is in the log but not in the index:
    RocketMQ's enqueue lag. Appended here without waiting, and scraped before the loop can run
    the flusher (nothing awaits in between), so the count is exact."""
    from chronoq.http.metrics import BrokerCollector
    from chronoq.model import MessageType
    from chronoq.store.messagestore import PreparedMessage

    async def main() -> None:
        clock = FakeClock(T0)
        broker = await open_broker(Config(data_dir=tmp_path / "data"), clock=clock, background=False)
        try:
            await broker.create_topic(TOPIC)
            timers = [broker.timer.route(PreparedMessage(TOPIC, f"id{i}", MessageType.DELAY, b"x", T0), T0 + 60_000,
                                         None, T0) for i in range(3)]
            stored = broker.store.append([*timers, PreparedMessage(TOPIC, "plain", MessageType.NORMAL, b"x", T0)], T0)

            def lag() -> float:
                families = {f.name: f for f in BrokerCollector(broker).collect()}
                return families["rocketmq_timer_enqueue_lag"].samples[0].value

            assert lag() == 3  # the plain message is not a timer
            await broker.store.wait_durable(stored[-1].position + stored[-1].size)
            assert lag() == 0
        finally:
            await broker.close()
    arun(main())
