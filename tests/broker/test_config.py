"""Configuration: every setting checked against its one declaration, from every source.

Each integer setting declares its range beside its default (`config.limit`); these tests walk
the dataclass's fields, so a setting added later is checked without touching this file. A value
of the wrong type is refused from TOML (no silent conversion: `trace_enable = "false"` used to
turn tracing on, `port = "18460"` ended in a traceback) and from `CHRONOQ_*` variables, with one
line naming the source, the key, the value and what was expected; `chronoq serve` prints that
line and exits 2.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

import chronoq
from chronoq import config as config_module
from chronoq import envvars
from chronoq.config import Config, ConfigError

FIELDS = dataclasses.fields(Config)
HINTS = typing.get_type_hints(Config)
INT_FIELDS = [f for f in FIELDS if HINTS[f.name] is int]
WRONG_TYPE_IN_TOML = {bool: ('"false"', '"false"'), int: ('"18460"', '"18460"'), str: ("true", "true"),
                      Path: ("1", "1")}


def toml_value_of_the_wrong_type(f: dataclasses.Field[Any]) -> tuple[str, str]:
    kind = HINTS[f.name]
    if typing.get_origin(kind) is Literal:
        return '"neither"', '"neither"'
    return WRONG_TYPE_IN_TOML.get(kind, ("1", "1"))


def test_every_integer_setting_declares_its_range() -> None:
    for f in INT_FIELDS:
        assert "minimum" in f.metadata, f"{f.name} is not declared with config.limit()"


@pytest.mark.parametrize("f", INT_FIELDS, ids=lambda f: f.name)
def test_an_integer_outside_its_declared_range_is_refused_naming_key_and_value(f: dataclasses.Field[Any]) -> None:
    low = f.metadata["minimum"]
    with pytest.raises(ConfigError, match=rf"^{f.name} = {low - 1}: expected an integer"):
        Config(**{f.name: low - 1})
    if f.metadata["maximum"] is not None:
        with pytest.raises(ConfigError, match=rf"^{f.name} = {f.metadata['maximum'] + 1}: expected an integer in"):
            Config(**{f.name: f.metadata["maximum"] + 1})
    with pytest.raises(ConfigError, match=rf"^{f.name} = true: expected an integer"):
        Config(**{f.name: True})


@pytest.mark.parametrize("name", ["max_tag_length", "max_keys_count", "max_long_poll_ms", "dedupe_window_ms"])
def test_the_limits_that_used_to_pass_unchecked(name: str) -> None:
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=name):
            Config(**{name: bad})


@pytest.mark.parametrize("f", [f for f in FIELDS if f.name != "extra"], ids=lambda f: f.name)
def test_a_toml_value_of_the_wrong_type_is_one_line_naming_file_key_value(tmp_path: Path,
                                                                           f: dataclasses.Field[Any]) -> None:
    toml_text, shown = toml_value_of_the_wrong_type(f)
    path = tmp_path / "chronoq.toml"
    path.write_text(f"[chronoq]\n{f.name} = {toml_text}\n")
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {f.name} = {shown}: expected "), message
    assert "\n" not in message


def test_a_refused_value_is_shown_as_toml_spells_it(tmp_path: Path) -> None:
    """`port = true` was refused as "port = True", and a string in Python's quotes: a person
    reading the line against the file looked for a True the file does not have."""
    path = tmp_path / "chronoq.toml"
    for line, shown in [("port = true", "port = true"), ("trace_enable = 'no'", 'trace_enable = "no"'),
                        ('timer_engine = "it\'s \\"x\\""', 'timer_engine = "it\'s \\"x\\""'),
                        ("port = [1, false]", "port = [1, false]"), ("port = 1.5", "port = 1.5"),
                        ("port = {a = 'b'}", 'port = {a = "b"}')]:
        path.write_text(line + "\n")
        with pytest.raises(ConfigError) as info:
            Config.load(path)
        assert str(info.value).startswith(f"{path}: {shown}: expected "), (line, str(info.value))
    assert [config_module.toml_text(v) for v in (True, False, "a\tb\x01", None)] == [
        "true", "false", '"a\\tb\\u0001"', "None"]


def test_an_auth_table_refused_names_its_file_and_shows_toml(tmp_path: Path) -> None:
    from chronoq.server.auth import load_auth

    path = tmp_path / "chronoq.toml"
    path.write_text('[auth]\nenabled = "yes"\n')
    with pytest.raises(ConfigError) as info:
        load_auth(path)
    assert str(info.value) == f'{path}: auth.enabled must be true or false, not "yes"'
    path.write_text('[auth]\nenabled = true\n[[auth.users]]\naccess_key = "a"\nsecret_key = "b"\nadmin = "true"\n')
    with pytest.raises(ConfigError) as info:
        load_auth(path)
    assert str(info.value) == f'{path}: auth.users[0].admin must be true or false, not "true"'


def test_toml_booleans_and_integers_of_the_right_type_load(tmp_path: Path) -> None:
    path = tmp_path / "chronoq.toml"
    path.write_text('trace_enable = false\nport = 18460\ndata_dir = "d"\ntimer_engine = "memory"\n'
                    'timer_firer = "spark"\n')
    config = Config.load(path)
    assert (config.trace_enable, config.port, config.data_dir, config.timer_engine, config.timer_firer) == (
        False, 18460, Path("d"), "memory", "spark")


@pytest.mark.parametrize("source", ["toml", "environment", "argument"])
def test_the_old_timer_engine_spark_is_read_as_timer_firer_spark_with_a_warning(
        tmp_path: Path, source: str, caplog: pytest.LogCaptureFixture) -> None:
    """`timer_engine = "spark"` said who fires; that is `timer_firer` now, and `timer_engine`
    names the index. The old value keeps working for one release, saying what to write instead."""
    path = tmp_path / "chronoq.toml"
    path.write_text('timer_engine = "spark"\n')
    with caplog.at_level("WARNING", logger="chronoq.config"):
        config = {"toml": lambda: Config.load(path),
                  "environment": lambda: Config.load(env={"CHRONOQ_TIMER_ENGINE": "spark"}),
                  "argument": lambda: Config(timer_engine="spark")}[source]()
    assert (config.timer_engine, config.timer_firer) == ("rocksdb", "spark")
    [warning] = [r.getMessage() for r in caplog.records if r.name == "chronoq.config"]
    assert 'timer_engine = "spark" is deprecated' in warning and 'timer_firer = "spark"' in warning
    assert config.replace(port=18461).timer_firer == "spark"  # a copy keeps it, without a second warning
    assert len([r for r in caplog.records if r.name == "chronoq.config"]) == 1


def test_environment_text_is_read_as_the_setting_type_or_refused() -> None:
    config = Config.load(env={"CHRONOQ_TRACE_ENABLE": "false", "CHRONOQ_PORT": "18460", "CHRONOQ_FLUSH": "async",
                              "CHRONOQ_SERVER": "10.0.0.5:8081", "PATH": "/bin"})
    assert (config.trace_enable, config.port, config.flush) == (False, 18460, "async")
    for key, raw, expected in [("CHRONOQ_PORT", "eighty", "an integer in 1..65535"),
                               ("CHRONOQ_TRACE_ENABLE", "maybe", "true or false"),
                               ("CHRONOQ_MAX_LONG_POLL_MS", "0", "an integer >= 1"),
                               ("CHRONOQ_TIMER_ENGINE", "rocks", 'one of "rocksdb", "wheel", "memory"'),
                               ("CHRONOQ_TIMER_FIRER", "job", 'one of "broker", "spark"')]:
        with pytest.raises(ConfigError) as info:
            Config.load(env={key: raw})
        name = key[len("CHRONOQ_"):].lower()
        shown = raw if raw.isdigit() else f'"{raw}"'
        assert str(info.value) == f"environment {key}: {name} = {shown}: expected {expected}"


MISSPELLED_ENV = {"CHRONOQ_TIMER_MAX_DELAY": "CHRONOQ_TIMER_MAX_DELAY_MS",
                  "CHRONOQ_FLUSH_INTERVAL": "CHRONOQ_FLUSH_INTERVAL_MS",
                  "CHRONOQ_SERVR": "CHRONOQ_SERVER"}
"""Misspellings this file makes on purpose, and the name each should be told of."""
DOCUMENTED_MISSPELLINGS = {"CHRONOQ_TIMER_MAX_DELAY", "CHRONOQ_FLUSH_INTERVAL"}
"""What README.md and docs/design.md show being refused (in prose, never set by a command), and
tests (here and in tests/client/test_cli_first_hour.py) set to see it refused."""


@pytest.mark.parametrize(("key", "nearest"), MISSPELLED_ENV.items())
def test_an_unknown_chronoq_variable_is_refused_naming_the_nearest_known_name(key: str, nearest: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={key: "7776000000", "CHRONOQ_PORT": "18460"})
    message = str(info.value)
    assert message.startswith(f"environment {key}: no such setting; did you mean {nearest}"), message
    assert "\n" not in message


def test_the_clients_variables_pass_a_broker_unread() -> None:
    config = Config.load(env={name: "x" for name in envvars.NOT_SETTINGS})
    assert config == Config()


def test_every_chronoq_variable_named_in_the_repository_is_a_setting_or_a_clients() -> None:
    """Scripts, CI, benchmarks, tests and docs name only variables a broker accepts: a broker
    started under any of them (a test's `chronoq serve` inherits the runner's environment) starts."""
    root = Path(__file__).resolve().parents[2]  # the checkout: tests/broker/ is two below it
    known = {f"CHRONOQ_{f.name.upper()}" for f in FIELDS} | envvars.NOT_SETTINGS
    pattern = re.compile(r"(?<![A-Za-z0-9_])CHRONOQ_[A-Z0-9_]*[A-Z0-9]")
    found: dict[str, str] = {}
    # The files the repository tracks: not what set-up or a run left beside them (an egg-info
    # copy of the README, bench results, data directories).
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    for where in (Path(n) for n in tracked.decode().split("\0") if n):
        path = root / where
        if path.suffix not in (".py", ".sh", ".md", ".toml", ".json", ".txt", ".yml", ".yaml", "") \
                or path.resolve() == Path(__file__).resolve() or not path.is_file() \
                or path.stat().st_size > 4 * 2**20:
            continue
        for name in pattern.findall(path.read_text(errors="replace")):
            shown = path.suffix == ".md" or where.parts[0] == "tests"
            if not (shown and name in DOCUMENTED_MISSPELLINGS):
                found.setdefault(name, str(where))
    assert "CHRONOQ_SERVER" in found and "CHRONOQ_FLUSH" in found  # the scan reads the repository
    unknown = {name: where for name, where in found.items() if name not in known}
    assert not unknown, f"CHRONOQ_* names a broker would refuse: {unknown}"


@pytest.mark.parametrize(("key", "nearest"), [("CHRONOQ_TIMER_MAX_DELAY", "CHRONOQ_TIMER_MAX_DELAY_MS")])
def test_chronoq_serve_refuses_to_start_under_a_misspelled_variable(tmp_path: Path, key: str, nearest: str) -> None:
    root = Path(chronoq.__file__).resolve().parents[1]
    # A data directory that cannot be one: a broker that got past its settings would fail on it
    # at once (not serve, and not be refused for the variable).
    (tmp_path / "not-a-dir").write_text("")
    proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "not-a-dir")],
                          capture_output=True, text=True, timeout=60, cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", key: "7776000000",
                               "CHRONOQ_SERVER": "127.0.0.1:1", "CHRONOQ_ACCESS_KEY": "ops"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"chronoq serve: environment {key}: no such setting; did you mean {nearest}?"), \
        proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_an_unknown_key_is_named_with_the_nearest_known_one(tmp_path: Path) -> None:
    path = tmp_path / "chronoq.toml"
    path.write_text("max_tag_lenght = 3\n")
    with pytest.raises(ConfigError, match=r"key 'max_tag_lenght' \(did you mean 'max_tag_length'"):
        Config.load(path)


def test_settings_tied_together_name_both_values() -> None:
    with pytest.raises(ConfigError, match="max_message_size_bytes = 8192 must not exceed segment_size_bytes = 4096"):
        Config(segment_size_bytes=4096, max_message_size_bytes=8192)
    with pytest.raises(ConfigError, match="trace_retention_bytes = 12288 must be at least twice "
                                          "trace_segment_size_bytes = 8192"):
        Config(trace_segment_size_bytes=8192, trace_retention_bytes=12288)
    # `serve --port 8081 --http-port 8081` said "port 8081 is in use (another chronoq serve, or
    # another program)": it was this serve's own gRPC port.
    with pytest.raises(ConfigError, match=re.escape("http_port = 8081 is also the gRPC port (port); the console")):
        Config(port=8081, http_port=8081)


def test_the_declared_defaults_are_valid() -> None:
    Config()
    assert config_module.check_setting("port", 1) == 1


@pytest.mark.slow
@pytest.mark.parametrize("line", ['trace_enable = "false"', 'port = "18460"'])
def test_chronoq_serve_exits_2_with_one_line_and_no_traceback(tmp_path: Path, line: str) -> None:
    path = tmp_path / "chronoq.toml"
    path.write_text(line + "\n")
    root = Path(chronoq.__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--config", str(path),
                           "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=60,
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    key, _, value = line.partition(" = ")
    assert proc.stderr.strip() == f"chronoq serve: {path}: {key} = {value}: expected " + (
        "true or false" if key == "trace_enable" else "an integer in 1..65535")
    assert "Traceback" not in proc.stderr


def test_settings_beside_a_chronoq_table_are_refused_not_ignored(tmp_path: Path) -> None:
    """With a [chronoq] table, top-level keys and other tables were silently ignored: a limit
    the operator set did not apply."""
    path = tmp_path / "chronoq.toml"
    path.write_text("timer_max_delay_ms = 1000\n[chronoq]\nport_hint = 1\n[auth]\n")
    with pytest.raises(ConfigError, match="timer_max_delay_ms outside the \\[chronoq\\] table"):
        Config.load(path)
    path.write_text("[chronoq]\ntimer_max_delay_ms = 1000\n[timer]\nmax_delay_ms = 5\n")
    with pytest.raises(ConfigError, match="timer outside the \\[chronoq\\] table"):
        Config.load(path)
    path.write_text("[chronoq]\ntimer_max_delay_ms = 1000\n[auth]\nenabled = false\n")
    assert Config.load(path).timer_max_delay_ms == 1000


def test_a_file_that_is_not_toml_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("port = \n")
    with pytest.raises(ConfigError, match=f"{path}: not valid TOML"):
        Config.load(path)


@pytest.mark.parametrize(("name", "value"), [("timer_max_delay_ms", 2**63 - 1), ("max_message_size_bytes", 2**30)])
def test_limits_that_would_overflow_are_out_of_range(name: str, value: int) -> None:
    """timer_max_delay_ms = 2^63 - 1 ("no limit") let one send overflow the index's due time and
    stop the broker for good; a max_message_size_bytes of 1 GiB (in 2 GiB segments) overflowed
    gRPC's 32-bit request limit at start-up."""
    with pytest.raises(ConfigError, match=f"{name} = {value}: expected an integer in 1.."):
        Config.load(None, segment_size_bytes=2**31, **{name: value})


