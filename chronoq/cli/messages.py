"""`chronoq send | consume | show | cancel`: the message commands, talking to a running server.

Theory of operation: each command parses its arguments into SDK calls (`chronoq.client`),
runs them in one `asyncio.run`, and prints for a person: rich tables, a progress bar while
`consume --wait` counts up. Times are shown in the local zone with milliseconds, because a
person reads "due 14:03:07.250, 12 ms late" faster than epoch numbers; `--at` without a zone
means local time for the same reason (the SDK itself refuses naive datetimes).

The helpers every client-side command shares (`--server`, error printing, time formatting)
live here too; `topics` and `stats` import them. Exit codes: 0 done, 1 the server or the
connection refused, 2 bad arguments (argparse), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from chronoq.client import AsyncAdmin, AsyncConsumer, AsyncProducer, ReceivedMessage, default_server
from chronoq.config import ConfigError, parse_duration_ms
from chronoq.errors import ChronoqError

LONG_POLL_MS = 20_000
"""One long poll of `consume --wait`; the loop polls again until --count messages arrived."""
BODY_PREVIEW_CHARS = 200
RECEIVE_BATCH = 32

# soft_wrap: a message line or an error is one line however narrow the terminal (greppable).
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


# -- shared by the client-side commands -------------------------------------------------------


def add_server_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="chronoq server (default: $CHRONOQ_SERVER or 127.0.0.1:8081)")


def server_of(args: argparse.Namespace) -> str:
    return args.server or default_server()


def run_remote(body: Callable[[], Awaitable[int]]) -> int:
    """Run one command's coroutine; a chronoq error becomes a one-line message and exit 1."""
    try:
        return asyncio.run(body())
    except ChronoqError as e:
        details = [type(e).__name__] + ([f"code {e.code}"] if e.code else []) + (["retriable"] if e.retriable else [])
        err_console.print(f"error ({', '.join(details)}): {e.message}", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


def format_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000).astimezone().isoformat(timespec="milliseconds")


