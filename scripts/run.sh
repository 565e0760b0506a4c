#!/usr/bin/env bash
# The quickstart: install, migrate, start the web process, the exec and tools workers and beat,
# print a demo user's API key, run one demo job with parallel tool calls, and print its result.
#
# With no URLs it runs embedded: SQLite and kombu's filesystem transport under var/ (PTC_DATA_DIR).
# With DATABASE_URL and CELERY_BROKER_URL (or REDIS_URL) it runs on PostgreSQL and Redis.
# PORT (default 8000) is the web port. PTC_QUICKSTART_ONCE=1 stops everything after the demo job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

export DJANGO_SETTINGS_MODULE=ptcproject.settings
data_dir="${PTC_DATA_DIR:-$PWD/var}"
logs="$data_dir/log"
mkdir -p "$logs"
port="${PORT:-8000}"
if ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
    echo "make run: PORT must be a port number (1-65535), not '$port'" >&2
    exit 1
fi
base="http://127.0.0.1:$port"
py=.venv/bin/python

# A port another process holds would leave the web process dead at start, and the wait below
# would wait for it in vain (or find the other process's /healthz).
$py - "$port" <<'PY'
import socket, sys
port = int(sys.argv[1])
with socket.socket() as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))
    except OSError as exc:
        sys.exit(f"make run: port {port} is taken ({exc.strerror}): stop what holds it, or pick another (PORT=8001 make run)")
PY

if [ -z "${DATABASE_URL:-}" ]; then
    echo "== embedded: SQLite at $data_dir/db.sqlite3, filesystem broker at $data_dir/broker"
else
    echo "== database: ${DATABASE_URL%%\?*}"
    # A PostgreSQL database that does not exist yet is created (on a server that answers); any
    # other failure to reach it is one line, not migrate's traceback.
    $py - <<'PY'
import os, sys
import environ, psycopg
from psycopg import sql
# Read as settings.py reads it (django-environ), not handed to libpq whole: its query string may
# hold Django's settings (conn_max_age), which libpq refuses.
config = environ.Env.db_url_config(os.environ["DATABASE_URL"])
if config["ENGINE"] == "django.db.backends.postgresql":
    name = config["NAME"]
    where = {"host": config["HOST"], "port": config["PORT"], "user": config["USER"], "password": config["PASSWORD"]}
    params = {k: v for k, v in where.items() if v not in ("", None)} | config.get("OPTIONS", {}) | {"connect_timeout": 5}
    try:
        psycopg.connect(dbname=name, **params).close()
    except psycopg.Error as exc:
        if f'database "{name}" does not exist' not in str(exc):
            sys.exit(f"make run: cannot reach the database at {config['HOST'] or 'localhost'}:{config['PORT'] or 5432}: {str(exc).strip()}")
        try:
            with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.Error as exc:
            sys.exit(f"make run: the database {name!r} does not exist, and creating it failed: {str(exc).strip()}")
        print(f"== created the database {name!r}")
PY
fi
$py manage.py migrate --no-input -v0

pids=()
started=()  # name:pid of each, for the wait below to say which stopped
stop() {  # TERM, then KILL what is still up after 20 s: nothing outlives the quickstart
    trap - EXIT INT TERM HUP
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 200); do
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true  # theirs, not the watch's sleep (below)
}
trap stop EXIT
trap 'exit 130' INT TERM HUP  # the exit stops them (the EXIT trap), and nothing after it runs

start() {  # name, then the command
    local name=$1; shift
    # Its own session: the terminal's Ctrl-C and hang-up reach this script only, never the workers
    # directly (Celery restarts itself on SIGHUP), and this script stops them in order.
    setsid "$@" >"$logs/$name.log" 2>&1 &
    pids+=($!)
    started+=("$name:$!")
}
start web .venv/bin/uvicorn ptcproject.asgi:application --host 127.0.0.1 --port "$port"
start exec .venv/bin/celery -A ptcproject worker -Q exec -n "exec@%h" -l info
start tools .venv/bin/celery -A ptcproject worker -Q tools -n "tools@%h" -l info
start beat .venv/bin/celery -A ptcproject beat -l info -s "$data_dir/celerybeat-schedule"

