"""`chronoq serve` and auth, as a process: the warning beyond loopback, a bad `[auth]` table.

Each test starts the real CLI in its own process (free port, temp data directory) and reads its
ready line and stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import chronoq
from chronoq.client.testing import free_port

pytestmark = pytest.mark.slow

ROOT = Path(chronoq.__file__).resolve().parent.parent
WARNING = "auth is off and chronoq listens on"




def _serve(tmp_path: Path, *args: str) -> tuple[str, str, int]:
    """Start `chronoq serve`, wait for its ready line, stop it; (ready line, stderr, exit code)."""
    lines, stderr, code = _serve_lines(tmp_path, 1, *args)
    return lines[0], stderr, code


def _serve_lines(tmp_path: Path, count: int, *args: str) -> tuple[list[str], str, int]:
    """Start `chronoq serve`, wait for its ready line, stop it; (its first `count` stdout lines, stderr, exit
    code)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    err_path = tmp_path / "serve.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(free_port()), *args], stdout=subprocess.PIPE, stderr=err, env=env)
        assert proc.stdout is not None
        lines = [proc.stdout.readline().decode().strip()]
        if proc.poll() is None:
            proc.terminate()
        # The lines after the ready one are printed with it, before the server awaits anything (and
        # so before it can act on the SIGTERM): they are in the pipe by the time it exits.
        code = proc.wait(timeout=30)
        rest = proc.stdout.read().decode().splitlines()
    return lines + rest[:count - 1], err_path.read_text(), code


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "chronoq.toml"
    path.write_text(text)
    return str(path)


AUTH_ON = """
[auth]
enabled = true
[[auth.users]]
access_key = "ops"
secret_key = "0ps-secret"
admin = true
"""


def test_serve_warns_when_it_listens_beyond_loopback_with_auth_off(tmp_path: Path) -> None:
    line, stderr, code = _serve(tmp_path, "--host", "0.0.0.0")
    assert line.startswith("chronoq serving on 0.0.0.0:") and code == 0
    assert WARNING in stderr and "[auth] enabled = true" in stderr


def test_serve_does_not_warn_on_loopback_or_with_auth_on(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    line, stderr, _ = _serve(tmp_path / "a")
    assert line.startswith("chronoq serving on 127.0.0.1:") and WARNING not in stderr
    (tmp_path / "b").mkdir()
    line, stderr, _ = _serve(tmp_path / "b", "--host", "0.0.0.0", "--config", _config(tmp_path / "b", AUTH_ON))
    assert line.startswith("chronoq serving on 0.0.0.0:") and WARNING not in stderr


def test_serve_says_whether_auth_is_on_under_its_ready_line(tmp_path: Path) -> None:
    """The ready line stays "chronoq serving on HOST:PORT" (scripts wait for it); the next line says
    whether calls are authenticated, and for how many users. (Before, only a warning beyond loopback
    said auth was off, and nothing said it was on.)"""
    (tmp_path / "off").mkdir()
    lines, _, code = _serve_lines(tmp_path / "off", 2)
    assert len(lines) == 2 and lines[0].startswith("chronoq serving on 127.0.0.1:") and code == 0, lines
    assert lines[1] == ("chronoq auth off: any caller may send, receive and administer "
                        "([auth] in --config turns it on)"), lines
    (tmp_path / "on").mkdir()
    two_users = AUTH_ON + '[[auth.users]]\naccess_key = "app"\nsecret_key = "app-secret"\npublish = ["orders"]\n'
    lines, _, code = _serve_lines(tmp_path / "on", 2, "--config", _config(tmp_path / "on", two_users))
    assert len(lines) == 2 and lines[0].startswith("chronoq serving on 127.0.0.1:") and code == 0, lines
    assert lines[1] == "chronoq auth on: 2 users", lines


@pytest.mark.parametrize(("text", "said"), [
    ("[auth]\nenabled = true\n", "no [[auth.users]] is configured"),
    ('[auth]\nenabled = true\n[[auth.users]]\naccess_key = "a"\n', "auth.users[0].secret_key"),
    ("delay_levels = false\n", "delay_levels = false: expected a string"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path, text: str, said: str) -> None:
    line, stderr, code = _serve(tmp_path, "--config", _config(tmp_path, text))
    assert (line, code) == ("", 2)
    assert stderr.startswith("chronoq serve: ") and said in stderr and "Traceback" not in stderr, stderr
