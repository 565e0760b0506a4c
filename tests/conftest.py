"""Integration fixtures: a fresh PostgreSQL database, real workers on Redis, the real HTTP API.

The test command (README) provides ``TEST_DATABASE_URL`` and ``REDIS_URL``. Nothing here runs
Celery eagerly: every job goes through the broker to a worker process.
"""

import itertools
import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from django.conf import settings
from django.db import connections

from tests.servers import RedisServer, database_drop, migrated_database, redis_keys_drop
from tests.stack import Stack

TEST_DATABASE_URL = os.environ.get("TEST_DATABASE_URL", "")
REDIS_URL = os.environ.get("REDIS_URL", "")
# The sandbox can't see this; a test checks that it really can't.
WORKER_SECRET = f"s3cret-{uuid.uuid4().hex}"
REDIS_PREFIX = f"ptc-test-{uuid.uuid4().hex[:8]}:"
# This process enqueues and publishes too (tests that call services directly).
os.environ["PTC_REDIS_PREFIX"] = REDIS_PREFIX


def _require_services() -> None:
    if not TEST_DATABASE_URL.startswith("postgres") or not REDIS_URL.startswith("redis"):
        pytest.exit(
            "The tests need PostgreSQL and Redis: run them with `make test`, which finds or starts both, "
            "or set TEST_DATABASE_URL=postgres://... and REDIS_URL=redis://...",
            returncode=2,
        )
    if connections["default"].vendor != "postgresql":  # else the test database would be a SQLite file in the cwd
        pytest.exit("The pytest process needs DATABASE_URL on the same PostgreSQL (make test sets it).", returncode=2)


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker: Any) -> Iterator[str]:
    """Create a uniquely named database, migrate it, and point Django at it; drop it at the end."""
    _require_services()
    name = f"ptc_test_{uuid.uuid4().hex[:10]}"
    admin_url = TEST_DATABASE_URL
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = TEST_DATABASE_URL.rsplit("/", 1)[0]
    db_url = f"{base}/{name}"
    for alias in connections:
        connections[alias].close()
    settings.DATABASES["default"]["NAME"] = name
    settings.PTC_REDIS_PREFIX = REDIS_PREFIX
    connections["default"].settings_dict["NAME"] = name
    from django.core.management import call_command

    with django_db_blocker.unblock():
        call_command("migrate", verbosity=0)
    yield db_url
    with django_db_blocker.unblock():
        for alias in connections:
            connections[alias].close()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    redis_keys_drop(REDIS_URL, REDIS_PREFIX)  # every stack of the run is under it, and stopped by now


@pytest.fixture(scope="session", autouse=True)
def _db_access(django_db_setup: str, django_db_blocker: Any) -> Iterator[None]:
    """Tests read and write the live database the workers use; each test makes its own users."""
    with django_db_blocker.unblock():
        yield


METRICS_TOKEN = f"metrics-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def stack_env(django_db_setup: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS"))}
    env.update(
        DATABASE_URL=django_db_setup,
        CELERY_BROKER_URL=REDIS_URL,
        REDIS_URL=REDIS_URL,
        DJANGO_SETTINGS_MODULE="ptcproject.settings",
        PTC_TEST_WORKER_SECRET=WORKER_SECRET,
        # Short leases so the worker-death test ends in seconds, not minutes.
        PTC_JOB_HEARTBEAT_SECONDS="1",
        PTC_JOB_LEASE_SECONDS="4",
        PTC_REAP_EVERY="1",
        # Retention rounds every second: a zero-retention user's job is purged within the test.
        PTC_RETENTION_EVERY="1",
        # A second tools queue, for the per-toolset routing test (its worker is started by that test).
        PTC_TOOLS_QUEUES="tools,tools.slow",
        # Every process of the stack writes its metrics here; the web's /metrics adds them up.
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path_factory.mktemp("prometheus")),
        PTC_METRICS_TOKEN=METRICS_TOKEN,
        PTC_EVENTS_HEARTBEAT_SECONDS="1",
        # Its own keys and channels on a shared Redis: two test runs never take each other's tasks.
        PTC_REDIS_PREFIX=REDIS_PREFIX,
        PTC_EXEC_CONCURRENCY="6",
        PTC_TOOLS_CONCURRENCY="48",
        # A job's calls pass at most 8 MiB here (64 by default): the test of that bound sends a few.
        PTC_MAX_JOB_TOOL_BYTES=str(8 << 20),
    )
    return env


