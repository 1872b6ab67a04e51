#!/usr/bin/env bash
# Install everything and run the whole test suite (the command CI runs): fast, slow, spark, interop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --all
.venv/bin/ruff check chronoq tests bench
# -m "not long" undoes pyproject's default selection (fast tests only): CI runs slow, spark and interop
# too, all but the few tests of several minutes each (`scripts/test.sh -m long` runs those).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not long" "$@"
