#!/usr/bin/env bash
# Benchmarks against real PostgreSQL and Redis (found, or started for the run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
eval "$(scripts/test-services.sh)"
trap 'scripts/test-services.sh stop' EXIT
export DJANGO_SETTINGS_MODULE=ptcproject.settings DATABASE_URL="$TEST_DATABASE_URL" CELERY_BROKER_URL="$REDIS_URL"
for script in bench/spine.py bench/toolsets.py bench/load.py bench/events.py bench/sessions.py bench/context.py; do
    .venv/bin/python "$script"
done
