"""The first hour with the `chronoq` command: what a new user meets, as the real command in a
subprocess against a real `chronoq serve` started here.

Every test runs `python -m chronoq ...` with a clean environment (no CHRONOQ_* of the caller) and
judges what a person sees: the exit status, stdout, stderr. Tests that need no server and run
one or two commands are in the fast suite; those that start servers, or run many commands (each
a Python start-up of about a second), are `slow`. This module imports
nothing newer than the command itself, so the same tests can be run against an older checkout
(PYTHONPATH=that checkout) to see each one fail there.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import chronoq
from chronoq.client.testing import ServerProcess, free_port

ROOT = Path(chronoq.__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
GRPC_LOG_LINE = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
"""gRPC's C-core log format ("E1123 03:40:50.989144 1468 add_port.cc:83] ...")."""


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHRONOQ_") and k != "GRPC_VERBOSITY"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def chronoq_cmd(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chronoq", *args], capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=cwd)


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """stderr, checked to be what a person should see: no traceback, no gRPC log lines."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not GRPC_LOG_LINE.search(proc.stderr), proc.stderr
    return proc.stderr


def _openssl_cert(directory: Path, san: str = "DNS:localhost,IP:127.0.0.1", name: str = "server") -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=chronoq",
                    "-addext", f"subjectAltName={san}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A plain server with the defaults a newcomer gets (auto_create_topics on)."""
    with ServerProcess(tmp_path_factory.mktemp("first-hour") / "data") as proc:
        yield proc.address


def fresh(prefix: str) -> str:
    return f"{prefix}-{time.time_ns() % 10**9}"


# -- check: verdicts that mean what they say (no server) -------------------------------------------


@pytest.mark.slow
def test_check_calls_a_missing_path_missing_not_damaged(tmp_path: Path) -> None:
    proc = chronoq_cmd("check", str(tmp_path / "nosuch"))
    assert proc.returncode == 2
    assert "does not exist" in proc.stdout and "DAMAGED" not in proc.stdout
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    proc = chronoq_cmd("check", str(a_file))
    assert proc.returncode == 2 and "is a file, not a directory" in proc.stdout


