#!/usr/bin/env bash
# scripts/test-services.sh -- make sure a real PostgreSQL and Redis are
# available for the test suite and print `export` lines for the caller.
#
# Usage:
#   eval "$(scripts/test-services.sh)"   # find or start services, export URLs
#   ...run the tests...
#   scripts/test-services.sh stop        # stop throwaway servers (no-op if none)
#
# Stdout carries ONLY `export NAME='value'` lines; all diagnostics go to
# stderr. On failure nothing is exported and the exit status is non-zero.
#
# Exported variables:
#   TEST_DATABASE_URL       postgres://USER@HOST:PORT/postgres -- a server-level
#                           URL; the test suite creates its own database on it
#   REDIS_URL               redis://HOST:PORT/0
#   PTC_TEST_SERVICES_DIR   temp dir of throwaway servers  } only when this
#   PTC_TEST_SERVICES_PIDS  their PIDs, space separated    } script started any
#
# Resolution order (PostgreSQL and Redis independently):
#   1. TEST_DATABASE_URL / REDIS_URL already set: must be reachable, used as is
#      (an unreachable one is an error, not silently replaced)
#   2. a server on 127.0.0.1:5432 (user postgres, trust auth) / 127.0.0.1:6379
#   3. installed binaries: a throwaway server on a free 127.0.0.1 port with its
#      data in a temp dir (PostgreSQL: newest /usr/lib/postgresql/*/bin; when
#      run as root the servers run as the unprivileged user `nobody`)
#   4. root on Debian: apt-get install postgresql / redis-server, then step 3
#   5. otherwise: exit non-zero naming the Debian packages to install
#
# Testing-only overrides -- the "default" port probed in step 2:
#   PTC_TEST_PG_PORT_DEFAULT     (default 5432)
#   PTC_TEST_REDIS_PORT_DEFAULT  (default 6379)
# Point them at unused ports to force the throwaway path, e.g.
#   PTC_TEST_PG_PORT_DEFAULT=59999 PTC_TEST_REDIS_PORT_DEFAULT=59998 \
#       scripts/test-services.sh

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # shellcheck disable=SC2016  # the $(...) is meant literally
    echo 'test-services.sh: run it, do not source it: eval "$(scripts/test-services.sh)"' >&2
    return 1
fi

set -euo pipefail

readonly PG_PORT_DEFAULT="${PTC_TEST_PG_PORT_DEFAULT:-5432}"
readonly REDIS_PORT_DEFAULT="${PTC_TEST_REDIS_PORT_DEFAULT:-6379}"
readonly READY_TIMEOUT=30        # seconds to wait for a server to come up
readonly CONNECT_TIMEOUT=5       # seconds for a single reachability probe
readonly TMP_PREFIX=ptc-test-services
readonly FALLBACK_USER=ptc-test  # created only if `nobody` does not exist

# State of this run.
SERVICES_DIR=""   # temp dir for throwaway servers, created lazily
STARTED_PIDS=""   # PIDs of throwaway servers
MISSING_PKGS=""   # Debian packages needed but unavailable
APT_UPDATED=0
SVC_USER=""       # unprivileged user for servers when running as root
PG_URL=""
REDIS_URL_OUT=""

# ---------------------------------------------------------------- helpers

