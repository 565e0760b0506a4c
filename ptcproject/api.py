"""What every endpoint shares: the error shape, pagination and the error type services raise."""

from typing import Any

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


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every API error as ``{"error": {"code", "message", "details"}}`` (API.md)."""
    if isinstance(exc, ApplicationError):
        body = {"code": exc.code, "message": exc.message, "details": exc.details}
        return Response({"error": body}, status=exc.status)
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
                "404": {"description": "No such job, or another user's"},
            },
        }
    }
    return result