def format_delta_ms(delta_ms: int) -> str:
    """A signed duration for people: '4m03s', '1.250s', '12ms'."""
    sign = "-" if delta_ms < 0 else ""
    ms = abs(delta_ms)
    if ms < 1000:
        return f"{sign}{ms}ms"
    if ms < 60_000:
        return f"{sign}{ms / 1000:.3f}s"
    hours, rest = divmod(ms // 1000, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{sign}{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{sign}{minutes}m{seconds:02d}s"


def relative_to_now(ms: int, now_ms: int) -> str:
    delta = ms - now_ms
    return f"in {format_delta_ms(delta)}" if delta >= 0 else f"{format_delta_ms(-delta)} ago"


def _now_ms() -> int:
    return int(datetime.now().timestamp() * 1000)


# -- argument types -------------------------------------------------------------------------


def parse_at(text: str) -> int:
    """`--at`: ms since the epoch (digits) or ISO 8601; without a zone it means local time."""
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read time {text!r}: give ISO 8601 (2026-11-22T14:00:00+01:00) or ms since the epoch") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return int(when.timestamp() * 1000)


def parse_in(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_prop(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"property {text!r} must look like key=value")
    return key, value


# -- send ----------------------------------------------------------------------------------


def _cmd_send(args: argparse.Namespace) -> int:
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()

    async def go() -> int:
        async with AsyncProducer(server_of(args)) as p:
            r = await p.send(args.topic, body, deliver_at=args.at, delay=args.delay_ms, delay_level=args.level,
                             tag=args.tag, keys=args.key or (), properties=dict(args.prop or []))
            due_ms = r.deliver_at_ms
            if due_ms is None and (args.delay_ms is not None or args.level is not None):
                # The server's clock fixed the due time; ask it rather than guess.
                statuses = await p.query(r.message_id, r.topic)
                due_ms = statuses[0].deliver_at_ms if statuses else None
        console.print(f"sent {r.message_id} to {r.topic} (offset {r.offset})")
        if due_ms is not None:
            console.print(f"due at {format_ms(due_ms)} ({relative_to_now(due_ms, _now_ms())})")
        if r.recall_handle:
            console.print(f"recall handle: {r.recall_handle}")
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
    if msg.lateness_ms is not None:
        parts.append(f"due {format_ms(msg.deliver_at_ms)}, {format_delta_ms(msg.lateness_ms)} late")
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
                                     server=server_of(args)) as c:
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
        err_console.print(f"{got} message(s) {'received' if args.no_ack else 'consumed'}")
        return 0

    return run_remote(go)


# -- show ----------------------------------------------------------------------------------


def _cmd_show(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(server_of(args)) as a:
            statuses = await a.query(args.message_id, args.topic)
        if not statuses:
            err_console.print(f"no timer message with id {args.message_id}"
                              f"{' on topic ' + args.topic if args.topic else ''}")
            return 1
        now_ms = _now_ms()
        for s in statuses:
            # One message, several facts: a vertical table stays readable in a narrow terminal.
            table = Table(title=f"timer message {s.message_id}", show_header=False, title_justify="left")
            table.add_column("field", style="bold")
            table.add_column("value")
            table.add_row("topic", s.topic)
            table.add_row("state", s.state)
            table.add_row("deliver at", f"{format_ms(s.deliver_at_ms)} ({relative_to_now(s.deliver_at_ms, now_ms)})")
            table.add_row("accepted", format_ms(s.accepted_ms))
            if s.fired_ms is not None:
                table.add_row("fired", f"{format_ms(s.fired_ms)} ({format_delta_ms(s.fired_ms - s.deliver_at_ms)} "
                                       "after its time)")
            if s.cancelled_ms is not None:
                table.add_row("cancelled", format_ms(s.cancelled_ms))
            console.print(table)
        return 0

    return run_remote(go)


# -- cancel --------------------------------------------------------------------------------


def _cmd_cancel(args: argparse.Namespace) -> int:
    if args.handle is None and (args.topic is None or args.id is None):
        err_console.print("chronoq cancel: give --handle H, or both --topic T and --id ID")
        return 2

    async def go() -> int:
        async with AsyncProducer(server_of(args)) as p:
            if args.handle is not None and args.topic is not None:
                message_id = await p.recall(args.topic, args.handle)
            elif args.handle is not None:
                message_id = await p.cancel_handle(args.handle)
            else:
                message_id = await p.cancel(args.topic, args.id)
        console.print(f"cancelled {message_id}")
        return 0

    return run_remote(go)


# -- registration ----------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    send = subparsers.add_parser("send", help="send a message (a timer message with --at, --in or --level)")
    send.add_argument("topic")
    send.add_argument("body", help="message body; '-' reads it from stdin")
    when = send.add_mutually_exclusive_group()
    when.add_argument("--at", type=parse_at, metavar="ISO8601|MS", help="deliver at this time")
    when.add_argument("--in", dest="delay_ms", type=parse_in, metavar="DURATION",
                      help="deliver after this delay (30s, 5m, 2h, 1500ms), measured by the server's clock")
    when.add_argument("--level", type=int, metavar="N", help="RocketMQ 4 delay level (1-based)")
    send.add_argument("--tag")
    send.add_argument("--key", action="append", metavar="KEY", help="message key (repeatable)")
    send.add_argument("--prop", action="append", type=parse_prop, metavar="K=V", help="user property (repeatable)")
    add_server_argument(send)
    send.set_defaults(func=_cmd_send)

    consume = subparsers.add_parser("consume", help="receive, print and ack messages of a topic")
    consume.add_argument("topic")
    consume.add_argument("--group", required=True, help="consumer group")
    consume.add_argument("--count", type=int, default=None, metavar="N", help="stop after N messages")
    consume.add_argument("--wait", action="store_true",
                         help="long-poll until --count messages arrived (or forever without --count)")
    consume.add_argument("--filter", default="*", help="tag filter, e.g. 'a||b' (default *)")
    consume.add_argument("--invisible", dest="invisible_ms", type=parse_in, default=None, metavar="DURATION",
                         help="invisible duration per received message (default: the server's)")
    consume.add_argument("--no-ack", action="store_true", help="print only; the messages will be redelivered")
    add_server_argument(consume)
    consume.set_defaults(func=_cmd_consume)

    show = subparsers.add_parser("show", help="state and delivery time of a timer message")
    show.add_argument("message_id")
    show.add_argument("--topic", default=None)
    add_server_argument(show)
    show.set_defaults(func=_cmd_show)

    cancel = subparsers.add_parser("cancel", help="cancel a pending timer message")
    cancel.add_argument("--handle", default=None, help="recall handle printed by send")
    cancel.add_argument("--topic", default=None)
    cancel.add_argument("--id", default=None, help="message id (with --topic)")
    add_server_argument(cancel)
    cancel.set_defaults(func=_cmd_cancel)
