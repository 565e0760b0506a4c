"""The reaper's scans that run every round (PTC_REAP_EVERY), over tables of every job ever run:
each reads the few rows it is after, by an index, not the ended jobs (millions on a deployment
that has run a while). Asserted on the rows each plan read as run (EXPLAIN ANALYZE), not on time.

JOBS ended and closed jobs, half of them a managed container's, stand for millions."""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from execution.models import ExecSession
from execution.services.jobs import _exec_jobs_close_left
from execution.services.sessions import _session_jobs_fail_queued
from tests.factories import running_job
from tests.test_admin import _rows_read

JOBS = 200_000


@pytest.fixture(scope="module")
def ended_jobs() -> Iterator[Any]:
    """A user with JOBS jobs ended a day ago and closed, every other one a managed container's and
    every other one in a session that ended; the rows gone after."""
    user = get_user_model().objects.create_user(username=f"ended-{uuid.uuid4().hex[:6]}")
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 0")
        cursor.execute(
            """
            INSERT INTO execution_execsession (id, user_id, status, end_reason, toolsets, limits, idle_timeout_seconds,
                                               max_lifetime_seconds, worker, jobs_run, created_at, last_used_at,
                                               expires_at, max_expires_at, ended_at)
            SELECT md5(%(user)s || '-' || g)::uuid, %(user)s, 'expired', 'idle', '[]', '{}', 60, 60, 'w', 1, day, day,
                   day, day, day
            FROM generate_series(1, %(jobs)s / 2) g, (SELECT now() - interval '1 day' AS day) d
            """,
            {"user": user.pk, "jobs": JOBS},
        )
        cursor.execute(
            """
            INSERT INTO execution_execjob (id, call_id, user_id, status, title, code, toolsets, sdk_hash, timeout_seconds,
                                           limits, sequential, client_tools, container_id, http_tool_bytes,
                                           http_admit_epoch, output_files, output_files_omitted, stdout, stderr,
                                           stdout_truncated, stderr_truncated, timings, worker, created_at, started_at,
                                           heartbeat_at, finished_at, closed_at, session_id)
            SELECT gen_random_uuid(), 'exec_' || md5(random()::text || g), %(user)s, 'completed', '', '', '[]', '', 30,
                   '{}', false, '[]', CASE WHEN g %% 2 = 0 THEN 'container_' || g ELSE '' END, 0, 0, '[]', '[]', '', '',
                   false, false, '{}', 'w', day, day, day, day, day,
                   CASE WHEN g %% 2 = 1 THEN md5(%(user)s || '-' || (g + 1) / 2)::uuid END
            FROM generate_series(1, %(jobs)s) g, (SELECT now() - interval '1 day' AS day) d
            """,
            {"user": user.pk, "jobs": JOBS},
        )
        cursor.execute("ANALYZE execution_execjob")
        cursor.execute("ANALYZE execution_execsession")
        cursor.execute("RESET statement_timeout")
    try:
        yield user
    finally:
        with connection.cursor() as cursor:  # not Django's delete, which names each row in a statement
            cursor.execute("DELETE FROM execution_execjob WHERE user_id = %s", [user.pk])
            cursor.execute("DELETE FROM execution_execsession WHERE user_id = %s", [user.pk])


def _reads(run: Any, table: str) -> int:
    """How many rows of ``table`` the SELECTs ``run`` makes of it read, each run again as it was."""
    with CaptureQueriesContext(connection) as queries:
        run()
    scans = [
        query["sql"] for query in queries.captured_queries if query["sql"].startswith("SELECT") and f'"{table}"' in query["sql"]
    ]
    assert scans
    return sum(_rows_read(sql, table) for sql in scans)


def test_the_reapers_scan_for_ended_jobs_left_unclosed_reads_those_jobs_not_every_ended_one(ended_jobs: Any) -> None:
    """_exec_jobs_close_left finds the ended jobs no one closed. Its branch for a managed
    container's job did not say the job had ended (its status did, which the partial index of
    ended, unclosed jobs does not name), so each round read every container's job ever run."""
    now = timezone.now()
    left = running_job(
        user=ended_jobs, status="cancelled", container_id=f"left-{uuid.uuid4().hex[:6]}", finished_at=now, closed_at=None
    )
    read = _reads(_exec_jobs_close_left, "execution_execjob")
    assert read <= 10, read  # before: the table, by a scan of it
    left.refresh_from_db()
    assert left.closed_at is not None  # and it still finds what it is after


def test_the_reapers_scan_for_jobs_queued_in_ended_sessions_reads_the_queued_jobs(ended_jobs: Any) -> None:
    """_session_jobs_fail_queued finds the jobs still queued in a session that ended: by the few
    queued jobs, not the ended sessions or their jobs."""
    session = ExecSession.objects.filter(user=ended_jobs).first()
    assert session is not None
    queued = running_job(user=ended_jobs, status="queued", session=session)
    assert _reads(_session_jobs_fail_queued, "execution_execjob") <= 10
    assert _reads(_session_jobs_fail_queued, "execution_execsession") <= 10
    queued.refresh_from_db()
    assert queued.status == "failed"
