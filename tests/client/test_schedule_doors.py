"""Recurring schedules through their doors, against a real `chronoq serve` with auth on: the CLI
(`chronoq schedule create | list | show | pause | resume | delete`, each refusal's words and exit
status), the admin service's *Schedule calls and who may make them, and the SDK's calls.

The server runs in its own process (`ServerProcess`, a `[auth]` table in its `--config`); the CLI
runs in this process, its output captured, as in `test_cli_client.py`. Users: `ops` (admin),
`app` (publish `jobs`, `plain`, `ticks`, subscribe `jobs`, `ticks`), `reader` (subscribe `jobs`), `outsider` (publish
`elsewhere` only).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from chronoq import errors
from chronoq.cli import schedules
from chronoq.client import Admin, AsyncAdmin, AsyncConsumer
from chronoq.client.testing import ServerProcess
from chronoq.model import PROP_SCHEDULE_DUE_MS, PROP_SCHEDULE_NAME

pytestmark = pytest.mark.slow

AUTH = """
[auth]
enabled = true
[[auth.users]]
access_key = "ops"
secret_key = "ops-secret"
admin = true
[[auth.users]]
access_key = "app"
secret_key = "app-secret"
publish = ["jobs", "plain", "ticks"]
subscribe = ["jobs", "ticks"]
groups = ["g"]
[[auth.users]]
access_key = "reader"
secret_key = "reader-secret"
subscribe = ["jobs"]
[[auth.users]]
access_key = "outsider"
secret_key = "outsider-secret"
publish = ["elsewhere"]
"""
KEYS = {"ops": "ops-secret", "app": "app-secret", "reader": "reader-secret", "outsider": "outsider-secret"}
_names = itertools.count()


def fresh(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = Path(tmp_path_factory.mktemp("chronoq-schedules"))
    (root / "chronoq.toml").write_text(AUTH)
    with ServerProcess(root / "data", args=["--config", str(root / "chronoq.toml"), "--log-level", "WARNING"],
                       access_key="ops", secret_key=KEYS["ops"]) as proc:
        with Admin(proc.address, access_key="ops", secret_key=KEYS["ops"]) as admin:
            admin.create_topic("jobs", message_types=["DELAY"])
            admin.create_topic("plain", message_types=["NORMAL"])
            admin.create_topic("elsewhere", message_types=["DELAY"])
            admin.create_topic("ticks", message_types=["DELAY"])
        yield proc.address


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    """Run `chronoq schedule ...` as `user` (default ops): (exit status, stdout, stderr); argparse's
    refusals exit 2 with their message on stderr."""
    monkeypatch.setenv("CHRONOQ_SERVER", server)

    def call(*argv: str, user: str = "ops") -> tuple[int, str, str]:
        parser = argparse.ArgumentParser(prog="chronoq")
        schedules.register(parser.add_subparsers(dest="command", required=True))
        capsys.readouterr()
        monkeypatch.setenv("CHRONOQ_ACCESS_KEY", user)
        monkeypatch.setenv("CHRONOQ_SECRET_KEY", KEYS[user])
        try:
            args = parser.parse_args(["schedule", *argv])
        except SystemExit as e:
            out, err = capsys.readouterr()
            return int(e.code or 0), out, err
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err

    return call


def one_line(text: str) -> str:
    return " ".join(text.split())


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_create_show_list_pause_resume_delete(run: Run) -> None:
    name = fresh("poll")
    code, out, err = run("create", name, "--topic", "jobs", "--body", "go", "--every", "2m", "--catch-up", "latest")
    assert code == 0, err
    assert one_line(out).startswith(f"schedule {name} -> topic jobs: every 2m00s in UTC, active, catch-up latest, "
                                    "jitter 0ms, 1 issued"), out
    assert out.count("next: ") == 5
    cron = fresh("wake")
    code, out, err = run("create", cron, "--topic", "jobs", "--body", "hi", "--cron", "0 0 5 * * *", "--tz",
                         "Asia/Shanghai", "--start", "2030-01-01T00:00:00+08:00", "--end", "2030-01-03T23:00:00+08:00",
                         "--limit", "2", "--jitter", "30s", "--tag", "morning")
    assert code == 0, err
    assert one_line(out).startswith(f"schedule {cron} -> topic jobs: cron '0 0 5 * * *' in Asia/Shanghai, active, "
                                    "catch-up skip, jitter 30s, 0 issued of 2"), out
    # Issued once within timer_max_delay_ms of its time; the limit: two occurrences in all.
    assert out.count("next: ") == 2 and "next: 2029-12-31T21:00:00.000+00:00" in out
    code, out, _ = run("show", cron, "--count", "10")
    assert code == 0 and out.count("next: ") == 2
    alias = fresh("nightly")
    code, out, err = run("create", alias, "--topic", "jobs", "--body", "x", "--cron", "@daily")
    assert code == 0 and "cron '@daily' in UTC" in out, err

    code, out, _ = run("list")
    assert code == 0 and "schedule(s)" in out
    for n in (name, cron, alias):
        assert n in out
    code, out, _ = run("pause", name)
    assert (code, out.strip()) == (0, f"paused schedule {name}")
    code, out, _ = run("show", name)
    assert code == 0 and ", paused," in one_line(out) and out.count("next if resumed: ") == 5, out
    code, out, _ = run("resume", name)
    assert (code, out.strip()) == (0, f"resumed schedule {name}")
    code, out, _ = run("show", name, "--count", "3")
    assert code == 0 and ", active," in one_line(out) and out.count("next: ") == 3 and "resumed" not in out
    for n in (name, cron, alias):
        code, out, _ = run("delete", n)
        assert (code, out.strip()) == (0, f"deleted schedule {n}")
    code, _, err = run("show", name)
    assert code == 1 and one_line(err) == f"error (ScheduleNotFound, code 40000): no schedule {name!r}"


def test_cli_list_with_nothing_to_see_says_how_to_create_one(run: Run) -> None:
    name = fresh("hidden")
    assert run("create", name, "--topic", "jobs", "--body", "x", "--every", "1h")[0] == 0
    code, out, _ = run("list", user="outsider")  # may see none of the schedules' topics
    assert code == 0 and out.strip() == ("no schedules yet: create one with "
                                         "`chronoq schedule create NAME --topic T --every 2m`")
    assert run("delete", name)[0] == 0


BASE = ("--topic", "jobs", "--body", "x")


@pytest.mark.parametrize(("argv", "says"), [
    (("--every", "500ms"), "'every 500ms' has occurrences 500ms apart; the minimum (schedule_min_interval_ms) is 1s"),
    (("--cron", "61 * * * *"), "cron '61 * * * *' cannot be read"),
    (("--cron", "* * * *"), "cron '* * * *' must have 5 fields, or 6 with seconds first"),
    (("--cron", "@sometimes"), "cron '@sometimes' is not an alias (@yearly, @annually, @monthly, @weekly, @daily, "
                               "@midnight, @hourly)"),
    (("--every", "1h", "--tz", "Mars/Olympus"), "unknown time zone 'Mars/Olympus' (give an IANA name"),
    (("--cron", "0 0 30 2 *"), "cron '0 0 30 2 *' cannot be read: Bad day-of-month"),
    (("--cron", "0 0 1 1 *", "--start", "2031-02-01T00:00:00Z", "--end", "2031-12-01T00:00:00Z"),
     "'0 0 1 1 *' never fires: no occurrence before its end"),
    (("--every", "1h", "--end", "2001-01-01T00:00:00Z"), "'every 1h00m' never fires: no occurrence before its end"),
    (("--every", "1h", "--start", "2031-01-02T00:00:00Z", "--end", "2031-01-01T00:00:00Z"), "is before the start"),
    (("--every", "1h", "--limit", "0"), "limit 0 must be a whole number of occurrences, at least 1"),
    (("--every", "1m", "--jitter", "1m"), "jitter_ms 60000 must be shorter than the gap between occurrences (1m00s)"),
])
def test_cli_refusals_are_one_line_exit_1_and_store_nothing(run: Run, argv: tuple[str, ...], says: str) -> None:
    name = fresh("bad")
    code, out, err = run("create", name, *BASE, *argv)
    assert code == 1 and out == "", (out, err)
    assert err.startswith("error (") and "code 40000" in err and says in one_line(err), err
    assert run("show", name)[0] == 1  # nothing stored


def test_cli_refusals_of_names_topics_and_rights(run: Run) -> None:
    name = fresh("dup")
    assert run("create", name, *BASE, "--every", "1h")[0] == 0
    code, _, err = run("create", name, *BASE, "--every", "2h")
    assert code == 1 and one_line(err) == f"error (ScheduleExists, code 40000): schedule {name!r} already exists"
    code, _, err = run("create", "no spaces", *BASE, "--every", "1h")
    assert code == 1 and "may hold only letters, digits and _ % | -" in err
    code, _, err = run("create", fresh("plain"), "--topic", "plain", "--body", "x", "--every", "1h")
    assert code == 1 and "MessageTypeNotAccepted" in err and "DELAY" in err
    for action in ("pause", "resume", "delete", "show"):
        code, _, err = run(action, "nobody-has-this")
        assert code == 1 and "no schedule 'nobody-has-this'" in err, (action, err)
    code, _, err = run("create", fresh("theirs"), *BASE, "--every", "1h", user="reader")
    assert code == 1 and one_line(err) == ("error (Forbidden, code 40300): access key 'reader' may not "
                                           "publish to topic 'jobs'"), err
    # A user with no right on the topic is told what it would be told of a name that does not exist.
    for action in ("pause", "resume", "delete", "show"):
        code, _, err = run(action, name, user="outsider")
        _, _, nobody = run(action, "nobody-has-this", user="outsider")
        assert code == 1 and one_line(err) == f"error (ScheduleNotFound, code 40000): no schedule {name!r}", err
        assert one_line(err).replace(name, "nobody-has-this") == one_line(nobody), (action, err, nobody)
    assert run("delete", name)[0] == 0


@pytest.mark.parametrize(("argv", "says"), [
    (("--every", "1h", "--cron", "@daily"), "argument --cron: not allowed with argument --every"),
    ((), "one of the arguments --every --cron is required"),
    (("--every", "soon"), "argument --every:"),
    (("--every", "1h", "--start", "yesterday"), "cannot read 'yesterday' as an ISO 8601 instant"),
    (("--every", "1h", "--catch-up", "sometimes"), "argument --catch-up: invalid choice: 'sometimes'"),
    (("--every", "1h", "--limit", "two"), "argument --limit: invalid int value: 'two'"),
])
def test_cli_unreadable_arguments_exit_2(run: Run, argv: tuple[str, ...], says: str) -> None:
    code, _, err = run("create", fresh("unread"), *BASE, *argv)
    assert code == 2 and says in one_line(err), err


# -- the admin service, with auth ----------------------------------------------------------------


def test_who_may_call_each_schedule_method(server: str) -> None:
    def admin(user: str) -> AsyncAdmin:
        return AsyncAdmin(server, access_key=user, secret_key=KEYS[user], timeout_ms=5000, attempts=1)

    async def main() -> None:
        name = fresh("rights")
        async with admin("app") as app, admin("reader") as reader, admin("outsider") as outsider:
            s = await app.create_schedule(name, "jobs", b"x", every_ms=3_600_000)
            assert s["name"] == name and s["topic"] == "jobs"
            with pytest.raises(errors.Forbidden) as denied:
                await app.create_schedule(fresh("their"), "elsewhere", b"x", every_ms=3_600_000)
            assert denied.value.details["action"] == "publish to"
            assert denied.value.details["resource"] == "topic 'elsewhere'"
            # A subscriber sees it (describe, list) and may not change it.
            assert (await reader.describe_schedule(name))["name"] == name
            assert name in [x["name"] for x in await reader.list_schedules()]
            for call in (reader.pause_schedule(name), reader.resume_schedule(name), reader.delete_schedule(name),
                         reader.update_schedule(name, every_ms=7_200_000),
                         reader.create_schedule(fresh("r"), "jobs", b"x", every_ms=3_600_000)):
                with pytest.raises(errors.Forbidden, match="'reader' may not publish to topic 'jobs'"):
                    await call
            # A user with no right on the topic neither sees nor changes it, nor learns that it
            # exists: each call gets the reply a name that does not exist gets, details and all.
            assert name not in [x["name"] for x in await outsider.list_schedules()]
            missing = fresh("missing")
            for method in ("describe_schedule", "pause_schedule", "resume_schedule", "delete_schedule",
                           "update_schedule"):
                replies = []
                for target in (name, missing):
                    call = getattr(outsider, method)
                    with pytest.raises(errors.ScheduleNotFound) as refused:
                        await (call(target, every_ms=7_200_000) if method == "update_schedule" else call(target))
                    replies.append((refused.value.code, str(refused.value).replace(target, "X"),
                                    {k: (v if v != target else "X") for k, v in refused.value.details.items()}))
                assert replies[0] == replies[1], (method, replies)
                assert replies[0][1].endswith("no schedule 'X'"), replies
            assert (await app.describe_schedule(name))["paused"] is False  # refused calls changed nothing
        async with AsyncAdmin(server, access_key="app", secret_key="wrong", timeout_ms=5000, attempts=1) as bad:
            with pytest.raises(errors.Unauthorized):
                await bad.list_schedules()
        async with admin("app") as app:
            await app.delete_schedule(name)

    asyncio.run(main())


# -- the SDK ----------------------------------------------------------------------------------------


def test_sdk_calls_round_trip_and_an_occurrence_arrives_with_its_id_and_properties(server: str) -> None:
    async def main() -> None:
        name = fresh("sdk")
        async with AsyncAdmin(server, access_key="app", secret_key=KEYS["app"], timeout_ms=5000) as a:
            made = await a.create_schedule(name, "ticks", b"tick", every_ms=1000, limit=2, tag="t",
                                           properties={"k": "v"}, catch_up="all")
            assert (made["every_ms"], made["limit"], made["catch_up"], made["tag"], made["properties"],
                    made["version"], made["count"]) == (1000, 2, "all", "t", {"k": "v"}, 1, 1)
            first, second = made["upcoming_ms"]
            assert second - first == 1000 and made["pending_due_ms"] == first
            async with AsyncConsumer("g", "ticks", server=server, access_key="app", secret_key=KEYS["app"]) as c:
                got: list[Any] = []
                deadline = time.monotonic() + 15
                while len(got) < 2 and time.monotonic() < deadline:
                    for m in await c.receive(8, wait=1000):
                        got.append(m)
                        await c.ack(m)
            assert [m.message_id for m in got] == [f"{name}@{first}.v1", f"{name}@{second}.v1"]
            for m, due in zip(got, (first, second), strict=True):
                assert m.properties == {"k": "v", PROP_SCHEDULE_NAME: name, PROP_SCHEDULE_DUE_MS: str(due)}
                assert (m.body, m.tag, m.deliver_at_ms) == (b"tick", "t", due) and m.received_ms >= due
            done = await a.describe_schedule(name)
            assert done["finished"] and done["count"] == 2 and done["upcoming_ms"] == []
            # Update: a new version, the interval and body from the next occurrence on.
            changed = await a.update_schedule(name, body=b"tock", every_ms=3_600_000, limit=5)
            assert (changed["every_ms"], changed["limit"], changed["version"], changed["body_b64"]) == \
                (3_600_000, 5, 2, "dG9jaw==")
            assert not changed["finished"] and len(changed["upcoming_ms"]) == 3
            assert [x["name"] for x in await a.list_schedules() if x["name"] == name] == [name]
            assert len((await a.describe_schedule(name, 3))["upcoming_ms"]) == 3
            paused = await a.pause_schedule(name)
            assert paused["paused"] and paused["pending_due_ms"] is None
            resumed = await a.resume_schedule(name)
            assert not resumed["paused"] and resumed["upcoming_ms"]
            with pytest.raises(errors.ScheduleExists) as exists:
                await a.create_schedule(name, "jobs", b"x", every_ms=3_600_000)
            assert exists.value.details["name"] == name
            with pytest.raises(errors.InvalidSchedule) as bad:
                await a.create_schedule(fresh("sdk"), "jobs", b"x", every_ms=3_600_000, catch_up="some")
            assert bad.value.details["field"] == "catch_up" and bad.value.details["value"] == "some"
            with pytest.raises(errors.UnknownTimeZone):
                await a.create_schedule(fresh("sdk"), "jobs", b"x", cron="@daily", zone="Nowhere/Town")
            gone = await a.delete_schedule(name)
            assert gone["name"] == name
            with pytest.raises(errors.ScheduleNotFound):
                await a.describe_schedule(name)

    asyncio.run(main())


def test_sync_admin_has_the_schedule_calls(server: str) -> None:
    name = fresh("sync")
    start = datetime(2040, 1, 1).timestamp() * 1000
    with Admin(server, access_key="app", secret_key=KEYS["app"]) as a:
        s = a.create_schedule(name, "jobs", b"x", cron="30 9 * * 1-5", zone="Europe/Berlin", start_ms=int(start))
        assert s["cron"] == "30 9 * * 1-5" and s["zone"] == "Europe/Berlin" and len(s["upcoming_ms"]) == 5
        assert all(re.fullmatch(r"\d{13}", str(t)) for t in s["upcoming_ms"])
        assert a.delete_schedule(name)["name"] == name
