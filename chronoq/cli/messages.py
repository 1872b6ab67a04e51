"""`chronoq send | consume | show | cancel`: the message commands, talking to a running server.

Theory of operation: each command parses its arguments into SDK calls (`chronoq.client`),
runs them in one `asyncio.run`, and prints for a person: rich tables, a progress bar while
`consume --wait` counts up. Times are shown in the local zone with milliseconds, because a
person reads "due 14:03:07.250, 12ms late" faster than epoch numbers (`chronoq.timefmt`); `--at`
without a zone means local time for the same reason (the SDK itself refuses naive datetimes).

What every client command shares (connection flags, error printing, exit statuses) is in
`chronoq.cli.common`.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from chronoq.cli.common import (
    add_command,
    add_connection_arguments,
    connection_of,
    console,
    err_console,
    run_remote,
)
from chronoq.client import AsyncAdmin, AsyncConsumer, AsyncProducer, ReceivedMessage
from chronoq.client.wire import EARLIEST_DELIVERY_TIMESTAMP_MS
from chronoq.config import ConfigError, parse_duration_ms
from chronoq.timefmt import duration, instant, local_instant, relative
from chronoq.validate import seconds_not_ms

LONG_POLL_MS = 20_000
"""One long poll of `consume --wait`; the loop polls again until --count messages arrived."""
BODY_PREVIEW_CHARS = 200
RECEIVE_BATCH = 32
LEVEL_NOTE = ("no recall handle: a delay-level message waits in its level's queue, as in RocketMQ 4, so it cannot be "
              "recalled, cancelled or shown; send with --in or --at for a timer you can")
"""`send --level` and `show` of an unknown id say why a delay-level message has no handle and no status."""


def _now_ms() -> int:
    return int(datetime.now().timestamp() * 1000)


# -- argument types -------------------------------------------------------------------------


def _nine_tomorrow() -> str:
    """09:00 tomorrow here, in ISO 8601 with that day's offset: an `--at` example made now, so it is
    not in the past when pasted (a fixed date in a help text would be, soon)."""
    tomorrow = datetime.now().date() + timedelta(days=1)
    return datetime(tomorrow.year, tomorrow.month, tomorrow.day, 9).astimezone().isoformat(timespec="seconds")


def parse_at(text: str) -> int:
    """`--at`: ms since the epoch (digits) or ISO 8601; without a zone it means local time."""
    if text.isdigit():
        ms = int(text)
        seconds = seconds_not_ms(ms)
        if seconds is not None:
            raise argparse.ArgumentTypeError(f"{text} {seconds}")
        if ms < EARLIEST_DELIVERY_TIMESTAMP_MS:
            raise argparse.ArgumentTypeError(
                f"{text} reads as ms since the epoch, {instant(ms)}: not a time a message can be due; for a delay "
                f"use --in (--in {text}ms)")
        return ms
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read time {text!r}: give a date and time in ISO 8601, e.g. {_nine_tomorrow()} for 09:00 "
            "tomorrow in this machine's zone (without a zone: local time), or ms since the epoch") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return int(when.timestamp() * 1000)


def parse_in(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_count(text: str) -> int:
    """`consume --count`: how many messages to stop after, at least one."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of messages, 1 or more, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n} (without --count, consume takes "
                                         "what is there)")
    return n


def parse_prop(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"property {text!r} must look like key=value")
    return key, value


# -- send ----------------------------------------------------------------------------------


