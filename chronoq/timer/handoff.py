"""The hand-off: which pending timers the broker's loop fires at their due time when a job owns the far ones.

Theory of operation. With `timer_firer = "spark"` a Spark job keeps the far timers (its state is
the wheel's far levels) and hands each one to the broker before it is due: ArmTimers names the
timer's commit-log position when the timer enters the hand-off horizon (`timer_handoff_horizon_ms`
before its due time). From then on the broker's own loop fires it at its due time, to the
millisecond, as it fires every timer when it is the firer. A timer nobody armed is fired by the
backstop instead, `timer_spark_backstop_ms` after its due time: late, never lost. The broker's
durable index still holds every timer (the backstop's truth); this module holds only which of
them are armed, in memory, bounded by the timers inside the horizon.

A pending timer counts as armed when
- its due time is at or before `armed_through_ms`: set at the loop's first step to the fire
  horizon then plus the hand-off horizon. Everything due that soon is the broker's own, as if
  armed at start: a timer accepted before a restart (armed or not, the armed set was in memory)
  that is due within the horizon fires on time, so a restarted broker needs nothing from the job
  to keep its promise (the job arms a timer when it enters the horizon, never earlier, so every
  timer it armed before the restart is due within the horizon after it); or
- its position is in the armed set: armed by ArmTimers, or at acceptance when it was already due
  within the horizon (the job would only arm it late).
An armed timer leaves the set when it fires (by any path), and one found no longer pending when
due (cancelled, rolled to a new position) is dropped then; a roll of an armed timer arms its new
position. Cancels need nothing here: a cancelled timer is not pending, so it never fires, armed
or not, and an arm of it is refused (`TimerService.arm`).

Pure: no clock, no I/O; the timer service calls in with the times.
"""

from __future__ import annotations

from sortedcontainers import SortedList


class HandOff:
    def __init__(self, horizon_ms: int) -> None:
        self.horizon_ms = horizon_ms
        """Timers due within this of now are the broker's to fire on time."""
        self.armed_through_ms: int | None = None
        """Every pending timer due at or before this counts as armed (None until the loop's first step)."""
        self._armed: dict[int, int] = {}
        """Position -> due time of the armed timers due after `armed_through_ms`."""
        self._by_due: SortedList = SortedList()
        """(due time, position) of `_armed`, earliest first."""
        self.armed_by_call = 0
        """Timers armed by ArmTimers since start (not counting repeats)."""
        self.armed_on_accept = 0
        """Timers armed at acceptance, already due within the horizon."""
        self.fired_armed = 0
        """Timers the loop fired because they were armed (on time)."""
        self.fired_by_backstop = 0
        """Timers the loop fired unarmed, `timer_spark_backstop_ms` after their due time (late)."""

    def start(self, now_ms: int) -> None:
        """The loop's first step: everything due within the horizon of `now_ms` is armed."""
        if self.armed_through_ms is None:
            self.armed_through_ms = now_ms + self.horizon_ms
            for due_ms, position in list(self._by_due.irange(maximum=(self.armed_through_ms, 1 << 64))):
                self._drop(position, due_ms)

    def is_armed(self, position: int, due_ms: int) -> bool:
        through = self.armed_through_ms
        return (through is not None and due_ms <= through) or position in self._armed

    def arm(self, position: int, due_ms: int) -> bool:
        """Arm the pending timer at `position` due at `due_ms`; False if it was armed already."""
        if self.is_armed(position, due_ms):
            return False
        self._armed[position] = due_ms
        self._by_due.add((due_ms, position))
        return True

    def arm_on_accept(self, position: int, due_ms: int, now_ms: int) -> None:
        """A timer just accepted: armed if it is due within the horizon already."""
        if due_ms <= now_ms + self.horizon_ms and self.arm(position, due_ms):
            self.armed_on_accept += 1

    def moved(self, old_position: int, new_position: int, due_ms: int) -> None:
        """A roll moved a timer to a new record: an armed one stays armed there."""
        if old_position in self._armed:
            self._drop(old_position, self._armed[old_position])
            self.arm(new_position, due_ms)

    def due(self, now_ms: int, limit: int) -> list[int]:
        """Positions of armed timers (from the set) due at or before `now_ms`, earliest first, at
        most `limit`. They stay armed until `fired` or `drop` says otherwise."""
        out: list[int] = []
        for due_ms, position in self._by_due:
            if due_ms > now_ms or len(out) >= limit:
                break
            out.append(position)
        return out

    def fired(self, positions: list[int]) -> None:
        """These timers fired (their link record is durable): no longer armed."""
        armed = self._armed
        for position in positions:
            due_ms = armed.get(position)
            if due_ms is not None:
                self._drop(position, due_ms)

    def drop(self, position: int) -> None:
        """The timer at `position` is no longer pending (cancelled, rolled away, damaged)."""
        due_ms = self._armed.get(position)
        if due_ms is not None:
            self._drop(position, due_ms)

    def _drop(self, position: int, due_ms: int) -> None:
        del self._armed[position]
        self._by_due.remove((due_ms, position))

    def next_armed_ms(self) -> int | None:
        """The earliest due time in the armed set."""
        return self._by_due[0][0] if self._by_due else None

    def scan_horizon_ms(self, now_ms: int, backstop_ms: int) -> int:
        """The loop fires every pending timer (from the index, armed or not) due at or before this:
        the backstop's `now - backstop_ms`, or `now` itself while that is within `armed_through_ms`."""
        through = self.armed_through_ms if self.armed_through_ms is not None else now_ms
        return max(now_ms - backstop_ms, min(now_ms, through))

    def deadline_ms(self, engine_deadline_ms: int | None, backstop_ms: int) -> int | None:
        """When the loop next has work, given the index's earliest pending due time."""
        times = []
        if engine_deadline_ms is not None:
            through = self.armed_through_ms
            armed = through is None or engine_deadline_ms <= through
            times.append(engine_deadline_ms if armed else engine_deadline_ms + backstop_ms)
        head = self.next_armed_ms()
        if head is not None:
            times.append(head)
        return min(times) if times else None

    def stats(self) -> dict[str, int | None]:
        return {"horizon_ms": self.horizon_ms, "armed_through_ms": self.armed_through_ms,
                "armed": len(self._armed), "armed_by_call": self.armed_by_call,
                "armed_on_accept": self.armed_on_accept, "fired_armed": self.fired_armed,
                "fired_by_backstop": self.fired_by_backstop}
