"""Recurring schedules on a simulated broker: a year across DST, catch-up after an outage,
changes racing an occurrence, restarts, and every refusal (`chronoq/recurring/`)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from chronoq import errors
from chronoq.broker import Broker
from chronoq.clock import FakeClock
from chronoq.model import PROP_SCHEDULE_DUE_MS, PROP_SCHEDULE_NAME
from chronoq.recurring.records import ScheduleChange
from chronoq.recurring.service import ISSUE_GRID_MS, issue_offset_ms
from tests.support.brokers import SimulatedBrokers

HOUR = 3_600_000
DAY = 24 * HOUR


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


class Inbox:
    """Every message a schedule delivered to `topic`, with the (fake) time it was first seen."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.seen: list[tuple[int, dict[str, str], bytes, str]] = []

    async def collect(self, broker: Broker) -> None:
        while True:
            got = await broker.receive("g", self.topic, batch_size=64, invisible_duration_ms=HOUR)
            if not got:
                return
            for m in got:
                msg = m.message
                self.seen.append((broker.now_ms(), dict(msg.properties), msg.body, msg.message_id))
                await broker.ack("g", self.topic, m.receipt_handle)

    def dues(self) -> list[int]:
        return [int(p[PROP_SCHEDULE_DUE_MS]) for _, p, _, _ in self.seen]


def _next_event(broker: Broker) -> int | None:
    """The next instant something is due: a schedule's step, or an issued occurrence (its due
    time is later than its nominal one under jitter)."""
    now = broker.now_ms()
    times = [s.pending[1] for s in broker.list_schedules() if s.pending is not None and s.pending[1] > now]
    wake = broker.schedules.next_wake_ms()
    if wake is not None:
        times.append(wake)
    return min(times, default=None)


async def drive(broker: Broker, clock: FakeClock, inbox: Inbox, until_ms: int, *, check_early: bool = True) -> None:
    """Move the clock from event to event up to `until_ms`: to 1 ms before each issued
    occurrence (nothing may fire then), to it (it must fire then), collecting what arrives."""
    while (wake := _next_event(broker)) is not None and wake <= until_ms:
        if wake > clock.now_ms():
            if check_early:
                clock.set(wake - 1)
                await broker.run_due()
                before = len(inbox.seen)
                await inbox.collect(broker)
                assert len(inbox.seen) == before, f"an occurrence fired early, at {clock.now_ms()}"
            clock.set(wake)
        await broker.run_due()
        await inbox.collect(broker)
    clock.set(max(clock.now_ms(), until_ms))
    await broker.run_due()
    await inbox.collect(broker)


@pytest.mark.parametrize("zone", ["America/New_York", "Europe/Berlin"])
def test_a_year_of_a_daily_schedule_fires_at_five_local_time_once_a_day_across_both_dst_changes(
        brokers: SimulatedBrokers, clock: FakeClock, arun, zone: str) -> None:
    tz = ZoneInfo(zone)
    clock.set(ms("2026-01-01T00:00:00+00:00"))

    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("daily")
            await broker.create_schedule("wake", "daily", b"good morning", cron="0 0 5 * * *", zone=zone)
            inbox = Inbox("daily")
            await drive(broker, clock, inbox, ms("2027-01-01T00:00:00+00:00"))
            assert len(inbox.seen) == 365
            days = set()
            offsets = set()
            for seen_ms, props, body, _ in inbox.seen:
                local = datetime.fromtimestamp(seen_ms / 1000, tz)
                assert (local.hour, local.minute, local.second) == (5, 0, 0)
                assert int(props[PROP_SCHEDULE_DUE_MS]) == seen_ms  # fired at its due time, not after
                assert props[PROP_SCHEDULE_NAME] == "wake" and body == b"good morning"
                days.add(local.date())
                offsets.add(local.utcoffset())
            assert len(days) == 365 and len(offsets) == 2  # both sides of each change
            assert len({m for *_, m in inbox.seen}) == 365  # one message id per occurrence

    arun(main())


