#!/usr/bin/env bash
# Install what the outage tests need: their own throwaway PostgreSQL and Redis servers, which they
# stop and start at will, and PgBouncer, which they put in front of PostgreSQL (tests/servers.py).
# Idempotent: when all are there, it prints nothing.
set -euo pipefail

need=()
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
command -v redis-server >/dev/null || need+=(redis-server)
[ -x /usr/sbin/pgbouncer ] || command -v pgbouncer >/dev/null || need+=(pgbouncer)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "outage-deps: installing ${need[*]} with apt (once)" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
else
    echo "outage-deps: the outage tests need the server binaries of: ${need[*]}." \
        "Install them, e.g. 'sudo apt-get install ${need[*]}'." >&2
    exit 1
fi
