#!/usr/bin/env bash
# The whole suite against real PostgreSQL and Redis, plus lint and the OpenAPI check.
# Extra arguments go to pytest, e.g. `make test ARGS="-k cancel"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/browser-deps.sh
scripts/outage-deps.sh
scripts/deploy-deps.sh

services=$(scripts/test-services.sh)
eval "$services"
trap 'scripts/test-services.sh stop' EXIT

export DJANGO_SETTINGS_MODULE=ptcproject.settings
# The pytest process itself talks to the same servers as the workers it starts.
export DATABASE_URL="$TEST_DATABASE_URL" CELERY_BROKER_URL="$REDIS_URL"

echo "== ruff"
.venv/bin/ruff check .
echo "== mypy"
.venv/bin/mypy ptcproject tools execution billing
echo "== OpenAPI schema"
.venv/bin/python manage.py spectacular --validate --fail-on-warn --file /dev/null
echo "== pytest"
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" = 5 ]; then
    echo "test: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