def test_a_limit_in_ms_or_bytes_reads_as_a_duration_or_a_size_and_a_duration_given_is_converted_for_you() -> None:
    """CHRONOQ_TIMER_MAX_DELAY_MS=90d was refused with 'expected an integer in 1..3153600000000'."""
    with pytest.raises(ConfigError) as info:
        Config.load(env={"CHRONOQ_TIMER_MAX_DELAY_MS": "90d"})
    assert str(info.value) == ("environment CHRONOQ_TIMER_MAX_DELAY_MS: timer_max_delay_ms = \"90d\": expected an "
                               "integer in 1..3,153,600,000,000 (1ms..36,500 days); in milliseconds, 90d is "
                               "7776000000")
    with pytest.raises(ConfigError, match=re.escape("expected an integer in 1..536,870,912 (512 MiB at most)")):
        Config.load(env={"CHRONOQ_MAX_MESSAGE_SIZE_BYTES": "1G"})
    with pytest.raises(ConfigError, match=re.escape("expected an integer in 0..1,000,000") + "$"):
        Config.load(env={"CHRONOQ_CLOCK_CATCHUP_PPM": "-1"})


def test_max_queue_count_has_a_ceiling_named_in_the_refusal() -> None:
    """max_queue_count had no upper bound: a topic of 65,000 queues held the event loop 139 s at
    its creation (a file and a directory fsync per queue), with no send, receive or timer
    meanwhile. Its most is `MAX_QUEUE_COUNT_CEILING` (256, ~120 ms of creation here)."""
    with pytest.raises(ConfigError, match=r"^max_queue_count = 65000: expected an integer in 1\.\.256$"):
        Config.load(None, max_queue_count=65_000)
    with pytest.raises(ConfigError, match=r"^environment CHRONOQ_MAX_QUEUE_COUNT: .*1\.\.256"):
        Config.load(None, env={"CHRONOQ_MAX_QUEUE_COUNT": "257"})
    assert Config(max_queue_count=256).max_queue_count == 256 == config_module.MAX_QUEUE_COUNT_CEILING
