"""Prometheus metrics (README, "Metrics"), with the official ``prometheus_client``.

Two kinds, kept apart so no tool call pays a round trip for them:

- **Events** (a job ended, a call ended, a sandbox started, an event reached a follower) are counted
  where they happen, in the worker or web process: a histogram observation in memory, nothing more.
  Several processes expose them one of two ways. With ``PROMETHEUS_MULTIPROC_DIR`` (one host: the
  compose file, the test stack) every process writes its values to files there and ``/metrics``
  on the web process adds them up. Without it (one pod per process: Kubernetes) each worker serves
  its own on ``PTC_METRICS_PORT`` for Prometheus to scrape, the usual per-process exposition.
- **Fleet state** (jobs queued and running, calls in flight, queue depths, reservations held, live
  workers per queue) is read when ``/metrics`` is scraped, from PostgreSQL and Redis: one set of
  queries per scrape, whatever the traffic, and right however many processes there are.

Celery's own task events stay on for exec workers (settings), so flower and celery-exporter work
beside these.
"""

import hmac
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, Min, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily, Metric

from ptcproject import queues

logger = logging.getLogger("ptc.metrics")

# -- Events, observed where they happen -----------------------------------------------------------
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # prometheus_client names each process's file by its pid alone; processes of several containers
    # sharing the folder (deploy/compose.yaml) are each pid 1 in their own, and wrote one file over
    # each other's values. The host's name (a container's own) tells them apart, and a container
    # restarted takes up its files again rather than adding new ones at each start (a token of the
    # process's own did, for ever); the pid still changes with a fork, which is how
    # prometheus_client knows a child from its parent.
    _HOST = socket.gethostname()
    values.ValueClass = values.MultiProcessValue(lambda: f"{os.getpid()}-{_HOST}")
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
JOB_DURATION = Histogram(
    "ptc_job_duration_seconds",
    "Wall time of finished jobs, from start in the sandbox to end; once per toolset the job was granted.",
    ["toolset", "status"],
    buckets=_SECONDS,
)
JOBS_FINISHED = Counter("ptc_jobs_finished_total", "Jobs that finished, by status.", ["status"])
TOOL_CALL_DURATION = Histogram(
    "ptc_tool_call_duration_seconds",
    "Tool calls run by a tools worker, from their record to their result (queue wait included).",
    ["toolset", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
SANDBOX_START = Histogram(
    "ptc_sandbox_start_seconds",
    "Time to start a job's sandbox (spawn to ready).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
EVENT_LAG = Histogram(
    "ptc_event_lag_seconds",
    "Delay from a job event's write to the Redis stream to its delivery to a live SSE follower.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def job_finished_observe(*, status: str, toolsets: Iterable[str], seconds: float | None, spawn_ms: float | None) -> None:
    """Count a finished job (in memory; never raises into the job's path)."""
    try:
        JOBS_FINISHED.labels(status).inc()
        if seconds is not None:
            for toolset in list(toolsets) or ["-"]:
                JOB_DURATION.labels(toolset, status).observe(seconds)
        if spawn_ms is not None:
            SANDBOX_START.observe(spawn_ms / 1000)
    except Exception:  # a metric must never fail a job
        logger.warning("could not observe a job's metrics", exc_info=True)


def tool_call_observe(*, toolset: str, ok: bool, seconds: float) -> None:
    try:
        TOOL_CALL_DURATION.labels(toolset, "ok" if ok else "failed").observe(seconds)
    except Exception:  # a metric must never fail a call
        logger.warning("could not observe a call's metrics", exc_info=True)


def event_lag_observe(*, written_ms: int) -> None:
    """Observe the lag of an event written at ``written_ms`` (Redis' clock, ms), delivered now."""
    EVENT_LAG.observe(max(0.0, time.time() - written_ms / 1000))


# -- Live workers per queue ----------------------------------------------------------------------
# Every worker says it is alive on each queue it consumes, every PRESENCE_EVERY seconds: one ZADD
# per queue on its own clock (not per task). A worker silent for PRESENCE_TTL is gone.
PRESENCE_EVERY = 10.0
PRESENCE_TTL = 35.0


def _presence_key(queue: str) -> str:
    return f"{settings.PTC_REDIS_PREFIX}ptc:workers:{queue}"


def worker_presence_beat(*, consumed: list[str], name: str) -> None:
    """Record that worker ``name`` is alive on each queue of ``consumed`` (Redis deployments only)."""
    if not settings.REDIS_URL:
        return
    from execution.backplane import RedisBackplane, backplane

    plane = backplane()
    if not isinstance(plane, RedisBackplane):
        return
    now = time.time()
    pipe = plane.client.pipeline(transaction=False)
    for queue in consumed:
        pipe.zadd(_presence_key(queue), {name: now})
        pipe.zremrangebyscore(_presence_key(queue), 0, now - PRESENCE_TTL)
    pipe.execute()


def worker_presence_leave(*, consumed: list[str], name: str) -> None:
    """Take worker ``name`` off its queues at once when it stops (else it counts for PRESENCE_TTL)."""
    from execution.backplane import RedisBackplane, backplane

    plane = backplane()
    if not isinstance(plane, RedisBackplane):
        return
    try:
        pipe = plane.client.pipeline(transaction=False)
        for queue in consumed:
            pipe.zrem(_presence_key(queue), name)
        pipe.execute()
    except Exception:  # a worker that can't say goodbye is counted until PRESENCE_TTL lapses
        logger.warning("could not take this worker off its queues", exc_info=True)


def worker_metrics_serve() -> None:
    """Serve this worker's own metrics on PTC_METRICS_PORT, when set and not multi-process."""
    port = settings.PTC_METRICS_PORT
    if port and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import start_http_server

        try:
            start_http_server(port)
        except OSError as error:  # a port another process holds: this worker runs on, unscraped
            logger.error(
                "this worker serves no metrics: PTC_METRICS_PORT %s can't be opened (%s); give each worker "
                "on a host its own port, or every process one PROMETHEUS_MULTIPROC_DIR",
                port,
                error.strerror or error,
            )
            return
        logger.info("serving this worker's metrics", extra={"port": port})


# -- Fleet state, read at scrape time --------------------------------------------------------------
def _queue_names() -> list[str]:
    """The queues whose depth and workers are reported: exec, maintenance, PTC_TOOLS_QUEUES, and any other an
    enabled toolset sends its calls to (one dropped from PTC_TOOLS_QUEUES while a toolset still
    names it: its calls wait there, no worker takes them, and PtcNoWorkersOnQueue says so)."""
    from tools.models import Toolset

    names = [queues.EXEC, queues.MAINTENANCE, *queues.tools_queues()]
    try:
        named = set(Toolset.objects.filter(enabled=True).values_list("queue", flat=True).distinct())
    except DatabaseError:  # ptc_fleet_up{source="database"} says so; the configured ones are read
        return names
    return names + sorted(named - set(names) - {""})


class FleetCollector:
    """Reads the fleet's state from PostgreSQL and Redis when /metrics is scraped."""

    def collect(self) -> Iterator[Metric]:
        # Each source is read whole or not at all: an outage gives ptc_fleet_up 0 (alertable), not a
        # failed scrape that hides the process's own metrics too.
        up = GaugeMetricFamily("ptc_fleet_up", "1 if /metrics could read the fleet's state from the source.", labels=["source"])
        # The broker's queues are read on Redis only: the embedded one's (files) are not, and said up.
        sources = [("database", self._database)] + ([("broker", self._broker)] if _broker_is_redis() else [])
        for source, read in sources:
            try:
                metrics = list(read())
            except Exception:  # an unreachable database or Redis, for as long as it lasts
                logger.warning("could not read the fleet's state", extra={"source": source}, exc_info=True)
                up.add_metric([source], 0)
                continue
            up.add_metric([source], 1)
            yield from metrics
        yield up

    def _database(self) -> Iterator[Metric]:
        from billing.models import Reservation
        from execution.models import ExecJob, ToolCall

        # Managed containers' jobs are left out: each stays running while its container calls back
        # (up to PTC_CONTAINER_IDLE_SECONDS after its last call), with no worker; counted, it would
        # set off PtcJobsStuckRunning.
        here = ExecJob.objects.run_here()
        active = (ExecJob.Status.QUEUED, ExecJob.Status.RUNNING)
        jobs = GaugeMetricFamily("ptc_jobs", "Jobs queued or running now, by status.", labels=["status"])
        counts = dict(here.filter(status__in=active).values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
        for status in active:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        oldest = GaugeMetricFamily(
            "ptc_jobs_oldest_age_seconds",
            "Age of the oldest job queued (since created) or running (since started).",
            labels=["status"],
        )
        now = timezone.now()
        first_queued = here.filter(status=ExecJob.Status.QUEUED).aggregate(at=Min("created_at"))["at"]
        first_running = here.filter(status=ExecJob.Status.RUNNING).aggregate(at=Min("started_at"))["at"]
        oldest.add_metric(["queued"], (now - first_queued).total_seconds() if first_queued else 0)
        oldest.add_metric(["running"], (now - first_running).total_seconds() if first_running else 0)
        yield oldest
        calls = GaugeMetricFamily(
            "ptc_tool_calls_in_flight",
            "Tool calls recorded as executing, by toolset (a job's calls are recorded when a tools worker takes them;"
            " those still queued are in ptc_queue_depth).",
            labels=["toolset"],
        )
        executing = ToolCall.objects.filter(status=ToolCall.Status.EXECUTING)
        for toolset, n in executing.values_list("toolset_key").annotate(n=Count("pk")).values_list("toolset_key", "n"):
            calls.add_metric([toolset], n)
        yield calls
        held = Reservation.objects.filter(status=Reservation.Status.HELD).aggregate(n=Count("pk"), credits=Sum("amount"))
        yield GaugeMetricFamily("ptc_reservations_held", "Credit reservations held for calls running now.", value=held["n"])
        yield GaugeMetricFamily(
            "ptc_reservations_held_credits", "Credits held by those reservations.", value=held["credits"] or 0
        )

    def _broker(self) -> Iterator[Metric]:
        from execution.backplane import RedisBackplane, backplane

        plane = backplane()
        assert isinstance(plane, RedisBackplane)  # _broker_is_redis
        names = _queue_names()
        prefix = settings.PTC_REDIS_PREFIX
        # kombu keeps a queue as a Redis list under the key prefix, one list per priority step
        # (0 is the bare name; kombu's separator is "\x06\x16").
        steps = ["", *(f"\x06\x16{step}" for step in (3, 6, 9))]
        pipe = plane.client.pipeline(transaction=False)
        for name in names:
            for step in steps:
                pipe.llen(f"{prefix}{name}{step}")
        now = time.time()
        for name in names:
            pipe.zcount(_presence_key(name), now - PRESENCE_TTL, "+inf")
        replies = pipe.execute()
        depth = GaugeMetricFamily(
            "ptc_queue_depth", "Messages waiting in each Celery queue (not yet taken by a worker).", labels=["queue"]
        )
        workers = GaugeMetricFamily("ptc_queue_workers", "Workers alive on each queue (seen in the last 35 s).", labels=["queue"])
        for i, name in enumerate(names):
            depth.add_metric([name], sum(replies[i * len(steps) : (i + 1) * len(steps)]))
            workers.add_metric([name], replies[len(names) * len(steps) + i])
        yield depth
        yield workers


def _broker_is_redis() -> bool:
    """Whether the broker is Redis, and the backplane too: the queues are read through its client."""
    from execution.backplane import RedisBackplane, backplane

    return settings.CELERY_BROKER_URL.startswith("redis") and isinstance(backplane(), RedisBackplane)


# Its own registry: the fleet's state is read per scrape, never added to the events' registries.
FLEET = CollectorRegistry()
FLEET.register(FleetCollector())


def metrics_text() -> bytes:
    """The exposition of every metric this deployment has: the events of every process
    (PROMETHEUS_MULTIPROC_DIR) or of this one, then the fleet's state. Two exposition blocks of
    distinct metric names, one after the other, are one valid exposition."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        events = CollectorRegistry()  # a fresh one per scrape, as prometheus_client's docs say
        multiprocess.MultiProcessCollector(events)
    else:
        from prometheus_client import REGISTRY as events
    return generate_latest(events) + generate_latest(FLEET)


def _may_read(request: HttpRequest) -> bool:
    """Return True if the request may read /metrics: the PTC_METRICS_TOKEN bearer, a staff API
    key, or a staff session in the admin."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        token = token.strip()
        if settings.PTC_METRICS_TOKEN and hmac.compare_digest(token.encode(), settings.PTC_METRICS_TOKEN.encode()):
            return True
        from ptcproject.accounts.services import api_key_authenticate

        key = api_key_authenticate(plaintext=token)
        return key is not None and key.exec_job_id is None and key.user.is_staff
    user: Any = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: Prometheus' text format, for the token or staff only (401 otherwise)."""
    if not _may_read(request):
        response = HttpResponse("Send Authorization: Bearer <PTC_METRICS_TOKEN or a staff API key>.\n", status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(metrics_text(), content_type=CONTENT_TYPE_LATEST)
