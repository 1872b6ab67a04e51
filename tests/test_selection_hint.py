"""The line a run gets when the default marker expression left out every test it collected.

`pytest tests/e2e/test_power_loss.py` (all slow) used to end with "N deselected" and exit
status 5, nothing more: it looked like a broken file. `tests/conftest.py` adds one line saying
why and how to run them. Checked on a real pytest run of two slow tests, collected only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL_SLOW = "tests/broker/test_config.py::test_chronoq_serve_exits_2_with_one_line_and_no_traceback"
"""Two parametrized tests, both marked slow."""
HINT = ("no test ran: the 2 tests collected are marked slow, which the default selection (pyproject's addopts: "
        "-m 'not slow and not spark and not interop') leaves out; run them with -m \"\" (as scripts/test.sh, the "
        "CI run, does)")


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_path_whose_tests_are_all_slow_says_how_to_run_them() -> None:
    proc = _pytest(ALL_SLOW)
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout
    assert HINT in proc.stdout, proc.stdout


@pytest.mark.parametrize("args", [("-m", "slow and not slow"), ("-k", "no_such_test")])
def test_no_hint_when_the_selection_was_the_users_own(args: tuple[str, ...]) -> None:
    proc = _pytest(ALL_SLOW.split("::")[0], *args)
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout
    assert "deselected" in proc.stdout and "no test ran" not in proc.stdout, proc.stdout
