"""README's SDK quick-start, copied out of README.md and run as a newcomer runs it.

The only change is the server address (a fresh `chronoq serve` on a free port instead of
127.0.0.1:8081). The example used to print a `TimerInfo` list with epoch milliseconds and then
wait five seconds for a consumer that had nothing to receive (its one message was recalled).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import chronoq
from chronoq.client.testing import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(chronoq.__file__).resolve().parent.parent


def _first_python_block(markdown: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_the_readme_sdk_example_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block((ROOT / "README.md").read_text())
    assert "127.0.0.1:8081" in code
    with ServerProcess(tmp_path / "data") as server:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8081", server.address)],
                              capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    assert re.fullmatch(r"pending until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z", lines[0]), lines[0]
    late = re.fullmatch(r"b'ship it' (\d+) ms after its due time", lines[1])
    assert late and int(late.group(1)) < 2000, lines[1]
