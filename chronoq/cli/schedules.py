"""`chronoq schedule create | list | show | pause | resume | delete`: recurring schedules on a running server.

Theory of operation: thin argument parsing over `AsyncAdmin`'s schedule calls (durations by
`config.parse_duration_ms`, instants as ISO 8601), printing rich tables; connection flags, error
handling and exit statuses come from `chronoq.cli.common`, times from `chronoq.timefmt`.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from chronoq.cli.common import add_command, add_connection_arguments, connection_of, console, run_remote
from chronoq.client import AsyncAdmin
from chronoq.config import ConfigError, parse_duration_ms
from chronoq.recurring.spec import CATCH_UP_POLICIES, iso_ms
from chronoq.timefmt import duration, local_instant


def _duration(text: str) -> int:
    try:
        return parse_duration_ms(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _instant(text: str) -> int:
    try:
        return iso_ms(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as an ISO 8601 instant "
                                         "(e.g. 2026-12-01T05:00:00+08:00)") from None


def _when(s: dict[str, Any]) -> str:
    return f"every {duration(s['every_ms'])}" if s.get("every_ms") is not None else f"cron {s['cron']!r}"


def _state(s: dict[str, Any]) -> str:
    return "paused" if s["paused"] else "finished" if s["finished"] else "active"


def _show(s: dict[str, Any]) -> None:
    console.print(f"schedule {s['name']} -> topic {s['topic']}: {_when(s)} in {s['zone']}, {_state(s)}, "
                  f"catch-up {s['catch_up']}, jitter {duration(s['jitter_ms'])}, {s['count']} issued"
                  + (f" of {s['limit']}" if s.get("limit") else "")
                  + (f"; last error: {s['last_error']}" if s.get("last_error") else ""))
    label = "next if resumed" if s["paused"] else "next"  # a paused schedule issues nothing
    for due in s.get("upcoming_ms") or []:
        console.print(f"  {label}: {local_instant(due)}")


def _cmd(call: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        async def go() -> int:
            async with AsyncAdmin(**connection_of(args).client_kwargs()) as a:
                if call == "create":
                    s = await a.create_schedule(
                        args.name, args.topic, args.body.encode(), every_ms=args.every, cron=args.cron, zone=args.tz,
                        start_ms=args.start, end_ms=args.end, catch_up=args.catch_up, jitter_ms=args.jitter,
                        limit=args.limit, tag=args.tag)
                elif call == "show":
                    s = await a.describe_schedule(args.name, args.count)
                elif call == "list":
                    return _list(await a.list_schedules())
                else:
                    s = await getattr(a, f"{call}_schedule")(args.name)
            if call in ("create", "show"):
                _show(s)
            else:
                console.print(f"{call}d schedule {s['name']}" if call != "pause" else f"paused schedule {s['name']}")
            return 0

        return run_remote(go)

    return run


def _list(schedules: list[dict[str, Any]]) -> int:
    if not schedules:
        console.print("no schedules yet: create one with `chronoq schedule create NAME --topic T --every 2m`")
        return 0
    table = Table(title=f"{len(schedules)} schedule(s)", title_justify="left")
    for col in ("schedule", "topic", "when", "zone", "state", "issued", "next due"):
        table.add_column(col)
    for s in schedules:
        table.add_row(s["name"], s["topic"], _when(s), s["zone"], _state(s), f"{s['count']:,}",
                      local_instant(s["pending_due_ms"]))
    console.print(table)
    return 0


def register(subparsers: Any) -> None:
    sched = subparsers.add_parser("schedule", help="recurring schedules",
                                  description="Create, list, show, pause, resume and delete recurring schedules.")
    sub = sched.add_subparsers(dest="schedule_command", required=True, metavar="ACTION")
    create = add_command(
        sub, "create", "create a recurring schedule",
        "A named schedule that sends BODY to TOPIC at each occurrence, as a timer message carrying the "
        "properties SCHEDULE_NAME and SCHEDULE_DUE_MS. Cron: 5 fields, or 6 with seconds first, or @daily-style "
        "aliases, read in --tz (DST: a repeated wall time fires once, at its first instant; a skipped one at the "
        "gap's end).",
        ['chronoq schedule create wake --topic alarms --body hi --cron "0 0 5 * * *" --tz Asia/Shanghai',
         "chronoq schedule create poll --topic jobs --body go --every 2m --catch-up latest"])
    create.add_argument("name")
    create.add_argument("--topic", required=True)
    create.add_argument("--body", required=True)
    when = create.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", type=_duration, metavar="DURATION", help="an interval in real time (2m, 1h30m)")
    when.add_argument("--cron", metavar="EXPR", help='a cron expression, e.g. "0 0 5 * * *" or @daily')
    create.add_argument("--tz", default=None, metavar="ZONE", help="IANA time zone of the cron (default UTC)")
    create.add_argument("--start", type=_instant, default=None, metavar="ISO")
    create.add_argument("--end", type=_instant, default=None, metavar="ISO")
    create.add_argument("--limit", type=int, default=None, metavar="N", help="at most N occurrences")
    create.add_argument("--catch-up", choices=CATCH_UP_POLICIES, default=None,
                        help="missed occurrences after downtime or a pause: skip (default), latest, all")
    create.add_argument("--jitter", type=_duration, default=None, metavar="DURATION",
                        help="spread each occurrence over this window after its time (late, never early)")
    create.add_argument("--tag", default=None)
    add_connection_arguments(create)
    create.set_defaults(func=_cmd("create"))

    lst = add_command(sub, "list", "list schedules", "The schedules and their next due time.",
                      ["chronoq schedule list"])
    add_connection_arguments(lst)
    lst.set_defaults(func=_cmd("list"))
    show = add_command(sub, "show", "a schedule and its next occurrences", "A schedule and its next occurrences.",
                       ["chronoq schedule show wake", "chronoq schedule show wake --count 10"])
    show.add_argument("name")
    show.add_argument("--count", type=int, default=5, metavar="N")
    add_connection_arguments(show)
    show.set_defaults(func=_cmd("show"))
    for action, text in (("pause", "pause a schedule (its pending occurrence is withdrawn if not yet due)"),
                         ("resume", "resume a paused schedule (missed occurrences: its catch-up policy)"),
                         ("delete", "delete a schedule")):
        p = add_command(sub, action, text, text[0].upper() + text[1:] + ".", [f"chronoq schedule {action} wake"])
        p.add_argument("name")
        add_connection_arguments(p)
        p.set_defaults(func=_cmd(action))
