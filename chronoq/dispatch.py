"""Dispatch: where a durable record goes next, named in one place.

Theory of operation: a message walks through rooms, and this module is the door between the
log and everything derived from it:

    accept (`accept.py`: admit, route a timer to the timer topic, append)
      -> log (`store/commitlog.py`: written, then made durable by the group commit's fsync)
      -> dispatch (this module), for each run of records that became durable, in log order:
           1. queues       the store's consume queues (`MessageStore.enter`): each record, and each
                           link a link record carries, takes its (topic, queue, offset) entry;
           2. timer index  (`TimerLoop.index` -> `TimerService.index`): timer records and
                           tombstones are indexed, and a link record marks the timers it links as
                           fired: this is how the timer room learns its fire is durable;
           3. trace        (`TraceJournal.dispatched`, when `trace_enable`): accepted, fired and
                           cancelled timers journaled;
           4. long polls   (`Deliver.arrived`): receivers waiting on these topics woken;
      -> the senders waiting on these records are released (acknowledged).

`Dispatch` is built once, by the broker (`broker.py`), with each of these consumers, and the
store is handed it (`MessageStore.dispatch_through`): no consumer adds itself later, so this
list is the whole path. The order is the reason for the steps: an entry is in its queue before
anything can look for it there; an acknowledged timer is indexed before its sender hears so;
a woken consumer finds the records in their queues. A store opened without a broker (tools,
`chronoq check`, the store's tests) dispatches to its queues only (`queues_only`).

A consumer that runs out of disk space (`DiskFull`) or file descriptors raises, and the store
holds the run back and calls again with the same records later (`store/messagestore.py`): so
each consumer takes a run it has seen again as a no-op (queues skip entries they hold, the
index ignores what it has applied, a wake-up is idempotent).
"""

from __future__ import annotations

from typing import Protocol

from chronoq.model import StoredMessage


class Queues(Protocol):
    def enter(self, records: list[StoredMessage]) -> None:
        """Append the consume-queue entries of `records` (and of the links in link records)."""
        ...


class TimerIndexing(Protocol):
    def index(self, records: list[StoredMessage]) -> None:
        """Apply `records` to the timer index (timers, tombstones, roll copies, fired marks)."""
        ...


class Journal(Protocol):
    def dispatched(self, records: list[StoredMessage]) -> None:
        """Journal the timer events `records` carry."""
        ...


class LongPolls(Protocol):
    def arrived(self, records: list[StoredMessage]) -> None:
        """Wake the receivers waiting on the topics of `records`."""
        ...


class Dispatch:
    """The consumers of every durable run of records, called in the module docstring's order."""

    __slots__ = ("long_polls", "queues", "timer_index", "trace")

    def __init__(self, *, queues: Queues, timer_index: TimerIndexing | None, trace: Journal | None,
                 long_polls: LongPolls | None) -> None:
        self.queues = queues
        self.timer_index = timer_index
        self.trace = trace
        self.long_polls = long_polls

    @classmethod
    def queues_only(cls, queues: Queues) -> Dispatch:
        """A store's own dispatch before (or without) a broker: its consume queues, nothing else."""
        return cls(queues=queues, timer_index=None, trace=None, long_polls=None)

    def __call__(self, records: list[StoredMessage]) -> None:
        self.queues.enter(records)
        if self.timer_index is not None:
            self.timer_index.index(records)
        if self.trace is not None:
            self.trace.dispatched(records)
        if self.long_polls is not None:
            self.long_polls.arrived(records)