def test_cron_in_a_dst_gap_fires_at_its_end_and_in_a_repeat_once_at_the_first() -> None:
    from chronoq.recurring.spec import Recurrence
    ny = ZoneInfo("America/New_York")
    gap = Recurrence(cron="30 2 * * *", zone="America/New_York")
    first = gap.next_after(ms("2026-03-07T12:00:00+00:00"))
    second = gap.next_after(first)
    assert datetime.fromtimestamp(first / 1000, ny).isoformat() == "2026-03-08T03:00:00-04:00"
    assert datetime.fromtimestamp(second / 1000, ny).isoformat() == "2026-03-09T02:30:00-04:00"
    repeat = Recurrence(cron="30 1 * * *", zone="America/New_York")
    a = repeat.next_after(ms("2026-10-31T12:00:00+00:00"))
    b = repeat.next_after(a)
    assert datetime.fromtimestamp(a / 1000, ny).isoformat() == "2026-11-01T01:30:00-04:00"  # the first 01:30
    assert datetime.fromtimestamp(b / 1000, ny).isoformat() == "2026-11-02T01:30:00-05:00"  # not the second
    every15 = Recurrence(cron="*/15 * * * *", zone="America/New_York")
    t, fired = ms("2026-03-08T06:00:00+00:00"), []
    while t < ms("2026-03-08T08:00:00+00:00"):
        t = every15.next_after(t)
        fired.append(datetime.fromtimestamp(t / 1000, ny).strftime("%H:%M%z"))
    # 01:00..01:45 EST, the gap's four wall times fire once at its end (03:00 EDT), then on.
    assert fired[:6] == ["01:15-0500", "01:30-0500", "01:45-0500", "03:00-0400", "03:15-0400", "03:30-0400"]
    assert every15.latest_in(ms("2026-11-01T04:00:00+00:00"), ms("2026-11-01T06:40:00+00:00")) == \
        ms("2026-11-01T05:45:00+00:00")  # in the repeated hour's second pass: the first 01:45's instant


