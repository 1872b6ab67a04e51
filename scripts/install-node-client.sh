#!/usr/bin/env bash
# Install the official RocketMQ 5 Node.js client (npm rocketmq-client-nodejs, version pinned in
# tests/interop/node/package.json) into tests/interop/node/node_modules for the interop tests.
# Needs Node >= 18 and npm. Idempotent: a second run only checks.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$here/tests/interop/node"
command -v node >/dev/null || { echo "install-node-client: node is not installed (need Node >= 18)" >&2; exit 1; }
command -v npm >/dev/null || { echo "install-node-client: npm is not installed" >&2; exit 1; }
cd "$dir"
if [ -f node_modules/rocketmq-client-nodejs/package.json ]; then
  echo "rocketmq-client-nodejs already installed in $dir/node_modules"
  exit 0
fi
if [ -f package-lock.json ]; then npm ci --no-audit --no-fund --omit=dev; else npm install --no-audit --no-fund --omit=dev; fi
node -e "require('rocketmq-client-nodejs'); console.log('rocketmq-client-nodejs', require('rocketmq-client-nodejs/package.json').version, 'installed')"