@pytest.fixture(scope="session")
def stack(stack_env: dict[str, str]) -> Iterator[Stack]:
    running = Stack(stack_env)
    try:
        running.start()
        yield running
    finally:
        running.stop()


@contextmanager
def own_deployment(
    stack_env: dict[str, str], name: str, *, beat: bool = False, exec_worker: bool = True, **env: str
) -> Iterator[Stack]:
    """A deployment of its own, started without beat unless ``beat`` (and without its exec worker
    unless ``exec_worker``): its database (migrated for it; another deployment's reaper, sharing one,
    would fail its calls) and its queues (its own Redis prefix), ``env`` set. Stopped, and its
    database dropped, after."""
    own = {**stack_env, "PTC_REDIS_PREFIX": f"{REDIS_PREFIX}{name}:", **env}
    own["DATABASE_URL"] = migrated_database(TEST_DATABASE_URL, own)
    stack = Stack(own, name=name)
    try:
        stack.start(beat=beat, exec_worker=exec_worker)
        yield stack
    finally:
        stack.stop()
        database_drop(own["DATABASE_URL"])


@pytest.fixture
def redis_stack(stack_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[RedisServer, Stack]]:
    """A stack on a Redis of its own (broker and backplane), which the test may stop, restart or fill
    at will; its database is the suite's. Named after the test's module (its processes' logs)."""
    redis = RedisServer(tmp_path)
    redis.start()
    env = {**stack_env, "CELERY_BROKER_URL": redis.url, "REDIS_URL": redis.url}
    stack = Stack(env, name=request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-"))
    try:
        stack.start(beat=False)
        yield redis, stack
    finally:
        stack.stop()
        redis.stop()


class Api:
    """An HTTP client for one user, against the running web process."""

    def __init__(self, base_url: str, key: str, username: str) -> None:
        self.key = key
        self.username = username
        self.http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=90)

    def run(self, code: str, *, toolsets: list[str] | None = None, wait: float = 60, **body: Any) -> dict[str, Any]:
        """Submit ``code`` and return the finished job (status 201 asserted)."""
        payload = {"code": code, "wait": wait, **body}
        if toolsets is not None:
            payload["toolsets"] = toolsets
        response = self.http.post("/api/v1/exec", json=payload)
        assert response.status_code == 201, response.text
        return response.json()

    def until_printed(self, job_id: str, seconds: float = 15) -> str:
        """Follow the job's events until its first output; return that text."""
        with self.http.stream("GET", f"/api/v1/exec/{job_id}/events", timeout=seconds) as response:
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event in ("stdout", "stderr"):
                    return json.loads(line[6:])["text"]
        raise AssertionError("the job's stream ended before it printed anything")

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, **kwargs)


def calls_most_at_once(calls: list[dict[str, Any]]) -> int:
    """The most of ``calls`` (a job's, as the API gives them) that ran at one moment, by their
    records (started, finished): a count of what overlapped, where the job's time is what the
    machine's load makes it."""
    ends = [(datetime.fromisoformat(c["started_at"]), 1) for c in calls]
    # A finish sorts before a start at the same moment (-1 < 1): calls that only touch did not overlap.
    ends += [(datetime.fromisoformat(c["finished_at"]), -1) for c in calls]
    return max([0, *itertools.accumulate(step for _, step in sorted(ends))])


@pytest.fixture
def make_api(stack: Stack) -> Iterator[Callable[..., Api]]:
    """Make clients, each a new user's; their connections are closed after the test (left to the
    collector, their sockets were closed at any moment of a later test, warning as they went)."""
    from ptcproject.accounts.services import user_with_key_create

    made: list[Api] = []

    def make(staff: bool = False, credits: int = 10_000) -> Api:
        username = f"user-{uuid.uuid4().hex[:8]}"
        _, key = user_with_key_create(username=username, create_user=True, staff=staff, credits=credits)
        made.append(Api(stack.base_url, key, username))
        return made[-1]

    yield make
    for client in made:
        client.http.close()


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api()


@pytest.fixture
def staff(make_api: Callable[..., Api]) -> Iterator[Api]:
    """A staff client; the policy is put back as it was after the test."""
    admin = make_api(staff=True)
    before = admin.get("/api/v1/policy").json()
    before.pop("updated_at")
    yield admin
    restored = admin.http.patch("/api/v1/policy", json=before)
    assert restored.status_code == 200, restored.text
