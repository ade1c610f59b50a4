#!/usr/bin/env bash
# The servers the scale-out tests start on loopback (tests/scaleout): redis-server and
# PostgreSQL, and docker-compose (tests/deploy validates deploy/compose.yaml with it; no
# Docker daemon is used), from Debian's packages. Installed only when missing, and only as root (CI runs
# as root; elsewhere it says what to install and the tests that need them are skipped).
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 \
    || missing+=(postgresql)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "scale-out tests: install ${missing[*]} (apt-get install ${missing[*]}) to run them" >&2
    exit 0
fi
echo "installing ${missing[*]} for the scale-out tests"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The packages' own services are not wanted: the tests start their servers themselves.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
