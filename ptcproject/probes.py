"""Liveness and readiness probes, outside the API's auth."""

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse

from ptcproject.errors import error_body

# A probe answers within this, whatever is down: an orchestrator must not wait on a hung server.
READY_TIMEOUT_SECONDS = 1.5
_checks = ThreadPoolExecutor(max_workers=6, thread_name_prefix="readyz")
# Answered whatever Host they are sent with: nothing they answer is built from it.
ANY_HOST_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class AnyHostMiddleware:
    """The probes and /metrics skip Django's check of the Host header against DJANGO_ALLOWED_HOSTS.

    The kubelet probes a pod at its IP (``Host: 10.1.2.3:8000``), and Prometheus scrapes it so,
    where DJANGO_ALLOWED_HOSTS names the public host: the check answered them 400, the liveness
    probe failed, and every web pod was restarted in a loop. Every other path keeps the check;
    these still go through the whole chain (sessions, auth, outages) after this one.
    """

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path_info in ANY_HOST_PATHS:
            # CommonMiddleware asks get_host(), which raises DisallowedHost; the raw one does not.
            request.get_host = request._get_raw_host  # type: ignore[method-assign,attr-defined]
        return self.get_response(request)


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _database() -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        try:
            connection.close()  # this thread's connection goes back to the pool
        except DatabaseError:
            pass


def _broker() -> None:
    from ptcproject.celery import app

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=READY_TIMEOUT_SECONDS)


def readyz(request: HttpRequest) -> JsonResponse:
    """200 when the database and the broker answer; 503 naming the part that does not, within
    READY_TIMEOUT_SECONDS: the parts are checked side by side, and one that hangs counts as down."""
    from execution.backplane import backplane

    parts: dict[str, Callable[[], None]] = {"database": _database, "broker": _broker}
    if settings.REDIS_URL:
        parts["redis"] = backplane().ping  # the backplane carries every tool result
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    running = {name: _checks.submit(check) for name, check in parts.items()}
    failures = {}
    for name, future in running.items():
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            failures[name] = f"no answer within {READY_TIMEOUT_SECONDS} s"
        except Exception as exc:  # any failure to reach a part makes us unready
            failures[name] = str(exc)
    if failures:
        return JsonResponse(
            error_body("not_ready", f"Not ready: {', '.join(failures)} unreachable.", failures),
            status=503,
        )
    return JsonResponse({"status": "ready"})