@pytest.mark.parametrize(("policy", "late"), [("skip", 0), ("latest", 1), ("all", 72)])
def test_catch_up_after_a_three_day_outage(brokers: SimulatedBrokers, clock: FakeClock, arun, policy: str,
                                           late: int) -> None:
    clock.set(ms("2026-05-01T00:00:00+00:00"))

    async def main() -> None:
        broker = await brokers.open()
        await broker.create_topic("hourly")
        await broker.create_schedule("h", "hourly", b"tick", every_ms=HOUR, catch_up=policy)
        inbox = Inbox("hourly")
        await drive(broker, clock, inbox, clock.now_ms() + 10 * HOUR + HOUR // 2)
        assert inbox.dues() == [ms("2026-05-01T00:00:00+00:00") + k * HOUR for k in range(1, 11)]
        await broker.close()  # 11h is issued, due during the outage
        down = clock.now_ms()
        clock.advance(3 * DAY)
        broker = await brokers.open()
        try:
            await broker.run_due()
            await inbox.collect(broker)
            after = inbox.seen[10:]
            assert len(after) == late
            missed = [down - HOUR // 2 + k * HOUR for k in range(1, 73)]  # 11h .. 82h, all in the outage
            if policy == "latest":
                assert [int(p[PROP_SCHEDULE_DUE_MS]) for _, p, _, _ in after] == [missed[-1]]
            if policy == "all":
                assert sorted(int(p[PROP_SCHEDULE_DUE_MS]) for _, p, _, _ in after) == missed
            # Then on the grid again, on time.
            nxt = missed[-1] + HOUR
            await drive(broker, clock, inbox, nxt)
            assert inbox.seen[-1][0] == nxt and inbox.dues()[-1] == nxt
            assert len(inbox.dues()) == len(set(inbox.dues()))
        finally:
            await broker.close()

    arun(main())


def test_a_restart_between_occurrences_neither_loses_nor_repeats_one(brokers: SimulatedBrokers, clock: FakeClock,
                                                                     arun) -> None:
    async def main() -> None:
        start = clock.now_ms()
        inbox = Inbox("t")
        broker = await brokers.open()
        await broker.create_topic("t")
        await broker.create_schedule("r", "t", b"x", every_ms=120_000)
        for k in range(1, 6):
            await drive(broker, clock, inbox, start + k * 120_000 + 30_000)
            await broker.close()
            clock.advance(10_000)  # back before the next occurrence
            broker = await brokers.open()
        await drive(broker, clock, inbox, start + 8 * 120_000)
        await broker.close()
        assert inbox.dues() == [start + k * 120_000 for k in range(1, 9)]
        assert [t for t, *_ in inbox.seen] == inbox.dues()

    arun(main())


def test_update_pause_and_delete_racing_an_occurrence(brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    async def main() -> None:
        start = clock.now_ms()
        async with brokers() as broker:
            await broker.create_topic("t")
            await broker.create_schedule("u", "t", b"old", every_ms=60_000)
            inbox = Inbox("t")
            # At the occurrence's instant, before the timer loop fired it: too late to withdraw,
            # so it goes out as it was; the update applies from the next one.
            clock.set(start + 60_000)
            await broker.update_schedule("u", ScheduleChange(body=b"new"))
            await broker.run_due()
            await inbox.collect(broker)
            await drive(broker, clock, inbox, start + 120_000)
            assert [(b, int(p[PROP_SCHEDULE_DUE_MS])) for _, p, b, _ in inbox.seen] == \
                [(b"old", start + 60_000), (b"new", start + 120_000)]
            # An update before the occurrence takes it over.
            await drive(broker, clock, inbox, start + 150_000 - 1)  # its occurrence issued
            clock.set(start + 150_000)
            withdrawn = broker.stats()["schedules"]["withdrawn"]
            await broker.update_schedule("u", ScheduleChange(body=b"newer"))
            assert broker.stats()["schedules"]["withdrawn"] == withdrawn + 1
            await drive(broker, clock, inbox, start + 180_000)
            assert inbox.seen[-1][2] == b"newer" and len(inbox.seen) == 3
            # A pause at the instant: that one is delivered, none after.
            await drive(broker, clock, inbox, start + 240_000 - 1)  # its occurrence issued
            clock.set(start + 240_000)
            await broker.pause_schedule("u")
            await broker.run_due()
            await drive(broker, clock, inbox, start + 600_000)
            assert inbox.dues()[-1] == start + 240_000 and len(inbox.seen) == 4
            assert broker.schedules.next_wake_ms() is None
            await broker.resume_schedule("u")  # skip: the paused ones are not delivered
            await drive(broker, clock, inbox, start + 660_000)
            assert inbox.dues()[-1] == start + 660_000 and len(inbox.seen) == 5
            # A pause before the occurrence withdraws it.
            await drive(broker, clock, inbox, start + 690_000 - 1)  # its occurrence issued
            clock.set(start + 690_000)
            await broker.pause_schedule("u")
            assert broker.stats()["schedules"]["withdrawn"] == withdrawn + 2
            await drive(broker, clock, inbox, start + 800_000)
            assert len(inbox.seen) == 5
            await broker.resume_schedule("u")
            await drive(broker, clock, inbox, start + 840_000)
            assert inbox.dues()[-1] == start + 840_000
            # Delete at the instant: delivered, and nothing after; delete before: nothing.
            await drive(broker, clock, inbox, start + 900_000 - 1)  # its occurrence issued
            clock.set(start + 900_000)
            await broker.delete_schedule("u")
            await broker.run_due()
            await drive(broker, clock, inbox, start + 1_200_000)
            assert inbox.dues()[-1] == start + 900_000
            await broker.create_schedule("d", "t", b"d", every_ms=60_000)
            clock.advance(30_000)
            await broker.delete_schedule("d")
            before = len(inbox.seen)
            clock.advance(10 * 60_000)
            await broker.run_due()
            await inbox.collect(broker)
            assert len(inbox.seen) == before and broker.list_schedules() == []
            assert len(inbox.dues()) == len(set(inbox.dues()))

    arun(main())


def test_changes_survive_a_restart(brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    async def main() -> None:
        start = clock.now_ms()
        broker = await brokers.open()
        await broker.create_topic("t")
        await broker.create_schedule("a", "t", b"1", every_ms=60_000, limit=3)
        await broker.create_schedule("b", "t", b"2", cron="@hourly", zone="Asia/Shanghai", jitter_ms=30_000)
        await broker.pause_schedule("b")
        await broker.update_schedule("a", ScheduleChange(body=b"one"))
        await broker.close()
        broker = await brokers.open()
        try:
            a, b = broker.get_schedule("a"), broker.get_schedule("b")
            assert (a.body, a.version, a.limit, b.paused, b.recurrence.zone) == (b"one", 2, 3, True, "Asia/Shanghai")
            inbox = Inbox("t")
            await drive(broker, clock, inbox, start + 10 * 60_000)
            assert inbox.dues() == [start + k * 60_000 for k in (1, 2, 3)]  # the limit
            assert broker.get_schedule("a").finished
            await broker.resume_schedule("b")
            await drive(broker, clock, inbox, start + 2 * HOUR, check_early=False)
            hourly = [t for t, p, _, _ in inbox.seen if p[PROP_SCHEDULE_NAME] == "b"]
            dues = [int(p[PROP_SCHEDULE_DUE_MS]) for _, p, _, _ in inbox.seen if p[PROP_SCHEDULE_NAME] == "b"]
            first = (start + 10 * 60_000) // HOUR * HOUR + HOUR
            assert dues == list(range(first, start + 2 * HOUR, HOUR)), (dues, first)
            assert all(0 <= t - d < 30_000 for t, d in zip(hourly, dues, strict=True))  # late, never early
        finally:
            await broker.close()

    arun(main())


def test_show_lists_the_next_occurrences(brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    clock.set(ms("2026-06-01T00:00:00+00:00"))

    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            await broker.create_schedule("s", "t", b"x", cron="0 0 5 * * *", zone="Asia/Shanghai")
            # 08:00 in Shanghai when made: the first is tomorrow's 05:00 there.
            assert broker.schedule_upcoming("s", 3) == [ms("2026-06-02T05:00:00+08:00"),
                                                        ms("2026-06-03T05:00:00+08:00"),
                                                        ms("2026-06-04T05:00:00+08:00")]

    arun(main())


@pytest.mark.parametrize(("spec", "error"), [
    ({"cron": "0 0 30 2 *"}, errors.InvalidSchedule),  # February 30th: cronsim refuses it when read
    ({"cron": "0 0 5 * * *", "end_ms": 1}, errors.ScheduleNeverFires),
    ({"every_ms": 60_000, "start_ms": 2_000_000_000_000, "end_ms": 1_900_000_000_000}, errors.InvalidSchedule),
    ({"cron": "0 0 5 * * *", "zone": "Mars/Olympus_Mons"}, errors.UnknownTimeZone),
    ({"every_ms": 500}, errors.ScheduleIntervalTooShort),
    ({"cron": "* * * * * *"}, None),  # every second: exactly the default minimum
    ({"cron": "*/5 * * * * *", "jitter_ms": 5_000}, errors.InvalidSchedule),
    ({"cron": "not a cron"}, errors.InvalidSchedule),
    ({"cron": "@reboot"}, errors.InvalidSchedule),
    ({"every_ms": 60_000, "catch_up": "sometimes"}, errors.InvalidSchedule),
    ({"every_ms": 60_000, "limit": 0}, errors.InvalidSchedule),
    ({}, errors.InvalidSchedule),
])
def test_bad_input_is_refused_with_its_values_and_stores_nothing(brokers: SimulatedBrokers, arun, spec: dict,
                                                                  error: type | None) -> None:
    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            end = broker.store.log.end_position
            if error is None:
                await broker.create_schedule("ok", "t", b"x", **spec)
                return
            with pytest.raises(error) as caught:
                await broker.create_schedule("bad", "t", b"x", **spec)
            assert caught.value.details["name"] == "bad"
            assert broker.list_schedules() == [] and broker.store.log.end_position == end

    arun(main())


def test_the_minimum_interval_is_a_setting(brokers: SimulatedBrokers, arun) -> None:
    async def main() -> None:
        async with brokers(schedule_min_interval_ms=60_000) as broker:
            await broker.create_topic("t")
            with pytest.raises(errors.ScheduleIntervalTooShort) as caught:
                await broker.create_schedule("s", "t", b"x", cron="*/30 * * * * *")
            assert (caught.value.details["interval_ms"], caught.value.details["min_interval_ms"]) == (30_000, 60_000)
            await broker.create_schedule("s", "t", b"x", every_ms=60_000)

    arun(main())


def test_a_duplicate_name_an_unknown_name_and_a_bad_name_are_refused(brokers: SimulatedBrokers, arun) -> None:
    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            await broker.create_schedule("s", "t", b"x", every_ms=60_000)
            end = broker.store.log.end_position
            with pytest.raises(errors.ScheduleExists):
                await broker.create_schedule("s", "t", b"other", every_ms=120_000)
            with pytest.raises(errors.InvalidSchedule):
                await broker.create_schedule("no spaces", "t", b"x", every_ms=60_000)
            for call in (broker.pause_schedule, broker.resume_schedule, broker.delete_schedule):
                with pytest.raises(errors.ScheduleNotFound):
                    await call("nope")
            with pytest.raises(errors.SystemTopicForbidden):
                await broker.create_schedule("sys", "rmq_sys_wheel_timer", b"x", every_ms=60_000)
            assert broker.store.log.end_position == end and broker.get_schedule("s").body == b"x"

    arun(main())


def test_a_schedule_outlives_retention(brokers: SimulatedBrokers, clock: FakeClock, make_config, arun) -> None:
    async def main() -> None:
        start = clock.now_ms()
        config = make_config(retention_ms=HOUR)
        broker = await brokers.open(config)
        await broker.create_topic("t")
        await broker.create_schedule("keep", "t", b"k" * 200, every_ms=10 * 60_000)
        inbox = Inbox("t")
        for k in range(1, 7):
            await drive(broker, clock, inbox, start + k * HOUR)
            await broker.enforce_retention()
        assert broker.store.log.start_position > 0  # segments went
        await broker.close()
        broker = await brokers.open(config)
        try:
            assert broker.get_schedule("keep").body == b"k" * 200
            await drive(broker, clock, inbox, start + 7 * HOUR)
            assert inbox.dues() == [start + k * 600_000 for k in range(1, 43)]
        finally:
            await broker.close()

    arun(main())


def test_every_keeps_real_time_across_a_dst_change(brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    clock.set(ms("2026-03-29T00:00:00+00:00"))  # Berlin springs forward at 01:00 UTC

    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            await broker.create_schedule("e", "t", b"x", every_ms=HOUR // 2, zone="Europe/Berlin")
            inbox = Inbox("t")
            await drive(broker, clock, inbox, ms("2026-03-29T03:00:00+00:00"))
            gaps = {b - a for a, b in zip(inbox.dues(), inbox.dues()[1:], strict=False)}
            assert gaps == {HOUR // 2} and len(inbox.dues()) == 6

    arun(main())


def test_stats_count_schedules(brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            await broker.create_schedule("a", "t", b"x", every_ms=60_000)
            await broker.create_schedule("b", "t", b"x", every_ms=60_000)
            await broker.pause_schedule("b")
            clock.advance(60_000)
            await broker.run_due()  # a's first fires; its second is issued later in the gap
            wake = broker.schedules.next_wake_ms()
            assert wake is not None and clock.now_ms() <= wake <= clock.now_ms() + 30_000
            clock.set(wake)
            await broker.run_due()
            stats = broker.stats()["schedules"]
            assert (stats["schedules"], stats["active"], stats["paused"]) == (2, 1, 1)
            assert stats["issued"] == 3  # a's first two, b's first (withdrawn by the pause)
            assert stats["withdrawn"] == 1

    arun(main())





def test_creates_arriving_together_are_made_together_each_refused_or_made_on_its_own(
        brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    """Twenty creates at once (two of them a name twice, one with a zone that does not exist):
    each refused one gets its own error, every other is made, and they share the log's group
    commits (a put append, an occurrence send and a progress append for the batch, not each)."""
    async def body() -> None:
        async with brokers() as broker:
            await broker.create_schedule("first", "jobs", b"x", every_ms=60_000)  # the topic exists
            fsyncs_before = broker.stats()["commitlog"]["fsyncs"]
            names = [f"s{i}" for i in range(18)] + ["s3", "bad-zone"]
            calls = [broker.create_schedule(n, "jobs", b"x", every_ms=60_000,
                                            **({"zone": "Mars/Olympus"} if n == "bad-zone" else {}))
                     for n in names]
            results = await asyncio.gather(*calls, return_exceptions=True)
            made = [r.name for r in results if not isinstance(r, BaseException)]
            refused = [type(r).__name__ for r in results if isinstance(r, BaseException)]
            assert sorted(made) == sorted(f"s{i}" for i in range(18))
            assert sorted(refused) == ["ScheduleExists", "UnknownTimeZone"]
            assert len(broker.list_schedules()) == 19
            # One by one: three durable appends a create (put, occurrence, progress), 54 fsyncs.
            assert broker.stats()["commitlog"]["fsyncs"] - fsyncs_before <= 8
        async with brokers() as broker:  # all of them durable
            assert sorted(s.name for s in broker.list_schedules()) == sorted(["first", *(f"s{i}" for i in range(18))])

    arun(body())


def test_the_next_occurrence_is_issued_off_the_due_instant_spread_over_the_first_half_of_the_gap(
        brokers: SimulatedBrokers, clock: FakeClock, arun) -> None:
    """Forty schedules made at one instant come due together; the step at that instant issues
    none of their next occurrences (the fire step has the forty to fire then): each is issued at
    its own point of the first half of the gap, on the issue grid, and all forty fire on time."""
    async def main() -> None:
        async with brokers() as broker:
            await broker.create_topic("t")
            names = [f"s{i}" for i in range(40)]
            await asyncio.gather(*(broker.create_schedule(n, "t", b"x", every_ms=60_000) for n in names))
            due = clock.now_ms() + 60_000
            inbox = Inbox("t")
            clock.set(due)
            assert await broker.run_due() == 40  # the first occurrences fired...
            await inbox.collect(broker)
            assert broker.stats()["schedules"]["issued"] == 40  # ...and no next one was issued with them
            issued_at: dict[str, int] = {}
            while len(issued_at) < len(names):
                wake = broker.schedules.next_wake_ms()
                assert wake is not None and due < wake <= due + 30_000, wake
                clock.set(wake)
                await broker.run_due()
                for s in broker.list_schedules():
                    if s.pending is not None and s.pending[0] == due + 60_000:
                        issued_at.setdefault(s.name, wake)
            for n in names:  # its own place: the fraction of the half gap its name gives, on the grid
                own = due + issue_offset_ms(n, 60_000)
                assert own <= issued_at[n] < own + ISSUE_GRID_MS, (n, issued_at[n] - due)
            assert len(set(issued_at.values())) >= 20  # spread, not heaped on one instant
            await drive(broker, clock, inbox, due + 60_000)
            assert sorted(inbox.dues()) == [due] * 40 + [due + 60_000] * 40
            assert all(t == d for t, d in zip([t for t, *_ in inbox.seen], inbox.dues(), strict=True))

    arun(main())


def test_issue_offsets_lie_in_the_first_half_of_the_gap() -> None:
    for gap in (1, 2, 1_000, 60_000, DAY, 400 * DAY):
        offsets = [issue_offset_ms(f"n{i}", gap) for i in range(200)]
        assert all(0 <= o <= gap // 2 for o in offsets) and all(o < gap for o in offsets)
    assert issue_offset_ms("same", 60_000) == issue_offset_ms("same", 60_000)