@pytest.mark.slow
def test_check_does_not_call_a_foreign_directory_ok(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    for directory in (tmp_path / "photos", tmp_path):
        proc = chronoq_cmd("check", str(directory))
        assert proc.returncode == 2, proc.stdout
        assert "not a chronoq data directory" in proc.stdout
        assert not re.search(r"^\s*OK\s*$", proc.stdout, re.MULTILINE)


@pytest.mark.slow
def test_check_names_a_damaged_topics_file_and_what_a_restart_does(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ServerProcess(data) as proc:
        assert chronoq_cmd("send", "orders", "x", env={"CHRONOQ_SERVER": proc.address}).returncode == 0
    (data / "topics").write_bytes(b"garbage")
    result = chronoq_cmd("check", str(data))
    assert result.returncode == 1
    [line] = [line for line in result.stdout.splitlines() if "PROBLEM" in line]
    assert str(data / "topics") in line
    assert "A restart moves it aside" in line and "orders" in line and "message type" in line


# -- the connection, before any server (no server) -------------------------------------------------


CLIENT_COMMANDS = (["send", "t", "x"], ["consume", "t", "--group", "g"], ["show", "ID"], ["cancel", "--handle", "H"],
                   ["topics", "create", "t"], ["topics", "list"], ["topics", "describe", "t"], ["stats"])


@pytest.mark.slow
def test_every_client_command_takes_the_tls_flags() -> None:
    for argv in CLIENT_COMMANDS:
        proc = chronoq_cmd(*argv[:2 if argv[0] == "topics" else 1], "--help")
        assert proc.returncode == 0
        for flag in ("--server", "--tls", "--ca-cert", "--tls-server-name", "CHRONOQ_CA_CERT", "examples:"):
            assert flag in proc.stdout, (argv, flag)


def test_a_command_imports_its_own_module_and_every_command_is_registered_where_listed() -> None:
    from chronoq.cli import COMMANDS, Parser, build_parser, command_module

    for module, commands in COMMANDS.items():
        sub = Parser(prog="chronoq").add_subparsers(dest="command")
        __import__(module, fromlist=["register"]).register(sub)
        assert tuple(sub.choices) == commands, module
    assert command_module(["--server", "demo:8081", "--tls", "send", "t", "x"]) == "chronoq.cli.messages"
    assert command_module(["--server=h:1", "serve"]) == "chronoq.cli.serve"
    assert command_module(["sned", "t"]) is None and command_module(["--version"]) is None
    assert build_parser().parse_known_args(["send", "t", "x"])[0].command == "send"
    assert build_parser("chronoq.cli.serve").parse_known_args(["serve"])[0].command == "serve"
    # `chronoq serve` runs without the SDK's or RocketMQ's client modules, which only client commands need.
    out = subprocess.run([sys.executable, "-c", "import sys, contextlib, io\n"
                          "from chronoq.cli import main\n"
                          "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
                          "    main(['serve', '--help'])\n"
                          "print(sorted(m for m in sys.modules if m.startswith(('rocketmq', 'chronoq.client'))))"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
def test_connection_mistakes_are_usage_errors_and_a_missing_server_is_named(tmp_path: Path) -> None:
    proc = chronoq_cmd("topics", "list", "--server", "localhost")
    assert proc.returncode == 2 and "must be HOST:PORT" in _one_line_error(proc)
    proc = chronoq_cmd("stats", env={"CHRONOQ_TLS": "maybe"})
    assert proc.returncode == 2 and "$CHRONOQ_TLS must be" in _one_line_error(proc)
    proc = chronoq_cmd("topics", "list", "--ca-cert", str(tmp_path / "nosuch.pem"))
    assert proc.returncode == 2 and "cannot read the CA certificate" in _one_line_error(proc)
    proc = chronoq_cmd("topics", "list", "--server", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and "nothing listens there" in _one_line_error(proc)


@pytest.mark.slow
def test_a_port_outside_1_to_65535_is_refused_not_wrapped_around(server: str) -> None:
    """gRPC takes a port modulo 65536: `--server 127.0.0.1:<port + 65536>` used to reach the
    server on <port>."""
    wrapped = f"127.0.0.1:{int(server.rpartition(':')[2]) + 65536}"
    proc = chronoq_cmd("topics", "list", "--server", wrapped)
    assert proc.returncode == 2, proc.stdout
    assert f"port {int(wrapped.rpartition(':')[2])} is outside 1-65535" in _one_line_error(proc)
    proc = chronoq_cmd("topics", "list", env={"CHRONOQ_SERVER": "127.0.0.1:0"})
    assert proc.returncode == 2 and "$CHRONOQ_SERVER '127.0.0.1:0'" in _one_line_error(proc)


# -- start-up --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_on_a_data_dir_that_is_a_file_says_so(tmp_path: Path) -> None:
    a_file = tmp_path / "data"
    a_file.write_text("not a directory")
    proc = chronoq_cmd("serve", "--data-dir", str(a_file), "--port", str(free_port()))
    assert proc.returncode == 2
    assert f"data directory {a_file} is a file, not a directory" in _one_line_error(proc)


@pytest.mark.slow
def test_demo_under_a_misspelled_variable_prints_the_servers_line_not_a_traceback(tmp_path: Path) -> None:
    proc = chronoq_cmd("demo", "--data-dir", str(tmp_path / "data"), env={"CHRONOQ_TIMER_MAX_DELAY": "1000"})
    assert proc.returncode == 1
    assert ("chronoq serve: environment CHRONOQ_TIMER_MAX_DELAY: no such setting; did you mean "
            "CHRONOQ_TIMER_MAX_DELAY_MS?") in _one_line_error(proc)


@pytest.mark.slow
def test_serve_on_a_busy_port_names_the_cause_without_grpc_log_lines(tmp_path: Path, server: str) -> None:
    port = server.rsplit(":", 1)[1]
    proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "d"), "--port", port)
    assert proc.returncode == 2
    err = _one_line_error(proc)
    assert f"port {port} is in use" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_serve_with_cert_and_key_swapped_or_mismatched_says_which(tmp_path: Path) -> None:
    cert, key = _openssl_cert(tmp_path)
    _, other_key = _openssl_cert(tmp_path, name="other")
    port = str(free_port())
    proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "d"), "--port", port, "--tls-cert", str(key),
                       "--tls-key", str(cert))
    assert proc.returncode == 2 and "the TLS files are swapped" in _one_line_error(proc)
    assert "cannot bind" not in proc.stderr
    proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "d"), "--port", port, "--tls-cert", str(cert),
                       "--tls-key", str(other_key))
    assert proc.returncode == 2 and "is not the private key of the certificate" in _one_line_error(proc)


# -- TLS on every client command ---------------------------------------------------------------------


