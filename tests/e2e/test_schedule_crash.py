"""A recurring schedule on a real `chronoq serve`, SIGKILLed again and again around its occurrences.

One schedule, `--every 1s --catch-up all --limit N`, on a real server process
(`chronoq.client.testing.ServerProcess`: `chronoq serve` in a child, `kill()` is SIGKILL). The
server is killed several times: a few ms before, at and after an occurrence's due time (while it
fires), at the instant the schedule issues the next one (its own point of the first half of the
gap, `issue_offset_ms`), half-way between two, and just after a restart (while the
occurrences the outage missed are being issued); each time it stays down a random while, then
starts again on the same directory and port. A consumer (the SDK, in a thread of this test)
receives and acks throughout, riding out the outages.

At the end, what policy `all` promises, checked on the topic's stored messages (read by offset)
and on what the consumer received:
- every occurrence, those due while the server was down too, was stored exactly once: the
  SCHEDULE_DUE_MS values are exactly the N nominal times `anchor + k * 1 s`, each once, under
  the deterministic id `tick@<due>.v1`, with TIMER_OUT_MS equal to it;
- none early: each stored copy's store time, and each receipt's client time, is at or after
  its due time;
- none missed while the server was up: an occurrence due while it was up (from its ready line to
  `KILL_MARGIN_MS` before its kill) was stored within `UP_LATE_MS` of its time, before the kill;
  one due during an outage (or cut off by a kill while it fired) was stored by the next start,
  at most `CATCH_UP_MS` after that start's ready line;
- the consumer received each occurrence; twice only one whose ack a kill cut off.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from chronoq.client import Admin, Consumer, ReceivedMessage
from chronoq.client.testing import ServerProcess
from chronoq.errors import ChronoqError
from chronoq.model import PROP_SCHEDULE_DUE_MS, PROP_SCHEDULE_NAME
from chronoq.recurring.service import issue_offset_ms

pytestmark = pytest.mark.slow

N = 60
"""Occurrences (the schedule's limit): a minute of schedule, long enough for the kills below."""
EVERY_MS = 1000
TOPIC, NAME, GROUP = "ticks", "tick", "g"
UP_LATE_MS = 2_000
"""How late an occurrence due while the server was up may be stored (loaded shared machine: the
timer fires it within ms of its time, as the printed lateness shows)."""
UP_AT_LEAST_MS = 2_500
"""A kill aimed at an occurrence comes at least this long after the start before it, so the
server is seen up across occurrences between kills."""
KILL_MARGIN_MS = 1_000
"""An occurrence due this close before a kill may have been cut off while firing: the next start
delivers it (catch-up `all`)."""
CATCH_UP_MS = 8_000
"""How long after the restart's ready line an occurrence the outage missed may be stored."""
INVISIBLE_MS = 3_000
"""A receipt whose ack a kill cut off comes back this much later."""


def now_ms() -> int:
    return int(time.time() * 1000)


class Receiver(threading.Thread):
    """Receives and acks until stopped, through every outage: (due, message id, received ms,
    deliver_at ms) per receipt; the message ids whose ack failed."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.receipts: list[tuple[int, str, int, int | None]] = []
        self.ack_failed: set[str] = set()
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        with Consumer(GROUP, TOPIC, server=self.address, timeout_ms=3000, attempts=1) as consumer:
            while not self.stopping.is_set():
                try:
                    got = consumer.receive(16, invisible=INVISIBLE_MS, wait=500)
                except ChronoqError as e:  # the server is down (or starting): try again shortly
                    self.errors.append(type(e).__name__)
                    time.sleep(0.1)
                    continue
                for m in got:
                    self._note(m)
                    try:
                        consumer.ack(m)
                    except ChronoqError:
                        self.ack_failed.add(m.message_id)

    def _note(self, m: ReceivedMessage) -> None:
        assert m.properties[PROP_SCHEDULE_NAME] == NAME
        self.receipts.append((int(m.properties[PROP_SCHEDULE_DUE_MS]), m.message_id, m.received_ms, m.deliver_at_ms))


def _stored(admin: Admin) -> list[tuple[int, str, int, int | None, str | None]]:
    """Every message of the topic, read by offset: (due, id, store ms, deliver_at ms, TIMER_OUT_MS)."""
    out = []
    for q in admin.describe_topic(TOPIC).queues:
        offset = q.min_offset
        while offset < q.max_offset:
            page = admin.read(TOPIC, q.queue_id, offset, 64)
            for m in page.messages:
                out.append((int(m.properties[PROP_SCHEDULE_DUE_MS]), m.message_id, m.store_ms, m.deliver_at_ms,
                            m.system_properties.get("TIMER_OUT_MS")))
            offset = page.next_offset
    return out


def _sleep_until(t_ms: int) -> None:
    time.sleep(max(0.0, (t_ms - now_ms()) / 1000))


@pytest.mark.timeout(240)
def test_a_schedule_under_repeated_sigkill_delivers_every_occurrence_once_and_never_early(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    launched = now_ms()
    server = ServerProcess(tmp_path / "data", args=["--log-level", "WARNING"]).start()
    up: list[list[int]] = [[launched, now_ms(), 0]]
    """[launched ms, ready ms, killed ms] per life of the server (the last one's end: the test's end)."""
    receiver = Receiver(server.address)
    try:
        with Admin(server.address, timeout_ms=5000) as admin:
            admin.create_topic(TOPIC, message_types=["DELAY"])
            s = admin.create_schedule(NAME, TOPIC, b"tick", every_ms=EVERY_MS, catch_up="all", limit=N)
        anchor = s["upcoming_ms"][0]
        dues = [anchor + k * EVERY_MS for k in range(N)]
        assert s["upcoming_ms"] == dues[:5] and s["count"] == 1, s
        receiver.start()

        # Where each kill lands, relative to the due time of an occurrence: just before, on, just
        # after it; when the next is issued; half-way to the next; and (None) 0-150 ms after the
        # server said it was ready.
        issue = issue_offset_ms(NAME, EVERY_MS)
        offsets: list[int | None] = [-20, 0, 15, issue, 500, None, rng.randint(-60, 60), None, rng.randint(1, 999)]
        kills: list[str] = []
        for offset in offsets:
            if offset is None:
                at = up[-1][1] + rng.randint(0, 150)
                what = f"{at - up[-1][1]} ms after ready"
            else:
                k = next(i for i, d in enumerate(dues) if d + offset > now_ms() + UP_AT_LEAST_MS)
                at = dues[k] + offset
                what = f"{offset:+d} ms from occurrence {k}"
            if at > dues[-1] - 6 * EVERY_MS:
                break  # leave the last occurrences to an undisturbed server
            _sleep_until(at)
            server.kill()
            up[-1][2] = now_ms()
            time.sleep(rng.uniform(0.0, 2.5))
            launched = now_ms()
            server.start()
            up.append([launched, now_ms(), 0])
            kills.append(what)
        assert len(kills) >= 6, kills

        # Every occurrence comes to the consumer (the last one: N s after the create).
        deadline = dues[-1] + CATCH_UP_MS
        while {r[0] for r in receiver.receipts} != set(dues) and now_ms() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)  # anything more (a repeat, an occurrence past the limit) would come now
        up[-1][2] = now_ms()
        with Admin(server.address, timeout_ms=5000) as admin:
            stored = _stored(admin)
            final = admin.describe_schedule(NAME)
    finally:
        receiver.stopping.set()
        receiver.join(10)
        server.stop()

    context = f"seed {seed}, kills {kills}, up windows {up}"
    # Stored exactly once each, under its deterministic id, never early.
    per_due = Counter(d for d, *_ in stored)
    assert sorted(per_due) == dues, f"{context}: stored dues {sorted(per_due)} != expected {dues}"
    assert set(per_due.values()) == {1}, f"{context}: stored twice: {[d for d, n in per_due.items() if n > 1]}"
    for due, mid, store_ms, deliver_at_ms, timer_out in stored:
        assert mid == f"{NAME}@{due}.v1" and deliver_at_ms == due and timer_out == str(due), (context, mid)
        assert store_ms >= due, f"{context}: {mid} stored {due - store_ms} ms early"
    assert final["count"] == N and final["finished"] and final["pending_due_ms"] == dues[-1], final

    # None missed: prompt while up, at the restart when due during an outage.
    late_up, late_down = [], []
    for due, mid, store_ms, _, _ in stored:
        life = next((w for w in up if w[1] <= due <= w[2]), None)
        if life is not None and due <= life[2] - KILL_MARGIN_MS:
            late_up.append(store_ms - due)
            assert store_ms - due <= UP_LATE_MS and store_ms <= life[2], \
                f"{context}: {mid} due while up, stored {store_ms - due} ms late"
        elif life is not None and store_ms <= life[2]:
            late_up.append(store_ms - due)  # due just before a kill, and fired before it
        else:  # due in an outage, or just before a kill that came first: delivered by the next start
            launched, ready, _ = next(w for w in up if w[1] > due)
            late_down.append(store_ms - ready)
            assert launched <= store_ms <= ready + CATCH_UP_MS, \
                f"{context}: {mid} due during an outage, stored {store_ms - ready} ms after the restart was ready"
    assert late_down, f"{context}: no occurrence fell in an outage: the kills proved nothing"

    # The consumer: each occurrence received, never before its due time; twice only after a lost ack.
    got = Counter(r[0] for r in receiver.receipts)
    assert set(got) == set(dues), f"{context}: never received: {sorted(set(dues) - set(got))}"
    for due, mid, received_ms, deliver_at_ms in receiver.receipts:
        assert deliver_at_ms == due and received_ms >= due, f"{context}: {mid} received {due - received_ms} ms early"
    twice = {f"{NAME}@{d}.v1" for d, n in got.items() if n > 1}
    assert twice <= receiver.ack_failed, f"{context}: received twice without a lost ack: {twice - receiver.ack_failed}"
    print(f"\nseed {seed}: {len(kills)} kills ({'; '.join(kills)}); {N} occurrences stored once each, "
          f"{len(late_up)} due while up (stored ms after due: max {max(late_up)}, "
          f"median {sorted(late_up)[len(late_up) // 2]}), {len(late_down)} due while down (stored ms after the "
          f"restart was ready: max {max(late_down)}); {len(receiver.receipts)} receipts, "
          f"{len(twice)} again after a lost ack")
