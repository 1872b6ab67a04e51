"""`chronoq send | consume | show | cancel | topics | stats` against a real `chronoq serve`.

The commands run in this process (their output captured), the server in its own. The parser is
built from the three client-side command modules directly, so the test does not depend on
`COMMAND_MODULES` listing them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronoq.cli import messages, stats, topics
from chronoq.client.testing import ServerProcess

pytestmark = pytest.mark.slow

_names = itertools.count()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chronoq")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (messages, topics, stats):
        module.register(sub)
    return parser


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = Path(tmp_path_factory.mktemp("chronoq-cli")) / "data"
    with ServerProcess(data, settings={"auto_create_topics": False}) as proc:
        yield proc.address


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    # The server address comes from the environment, as a user would set it.
    monkeypatch.setenv("CHRONOQ_SERVER", server)

    return _runner(capsys)


def _runner(capsys: pytest.CaptureFixture[str]) -> Run:
    """Run a command in this process: (exit status, stdout, stderr)."""
    def call(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        args = _parser().parse_args(list(argv))
        code = args.func(args)
        out, err = capsys.readouterr()
        return code, out, err

    return call


def fresh(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{int(time.time() * 1000) % 100000}"


def test_topics_create_list_describe(run: Run) -> None:
    topic = fresh("cli-topic")
    code, out, _ = run("topics", "create", topic, "--queues", "3", "--types", "normal,delay")
    assert code == 0 and f"created topic {topic}: 3 queues" in out and "NORMAL, DELAY" in out
    code, out, _ = run("topics", "list")
    assert code == 0 and topic in out
    run("send", topic, "one")
    code, out, _ = run("topics", "describe", topic)
    assert code == 0 and "3 queues" in out
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d+\s*\W+\s*\d+", line)]
    assert len(rows) == 3
    code, _, err = run("topics", "create", topic)
    assert code == 1 and "TopicExists" in err


def test_send_in_show_consume_reports_lateness(run: Run) -> None:
    topic = fresh("cli-timer")
    run("topics", "create", topic)
    code, out, _ = run("send", topic, "ping", "--in", "3s", "--tag", "t1", "--key", "order-7", "--prop", "a=b")
    assert code == 0
    message_id = re.search(r"sent (\S+) to", out).group(1)
    assert "due at" in out and "recall handle:" in out
    code, out, _ = run("show", message_id)
    assert code == 0 and "pending" in out and topic in out
    code, out, err = run("consume", topic, "--group", "cli", "--count", "1", "--wait")
    assert code == 0 and message_id in out and "tag=t1" in out and "keys=order-7" in out
    late = re.search(r"late\s", out)
    assert late and "ping" in out
    lateness = re.search(r", (-?[\d.]+)(ms|s) late", out)
    assert lateness and not lateness.group(1).startswith("-")  # never early
    assert "1 message(s) consumed" in err
    code, out, _ = run("show", message_id)
    assert code == 0 and "delivered" in out
    # Acked: nothing left for the group.
    code, out, err = run("consume", topic, "--group", "cli")
    assert code == 0 and "0 message(s)" in err


def test_cancel_by_handle_and_by_id(run: Run) -> None:
    topic = fresh("cli-cancel")
    run("topics", "create", topic)
    future_ms = int(time.time() * 1000) + 3_600_000
    _, out, _ = run("send", topic, "a", "--at", str(future_ms))
    handle = re.search(r"recall handle: (\S+)", out).group(1)
    id_a = re.search(r"sent (\S+) to", out).group(1)
    _, out, _ = run("send", topic, "b", "--at", "2099-01-01T00:00:00+00:00")
    assert "error" not in out
    code, out, err = run("send", topic, "c", "--in", "10m")
    id_c = re.search(r"sent (\S+) to", out).group(1)
    assert run("cancel", "--handle", handle)[1].strip() == f"cancelled {id_a}"
    assert run("cancel", "--topic", topic, "--id", id_c)[1].strip() == f"cancelled {id_c}"
    code, out, _ = run("show", id_a)
    assert code == 0 and "cancelled" in out
    code, _, err = run("cancel", "--topic", topic, "--id", id_c)
    assert code == 1 and "already cancelled" in err
    assert run("cancel", "--topic", topic)[0] == 2


def test_one_timer_of_a_reused_id_is_cancelled_by_its_due_time(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An id sent again after the dedupe window names two pending timers: a cancel by id alone
    is refused (which one is not guessed), and the SDK's `deliver_at=` / the CLI's `--at` name
    one by its due time, which is all they cancel. Before, only the recall handle could."""
    import asyncio

    from chronoq.client import AsyncProducer
    from chronoq.errors import TimerIdAmbiguous

    with ServerProcess(tmp_path / "data", settings={"dedupe_window_ms": 1}) as proc:
        async def sdk() -> tuple[int, int]:
            async with AsyncProducer(proc.address) as p:
                now = int(time.time() * 1000)
                first = await p.send("orders", b"1", message_id="order-7", deliver_at=now + 3_600_000)
                await asyncio.sleep(0.05)  # past the 1 ms dedupe window: a new timer, not a retry
                second = await p.send("orders", b"2", message_id="order-7", deliver_at=now + 7_200_000)
                assert first.deliver_at_ms != second.deliver_at_ms
                with pytest.raises(TimerIdAmbiguous):
                    await p.cancel("orders", "order-7")
                assert await p.cancel("orders", "order-7", deliver_at=second.deliver_at_ms) == "order-7"
                states = {t.deliver_at_ms: t.state for t in await p.query("order-7", "orders")}
                assert states == {first.deliver_at_ms: "pending", second.deliver_at_ms: "cancelled"}
                third = await p.send("orders", b"3", message_id="order-7", deliver_at=now + 10_800_000)
                return first.deliver_at_ms, third.deliver_at_ms  # type: ignore[return-value]

        first_ms, third_ms = asyncio.run(sdk())
        monkeypatch.setenv("CHRONOQ_SERVER", proc.address)
        run_cli = _runner(capsys)

        code, out, _ = run_cli("cancel", "--topic", "orders", "--id", "order-7", "--at", str(third_ms))
        assert (code, out.strip()) == (0, "cancelled order-7")
        code, _, err = run_cli("cancel", "--handle", "AQAA", "--at", str(third_ms))
        assert code == 2 and "--at goes with --topic and --id" in err

        async def states() -> dict[int, str]:
            async with AsyncProducer(proc.address) as p:
                return {t.deliver_at_ms: t.state for t in await p.query("order-7", "orders")}

        assert asyncio.run(states())[first_ms] == "pending" and asyncio.run(states())[third_ms] == "cancelled"


def test_errors_are_one_line_and_exit_1(run: Run) -> None:
    code, _, err = run("send", fresh("missing"), "x")
    assert code == 1 and "TopicNotFound" in err and "code 40402" in err
    code, _, err = run("show", "0123456789ABCDEF")
    assert code == 1 and "no timer message" in err
    with pytest.raises(SystemExit):
        run("send", "t", "x", "--in", "soon")


def test_stats_tables_and_json(run: Run) -> None:
    topic = fresh("cli-stats")
    run("topics", "create", topic)
    run("send", topic, "x", "--in", "1h")
    code, out, _ = run("stats", "--json")
    assert code == 0
    doc = json.loads(out)
    assert isinstance(doc, dict) and doc
    code, out, _ = run("stats")
    assert code == 0
    # The person view: every section of the object, laid out in 80 columns.
    for label in ("timers", "by due", "by topic", "latency", "commit log", "disk", "clock", "topics"):
        assert label in out, label
    assert f"{topic} 1" in out and max(len(line) for line in out.splitlines()) <= 80