@pytest.mark.slow
def test_client_commands_talk_to_a_tls_server(tmp_path: Path) -> None:
    cert, key = _openssl_cert(tmp_path)
    settings = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    with ServerProcess(tmp_path / "data", settings=settings, tls_root_certificates=cert.read_bytes()) as proc:
        address = proc.address
        # Without TLS: refused, with the likely cause.
        plain = chronoq_cmd("topics", "list", "--server", address)
        assert plain.returncode == 1 and "may require TLS" in _one_line_error(plain)
        # Flags: the self-signed certificate as the CA.
        sent = chronoq_cmd("send", "orders", "over tls", "--in", "1s", "--server", address, "--ca-cert", str(cert))
        assert sent.returncode == 0, sent.stderr
        assert "recall handle:" in sent.stdout
        # The same through the environment, as kubectl and nats take theirs.
        env = {"CHRONOQ_SERVER": address, "CHRONOQ_CA_CERT": str(cert)}
        got = chronoq_cmd("consume", "orders", "--group", "g", "--count", "1", "--wait", env=env)
        assert got.returncode == 0 and "over tls" in got.stdout, got.stderr
        for argv in (["topics", "list"], ["stats"], ["show", re.search(r"sent (\S+)", sent.stdout).group(1)]):
            assert chronoq_cmd(*argv, env=env).returncode == 0, argv
        # TLS trusting only the system's CAs: the self-signed certificate is not trusted, and said so.
        system = chronoq_cmd("topics", "list", "--tls", env={"CHRONOQ_SERVER": address})
        assert system.returncode == 1 and "certificate is not trusted" in _one_line_error(system)
        assert _one_line_error(system).startswith("error (ServerUnavailable): "), system.stderr  # not "retriable"
        # The key given as the CA: a usage error naming the mistake, before any connection.
        wrong = chronoq_cmd("topics", "list", "--ca-cert", str(key), env={"CHRONOQ_SERVER": address})
        assert wrong.returncode == 2 and "holds a private key" in _one_line_error(wrong)


@pytest.mark.slow
def test_tls_server_name_for_a_certificate_that_names_a_host(tmp_path: Path) -> None:
    cert, key = _openssl_cert(tmp_path, san="DNS:broker.chronoq.test")
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                              "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        assert serve.stdout is not None
        assert serve.stdout.readline().startswith("chronoq serving on")
        env = {"CHRONOQ_SERVER": f"127.0.0.1:{port}", "CHRONOQ_CA_CERT": str(cert)}
        assert chronoq_cmd("topics", "list", env=env).returncode == 1  # the certificate does not name 127.0.0.1
        ok = chronoq_cmd("topics", "list", "--tls-server-name", "broker.chronoq.test", env=env)
        assert ok.returncode == 0, ok.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(20)


@pytest.mark.slow
def test_tls_to_a_plain_server_is_told_so(server: str) -> None:
    proc = chronoq_cmd("topics", "list", "--tls", "--server", server)
    assert proc.returncode == 1 and "does not seem to use TLS" in _one_line_error(proc)


@pytest.mark.slow
def test_the_http_port_given_as_the_server_is_named_and_logged_in_one_line(tmp_path: Path) -> None:
    """The console/metrics port speaks HTTP/1.1: a client command given it used to print gRPC's
    HTTP/2 parse error, and the server logged aiohttp's traceback for each connection."""
    http_port = free_port()
    with ServerProcess(tmp_path / "data", args=["--http-port", str(http_port)]) as proc:
        cmd = chronoq_cmd("stats", "--server", f"127.0.0.1:{http_port}")
        err = _one_line_error(cmd)
        assert cmd.returncode == 1, err
        assert err.startswith(f"error (ServerUnavailable): cannot reach chronoq server at 127.0.0.1:{http_port}: "
                              "this port answers HTTP/1.1, not gRPC (is it the console/metrics port, --http-port? "
                              "The gRPC port is the one `chronoq serve` prints first"), err
        assert "retriable" not in err.split(":")[0] and "Failed parsing HTTP/2" not in err, err
        log = proc.log()
    lines = [line for line in log.splitlines() if "connected to the HTTP port" in line]
    assert lines and all(f"WARNING chronoq.http.server: a gRPC (HTTP/2) client connected to the HTTP port from "
                         f"127.0.0.1, which serves the console, /metrics and /healthz over HTTP/1.1; gRPC is on "
                         f"port {proc.port}" in line for line in lines), log
    assert "Traceback" not in log and "BadHttpMessage" not in log and "Error handling request" not in log, log


