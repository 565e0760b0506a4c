"""Liveness and readiness probes, outside the API's auth."""

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """200 when the database and the broker answer; 503 naming the part that does not."""
    failures = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any failure to reach the database makes us unready
        failures["database"] = str(exc)
    try:
        from ptcproject.celery import app

        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:  # any failure to reach the broker makes us unready
        failures["broker"] = str(exc)
    if settings.REDIS_URL:
        try:
            from execution.channels import redis_client

            redis_client().ping()
        except Exception as exc:  # the channel store is needed for every tool result
            failures["redis"] = str(exc)
    if failures:
        return JsonResponse(
            {"error": {"code": "not_ready", "message": f"Not ready: {', '.join(failures)} unreachable.", "details": failures}},
            status=503,
        )
    return JsonResponse({"status": "ready"})
