#!/usr/bin/env bash
# Install chronoq and run the main job: a broker on the embedded default data directory and a
# short demo that sends normal and timer messages and prints each as it arrives, with how late.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/chronoq demo "$@"
