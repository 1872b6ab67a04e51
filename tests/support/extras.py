"""What a test needs beyond `scripts/setup.sh --test`, and what happens when it is missing.

Theory of operation: some tests need an optional part that `scripts/setup.sh` installs with a
flag (pyspark and friends: `--spark`; matplotlib, with the benchmark peers: `--peers`; the
Node.js RocketMQ client: `--node`; chromium: `--browser`). `need_module` and `need_command`
return the module or the program's path; when it is missing, the test is skipped with the extra's
name and the command that installs it, so a contributor's plain `pytest` passes without them.
With `CI=true` in the environment the same check fails instead: CI installs everything
(`scripts/test.sh` runs `setup.sh --all`), so a missing part there is a broken setup, not a
reason to run less. Both work at module level too (a module that imports the extra at its top).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

EXTRAS = ("test", "spark", "peers", "node", "browser")
"""The flags of scripts/setup.sh that install optional parts."""


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def missing(extra: str, what: str) -> NoReturn:
    """Skip (fail under `CI=true`) because `what`, which the `extra` flag of setup.sh installs, is missing."""
    __tracebackhide__ = True  # the report names the test module's line, not this one
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; scripts/setup.sh installs {', '.join(EXTRAS)}")
    message = f"needs the {extra} extra: scripts/setup.sh --{extra} ({what})"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need_module(name: str, extra: str) -> ModuleType:
    """Import `name`, which the `extra` flag of setup.sh installs."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as e:
        error = e  # reported below, outside the handler: a skip or failure with no chained traceback
    missing(extra, f"cannot import {name}: {error}")


def need_command(*names: str, extra: str) -> str:
    """The path of the first of `names` on PATH, which the `extra` flag of setup.sh installs."""
    __tracebackhide__ = True
    for name in names:
        if path := shutil.which(name):
            return path
    missing(extra, f"none of {', '.join(names)} on PATH")
