#!/usr/bin/env bash
# Install what the web console's browser test needs: Debian's chromium and its matching
# chromium-driver (apt-get; needs root), and selenium into the project venv. Idempotent, quiet,
# and loud on failure. No browser is downloaded from anywhere but Debian's archive.
#
# Usage: scripts/install-browser.sh            (PYTHON=/path/to/python to use another interpreter)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
log="$(mktemp -t install-browser.XXXXXX.log)"
trap 'rm -f "$log"' EXIT

fail() { echo "install-browser: $1 failed; its output:" >&2; cat "$log" >&2; exit 1; }

DEBS=(chromium chromium-driver)
missing=()
for deb in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "install-browser: need root for apt-get install ${missing[*]}" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >"$log" 2>&1 || fail "apt-get update"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
    || fail "apt-get install ${missing[*]}"
fi
[ -x "$py" ] || { echo "install-browser: no python at $py (create the venv first or set PYTHON)" >&2; exit 1; }
"$py" -m pip install -q --disable-pip-version-check "selenium==4.51.0" >"$log" 2>&1 || fail "pip install selenium"
command -v chromedriver >/dev/null || { echo "install-browser: chromedriver is not on PATH" >&2; exit 1; }
