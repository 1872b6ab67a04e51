"""`chronoq topics create | list | describe`: topic administration on a running server.

Theory of operation: thin argument parsing over `AsyncAdmin`'s topic calls, printing rich
tables; the shared `--server` option, error handling and time formatting come from
`chronoq.cli.messages`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from chronoq.cli.messages import add_server_argument, console, format_ms, run_remote, server_of
from chronoq.client import AsyncAdmin
from chronoq.model import MessageType


def _types(text: str) -> list[str]:
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MessageType.__members__]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"message types must be a comma list of {', '.join(MessageType.__members__)}; got {text!r}")
    return names


def _cmd_create(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(server_of(args)) as a:
            t = await a.create_topic(args.name, args.queues, args.types)
        console.print(f"created topic {t.name}: {t.queue_count} queues, accepts {', '.join(t.message_types)}")
        return 0

    return run_remote(go)


def _cmd_list(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(server_of(args)) as a:
            topics = await a.list_topics()
        table = Table(title=f"{len(topics)} topic(s)")
        for col in ("topic", "queues", "message types", "created"):
            table.add_column(col)
        for t in sorted(topics, key=lambda t: t.name):
            table.add_row(t.name, str(t.queue_count), ", ".join(t.message_types), format_ms(t.created_ms))
        console.print(table)
        return 0

    return run_remote(go)


def _cmd_describe(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(server_of(args)) as a:
            d = await a.describe_topic(args.name)
        t = d.topic
        console.print(f"topic {t.name}: {t.queue_count} queues, accepts {', '.join(t.message_types)}, "
                      f"created {format_ms(t.created_ms)}")
        table = Table()
        for col in ("queue", "min offset", "max offset", "messages"):
            table.add_column(col, justify="right")
        for q in d.queues:
            table.add_row(str(q.queue_id), str(q.min_offset), str(q.max_offset), str(q.max_offset - q.min_offset))
        console.print(table)
        return 0

    return run_remote(go)


def register(subparsers: Any) -> None:
    topics = subparsers.add_parser("topics", help="create, list and describe topics")
    sub = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")

    create = sub.add_parser("create", help="create a topic")
    create.add_argument("name")
    create.add_argument("--queues", type=int, default=None, metavar="N", help="queue count (default: the server's)")
    create.add_argument("--types", type=_types, default=None, metavar="T,T",
                        help="accepted message types, e.g. NORMAL,DELAY (default: all)")
    add_server_argument(create)
    create.set_defaults(func=_cmd_create)

    lst = sub.add_parser("list", help="list topics")
    add_server_argument(lst)
    lst.set_defaults(func=_cmd_list)

    describe = sub.add_parser("describe", help="a topic's queues and offsets")
    describe.add_argument("name")
    add_server_argument(describe)
    describe.set_defaults(func=_cmd_describe)
