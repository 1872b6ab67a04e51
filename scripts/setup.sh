#!/usr/bin/env bash
# Set up everything chronoq needs on a fresh machine (idempotent): a virtualenv in .venv with
# chronoq and its pinned dependencies. Extra parts install with flags:
#   --test    test tools (pytest, hypothesis, ruff, grimp) and Apache Pulsar's Python client
#   --node    the official Node.js RocketMQ client for the interop tests
#   --spark   PySpark and friends (Java 17 must be present)
#   --peers   the benchmark peers (Redis, RabbitMQ, beanstalkd, NATS)
#   --browser Debian's chromium and chromium-driver, for the web console's browser test
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0 want_node=0 want_spark=0 want_peers=0 want_browser=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --node) want_node=1 ;;
    --spark) want_spark=1 ;;
    --peers) want_peers=1 ;;
    --browser) want_browser=1 ;;
    --all) want_test=1 want_node=1 want_spark=1 want_peers=1 want_browser=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
extras=""
[ "$want_test" = 1 ] && extras="test"
[ "$want_spark" = 1 ] && extras="${extras:+$extras,}spark"
[ "$want_peers" = 1 ] && extras="${extras:+$extras,}bench"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import chronoq, rocksdict, grpc, cronsim" || { echo "setup.sh: chronoq did not install" >&2; exit 1; }
if [ "$want_node" = 1 ] && [ -x scripts/install-node-client.sh ]; then scripts/install-node-client.sh; fi
if [ "$want_spark" = 1 ] && [ -x scripts/install-spark.sh ]; then scripts/install-spark.sh; fi
if [ "$want_peers" = 1 ] && [ -x scripts/install-peers.sh ]; then scripts/install-peers.sh; fi
if [ "$want_browser" = 1 ] && [ -x scripts/install-browser.sh ]; then scripts/install-browser.sh; fi
echo "setup.sh: ready (.venv)"
