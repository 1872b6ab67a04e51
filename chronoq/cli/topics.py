"""`chronoq topics create | list | describe`: topic administration on a running server.

Theory of operation: thin argument parsing over `AsyncAdmin`'s topic calls, printing rich
tables; the connection flags, error handling and exit statuses come from `chronoq.cli.common`,
times from `chronoq.timefmt`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from chronoq.cli.common import add_command, add_connection_arguments, connection_of, console, run_remote
from chronoq.client import AsyncAdmin
from chronoq.model import MessageType
from chronoq.timefmt import local_instant


def _types(text: str) -> list[str]:
    names = [t.strip().upper() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MessageType.__members__]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"message types must be a comma list of {', '.join(MessageType.__members__)}; got {text!r}")
    return names


def _cmd_create(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(**connection_of(args).client_kwargs()) as a:
            t = await a.create_topic(args.name, args.queues, args.types)
        console.print(f"created topic {t.name}: {t.queue_count} queues, accepts {', '.join(t.message_types)}")
        return 0

    return run_remote(go)


def _cmd_list(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(**connection_of(args).client_kwargs()) as a:
            topics = await a.list_topics()
        if not topics:
            console.print("no topics yet: create one with `chronoq topics create NAME`, or send to one")
            return 0
        table = Table(title=f"{len(topics)} topic(s)", title_justify="left")
        for col in ("topic", "queues", "message types", "created"):
            table.add_column(col)
        for t in sorted(topics, key=lambda t: t.name):
            # All four types is the default: say "all" so the table stays narrow.
            types = "all" if len(t.message_types) == len(MessageType) else ", ".join(t.message_types)
            table.add_row(t.name, str(t.queue_count), types, local_instant(t.created_ms) if t.created_ms else "-")
        console.print(table)
        return 0

    return run_remote(go)


def _cmd_describe(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with AsyncAdmin(**connection_of(args).client_kwargs()) as a:
            d = await a.describe_topic(args.name)
        t = d.topic
        created = local_instant(t.created_ms) if t.created_ms else "unknown"
        console.print(f"topic {t.name}: {t.queue_count} queues, accepts {', '.join(t.message_types)}, "
                      f"created {created}")
        table = Table()
        for col in ("queue", "min offset", "max offset", "messages"):
            table.add_column(col, justify="right")
        for q in d.queues:
            # Offsets are positions, written whole (they are pasted into reads); the count is a quantity.
            table.add_row(str(q.queue_id), str(q.min_offset), str(q.max_offset), f"{q.max_offset - q.min_offset:,}")
        console.print(table)
        return 0

    return run_remote(go)


def register(subparsers: Any) -> None:
    topics = subparsers.add_parser("topics", help="create, list and describe topics",
                                   description="Create, list and describe the topics of a running server.")
    sub = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")

    create = add_command(
        sub, "create", "create a topic",
        "Create a topic. With auto_create_topics on (the default) a send creates a missing topic with the "
        "server's default queue count and every message type; create it first to choose them. Consumers never "
        "create topics.",
        ["chronoq topics create orders", "chronoq topics create reminders --queues 8 --types DELAY"])
    create.add_argument("name")
    create.add_argument("--queues", type=int, default=None, metavar="N", help="queue count (default: the server's)")
    create.add_argument("--types", type=_types, default=None, metavar="T,T",
                        help="accepted message types, e.g. NORMAL,DELAY (default: all)")
    add_connection_arguments(create)
    create.set_defaults(func=_cmd_create)

    lst = add_command(sub, "list", "list topics", "List the topics (not chronoq's system topics).",
                      ["chronoq topics list"])
    add_connection_arguments(lst)
    lst.set_defaults(func=_cmd_list)

    describe = add_command(sub, "describe", "a topic's queues and offsets",
                           "A topic's settings and, per queue, the offsets of its first and next message.",
                           ["chronoq topics describe orders"])
    describe.add_argument("name")
    add_connection_arguments(describe)
    describe.set_defaults(func=_cmd_describe)
