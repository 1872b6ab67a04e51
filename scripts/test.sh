#!/usr/bin/env bash
# Install everything and run the whole test suite (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --all
.venv/bin/ruff check chronoq tests bench
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