def _cmd_send(args: argparse.Namespace) -> int:
    if args.body == "-" and sys.stdin.isatty():  # else it waits on the terminal with no word of why
        err_console.print("reading the message body from the terminal; end it with Ctrl-D (Ctrl-C to give up)")
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()

    async def go() -> int:
        async with AsyncProducer(**connection_of(args).client_kwargs(), create_topics=args.create_topic) as p:
            r = await p.send(args.topic, body, deliver_at=args.at, delay=args.delay_ms, delay_level=args.level,
                             tag=args.tag, keys=args.key or (), properties=dict(args.prop or []))
            due_ms = r.deliver_at_ms
            if due_ms is None and args.delay_ms is not None:
                # The server's clock fixed the due time; ask it rather than guess.
                statuses = await p.query(r.message_id, r.topic)
                due_ms = statuses[0].deliver_at_ms if statuses else None
        now_ms = _now_ms()
        if due_ms is None:
            console.print(f"sent {r.message_id} to {r.topic} (offset {r.offset})")
        else:  # its offset is in chronoq's timer topic, not in r.topic: a number that would mislead
            console.print(f"sent {r.message_id} to {r.topic}{', held until due' if due_ms > now_ms else ''}")
        if due_ms is not None:
            level = f"; delay level {args.level}" if args.level is not None else ""
            past = ": delivered at once" if due_ms <= now_ms else ""
            console.print(f"due at {local_instant(due_ms)} ({relative(due_ms, now_ms)}{level}{past})")
        if r.recall_handle:
            console.print(f"recall handle: {r.recall_handle}")
        elif args.level is not None:
            console.print(LEVEL_NOTE)
        return 0

    return run_remote(go)


# -- consume -------------------------------------------------------------------------------


def _describe(msg: ReceivedMessage) -> str:
    text = msg.body.decode("utf-8", errors="replace")
    if len(text) > BODY_PREVIEW_CHARS:
        text = text[:BODY_PREVIEW_CHARS] + "..."
    parts = [f"{msg.topic}[{msg.queue_id}]@{msg.queue_offset}", msg.message_id]
    if msg.tag:
        parts.append(f"tag={msg.tag}")
    if msg.keys:
        parts.append(f"keys={','.join(msg.keys)}")
    if msg.delivery_attempt > 1:
        parts.append(f"attempt={msg.delivery_attempt}")
    if msg.lateness_ms is not None and msg.born_ms is not None and msg.deliver_at_ms is not None \
            and msg.deliver_at_ms < msg.born_ms:
        # Due before it was sent: delivered at once, so "hours late" would mislead (as in `stats`).
        parts.append(f"due {local_instant(msg.deliver_at_ms)}, before it was sent: delivered at once, "
                     f"{duration(msg.received_ms - msg.born_ms)} after sending")
    elif msg.lateness_ms is not None:
        parts.append(f"due {local_instant(msg.deliver_at_ms)}, {duration(msg.lateness_ms)} late")
    if msg.body_digest_ok is False:
        parts.append("BODY DIGEST MISMATCH")
    return " ".join(parts) + f"  {text}"


