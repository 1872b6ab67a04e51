"""Soak: a real `chronoq serve` under mixed load for a set time, SIGKILLed every few minutes.

Usage: python -m bench.soak --minutes 30 [--rate 60] [--kill-every-min 3] [--body-bytes 1]
       [--retention-s S --segment-kib K] [--out DIR (default: a new directory under /tmp)]

Theory of operation: one server process (a fresh data directory, sync flush) and, in this
process, asyncio tasks that drive it through chronoq's SDK:

- producers send at `--rate` messages/s in all: a third normal messages, the rest timer messages
  due in 1-30 s (most) or 60-120 s (one in five, so they live across a kill; `--max-delay-s`
  changes 120); every tenth send is
  a SendBatch of 10 through the admin service, the rest single RocketMQ SendMessage calls;
- a canceller recalls one timer in ten, a few seconds after its send (before it is due);
- two consumers (one group) long-poll, ack, and note each message's first arrival.

A message counts as *owed* once its send was acknowledged and no acknowledged cancel took it
back; a send whose answer was lost in a kill is not counted either way (its message may or may
not come). A recall whose answer was lost (a retriable failure: the connection, a deadline) may
have taken effect (its tombstone written before the kill is recovered): the soak asks the broker,
once it answers again, what became of that timer (`query`) and counts a cancelled one as
cancelled, a pending or delivered one as owed; one it cannot learn (`cancel_unknown`) is owed by
neither count. A cancelled one that comes anyway is reported as `cancelled_delivered`. A run that loses
anything keeps its data directory (`data/` beside the report) for a post-mortem. Every
`--kill-every-min` minutes the server is SIGKILLed and restarted on the same directory; clients retry through the gap.

With `--retention-s` the server deletes segments older than that (checked every
`RETENTION_CHECK_S`), in segments of `--segment-kib`: timers crossing segment boundaries, the
link records that fire them, rolled timers and SIGKILLs together, while the disk must stay flat
(`--body-bytes` sets every message's body, so segments fill at a known rate).

Every `SAMPLE_S` seconds the server's RSS and open files (psutil), the bytes and segments of its
commit log and the bytes of its whole data directory, and the lateness of the timer messages
that arrived since the last sample (arrival minus due time, both read from the one host's wall clock)
are recorded. After `--minutes` the producers stop and the consumers drain until every
owed message arrived or `DRAIN_S` passed. Lost = owed and never arrived; early = arrived before
its due time. The report: `soak.json` (every sample), `soak.md` (summary, with the bytes on disk
at 5, 10, 20 and 30 minutes side by side) and `soak.png` (RSS, fds, disk, lateness over time,
kills marked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from chronoq.client import AsyncConsumer, AsyncProducer, outgoing
from chronoq.client.testing import ServerProcess
from chronoq.errors import ChronoqError
from chronoq.store import files

TOPIC = "soak"
GROUP = "soak_group"
SAMPLE_S = 5.0
DRAIN_S = 180.0
SHORT_DELAY_MS = (1_000, 30_000)
"""Most timers' delays; with `--max-delay-s` M: 1 s to min(30 s, M)."""
INVISIBLE_MS = 15_000
RETRY_S = 0.5
RESOLVE_AFTER_S = 3.0
RESOLVE_FOR_S = 50.0
"""How long after a recall whose answer was lost the soak asks what became of it, and for how
long it keeps asking (well within the timer index's history, which the retention period bounds)."""
RETENTION_CHECK_S = 5
DISK_AT_MIN = (1, 2, 5, 10, 20, 30)
"""The minutes at which the report shows the bytes on disk side by side."""
CANCEL_WORKERS = 16
"""Each waits 0.2-2 s before its recall; one alone fell behind (in the first 30-minute run only 30
recalls were made: the queue aged past the timers' due times)."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class Ledger:
    """What was sent, what is owed, what arrived."""

    due_ms: dict[str, int] = field(default_factory=dict)  # acknowledged sends: id -> due time (send time if normal)
    cancelled: set[str] = field(default_factory=set)  # acknowledged cancels
    cancel_unknown: set[str] = field(default_factory=set)
    """Recalls whose answer was lost (the server killed, a deadline) and whose outcome the broker
    has not told yet (`Soak.resolve_recall`): owed by neither count."""
    recalls_lost_answer: int = 0
    recalls_lost_answer_cancelled: int = 0
    """Of the recalls whose answer was lost, how many the broker says took effect."""
    arrived_ms: dict[str, int] = field(default_factory=dict)  # first arrival
    duplicates: int = 0
    recent_lateness_ms: list[int] = field(default_factory=list)
    early: list[tuple[str, int]] = field(default_factory=list)
    send_errors: int = 0
    cancel_errors: int = 0
    receive_errors: int = 0
    cancels_too_late: int = 0

    recall_outcome: dict[str, str] = field(default_factory=dict)
    """Each recalled id -> "ok", or the error's code (a lost message's is in the report)."""

    def owed(self) -> set[str]:
        return set(self.due_ms) - self.cancelled - self.cancel_unknown


class Server(ServerProcess):
    """`chronoq serve` on one data directory and port, SIGKILLed and started again on them (the
    tests' `ServerProcess`), and what the soak samples of it."""

    def __init__(self, data_dir: Path, log_path: Path, settings: dict[str, int] | None = None) -> None:
        super().__init__(data_dir, settings=settings, log_path=log_path, args=["--log-level", "WARNING"])

    def sample(self) -> tuple[int, int]:
        assert self.pid is not None
        p = psutil.Process(self.pid)
        return p.memory_info().rss, p.num_fds()

    def disk(self) -> dict[str, int]:
        """Bytes on disk now (allocated blocks): the commit log and its segments, the timer index
        and the consumer-group store (RocksDB, with their WALs), the whole data directory; and
        where the log starts (retention moves it)."""
        out = {"log_bytes": 0, "segments": 0, "timer_bytes": 0, "groups_bytes": 0, "disk_bytes": 0, "log_start": -1}
        for root, _dirs, names in os.walk(self.data_dir):
            part = Path(root).relative_to(self.data_dir).parts[:1]
            for name in names:
                try:
                    size = os.stat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    continue  # deleted by retention meanwhile
                out["disk_bytes"] += size
                if part == (files.COMMITLOG_DIR,) and name.endswith(files.SEGMENT_SUFFIX):
                    out["log_bytes"] += size
                    out["segments"] += 1
                    base = files.parse_numbered(name, files.SEGMENT_SUFFIX)
                    if base is not None and (out["log_start"] < 0 or base < out["log_start"]):
                        out["log_start"] = base
                elif part == (files.TIMER_DIR,):
                    out["timer_bytes"] += size
                elif part == (files.GROUPS_DIR,):
                    out["groups_bytes"] += size
        return out


class Soak:
    def __init__(self, args: argparse.Namespace, server: Server) -> None:
        self.args = args
        self.server = server
        self.ledger = Ledger()
        self.address = f"127.0.0.1:{server.port}"
        self.sending = True
        self.done = False
        self.rng = random.Random(args.seed)
        self.to_cancel: asyncio.Queue[tuple[str, str, int]] = asyncio.Queue()
        self.samples: list[dict[str, Any]] = []
        self.kills_s: list[float] = []
        self.t0 = time.monotonic()
        self.started = datetime.now(UTC).isoformat(timespec="seconds")

    def _message(self) -> tuple[Any, int]:
        roll = self.rng.random()
        sent = now_ms()
        if roll < 1 / 3:
            return outgoing(TOPIC, b"n" * self.args.body_bytes, tag="normal"), sent
        max_ms = self.args.max_delay_s * 1000
        low, high = (max_ms // 2, max_ms) if roll > 0.87 else (SHORT_DELAY_MS[0], min(SHORT_DELAY_MS[1], max_ms))
        due = sent + self.rng.randint(low, high)
        return outgoing(TOPIC, b"t" * self.args.body_bytes, deliver_at=due, tag="timer"), due

    async def produce(self, producer: AsyncProducer, share: float) -> None:
        interval_s = 1 / (self.args.rate * share)
        n = 0
        next_at = time.monotonic()
        while self.sending:
            n += 1
            batch = 10 if n % 10 == 0 else 1
            msgs = [self._message() for _ in range(batch)]
            try:
                if batch == 1:
                    receipts = [await producer.send(TOPIC, msgs[0][0].body, deliver_at=msgs[0][0].deliver_at_ms,
                                                    tag=msgs[0][0].tag)]
                else:
                    receipts = await producer.send_batch([m for m, _ in msgs])
            except ChronoqError:
                self.ledger.send_errors += 1
                receipts = []
            for receipt, (_msg, due) in zip(receipts, msgs, strict=False):
                self.ledger.due_ms[receipt.message_id] = receipt.deliver_at_ms or due
                if receipt.recall_handle and self.rng.random() < 0.1:
                    self.to_cancel.put_nowait((receipt.message_id, receipt.recall_handle, due))
            next_at += interval_s * batch
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def cancel(self, producer: AsyncProducer) -> None:
        while not self.done:
            message_id, handle, due = await self.to_cancel.get()
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))
            if now_ms() > due - 500:
                continue  # too close to its time: a race the report would count as an error
            try:
                await producer.recall(TOPIC, handle)
                self.ledger.cancelled.add(message_id)
                self.ledger.recall_outcome[message_id] = "ok"
            except ChronoqError as e:
                self.ledger.recall_outcome[message_id] = f"{e.code} {type(e).__name__}"
                if e.code == 42800:
                    self.ledger.cancels_too_late += 1
                else:
                    self.ledger.cancel_errors += 1
                    if e.retriable:
                        # A connection failure or a deadline (the server killed under it): the
                        # tombstone may be durable, so the timer may not come. Not owed until
                        # the broker says what became of it.
                        self.ledger.cancel_unknown.add(message_id)
                        self.ledger.recalls_lost_answer += 1
                        await self.resolve_recall(producer, message_id)

    async def resolve_recall(self, producer: AsyncProducer, message_id: str) -> None:
        """Ask the broker, once it answers (a restart), whether a recall whose answer was lost
        cancelled `message_id`'s timer: a tombstone written before a kill is recovered and applied
        at the restart, so the answer is final then (waiting `RESOLVE_AFTER_S` first for one still
        on its way to the disk)."""
        deadline = time.monotonic() + RESOLVE_FOR_S
        await asyncio.sleep(RESOLVE_AFTER_S)
        while time.monotonic() < deadline:
            try:
                states = {t.state for t in await producer.query(message_id, TOPIC)}
            except ChronoqError:
                await asyncio.sleep(RETRY_S)
                continue
            if "cancelled" in states:
                self.ledger.cancelled.add(message_id)
                self.ledger.recalls_lost_answer_cancelled += 1
            if states:
                self.ledger.cancel_unknown.discard(message_id)
            return

    async def consume(self, consumer: AsyncConsumer) -> None:
        while not self.done:
            try:
                got = await consumer.receive(32, invisible=INVISIBLE_MS, wait=2000)
            except ChronoqError:
                self.ledger.receive_errors += 1
                await asyncio.sleep(RETRY_S)
                continue
            for m in got:
                self._arrived(m.message_id, m.received_ms)
            if got:
                try:
                    await consumer.ack(*got)
                except ChronoqError:
                    self.ledger.receive_errors += 1

    def _arrived(self, message_id: str, at_ms: int) -> None:
        led = self.ledger
        if message_id in led.arrived_ms:
            led.duplicates += 1
            return
        led.arrived_ms[message_id] = at_ms
        due = led.due_ms.get(message_id)
        if due is None:
            return  # a send whose answer was lost, or not yet recorded: not owed
        if at_ms < due:
            led.early.append((message_id, due - at_ms))
        led.recent_lateness_ms.append(at_ms - due)

    async def sample(self) -> None:
        while not self.done:
            await asyncio.sleep(SAMPLE_S)
            try:
                rss, fds = self.server.sample()
            except (psutil.Error, AssertionError):
                rss, fds = 0, 0
            disk = await asyncio.to_thread(self.server.disk)
            late = sorted(self.ledger.recent_lateness_ms)
            self.ledger.recent_lateness_ms = []
            self.samples.append({
                "t_s": round(time.monotonic() - self.t0, 1), "rss_bytes": rss, "fds": fds,
                **disk,
                "arrived": len(late), "late_p50_ms": late[len(late) // 2] if late else None,
                "late_p99_ms": late[min(len(late) - 1, int(len(late) * 0.99))] if late else None,
                "late_max_ms": late[-1] if late else None, "owed": len(self.ledger.owed()),
                "missing": len(self.ledger.owed() - set(self.ledger.arrived_ms)),
            })

    async def killer(self) -> None:
        period_s = self.args.kill_every_min * 60
        while self.sending:
            await asyncio.sleep(period_s)
            if not self.sending:
                return
            self.kills_s.append(round(time.monotonic() - self.t0, 1))
            self.server.kill()
            await asyncio.to_thread(self.server.start)

    async def run(self) -> None:
        producers = [AsyncProducer(self.address, send_attempts=5, timeout_ms=5000) for _ in range(2)]
        canceller = AsyncProducer(self.address, timeout_ms=5000)
        consumers = [AsyncConsumer(GROUP, TOPIC, server=self.address, timeout_ms=5000) for _ in range(2)]
        async with asyncio.TaskGroup() as tg:
            background = [tg.create_task(self.sample()),
                          *(tg.create_task(self.cancel(canceller)) for _ in range(CANCEL_WORKERS)),
                          *(tg.create_task(self.consume(c)) for c in consumers)]
            sends = [tg.create_task(self.produce(p, 0.5)) for p in producers]
            killer = tg.create_task(self.killer())
            await asyncio.sleep(self.args.minutes * 60)
            self.sending = False
            killer.cancel()
            await asyncio.gather(*sends)
            drain_until = time.monotonic() + DRAIN_S
            while time.monotonic() < drain_until and self.ledger.owed() - set(self.ledger.arrived_ms):
                await asyncio.sleep(1)
            await asyncio.sleep(SAMPLE_S)
            self.done = True
            for task in background:
                task.cancel()
        for client in (*producers, canceller, *consumers):
            await client.close()


def summary(soak: Soak, args: argparse.Namespace) -> dict[str, Any]:
    led = soak.ledger
    owed = led.owed()
    lost = sorted(owed - set(led.arrived_ms))
    cancelled_delivered = sorted(led.cancelled & set(led.arrived_ms))
    lateness = sorted(led.arrived_ms[i] - led.due_ms[i] for i in owed if i in led.arrived_ms)
    rss = [s["rss_bytes"] for s in soak.samples if s["rss_bytes"]]
    fds = [s["fds"] for s in soak.samples if s["fds"]]
    disk_at: dict[str, dict[str, int]] = {}
    for minute in DISK_AT_MIN:
        near = sorted(soak.samples, key=lambda s: abs(s["t_s"] - minute * 60))[:1]
        if near and abs(near[0]["t_s"] - minute * 60) <= 2 * SAMPLE_S and minute <= args.minutes:
            s = near[0]
            disk_at[str(minute)] = {k: s[k] for k in ("log_bytes", "segments", "timer_bytes", "groups_bytes",
                                                      "disk_bytes")}

    def pct(q: float) -> int | None:
        return lateness[min(len(lateness) - 1, int(len(lateness) * q))] if lateness else None

    return {
        "started": soak.started, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "minutes": args.minutes, "rate": args.rate,
        "kill_every_min": args.kill_every_min, "kills": len(soak.kills_s), "kills_at_s": soak.kills_s,
        "sent_acknowledged": len(led.due_ms), "cancelled_acknowledged": len(led.cancelled),
        "cancels_too_late": led.cancels_too_late, "owed": len(owed), "arrived_owed": len(owed) - len(lost),
        "lost": len(lost), "lost_ids": lost[:50],
        "lost_detail": [{"id": i, "due_ms": led.due_ms[i], "recall": led.recall_outcome.get(i)} for i in lost[:50]],
        "early": len(led.early), "early_examples": led.early[:20],
        "cancelled_delivered": len(cancelled_delivered), "duplicates": led.duplicates,
        "recalls_lost_answer": led.recalls_lost_answer,
        "recalls_lost_answer_cancelled": led.recalls_lost_answer_cancelled,
        "cancel_unknown": len(led.cancel_unknown),
        "cancel_unknown_arrived": len(led.cancel_unknown & set(led.arrived_ms)),
        "send_errors": led.send_errors, "cancel_errors": led.cancel_errors, "receive_errors": led.receive_errors,
        "late_p50_ms": pct(0.5), "late_p99_ms": pct(0.99), "late_max_ms": lateness[-1] if lateness else None,
        "rss_first_bytes": rss[0] if rss else None, "rss_last_bytes": rss[-1] if rss else None,
        "rss_max_bytes": max(rss) if rss else None, "fds_first": fds[0] if fds else None,
        "fds_last": fds[-1] if fds else None, "fds_max": max(fds) if fds else None,
        "retention_s": args.retention_s, "segment_kib": args.segment_kib, "body_bytes": args.body_bytes,
        "disk_at_min": disk_at,
        "log_bytes_max": max((s["log_bytes"] for s in soak.samples), default=None),
    }


def plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in soak.samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    axes[0].plot(t, [s["rss_bytes"] / 2**20 for s in soak.samples])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [s["fds"] for s in soak.samples])
    axes[1].set_ylabel("server open files")
    axes[2].plot(t, [s["log_bytes"] / 2**20 for s in soak.samples], label="commit log")
    axes[2].plot(t, [s["timer_bytes"] / 2**20 for s in soak.samples], label="timer index")
    axes[2].plot(t, [s["groups_bytes"] / 2**20 for s in soak.samples], label="consumer groups")
    axes[2].plot(t, [s["disk_bytes"] / 2**20 for s in soak.samples], label="data directory")
    axes[2].set_ylabel("on disk (MiB)")
    axes[2].legend()
    for key, label in (("late_p50_ms", "p50"), ("late_p99_ms", "p99"), ("late_max_ms", "max")):
        axes[3].plot(t, [s[key] if s[key] is not None else float("nan") for s in soak.samples], label=label)
    axes[3].set_ylabel("arrival - due (ms), per 5 s")
    axes[3].set_yscale("symlog", linthresh=100)
    axes[3].axhline(0, color="red", linewidth=0.8)
    axes[3].legend()
    axes[3].set_xlabel("minutes")
    for ax in axes:
        for k in soak.kills_s:
            ax.axvline(k / 60, color="grey", linestyle="--", linewidth=0.8)
    fig.suptitle("chronoq soak: mixed load, cancels, SIGKILL (dashed) every few minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def markdown(result: dict[str, Any], command: str) -> str:
    mib = 2**20
    rows = [
        ("duration", f"{result['minutes']} min of load (+ drain), {result['rate']} msg/s"),
        ("SIGKILLs", f"{result['kills']} (every {result['kill_every_min']} min)"),
        ("acknowledged sends / cancels", f"{result['sent_acknowledged']} / {result['cancelled_acknowledged']}"),
        ("owed / arrived", f"{result['owed']} / {result['arrived_owed']}"),
        ("**lost**", str(result["lost"])), ("**early**", str(result["early"])),
        ("cancelled yet delivered", str(result["cancelled_delivered"])),
        ("recalls whose answer was lost / that the broker says took effect / unresolved (owed by neither)",
         f"{result['recalls_lost_answer']} / {result['recalls_lost_answer_cancelled']} / "
         f"{result['cancel_unknown']}"),
        ("duplicates (at-least-once, after kills)", str(result["duplicates"])),
        ("lateness p50 / p99 / max (ms)",
         f"{result['late_p50_ms']} / {result['late_p99_ms']} / {result['late_max_ms']}"),
        ("RSS first / last / max (MiB)", " / ".join(f"{(result[k] or 0) / mib:.0f}" for k in
                                                    ("rss_first_bytes", "rss_last_bytes", "rss_max_bytes"))),
        ("open files first / last / max", f"{result['fds_first']} / {result['fds_last']} / {result['fds_max']}"),
        ("client-side errors (send / cancel / receive)",
         f"{result['send_errors']} / {result['cancel_errors']} / {result['receive_errors']}"),
        ("retention / segment size / body",
         f"{result['retention_s'] or 'default'} s / {result['segment_kib'] or 'default'} KiB / "
         f"{result['body_bytes']} bytes"),
    ]
    for minute, disk in result["disk_at_min"].items():
        rows.append((f"on disk at {minute} min: commit log (segments) / timer index / groups / data directory",
                     f"{disk['log_bytes'] / mib:.1f} MiB ({disk['segments']}) / {disk['timer_bytes'] / mib:.1f} / "
                     f"{disk['groups_bytes'] / mib:.1f} / {disk['disk_bytes'] / mib:.1f} MiB"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"# Soak, {result['started']} to {result['finished']}\n\n`{command}`\n\n"
            f"| measure | value |\n|---|---|\n{table}\n\n![soak](soak.png)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=60, help="messages per second, all producers together")
    parser.add_argument("--kill-every-min", type=float, default=3)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--body-bytes", type=int, default=1, help="every message's body size")
    parser.add_argument("--max-delay-s", type=int, default=120,
                        help="the longest delay; one timer in five is due between half of it and it")
    parser.add_argument("--retention-s", type=int, default=None, help="the server's retention (default: its own)")
    parser.add_argument("--segment-kib", type=int, default=None, help="the server's segment size (default: its own)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.gettempdir()) / f"chronoq-soak-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, int] = {}
    if args.retention_s is not None:
        settings.update(retention_ms=args.retention_s * 1000, retention_check_interval_ms=RETENTION_CHECK_S * 1000)
    if args.segment_kib is not None:
        settings.update(segment_size_bytes=args.segment_kib * 1024,
                        max_message_size_bytes=min(args.segment_kib * 1024, 4 * 2**20))
    with tempfile.TemporaryDirectory(prefix="chronoq-soak-") as tmp:
        server = Server(Path(tmp) / "data", out / "server.log", settings)
        server.start()
        soak = Soak(args, server)
        try:
            asyncio.run(soak.run())
        finally:
            code = server.stop()
        result = summary(soak, args)
        if result["lost"] or result["early"]:
            shutil.copytree(server.data_dir, out / "data")  # for a post-mortem (`chronoq check`)
    result["server_exit_after_sigterm"] = code
    command = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "soak.json").write_text(json.dumps({"summary": result, "samples": soak.samples}, indent=1))
    (out / "soak.md").write_text(markdown(result, command))
    plot(soak, out / "soak.png")
    print(json.dumps(result))
    print(f"report: {out / 'soak.md'}")
    return 0 if result["lost"] == 0 and result["early"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
