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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    err_path = tmp_path / "serve.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(free_port()), *args], stdout=subprocess.PIPE, stderr=err, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if proc.poll() is None:
            proc.terminate()
        code = proc.wait(timeout=30)
    return line, err_path.read_text(), code


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


@pytest.mark.parametrize(("text", "said"), [
    ("[auth]\nenabled = true\n", "no [[auth.users]] is configured"),
    ('[auth]\nenabled = true\n[[auth.users]]\naccess_key = "a"\n', "auth.users[0].secret_key"),
    ("delay_levels = false\n", "delay_levels = false: expected a string"),
])
def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path, text: str, said: str) -> None:
    line, stderr, code = _serve(tmp_path, "--config", _config(tmp_path, text))
    assert (line, code) == ("", 2)
    assert stderr.startswith("chronoq serve: ") and said in stderr and "Traceback" not in stderr, stderr