def _cmd_consume(args: argparse.Namespace) -> int:
    async def go() -> int:
        got = 0
        target = args.count
        with Progress(TextColumn("consumed"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True,
                      disable=not (args.wait and target and err_console.is_terminal)) as progress:
            task = progress.add_task("consume", total=target)
            async with AsyncConsumer(args.group, args.topic, filter_expression=args.filter,
                                     **connection_of(args).client_kwargs()) as c:
                while target is None or got < target:
                    want = RECEIVE_BATCH if target is None else min(RECEIVE_BATCH, target - got)
                    batch = await c.receive(want, invisible=args.invisible_ms,
                                            wait=LONG_POLL_MS if args.wait else 0)
                    if not batch and not args.wait:
                        break
                    for msg in batch:
                        console.print(_describe(msg), markup=False)
                        if not args.no_ack:
                            await c.ack(msg)
                        got += 1
                        progress.advance(task)
        done = f"{got} message(s) {'received' if args.no_ack else 'consumed'}"
        if got == 0 and not args.wait:  # a newcomer's first consume often comes before the timer is due
            done += ": none ready now (a timer message can be consumed once it is due; --wait waits for it)"
        err_console.print(done)
        return 0

    return run_remote(go)


# -- show ----------------------------------------------------------------------------------


def _cmd_show(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(**connection_of(args).client_kwargs()) as a:
            statuses = await a.query(args.message_id, args.topic)
        if not statuses:
            err_console.print(f"no timer message with id {args.message_id}"
                              f"{' on topic ' + args.topic if args.topic else ''} (`show` sees messages sent with "
                              "--at or --in; a delay-level message is not tracked, as in RocketMQ 4)")
            return 1
        now_ms = _now_ms()
        for s in statuses:
            # One message, several facts: a vertical table stays readable in a narrow terminal.
            table = Table(title=f"timer message {s.message_id}", show_header=False, title_justify="left")
            table.add_column("field", style="bold")
            table.add_column("value")
            table.add_row("topic", s.topic)
            table.add_row("state", s.state)
            table.add_row("deliver at", f"{local_instant(s.deliver_at_ms)} ({relative(s.deliver_at_ms, now_ms)})")
            table.add_row("accepted", f"{local_instant(s.accepted_ms)} ({relative(s.accepted_ms, now_ms)})")
            if s.fired_ms is not None:
                # Late from the due time, or from the acceptance when it was due before it (as `stats` counts).
                counted_from = max(s.deliver_at_ms, s.accepted_ms)
                table.add_row("fired", f"{local_instant(s.fired_ms)} ({duration(s.fired_ms - counted_from)} "
                                       f"after {'its time' if counted_from == s.deliver_at_ms else 'it was accepted'})")
            if s.cancelled_ms is not None:
                table.add_row("cancelled", local_instant(s.cancelled_ms))
            console.print(table)
        return 0

    return run_remote(go)


# -- cancel --------------------------------------------------------------------------------


def _cmd_cancel(args: argparse.Namespace) -> int:
    if args.handle is None and (args.topic is None or args.id is None):
        err_console.print("chronoq cancel: give --handle H, or both --topic T and --id ID")
        return 2
    if args.at is not None and args.handle is not None:
        err_console.print("chronoq cancel: --at goes with --topic and --id (a handle names its due time already)")
        return 2

    async def go() -> int:
        async with AsyncProducer(**connection_of(args).client_kwargs()) as p:
            if args.handle is not None and args.topic is not None:
                message_id = await p.recall(args.topic, args.handle)
            elif args.handle is not None:
                message_id = await p.cancel_handle(args.handle)
            else:
                message_id = await p.cancel(args.topic, args.id, deliver_at=args.at)
        console.print(f"cancelled {message_id}")
        return 0

    return run_remote(go)


# -- registration ----------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    send = add_command(
        subparsers, "send", "send a message (a timer message with --at, --in or --level)",
        "Send one message and wait until the server has made it durable. A timer message is due at --at, "
        "after --in, or after a RocketMQ 4 delay level; send prints its due time and the recall handle "
        "`chronoq cancel --handle` takes.",
        ["chronoq send orders 'ship it'", "chronoq send orders 'cancel if unpaid' --in 30m --key order-7",
         f"chronoq send reminders 'stand-up' --at {_nine_tomorrow()}",
         "chronoq send orders 'retry' --level 3", "chronoq send orders-eu 'hello' --create-topic",
         "echo '{\"id\": 7}' | chronoq send orders - --tag created"])
    send.add_argument("topic")
    send.add_argument("body", help="message body; '-' reads it from stdin")
    when = send.add_mutually_exclusive_group()
    when.add_argument("--at", type=parse_at, metavar="ISO8601|MS",
                      help="deliver at this time: ISO 8601 (local time without a zone) or ms since the epoch; "
                           "a time in the past is delivered at once")
    when.add_argument("--in", dest="delay_ms", type=parse_in, metavar="DURATION",
                      help="deliver after this delay (30s, 5m, 1h30m, 3d, 1500ms), measured by the server's clock")
    when.add_argument("--level", type=int, metavar="N",
                      help="RocketMQ 4 delay level, 1..18 with the default table (1s 5s 10s 30s 1m..10m 20m 30m 1h "
                           "2h); a level above the server's table is refused; such a message cannot be recalled "
                           "or shown, as in RocketMQ 4")
    send.add_argument("--tag", help="message tag (consumers can filter on it)")
    send.add_argument("--key", action="append", metavar="KEY", help="message key (repeatable)")
    send.add_argument("--prop", action="append", type=parse_prop, metavar="K=V", help="user property (repeatable)")
    send.add_argument("--create-topic", action="store_true",
                      help="create the topic even if its name is near an existing one's (without it, a send to a "
                           "missing topic named like an existing one, 'ordres' beside 'orders', is refused as a "
                           "likely typo); needs the server's auto-create on")
    add_connection_arguments(send)
    send.set_defaults(func=_cmd_send)

    consume = add_command(
        subparsers, "consume", "receive, print and ack messages of a topic",
        "Receive messages of an existing topic as consumer group --group, print each (a timer message with "
        "its due time and how late it arrived) and acknowledge it. A consumer never creates a topic.",
        ["chronoq consume orders --group billing", "chronoq consume orders --group billing --count 5 --wait",
         "chronoq consume orders --group audit --filter 'created||paid' --no-ack"])
    consume.add_argument("topic")
    consume.add_argument("--group", required=True, help="consumer group")
    consume.add_argument("--count", type=parse_count, default=None, metavar="N", help="stop after N messages")
    consume.add_argument("--wait", action="store_true",
                         help="long-poll until --count messages arrived (or forever without --count)")
    consume.add_argument("--filter", default="*", help="tag filter, e.g. 'a||b' (default *)")
    consume.add_argument("--invisible", dest="invisible_ms", type=parse_in, default=None, metavar="DURATION",
                         help="invisible duration per received message (default: the server's)")
    consume.add_argument("--no-ack", action="store_true", help="print only; the messages will be redelivered")
    add_connection_arguments(consume)
    consume.set_defaults(func=_cmd_consume)

    show = add_command(
        subparsers, "show", "state and delivery time of a timer message",
        "Show what the server knows about a timer message sent with --at or --in: pending, delivered or "
        "cancelled, when it is or was due, and when it fired. Delay-level messages are not tracked (as in "
        "RocketMQ 4). Exit status 1 when no such timer is known.",
        ["chronoq show 0105582AB6E26FD1610B16A12F00000001", "chronoq show 0105582AB6E2... --topic orders"])
    show.add_argument("message_id")
    show.add_argument("--topic", default=None, help="only this topic (an id may recur on several)")
    add_connection_arguments(show)
    show.set_defaults(func=_cmd_show)

    cancel = add_command(
        subparsers, "cancel", "cancel a pending timer message",
        "Cancel a timer message that is not yet due, by the recall handle `send` printed or by topic and id. "
        "An id sent again after the dedupe window names several timers: by id, the one pending is cancelled, "
        "and with several pending the cancel is refused with each one's due time and recall handle; "
        "--at names one by its due time.",
        ["chronoq cancel --handle AQAAAaILbeX7dHIAMDEw...", "chronoq cancel --topic orders --id 0105582AB6E2...",
         "chronoq cancel --topic orders --id order-7 --at 2026-11-25T10:00:00.250"])
    cancel.add_argument("--handle", default=None, help="recall handle printed by send")
    cancel.add_argument("--topic", default=None, help="the message's topic (with --id)")
    cancel.add_argument("--id", default=None, help="message id (with --topic)")
    cancel.add_argument("--at", type=parse_at, default=None, metavar="ISO8601|MS",
                        help="with --topic and --id: the due time of the one timer to cancel, when the id "
                             "names several (as `show` lists it: ISO 8601, local time without a zone, or ms)")
    add_connection_arguments(cancel)
    cancel.set_defaults(func=_cmd_cancel)