$py - "$base" "$logs" "${started[@]}" <<'PY'
import sys, time, pathlib, urllib.request
base, logs = sys.argv[1], pathlib.Path(sys.argv[2])
started = [(name, int(pid)) for name, _, pid in (arg.rpartition(":") for arg in sys.argv[3:])]
deadline = time.monotonic() + 60
def ready() -> bool:
    workers = all(" ready." in (logs / f"{n}.log").read_text(errors="replace") for n in ("exec", "tools"))
    try:
        return workers and urllib.request.urlopen(f"{base}/healthz", timeout=1).status == 200
    except OSError:
        return False
def exited() -> str | None:
    """The first process that has stopped (gone, or a zombie its parent, this script, has not reaped)."""
    for name, pid in started:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            state = "X"
        if state in ("Z", "X"):
            return name
    return None
while not ready():
    dead = exited()
    if dead:
        tail = (logs / f"{dead}.log").read_text(errors="replace").strip().splitlines()[-5:]
        sys.exit(f"make run: the {dead} process stopped as it started; the end of {logs / dead}.log:\n  " + "\n  ".join(tail))
    if time.monotonic() > deadline:
        sys.exit(f"the stack did not start within 60 s; see the logs in {logs}")
    time.sleep(0.2)
PY

key=$($py manage.py create_api_key demo --create-user --credits 1000 | tail -n 1)
echo "== the demo user's API key (shown once):"
echo "$key"
echo "== running a demo job: four catalog searches in parallel, then a sum"
$py - "$base" "$key" <<'PY'
import json, sys, urllib.request
base, key = sys.argv[1], sys.argv[2]
code = '''
from concurrent.futures import ThreadPoolExecutor
from ptc_tools.demo import Demo

categories = ["jewelry", "watches", "accessories", "bags"]
with ThreadPoolExecutor(4) as pool:
    found = dict(zip(categories, pool.map(lambda c: Demo.catalog_search(query="classic", category=c), categories)))
for category, products in found.items():
    print(f"{category:12} {len(products)} products, cheapest {min(p['price'] for p in products)}")
Demo.add(a=sum(len(p) for p in found.values()), b=0)
'''
body = json.dumps({"code": code, "toolsets": ["demo"], "wait": 30, "title": "quickstart"}).encode()
request = urllib.request.Request(f"{base}/api/v1/exec", data=body, method="POST", headers={
    "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
job = json.load(urllib.request.urlopen(request, timeout=60))
print(job["stdout"], end="")
print(f"status: {job['status']}   return value: {job['return_value']}   "
      f"tool calls: {len(job['tool_calls'])}   time: {job['execution_time_seconds']} s")
for call in job["tool_calls"]:
    print(f"  {call['call_id']}  {call['tool']:15} {call['status']:9} {call['duration_ms']} ms")
if job["status"] != "completed":
    sys.exit(f"the demo job did not complete: {job['error']}")
PY

echo
echo "== up: API $base/api/v1/   docs $base/api/docs/   admin $base/admin/   logs $logs"
echo "   try: curl -s -H \"Authorization: Bearer $key\" $base/api/v1/exec | head -c 400"
if [ "${PTC_QUICKSTART_ONCE:-}" = 1 ]; then
    exit 0
fi
echo "   Ctrl-C stops everything."
# Until Ctrl-C, none of them should stop: the first that does stops the rest, saying which.
stopped() {  # say those of them that have stopped; false if none has
    local entry name found=1
    for entry in "${started[@]}"; do
        name=${entry%:*}
        if ! kill -0 "${entry##*:}" 2>/dev/null; then
            echo "make run: the $name process stopped; the end of $logs/$name.log:" >&2
            tail -n 5 "$logs/$name.log" | sed 's/^/  /' >&2 || true
            found=0
        fi
    done
    return $found
}
# wait -n returns when the next of them stops, never for one that stopped before it was called (in
# the demo job's seconds, or between a look and the wait): a sleep beside them bounds each wait.
until stopped; do
    sleep 5 &
    wait -n || true
    kill $! 2>/dev/null || true
done
exit 1