log() { printf 'test-services: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }
is_root() { [[ "$(id -u)" -eq 0 ]]; }

# Single-quote a value for the shell: it's -> 'it'\''s'
shell_quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# Print one export line on the real stdout (fd 3, see main_start).
emit() { printf 'export %s=%s\n' "$1" "$(shell_quote "$2")" >&3; }

# tcp_open HOST PORT -- does anything accept TCP connections there?
tcp_open() {
    have python3 || { log "python3 not found; cannot probe $1:$2"; return 1; }
    python3 -c 'import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()' \
        "$1" "$2" "$CONNECT_TIMEOUT" 2>/dev/null
}

# url_tcp_open URL DEFAULT_PORT -- TCP probe of the host:port in a URL.
url_tcp_open() {
    local hostport
    have python3 || { log "python3 not found; cannot probe URL"; return 1; }
    hostport=$(python3 -c 'import sys, urllib.parse as p
u = p.urlsplit(sys.argv[1]); print(u.hostname or "localhost", u.port or sys.argv[2])' \
        "$1" "$2") || return 1
    tcp_open "${hostport% *}" "${hostport#* }"
}

free_port() {
    have python3 || die "python3 is needed to pick a free port"
    python3 -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# pid_alive PID -- running and not a zombie (works for other users' PIDs).
pid_alive() {
    local stat
    stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ -n "$stat" && "$stat" != Z* ]]
}

# wait_for SECONDS CMD... -- retry CMD every 0.2s until it succeeds.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

# run_as USER CMD... -- run CMD as USER (empty: as ourselves). The daemons
# must not inherit fd 3 (the caller's $(...) pipe) or the caller would hang.
run_as() {
    local user=$1
    shift
    if [[ -z "$user" || "$user" == "$(id -un)" ]]; then
        (cd / && "$@") 3>&-
    elif have runuser; then
        (cd / && runuser -u "$user" -- "$@") 3>&-
    else
        (cd / && su -s /bin/bash "$user" -c "$(printf '%q ' "$@")") 3>&-
    fi
}

# When root, servers run as `nobody` (or a system user we create).
pick_svc_user() {
    is_root || return 0
    [[ -z "$SVC_USER" ]] || return 0
    if id nobody >/dev/null 2>&1; then
        SVC_USER=nobody
    else
        id "$FALLBACK_USER" >/dev/null 2>&1 ||
            useradd --system --no-create-home --shell /usr/sbin/nologin "$FALLBACK_USER"
        SVC_USER=$FALLBACK_USER
    fi
}

ensure_services_dir() {
    [[ -z "$SERVICES_DIR" ]] || return 0
    local base=${TMPDIR:-/tmp}
    pick_svc_user
    if is_root; then
        base=/tmp   # $TMPDIR may not be traversable by $SVC_USER
    fi
    SERVICES_DIR=$(mktemp -d "$base/$TMP_PREFIX.XXXXXX")
    if is_root; then chown "$SVC_USER:" "$SERVICES_DIR"; fi
}

# apt_install PKG -- only as root on Debian; returns 1 if not possible.
apt_install() {
    if ! is_root || [[ ! -f /etc/debian_version ]] || ! have apt-get; then
        return 1
    fi
    log "installing Debian package $1 with apt-get..."
    if ((APT_UPDATED == 0)); then
        apt-get update -qq >&2 || { log "apt-get update failed"; return 1; }
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" </dev/null >&2 ||
        { log "apt-get install $1 failed"; return 1; }
}

# ------------------------------------------------------------- PostgreSQL

pg_url_reachable() {
    if have pg_isready; then
        pg_isready -q -t "$CONNECT_TIMEOUT" -d "$1"
    else
        url_tcp_open "$1" 5432
    fi
}

# pg_trust_ok URL -- can we run a query there without a password?
pg_trust_ok() {
    if have psql; then
        PGCONNECT_TIMEOUT=$CONNECT_TIMEOUT psql -X -w -Atc 'select 1' "$1" >/dev/null 2>&1
    else
        url_tcp_open "$1" 5432
    fi
}

# Newest directory holding both initdb and pg_ctl.
find_pg_bindir() {
    local dir best=""
    while IFS= read -r dir; do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then best=$dir; fi
    done < <(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V)
    if [[ -z "$best" ]] && have initdb && have pg_ctl; then
        best=$(dirname "$(readlink -f "$(command -v initdb)")")
    fi
    [[ -n "$best" ]] && printf '%s\n' "$best"
}

pg_write_conf() {  # DATADIR PORT
    cat >>"$1/postgresql.conf" <<EOF

# --- throwaway test cluster (scripts/test-services.sh)
listen_addresses = '127.0.0.1'
port = $2
unix_socket_directories = '$SERVICES_DIR'
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
}

pg_ready() {  # BINDIR PORT
    local isready=$1/pg_isready
    [[ -x "$isready" ]] || isready=$(command -v pg_isready) || {
        tcp_open 127.0.0.1 "$2"
        return
    }
    "$isready" -q -h 127.0.0.1 -p "$2" -U postgres -d postgres
}

start_pg() {  # BINDIR
    local bindir=$1 port datadir started=$SECONDS
    ensure_services_dir
    port=$(free_port)
    datadir=$SERVICES_DIR/pg
    log "PostgreSQL: starting throwaway cluster ($bindir) on 127.0.0.1:$port in $SERVICES_DIR"
    printf '%s\n' "$bindir" >"$SERVICES_DIR/pg_bindir"
    run_as "$SVC_USER" "$bindir/initdb" -D "$datadir" -U postgres -A trust \
        -E UTF8 --locale=C -N >&2 || die "initdb failed"
    pg_write_conf "$datadir" "$port"
    if ! run_as "$SVC_USER" "$bindir/pg_ctl" -D "$datadir" -l "$SERVICES_DIR/pg.log" \
        -w -t "$READY_TIMEOUT" start >&2; then
        tail -n 20 "$SERVICES_DIR/pg.log" >&2 || true
        die "PostgreSQL did not start"
    fi
    STARTED_PIDS+=" $(head -n 1 "$datadir/postmaster.pid")"
    wait_for "$READY_TIMEOUT" pg_ready "$bindir" "$port" ||
        die "PostgreSQL on port $port not ready after ${READY_TIMEOUT}s"
    log "PostgreSQL: ready after $((SECONDS - started))s"
    PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
}

resolve_pg() {
    local url="postgres://postgres@127.0.0.1:$PG_PORT_DEFAULT/postgres" bindir
    if [[ -n "${TEST_DATABASE_URL:-}" ]]; then
        pg_url_reachable "$TEST_DATABASE_URL" ||
            die "TEST_DATABASE_URL is set but its server is not reachable (unset it to let this script provide one)"
        log "PostgreSQL: using TEST_DATABASE_URL from the environment"
        PG_URL=$TEST_DATABASE_URL
        return 0
    fi
    if pg_trust_ok "$url"; then
        log "PostgreSQL: using the server on 127.0.0.1:$PG_PORT_DEFAULT"
        PG_URL=$url
        return 0
    fi
    if bindir=$(find_pg_bindir) ||
        { apt_install postgresql && bindir=$(find_pg_bindir); }; then
        start_pg "$bindir"
    else
        MISSING_PKGS+=" postgresql"
    fi
}

# ------------------------------------------------------------------ Redis

redis_url_reachable() {
    if have redis-cli; then
        [[ "$(timeout "$CONNECT_TIMEOUT" redis-cli --no-auth-warning -u "$1" ping 2>/dev/null)" == PONG ]]
    else
        url_tcp_open "$1" 6379
    fi
}

redis_ready() { redis_url_reachable "redis://127.0.0.1:$1/0"; }  # PORT

start_redis() {  # REDIS_SERVER_PATH
    local server=$1 port started=$SECONDS
    ensure_services_dir
    port=$(free_port)
    log "Redis: starting throwaway server on 127.0.0.1:$port in $SERVICES_DIR"
    printf '%s\n' "$port" >"$SERVICES_DIR/redis.port"
    run_as "$SVC_USER" "$server" --port "$port" --bind 127.0.0.1 --save '' \
        --appendonly no --daemonize yes --dir "$SERVICES_DIR" \
        --pidfile "$SERVICES_DIR/redis.pid" --logfile "$SERVICES_DIR/redis.log" \
        </dev/null >&2 || die "redis-server failed to start"
    if ! wait_for "$READY_TIMEOUT" test -s "$SERVICES_DIR/redis.pid"; then
        tail -n 20 "$SERVICES_DIR/redis.log" >&2 || true
        die "Redis wrote no pidfile within ${READY_TIMEOUT}s"
    fi
    STARTED_PIDS+=" $(cat "$SERVICES_DIR/redis.pid")"
    wait_for "$READY_TIMEOUT" redis_ready "$port" ||
        die "Redis on port $port not answering PING after ${READY_TIMEOUT}s"
    log "Redis: ready after $((SECONDS - started))s"
    REDIS_URL_OUT="redis://127.0.0.1:$port/0"
}

resolve_redis() {
    local url="redis://127.0.0.1:$REDIS_PORT_DEFAULT/0" server
    if [[ -n "${REDIS_URL:-}" ]]; then
        redis_url_reachable "$REDIS_URL" ||
            die "REDIS_URL is set but its server is not reachable (unset it to let this script provide one)"
        log "Redis: using REDIS_URL from the environment"
        REDIS_URL_OUT=$REDIS_URL
        return 0
    fi
    if redis_url_reachable "$url"; then
        log "Redis: using the server on 127.0.0.1:$REDIS_PORT_DEFAULT"
        REDIS_URL_OUT=$url
        return 0
    fi
    if server=$(command -v redis-server) ||
        { apt_install redis-server && server=$(command -v redis-server); }; then
        start_redis "$server"
    else
        MISSING_PKGS+=" redis-server"
    fi
}

# ------------------------------------------------------------------- stop

stop_pg_in() {  # DIR
    local dir=$1 bindir owner=""
    [[ -f "$dir/pg/postmaster.pid" ]] || return 0
    bindir=$(cat "$dir/pg_bindir" 2>/dev/null) || bindir=$(find_pg_bindir) || return 0
    if is_root; then owner=$(stat -c %U "$dir/pg"); fi
    log "stopping throwaway PostgreSQL in $dir"
    run_as "$owner" "$bindir/pg_ctl" -D "$dir/pg" stop -m fast -w -t "$READY_TIMEOUT" >&2 ||
        log "warning: pg_ctl stop failed"
}

stop_redis_in() {  # DIR
    local dir=$1 port pid
    port=$(cat "$dir/redis.port" 2>/dev/null) || return 0
    log "stopping throwaway Redis on port $port"
    if have redis-cli &&
        timeout "$CONNECT_TIMEOUT" redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1; then
        return 0
    fi
    pid=$(cat "$dir/redis.pid" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || true
}

# Give our servers a moment to exit, then kill what is left -- but only
# processes whose working directory is inside our temp dir (postgres runs in
# its data dir, redis in --dir), so a stale or reused PID is never touched.
is_our_server() {  # PID DIR
    local cwd dir
    if [[ -z "$2" ]] || ! pid_alive "$1"; then return 1; fi
    dir=$(readlink -f "$2") || return 1
    cwd=$(readlink "/proc/$1/cwd" 2>/dev/null) || return 1
    [[ "$cwd" == "$dir" || "$cwd" == "$dir"/* ]]
}

all_gone() { local pid; for pid in "$@"; do pid_alive "$pid" && return 1; done; return 0; }

reap_pids() {  # "PID..." DIR
    local pid pids ours=()
    read -ra pids <<<"$1"
    for pid in "${pids[@]}"; do
        if is_our_server "$pid" "$2"; then ours+=("$pid"); fi
    done
    ((${#ours[@]})) || return 0
    wait_for 10 all_gone "${ours[@]}" && return 0
    log "still running after stop: ${ours[*]}; sending SIGTERM"
    kill -TERM "${ours[@]}" 2>/dev/null || true
    wait_for 5 all_gone "${ours[@]}" && return 0
    log "sending SIGKILL to ${ours[*]}"
    kill -KILL "${ours[@]}" 2>/dev/null || true
}

remove_services_dir() {  # DIR
    local dir=$1
    [[ -n "$dir" && -d "$dir" ]] || return 0
    case $(basename "$dir") in
        "$TMP_PREFIX".*) rm -rf -- "$dir" ;;
        *) log "warning: not removing $dir (not one of ours)" ;;
    esac
}

stop_services() {  # DIR "PIDS"
    if [[ -n "$1" && -d "$1" ]]; then
        stop_pg_in "$1"
        stop_redis_in "$1"
    fi
    reap_pids "$2" "$1"
    remove_services_dir "$1"
}

# ------------------------------------------------------------------- main

fail_missing() {
    local pkgs=${MISSING_PKGS# } sudo="sudo "
    if is_root; then sudo=""; fi
    log "error: cannot provide a test server for:$MISSING_PKGS"
    log "  install the Debian packages:  ${sudo}apt-get install $pkgs"
    log "  (or set TEST_DATABASE_URL / REDIS_URL to servers you already have)"
    exit 1
}

on_exit() {
    local rc=$?
    if ((rc != 0)) && [[ -n "$SERVICES_DIR" ]]; then
        log "cleaning up throwaway servers after failure"
        stop_services "$SERVICES_DIR" "$STARTED_PIDS" || true
    fi
    exit "$rc"
}

main_start() {
    exec 3>&1 1>&2   # fd 3 = real stdout, reserved for export lines
    trap on_exit EXIT
    trap 'exit 130' INT TERM HUP   # run the EXIT cleanup on interruption too
    resolve_pg
    resolve_redis
    [[ -z "$MISSING_PKGS" ]] || fail_missing
    emit TEST_DATABASE_URL "$PG_URL"
    emit REDIS_URL "$REDIS_URL_OUT"
    if [[ -n "$SERVICES_DIR" ]]; then
        emit PTC_TEST_SERVICES_DIR "$SERVICES_DIR"
        emit PTC_TEST_SERVICES_PIDS "${STARTED_PIDS# }"
    fi
}

main_stop() {
    local dir=${PTC_TEST_SERVICES_DIR:-} pids=${PTC_TEST_SERVICES_PIDS:-}
    if [[ -z "$dir" && -z "$pids" ]]; then
        log "stop: nothing was started; nothing to do"
        return 0
    fi
    stop_services "$dir" "$pids"
    log "stop: done"
}

case "${1:-start}" in
    start) main_start ;;
    stop) main_stop ;;
    *) die "usage: eval \"\$($0)\"  |  $0 stop" ;;
esac
