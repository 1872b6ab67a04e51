"""The web console of a user without the admin role: the broker's views, cut to the topics it may see.

Theory of operation: the admin service's broker-wide methods (Stats, PendingByDue, and
SearchTimers or QueryMessage without a topic) are admin only, because they span every topic. A
user who may publish or subscribe to a few topics still needs the console's views of *those*
topics: its topics' rows and consumer groups, the pending-by-due chart of its timers, a search or
a look-up across its topics. This module computes them from the same broker reads the admin
methods make, then keeps what `Principal.may_see` allows (publish or subscribe on the topic: the
rule of DescribeTopic, of ListTopics and of SearchTimers with a topic), so the console has one
permission model, the users' table. A consumer group's row is kept when the caller may see its
topic and may consume as the group (`may_use_group`): another team's group on a shared topic is
that team's business.

Every function does bounded work, as the admin methods do: a scan of the timer index reads at
most `timer_search_max_scanned` entries (of every topic: the index is in due-time order, not per
topic), and the filter runs on what was read. Where other topics' timers fill the scan, the view
stops early and says so (`truncated`, the chart's `partial_from_ms`) rather than read on.

The HTTP server (`http/server.py`) calls these after `Access.check` has authenticated the caller;
an admin's console never comes here: it gets the admin methods' replies unfiltered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chronoq.server.auth import Principal

if TYPE_CHECKING:
    from chronoq.broker import Broker
    from chronoq.model import TimerStatus
    from chronoq.timer.engine import TimerEntry

SYSTEM_TOPIC_PREFIXES = ("rmq_sys_", "SCHEDULE_TOPIC", "%PULSAR_NOW%")
"""Topics the console never lists: the broker's own (the timer and delay-level topics) and the
Pulsar door's immediate copies (`chronoq.pulsar.messages.IMMEDIATE_PREFIX`; not imported here,
which would load the Pulsar protocol's modules), whose traffic is counted under their topic."""


def console_topics(names: Iterable[str]) -> list[str]:
    """The topics a console lists, of `names` (ListTopics' reply, already cut to the caller's):
    the broker's own topics left out, sorted."""
    return sorted(n for n in names if not n.startswith(SYSTEM_TOPIC_PREFIXES))


def visible_groups(groups: Iterable[Mapping[str, Any]], caller: Principal) -> list[dict[str, Any]]:
    """Stats' consumer-group rows the caller may see: its topic and its group both allowed."""
    return [dict(g) for g in groups if caller.may_see(g["topic"]) and caller.may_use_group(g["group"])]


def visible_pending(broker: Broker, caller: Principal, from_ms: int, to_ms: int, rows: int,
                    max_scanned: int) -> tuple[list[TimerEntry], bool]:
    """Pending timers due in [from_ms, to_ms) of every topic the caller may see, earliest first,
    at most `rows`; one scan of at most `max_scanned` index entries. True when a bound stopped it
    with entries left in the range (the console then says to narrow the range)."""
    entries, truncated = broker.pending_between(from_ms, to_ms, None, max_scanned, max_scanned)
    mine = [e for e in entries if caller.may_see(e.topic)]
    return mine[:rows], truncated or len(mine) > rows


def visible_statuses(statuses: Iterable[TimerStatus], caller: Principal) -> list[TimerStatus]:
    """A look-up's timers (by id or key, every topic) of the topics the caller may see."""
    return [s for s in statuses if caller.may_see(s.topic)]


@dataclass(frozen=True, slots=True)
class Bars:
    """The pending-by-due chart of a user's topics. `before` (overdue) and `after` (due past the
    chart) are None when a scan stopped at its bound; `partial_from_ms` then says from when on the
    bars may be short."""

    counts: list[int]
    before: int | None
    after: int | None
    partial_from_ms: int | None


def visible_pending_by_due(broker: Broker, caller: Principal, pending_by_topic: Mapping[str, int], from_s: int,
                           bar_s: int, bars: int, max_scanned: int) -> Bars:
    """Pending timers of the caller's topics per bar of `bar_s` seconds from `from_s` on (the
    admin chart's bars, PendingByDue's, which count every topic from the index's counters: no
    per-topic counter exists, so this scans, bounded). `pending_by_topic`: Stats' exact counts,
    which make `after` exact when both scans (overdue, and the chart's span) completed."""
    start_ms, end_ms = from_s * 1000, (from_s + bar_s * bars) * 1000
    counts = [0] * bars
    entries, truncated = broker.pending_between(start_ms, end_ms, None, max_scanned, max_scanned)
    for e in entries:
        if caller.may_see(e.topic):
            counts[(e.deliver_at_ms - start_ms) // (bar_s * 1000)] += 1
    overdue, overdue_truncated = visible_pending(broker, caller, 0, start_ms, max_scanned, max_scanned)
    before = None if overdue_truncated else len(overdue)
    total = sum(n for topic, n in pending_by_topic.items() if caller.may_see(topic))
    after = None if truncated or before is None else total - before - sum(counts)
    partial_from_ms = (entries[-1].deliver_at_ms if entries else start_ms) if truncated else None
    return Bars(counts, before, after, partial_from_ms)