# -- optional parts --------------------------------------------------------------------------------


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which importing `modules` fails as it does where they are not installed."""
    hook = tmp_path / "hide-modules"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import sys\n"
        f"HIDDEN = {set(modules)!r}\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in HIDDEN:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Hide())\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(hook), str(ROOT), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.slow
def test_commands_of_the_spark_extra_name_the_setup_step(tmp_path: Path) -> None:
    env = _without(tmp_path, "pyarrow", "pyspark")
    probe = subprocess.run([sys.executable, "-c", "import pyarrow"], env=_env(env), capture_output=True, text=True)
    assert "No module named 'pyarrow'" in probe.stderr  # the hiding works
    (tmp_path / "data").mkdir()
    for argv in (["trace", "export", str(tmp_path / "data"), str(tmp_path / "t.parquet")],
                 ["spark", "report", str(tmp_path / "t.parquet")],
                 ["spark", "schedule", "--input", "x.csv", "--topic", "t", "--delay-column", "d", "--server", "h:1"],
                 ["spark", "engine", "--server", "h:1", "--checkpoint", str(tmp_path / "ckpt")]):
        proc = chronoq_cmd(*argv, env=env)
        assert proc.returncode == 1, (argv, proc.stderr)
        err = _one_line_error(proc)
        assert "scripts/setup.sh --spark" in err and "ModuleNotFoundError" not in err, argv


# -- dates and durations in errors ----------------------------------------------------------------


@pytest.mark.slow
def test_refusals_show_dates_and_durations(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    proc = chronoq_cmd("send", fresh("far"), "x", "--at", "2099-01-01T00:00:00Z", env=env)
    assert proc.returncode == 1
    err = _one_line_error(proc)
    assert "delivery time 2099-01-01T00:00:00Z is" in err and "days ahead" in err and "is 30 days" in err, err
    assert not re.search(r"\d{10,}", err), err  # no epoch milliseconds
    proc = chronoq_cmd("send", fresh("far"), "x", "--at", "1000", env=env)
    assert proc.returncode == 2 and "1970-01-01T00:00:01Z" in proc.stderr and "--in" in proc.stderr


@pytest.mark.slow
def test_a_deliver_at_in_the_past_is_late_only_since_it_was_accepted(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("past")
    an_hour_ago_ms = int(time.time() * 1000) - 3_600_000
    sent = chronoq_cmd("send", topic, "late?", "--at", str(an_hour_ago_ms), env=env)
    assert sent.returncode == 0, sent.stderr
    got = chronoq_cmd("consume", topic, "--group", "g", "--count", "1", "--wait", env=env)
    assert got.returncode == 0 and "late?" in got.stdout
    stats = json.loads(chronoq_cmd("stats", "--json", env=env).stdout)
    error = stats["timer"]["latencies"]["delivery_error_ms"]
    assert error["count"] >= 1 and error["max"] < 60_000, error  # not the hour it was "due" before it existed
    assert "before it was sent: delivered at once" in got.stdout and "1h00m" not in got.stdout, got.stdout
    assert "delivered at once" in sent.stdout, sent.stdout
    message_id = re.search(r"sent (\S+)", sent.stdout).group(1)
    show = chronoq_cmd("show", message_id, env=env)
    assert re.search(r"fired .*\((\d+ms|[\d.]+s) after it was accepted\)", show.stdout), show.stdout


# -- consumers never create topics -------------------------------------------------------------------


@pytest.mark.slow
def test_consume_of_a_mistyped_topic_creates_nothing_and_says_what_to_do(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    typo = fresh("ordrs")
    proc = chronoq_cmd("consume", typo, "--group", "g", env=env)
    assert proc.returncode == 1
    err = _one_line_error(proc)
    assert f"topic '{typo}' does not exist" in err and f"chronoq topics create {typo}" in err
    assert "auto-create is off" not in err  # it is on here
    assert typo not in chronoq_cmd("topics", "list", env=env).stdout
    described = chronoq_cmd("topics", "describe", typo, env=env)
    assert described.returncode == 1 and "auto-create is off" not in described.stderr


# -- topic names that forgive typos -------------------------------------------------------------------


@pytest.mark.slow
def test_a_send_to_a_mistyped_topic_is_refused_naming_the_topic_and_create_topic_creates_it(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("orders")
    typo = topic.replace("orders", "ordres", 1)
    assert chronoq_cmd("send", topic, "first", env=env).returncode == 0
    refused = chronoq_cmd("send", typo, "lost?", env=env)
    assert refused.returncode == 1
    err = _one_line_error(refused)
    assert f"topic '{typo}' does not exist; did you mean '{topic}'?" in err, err
    assert "code 40402" in err  # TOPIC_NOT_FOUND: all the RocketMQ protocol's status carries beside the text
    assert "--create-topic" in err and f"chronoq topics create {typo}" in err
    assert typo not in chronoq_cmd("topics", "list", env=env).stdout
    created = chronoq_cmd("send", typo, "on purpose", "--create-topic", env=env)
    assert created.returncode == 0, created.stderr
    assert "sent " in created.stdout and typo in created.stdout
    assert typo in chronoq_cmd("topics", "list", env=env).stdout
    got = chronoq_cmd("consume", typo, "--group", "g", env=env)
    assert got.returncode == 0 and "on purpose" in got.stdout


@pytest.mark.slow
def test_consume_of_a_mistyped_topic_points_at_the_near_topic(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("orders")
    typo = topic.replace("orders", "ordrs", 1)
    assert chronoq_cmd("send", topic, "x", env=env).returncode == 0
    proc = chronoq_cmd("consume", typo, "--group", "g", env=env)
    assert proc.returncode == 1
    err = _one_line_error(proc)
    assert f"topic '{typo}' does not exist; did you mean '{topic}'?" in err, err
    assert "chronoq topics create" not in err  # not a suggestion to create the typo
    assert typo not in chronoq_cmd("topics", "list", env=env).stdout


# -- delay levels -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_send_level_prints_its_due_time_and_why_it_has_no_handle(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("levels")
    proc = chronoq_cmd("send", topic, "x", "--level", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"due at \S+ \(in (9\.\d+s|10s); delay level 3\)", proc.stdout), proc.stdout
    assert "no recall handle" in proc.stdout and "as in RocketMQ 4" in proc.stdout
    message_id = re.search(r"sent (\S+)", proc.stdout).group(1)
    show = chronoq_cmd("show", message_id, env=env)
    assert show.returncode == 1 and "delay-level message is not tracked, as in RocketMQ 4" in show.stderr


@pytest.mark.slow
def test_send_level_above_the_table_is_refused_naming_the_top(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("levels")
    proc = chronoq_cmd("send", topic, "x", "--level", "99", env=env)
    assert proc.returncode == 1
    err = _one_line_error(proc)
    assert "InvalidDelayLevel" in err and "level 18 = 2h00m" in err and "levels are 1..18" in err


# -- stats ------------------------------------------------------------------------------------------


def _stats_env(server: str) -> dict[str, str]:
    return {"CHRONOQ_SERVER": server}


@pytest.mark.slow
def test_stats_fits_80_columns_and_a_24_line_screen(server: str) -> None:
    env = _stats_env(server)
    for i in range(3):
        chronoq_cmd("send", fresh("stats"), "x", "--in", f"{i + 1}h", env=env)
    proc = chronoq_cmd("stats", env=env)
    assert proc.returncode == 0
    lines = proc.stdout.rstrip("\n").splitlines()
    assert len(lines) <= 22 and max(map(len, lines)) <= 80, proc.stdout
    text = proc.stdout
    assert "by due" in text and "delivery error" in text and "p99" in text


def _pty_run(argv: list[str], env: dict[str, str], seconds: float) -> str:
    """Run `argv` on a pseudo-terminal of 80x24 for `seconds`, then Ctrl-C; return what it drew."""
    import fcntl
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    full_env = _env(env)
    full_env.pop("COLUMNS", None)
    full_env.pop("LINES", None)
    full_env["TERM"] = "xterm-256color"
    # Ctrl-C as a person types it: SIGINT with its default disposition in the child, even when this
    # process was started with SIGINT ignored (a shell's background job does that, and an ignored
    # signal stays ignored across exec: the child would then never see its Ctrl-C).
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=full_env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    out = b""
    deadline = time.monotonic() + seconds
    interrupted = False
    try:
        while True:
            now = time.monotonic()
            if now >= deadline and proc.poll() is None:
                if interrupted:
                    raise AssertionError(f"{argv} still running 10 s after Ctrl-C; it drew {out[-400:]!r}")
                os.kill(proc.pid, signal.SIGINT)
                interrupted = True
                deadline = now + 10
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        os.close(master)
    return out.decode(errors="replace")


@pytest.mark.slow
def test_stats_watch_redraws_the_whole_screen_in_80x24(server: str) -> None:
    drawn = _pty_run([sys.executable, "-m", "chronoq", "stats", "--watch", "0.5"], _stats_env(server), 4)
    assert "\x1b[?1049h" in drawn and "\x1b[?1049l" in drawn, repr(drawn[:200])  # alternate screen, restored
    frames = [f for f in drawn.split("\x1b[H") if "chronoq stats" in f]
    assert len(frames) >= 2, repr(drawn[:400])  # redrawn, not appended
    screen = [line.rstrip() for line in ANSI.sub("", frames[-1]).replace("\r", "").split("\n")]
    while screen and not screen[-1]:
        screen.pop()
    assert len(screen) <= 24 and max(map(len, screen)) <= 80, screen
    shown = "\n".join(screen)
    assert "by due" in shown and "delivery error" in shown, shown


@pytest.mark.slow
def test_stats_watch_piped_prints_a_snapshot_every_interval(server: str) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as info:
        chronoq_cmd("stats", "--watch", "0.5", env=_stats_env(server), timeout=5)
    out = info.value.stdout or b""
    out = out.decode() if isinstance(out, bytes) else out
    assert out.count("chronoq stats") >= 3 and "\x1b[" not in out, out[:500]


# -- connection flags before the command --------------------------------------------------------------


@pytest.mark.slow
def test_connection_flags_may_come_before_the_command(server: str) -> None:
    """`chronoq --server H:P send ...` as kubectl and gh take global flags; a flag after the
    command still wins."""
    topic = fresh("global")
    sent = chronoq_cmd("--server", server, "send", topic, "first")
    assert sent.returncode == 0, sent.stderr
    got = chronoq_cmd("--server", "127.0.0.1:1", "consume", topic, "--group", "g", "--count", "1",
                      "--server", server)
    assert got.returncode == 0 and "first" in got.stdout, got.stderr


# -- mistakes in the arguments: named, with what is allowed (no server needed) -------------------------


@pytest.mark.slow
def test_a_misspelled_flag_or_command_is_named_with_the_one_meant() -> None:
    proc = chronoq_cmd("send", "t", "x", "--levle", "3")
    assert proc.returncode == 2
    err = _one_line_error(proc)
    assert "usage: chronoq send" in err, err  # the command's own usage, not `chronoq COMMAND ...`
    assert "chronoq send: error: unrecognized arguments: --levle 3 (--levle: did you mean --level?)" in err, err
    proc = chronoq_cmd("topics", "create", "t", "--queus", "3")
    assert proc.returncode == 2 and "did you mean --queues?" in _one_line_error(proc)
    proc = chronoq_cmd("sned", "t", "x")
    assert proc.returncode == 2 and "invalid choice: 'sned'" in proc.stderr and "did you mean 'send'?" in proc.stderr


@pytest.mark.slow
def test_a_negative_or_unit_less_duration_and_a_zero_count_are_refused_by_value() -> None:
    proc = chronoq_cmd("send", "t", "x", "--in", "-5s")  # argparse took '-5s' for an unknown flag
    assert proc.returncode == 2
    err = _one_line_error(proc)
    assert "expected one argument" not in err and "cannot read duration '-5s': a duration cannot be negative" in err
    proc = chronoq_cmd("send", "t", "x", "--in", "5")
    assert proc.returncode == 2 and "'5': a number needs its unit (5s, 5m" in _one_line_error(proc)
    for count in ("0", "-1"):  # used to consume nothing and exit 0
        proc = chronoq_cmd("consume", "t", "--group", "g", "--count", count)
        assert proc.returncode == 2, proc.stderr
        assert f"argument --count: must be 1 or more, not {count}" in _one_line_error(proc)


def test_serve_with_a_missing_config_file_names_it_without_errno(tmp_path: Path) -> None:
    proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "d"), "--port", str(free_port()),
                       "--config", str(tmp_path / "chronoq.toml"))
    assert proc.returncode == 2
    err = _one_line_error(proc)
    assert f"cannot read --config {tmp_path / 'chronoq.toml'}: No such file or directory" in err, err
    assert "[Errno" not in err


def test_stats_names_consumer_groups_in_80_columns_furthest_behind_first() -> None:
    from chronoq.cli.stats import render

    groups = [{"group": f"g{i}", "topic": "t", "lag": i * 100, "inflight": i % 2} for i in range(40)]
    lines = render({"now_ms": 0, "topics": 1, "groups": groups})
    line = next(x for x in lines if x.startswith("groups"))
    assert line.startswith("groups      g39 on t: lag 3,900, 1 in flight · g38 on t: lag 3,800 · and 38 more"), line
    assert re.search(r"· and \d+ more$", line) and len(line) <= 80, line
    assert not any('{"group"' in x for x in lines), lines
    assert "groups      none" in render({"now_ms": 0, "groups": []})


# -- durations as chronoq prints them, read back -----------------------------------------------------


@pytest.mark.slow
def test_durations_as_chronoq_prints_them_are_taken_back(server: str) -> None:
    """A person copies '1h30m' or '12h00m' from chronoq's own output (the invisible-duration
    refusal says '[1s, 12h00m]') into --in or --invisible."""
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("compound")
    proc = chronoq_cmd("send", topic, "x", "--in", "1h30m", env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"due at \S+ \(in 1h(29|30)m\)", proc.stdout), proc.stdout
    chronoq_cmd("send", topic, "now", env=env)
    proc = chronoq_cmd("consume", topic, "--group", "g", "--invisible", "12h00m", "--count", "1", env=env)
    assert proc.returncode == 0 and "now" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_stats_shows_consumer_groups_as_a_line_not_json(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("grouped")
    for body in ("a", "b"):
        chronoq_cmd("send", topic, body, env=env)
    chronoq_cmd("consume", topic, "--group", "readers", "--count", "1", env=env)
    proc = chronoq_cmd("stats", env=env)
    assert proc.returncode == 0
    assert '{"group"' not in proc.stdout, proc.stdout
    assert re.search(rf"^groups .*readers on {topic}: lag 1", proc.stdout, re.MULTILINE), proc.stdout


@pytest.mark.slow
def test_a_message_too_large_gives_sizes_a_person_reads(server: str, tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"a" * 5_000_000)
    with body.open("rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "chronoq", "send", fresh("big"), "-"], stdin=stdin,
                              capture_output=True, text=True, env=_env({"CHRONOQ_SERVER": server}), timeout=60)
    assert proc.returncode == 1
    err = _one_line_error(proc)
    assert re.search(r"message is 5,000,\d{3} bytes \(4\.8 MiB\); the limit \(max_message_size_bytes\) is "
                     r"4,194,304 bytes \(4 MiB\)", err), err


@pytest.mark.slow
def test_a_second_broker_on_the_same_data_dir_says_what_to_do(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data"):
        proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "data"), "--port", str(free_port()))
    assert proc.returncode == 2  # a start-up that cannot go on, as a port in use
    err = _one_line_error(proc)
    assert err.strip() == (f"chronoq serve: data directory {tmp_path / 'data'} is in use by another broker: stop that "
                           "broker first, or give this one another --data-dir"), err


@pytest.mark.slow
def test_an_unreadable_at_time_gets_an_example_that_is_not_in_the_past() -> None:
    """'09:00 tomorrow' is what a person types; the example in the refusal (and in --help) is
    09:00 tomorrow in ISO 8601, made now, not a fixed date that has since gone by."""
    from datetime import date, datetime, timedelta

    tomorrow = date.today() + timedelta(days=1)
    nine = datetime(tomorrow.year, tomorrow.month, tomorrow.day, 9).astimezone().isoformat(timespec="seconds")
    proc = chronoq_cmd("send", "t", "x", "--at", "09:00 tomorrow")
    assert proc.returncode == 2
    assert f"cannot read time '09:00 tomorrow': give a date and time in ISO 8601, e.g. {nine}" in \
        _one_line_error(proc), proc.stderr
    assert f"--at {nine}" in chronoq_cmd("send", "--help").stdout


@pytest.mark.slow
def test_a_timer_send_does_not_print_the_timer_topics_offset(server: str) -> None:
    """A timer message's receipt offset is in chronoq's own timer topic: 'offset 12' for the first
    message of a new topic, whose queues show none."""
    env = {"CHRONOQ_SERVER": server}
    for _ in range(3):
        chronoq_cmd("send", fresh("other"), "x", "--in", "1h", env=env)
    topic = fresh("reminders")
    proc = chronoq_cmd("send", topic, "x", "--in", "1h", env=env)
    assert proc.returncode == 0
    assert re.match(rf"sent \S+ to {topic}, held until due\n", proc.stdout) and "offset" not in proc.stdout, \
        proc.stdout
    proc = chronoq_cmd("send", topic, "now", env=env)
    assert re.match(rf"sent \S+ to {topic} \(offset 0\)\n", proc.stdout), proc.stdout


def test_serve_takes_its_log_level_in_either_case(tmp_path: Path) -> None:
    """`--log-level debug` was refused: invalid choice (choose from 'DEBUG', ...)."""
    proc = chronoq_cmd("serve", "--data-dir", str(tmp_path / "d"), "--port", "70000", "--log-level", "debug")
    assert proc.returncode == 2
    err = _one_line_error(proc)
    assert "--log-level" not in err and "port = 70000" in err, err  # got past the flags, to the port's check


@pytest.mark.slow
def test_a_refusal_for_missing_or_wrong_keys_says_where_the_cli_takes_them(tmp_path: Path) -> None:
    config = tmp_path / "chronoq.toml"
    config.write_text('[auth]\nenabled = true\n\n[[auth.users]]\naccess_key = "ops"\nsecret_key = "s3cret"\n'
                      "admin = true\n")
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                              "--port", str(port), "--config", str(config)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=_env())
    try:
        assert serve.stdout is not None and "chronoq serving on" in serve.stdout.readline()
        env = {"CHRONOQ_SERVER": f"127.0.0.1:{port}"}
        for keys in ({}, {"CHRONOQ_ACCESS_KEY": "ops", "CHRONOQ_SECRET_KEY": "wrong"}):
            # The same refusal has the same name whichever service refused it: the RocketMQ
            # protocol's send (a code only) and the admin service's stats (which names the class).
            for command in (["send", "orders", "x"], ["stats"]):
                proc = chronoq_cmd(*command, env={**env, **keys})
                assert proc.returncode == 1
                err = _one_line_error(proc)
                assert err.startswith("error (Unauthorized, code 40100): "), (command, err)
                assert "the CLI takes keys as --access-key and --secret-key, or " \
                       "$CHRONOQ_ACCESS_KEY and $CHRONOQ_SECRET_KEY" in err, err
        proc = chronoq_cmd("send", "orders", "x",
                           env={**env, "CHRONOQ_ACCESS_KEY": "ops", "CHRONOQ_SECRET_KEY": "s3cret"})
        assert proc.returncode == 0, proc.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(30)


@pytest.mark.slow
def test_a_mangled_recall_handle_is_named_with_where_a_good_one_comes_from(server: str) -> None:
    """`cancel --handle` with a handle cut short in copying said only 'checksum mismatch'."""
    env = {"CHRONOQ_SERVER": server}
    sent = chronoq_cmd("send", fresh("recall"), "x", "--in", "1h", env=env)
    handle = re.search(r"recall handle: (\S+)", sent.stdout).group(1)
    for bad in ("garbage", handle[:-6]):
        proc = chronoq_cmd("cancel", "--handle", bad, env=env)
        assert proc.returncode == 1
        err = _one_line_error(proc)
        assert f"invalid recall handle '{bad[:40]}" in err and "`chronoq send` prints it), copied whole" in err, err
    assert chronoq_cmd("cancel", "--handle", handle, env=env).returncode == 0


@pytest.mark.slow
def test_a_consume_before_the_timer_is_due_says_why_nothing_came(server: str) -> None:
    env = {"CHRONOQ_SERVER": server}
    topic = fresh("early")
    chronoq_cmd("send", topic, "later", "--in", "10s", env=env)
    proc = chronoq_cmd("consume", topic, "--group", "g", env=env)
    assert proc.returncode == 0 and "later" not in proc.stdout
    assert "0 message(s) consumed: none ready now (a timer message can be consumed once it is due; --wait waits " \
           "for it)" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_send_dash_on_a_terminal_says_it_reads_the_body_until_ctrl_d() -> None:
    """`chronoq send orders -` typed at a terminal waited for stdin without a word."""
    drawn = _pty_run([sys.executable, "-m", "chronoq", "send", "t", "-"], {"CHRONOQ_SERVER": "127.0.0.1:1"}, 3)
    assert "reading the message body from the terminal; end it with Ctrl-D" in drawn, drawn
    assert "Traceback" not in drawn, drawn  # Ctrl-C gives up quietly


@pytest.mark.slow
def test_a_missing_command_or_action_shows_the_list_to_choose_from() -> None:
    """`chronoq` alone said only 'the following arguments are required: COMMAND'."""
    proc = chronoq_cmd()
    assert proc.returncode == 2
    assert all(f"    {name} " in proc.stderr for name in ("serve", "send", "consume", "stats")), proc.stderr
    assert proc.stderr.rstrip().endswith("chronoq: error: the following arguments are required: COMMAND")
    proc = chronoq_cmd("topics")
    assert proc.returncode == 2 and "    create " in proc.stderr and "    describe " in proc.stderr, proc.stderr


@pytest.mark.slow
def test_demo_on_a_port_another_broker_holds_stops_and_sends_nothing_there(tmp_path: Path, server: str) -> None:
    """`chronoq demo --port P` with a broker already on P: its own serve failed to bind, but the
    other broker answered the readiness check, so the demo ran against it ('demo OK'), creating
    its topic and sending its messages into that broker's data."""
    port = server.rsplit(":", 1)[1]
    proc = chronoq_cmd("demo", "--data-dir", str(tmp_path / "data"), "--port", port, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert f"port {port} is in use" in _one_line_error(proc) and "demo OK" not in proc.stdout
    assert "demo-orders" not in chronoq_cmd("topics", "list", env={"CHRONOQ_SERVER": server}).stdout


def test_a_server_given_as_a_url_is_refused_naming_what_to_give() -> None:
    """CHRONOQ_SERVER=http://127.0.0.1:8081 went to gRPC whole: a retriable 'Misformatted domain
    name' lookup failure, exit 1."""
    proc = chronoq_cmd("topics", "list", env={"CHRONOQ_SERVER": "http://127.0.0.1:8081"})
    assert proc.returncode == 2
    assert "(drop 'http://': give 127.0.0.1:8081; TLS is set apart: tls=True, or the CLI's --tls)" in \
        _one_line_error(proc), proc.stderr


@pytest.mark.slow
def test_topics_describe_counts_messages_with_thousands_separators(server: str) -> None:
    from chronoq.client import Producer, outgoing

    topic = fresh("many")
    with Producer(server) as p:
        p.create_topic(topic, queue_count=1)
        p.send_batch([outgoing(topic, b"x") for _ in range(1200)])
    proc = chronoq_cmd("topics", "describe", topic, env={"CHRONOQ_SERVER": server})
    assert proc.returncode == 0
    assert re.search(r"│\s+0 │\s+0 │\s+1200 │\s+1,200 │", proc.stdout), proc.stdout


@pytest.mark.slow
def test_a_long_poll_ended_by_the_servers_shutdown_says_so(tmp_path: Path) -> None:
    """Ctrl-C on `chronoq serve` while `consume --wait` polled: the consumer said only 'cannot
    reach chronoq server at ...: Cancelling all calls'. The SDK now retries the receive (the
    shutdown's UNAVAILABLE is retriable), so with the server gone for good the error is the last
    attempt's: nothing listens there."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                              "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=_env())
    try:
        assert serve.stdout is not None and "chronoq serving on" in serve.stdout.readline()
        env = {"CHRONOQ_SERVER": f"127.0.0.1:{port}"}
        assert chronoq_cmd("topics", "create", "orders", env=env).returncode == 0
        consumer = subprocess.Popen([sys.executable, "-m", "chronoq", "consume", "orders", "--group", "g", "--wait"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env))
        time.sleep(4)  # started, routed, and waiting in its long poll
        serve.send_signal(signal.SIGINT)
        _, err = consumer.communicate(timeout=60)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(30)
    assert consumer.returncode == 1 and "Traceback" not in err, err
    assert "nothing listens there: is `chronoq serve` running" in err, err
