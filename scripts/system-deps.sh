#!/usr/bin/env bash
# Installs the system packages jobtier's local services and tests need, only when missing:
# redis-server and redis-cli (Debian redis-server), PostgreSQL server binaries, Chromium for
# the dashboard test, Prometheus with promtool (Debian prometheus) for deploy/'s tests, and
# Node (Debian nodejs) for the example HTTP worker's test. With --run (`make run`): only
# what `jobtier run` needs, the Redis and Postgres servers.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)

if [ "${1:-}" != "--run" ]; then
  # the dashboard's browser test; fonts-liberation is only a "Recommends" of chromium
  command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-liberation fonts-dejavu-core)
  # deploy/'s rules and dashboard: promtool checks and tests them, a prometheus evaluates them
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
  # the example Node worker (examples/node-worker) that tests/e2e/test_node_worker.py runs
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
fi

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "installing system packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "need root (or sudo) to install: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d keeps Debian from starting system-wide services: jobtier runs its own
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
# the package may have started a system-wide redis on 6379; ours use their own ports
