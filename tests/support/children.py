"""Child Python processes that run test code: the crash, power-loss and real-time drivers.

Theory of operation: a driver is a module of this package tree (`tests.e2e.crash_driver`), run
as `python -m` with this checkout first on `PYTHONPATH`, so the child imports the same `chronoq`
and the same `tests.support` as the test that started it, installed or not and whatever the
working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository checkout these tests belong to."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment with this checkout first on `PYTHONPATH`, plus `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def module_argv(module: str, *args: object) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]
