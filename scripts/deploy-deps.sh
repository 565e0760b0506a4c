#!/usr/bin/env bash
# Install what checks deploy/compose.yaml: Debian's docker-compose, whose `config` validates a
# compose file without a Docker daemon. Idempotent: when it is there, it prints nothing.
set -euo pipefail

command -v docker-compose >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "deploy-deps: installing docker-compose with apt (once; no Docker daemon is needed)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >&2
else
    echo "deploy-deps: the compose file's check needs docker-compose. Install it, e.g. 'sudo apt-get install docker-compose'." >&2
    exit 1
fi
