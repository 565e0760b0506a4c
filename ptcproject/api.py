"""What every endpoint shares: the error shape, pagination and the error type services raise."""

from typing import Any

from django.db import InterfaceError as DbInterfaceError
from django.db import OperationalError as DbOperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from ptcproject.errors import ApplicationError


class Pagination(PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 500


_DEFAULT_CODES = {
    400: "validation_error",
    401: "not_authenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    429: "throttled",
}


def _first_message(detail: Any) -> str:
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    if isinstance(detail, dict) and detail:
        key, value = next(iter(detail.items()))
        text = _first_message(value)
        return text if key == "non_field_errors" else f"{key}: {text}"
    return str(detail)


def outage_error(exc: BaseException) -> ApplicationError | None:
    """Return the 503 for an exception that means a server we depend on is unreachable, else None.

    The database (connection refused or dropped, the pool's wait ran out) is ``database_unavailable``;
    the broker or Redis is ``broker_unavailable``. Either way nothing was half done: say so.
    """
    from kombu.exceptions import OperationalError as BrokerOperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, DbOperationalError | DbInterfaceError):
        return ApplicationError(
            "database_unavailable",
            "The database is unreachable right now; nothing was changed. Try again in a few seconds.",
            status=503,
        )
    if isinstance(exc, BrokerOperationalError | RedisConnectionError | RedisTimeoutError):
        return ApplicationError(
            "broker_unavailable",
            "The message broker is unreachable right now; nothing was queued. Try again in a few seconds.",
            status=503,
        )
    return None


def error_response(exc: ApplicationError) -> JsonResponse:
    """The error shape as a plain Django response, for views outside DRF."""
    body = {"code": exc.code, "message": exc.message, "details": exc.details}
    return JsonResponse({"error": body}, status=exc.status, headers={"Retry-After": "5"} if exc.status == 503 else None)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every API error as ``{"error": {"code", "message", "details"}}`` (API.md)."""
    exc = outage_error(exc) or exc
    if isinstance(exc, ApplicationError):
        body = {"code": exc.code, "message": exc.message, "details": exc.details}
        headers = {"Retry-After": "5"} if exc.status == 503 else None
        return Response({"error": body}, status=exc.status, headers=headers)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        body = {
            "code": "validation_error",
            "message": f"Invalid input. {_first_message(exc.detail)}",
            "details": exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail},
        }
    else:
        code = _DEFAULT_CODES.get(response.status_code, "error")
        if isinstance(exc, exceptions.APIException) and isinstance(exc.detail, str):
            detail_code = getattr(exc.detail, "code", None)
            if detail_code and detail_code not in ("invalid", "error"):
                code = detail_code
        body = {"code": code, "message": _first_message(response.data.get("detail", response.data)), "details": {}}
    response.data = {"error": body}
    return response


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404 outside any view: the API's error shape under /api/, Django's page elsewhere."""
    if request.path.startswith("/api/"):
        body = {"code": "not_found", "message": f"No such endpoint or object: {request.path}", "details": {}}
        return JsonResponse({"error": body}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """500: the API's error shape under /api/; the traceback is in the log, never in the answer."""
    if request.path.startswith("/api/"):
        body = {"code": "internal_error", "message": "The server failed on this request; it is logged.", "details": {}}
        return JsonResponse({"error": body}, status=500)
    return defaults.server_error(request)


def add_event_stream_path(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """Document GET /api/v1/exec/{id}/events, an async Django view that DRF's schema can't see."""
    result.setdefault("paths", {})["/api/v1/exec/{job_id}/events"] = {
        "get": {
            "operationId": "exec_events",
            "summary": "The job's events as Server-Sent Events",
            "description": (
                "Events exec_start, stdout, stderr, tool_call_start, tool_call_end, tool_call_error and exec_end, "
                "each with an increasing id. Send Last-Event-ID to resume. Closes after exec_end."
            ),
            "tags": ["exec"],
            "parameters": [
                {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}},
                {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"}},
            ],
            "security": [{"ApiKeyAuth": []}],
            "responses": {
                "200": {"description": "An event stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                "400": {"description": "invalid_last_event_id: Last-Event-ID is not an event id"},
                "401": {"description": "No or bad key"},
                "404": {"description": "No such job, or another user's"},
            },
        }
    }
    return result


class OutageMiddleware:
    """A view outside DRF (SSE, probes, admin) that hits an unreachable database or broker answers
    503 in the API's error shape under /api/, rather than a 500 page."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        error = outage_error(exception)
        if error is None or not request.path.startswith("/api/"):
            return None
        return error_response(error)
