"""What every endpoint shares: the error shape, pagination, the error responses every operation
documents, and the error type services raise."""

import logging
import unicodedata
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation, TooManyFieldsSent, TooManyFilesSent
from django.db import InterfaceError as DbInterfaceError
from django.db import OperationalError as DbOperationalError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from ptcproject.broker import broker_trouble
from ptcproject.db import database_read_only, statement_cancelled
from ptcproject.errors import ApplicationError, error_body
from ptcproject.paging import EstimatingPaginator

logger = logging.getLogger("ptc.api")


class Pagination(PageNumberPagination):
    """DRF's page numbers, where a page that is not a positive number (``0``, ``-1``, ``abc``) is a
    400 saying so; DRF answers 404 "Invalid page.", as for a page past the last, which exists in form.

    Counted as ptcproject.paging counts: past 10,000 rows, ``count`` is PostgreSQL's estimate (a
    staff member's list of every call of a large deployment was a count of millions of rows, past
    PTC_DB_STATEMENT_TIMEOUT: 503), and ``next`` is there if another page is, whatever the estimate.
    ``page=last`` of such a list is a 400: where its last page is is not known."""

    page_size_query_param = "page_size"
    max_page_size = 500
    django_paginator_class = EstimatingPaginator

    def get_page_number(self, request: Any, paginator: Any) -> Any:
        if request.query_params.get(self.page_query_param) in self.last_page_strings and paginator.estimated:
            raise exceptions.ValidationError(
                {self.page_query_param: "this list is too long to find its last page; follow its next links"}
            )
        return super().get_page_number(request, paginator)

    def paginate_queryset(self, queryset: Any, request: Any, view: Any = None) -> Any:
        page = request.query_params.get(self.page_query_param)
        # Its digits, not int(page) > 0: past 4,300 digits int() raises (a 500); Django's paginator
        # then says "Invalid page." of such a number, as of any page past the last.
        if page and page not in self.last_page_strings and not (page.isdecimal() and any(map(unicodedata.decimal, page))):
            raise exceptions.ValidationError({self.page_query_param: "must be a whole number from 1 (or 'last')"})
        return super().paginate_queryset(queryset, request, view)


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


def first_message(detail: Any) -> str:
    """The first of DRF's error details as one line (``field: message``, ``0: message`` for a list's item)."""
    if isinstance(detail, list) and detail:
        return first_message(detail[0])
    if isinstance(detail, dict) and detail:
        key, value = next(iter(detail.items()))
        text = first_message(value)
        return text if key == "non_field_errors" else f"{key}: {text}"
    return str(detail)


def outage_error(exc: BaseException) -> ApplicationError | None:
    """Return the 503 for an exception that means a server we depend on is unreachable, else None.

    The database (connection refused or dropped, the pool's wait ran out, a statement cancelled) is
    ``database_unavailable``; the broker or Redis is ``broker_unavailable``. Either way nothing was
    half done: say so.
    """
    from kombu.exceptions import OperationalError as BrokerOperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, DbOperationalError | DbInterfaceError):
        if statement_cancelled(exc):
            # Not "nothing was changed": outside a transaction, the request's earlier statements stand.
            message = (
                "The database cancelled the request's statement (a statement or lock timeout, or an operator). "
                "Try again in a few seconds."
            )
        elif database_read_only(exc):
            message = (
                "The database is read-only right now (a failover, or maintenance); nothing was written. "
                "Try again in a few seconds."
            )
        else:
            message = "The database is unreachable right now; nothing was changed. Try again in a few seconds."
        return ApplicationError("database_unavailable", message, status=503)
    if isinstance(exc, BrokerOperationalError | RedisConnectionError | RedisTimeoutError | RedisOutOfMemoryError):
        return ApplicationError(
            "broker_unavailable",
            f"The message broker {broker_trouble(exc)} right now; nothing was queued. Try again in a few seconds.",
            status=503,
        )
    return None


def _retry_after(exc: ApplicationError) -> dict[str, str] | None:
    """Retry-After for a 503 (5 s) or a 429 (the seconds its details give)."""
    if exc.status == 503:
        return {"Retry-After": "5"}
    if exc.status == 429:
        return {"Retry-After": str(int(exc.details.get("retry_after", 1)))}
    return None


def error_response(exc: ApplicationError) -> JsonResponse:
    """The error shape as a plain Django response, for views outside DRF."""
    return JsonResponse(error_body(exc.code, exc.message, exc.details), status=exc.status, headers=_retry_after(exc))


def body_too_large_error() -> ApplicationError:
    """The 413 for a body over DATA_UPLOAD_MAX_MEMORY_SIZE, which Django raises as RequestDataTooBig
    when DRF reads the body (and would render as its HTML 400 page)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return ApplicationError(
        "code_too_large",
        f"The request body is over {limit} bytes, the most this API reads. Send less code or smaller values.",
        status=413,
        details={"limit": limit},
    )


def too_many_parts_error(exc: TooManyFieldsSent | TooManyFilesSent) -> ApplicationError:
    """The 400 for a form body of more parts than Django reads (DATA_UPLOAD_MAX_NUMBER_FILES or
    _FIELDS), which its parser raises as a SuspiciousOperation: past DRF's handler, Django answered
    it with its HTML page."""
    files = isinstance(exc, TooManyFilesSent)
    limit = settings.DATA_UPLOAD_MAX_NUMBER_FILES if files else settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    what = "files" if files else "fields"
    return ApplicationError(
        "validation_error",
        f"The form has more than {limit} {what}; send one file per upload (and at most a path).",
        details={what: [f"more than {limit}"]},
    )


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every API error as ``{"error": {"code", "message", "details"}}`` (API.md)."""
    if isinstance(exc, TooManyFieldsSent | TooManyFilesSent):
        exc = too_many_parts_error(exc)
    exc = outage_error(exc) or (body_too_large_error() if isinstance(exc, RequestDataTooBig) else exc)
    if isinstance(exc, Http404):
        # get_object_or_404's own words name the model ("No WorkFile matches the given query.").
        request = context.get("request")
        exc = object_not_found_error(request.path if request is not None else "")
    if isinstance(exc, ApplicationError):
        body = {"code": exc.code, "message": exc.message, "details": exc.details}
        answer = Response({"error": body}, status=exc.status, headers=_retry_after(exc))
        if exc.status >= 500:
            # A failure we named (a tool server's, an outage): one line with its code, not
            # django.request's ERROR, which is kept for the unexpected ones (with their tracebacks).
            request = context.get("request")
            path = request.path if request is not None else ""
            logger.warning("request failed: %s (%d)", exc.code, exc.status, extra={"path": path})
            answer._has_been_logged = True  # type: ignore[attr-defined]
        return answer
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        body = {
            "code": "validation_error",
            "message": f"Invalid input. {first_message(exc.detail)}",
            "details": exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail},
        }
    else:
        code = _DEFAULT_CODES.get(response.status_code, "error")
        if isinstance(exc, exceptions.APIException) and isinstance(exc.detail, str):
            detail_code = getattr(exc.detail, "code", None)
            if detail_code and detail_code not in ("invalid", "error"):
                code = detail_code
        body = {"code": code, "message": first_message(response.data.get("detail", response.data)), "details": {}}
    response.data = {"error": body}
    return response


def object_not_found_error(path: str) -> ApplicationError:
    """The 404 of a view that found no object (none, or none the caller may see: the same answer)."""
    return ApplicationError("not_found", f"Nothing found at {path}: no such object, or not one this key may see.")


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """404 outside any view: the API's error shape under /api/, Django's page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not_found", f"No such endpoint or object: {request.path}"), status=404)
    return defaults.page_not_found(request, exception)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """400 for a SuspiciousOperation raised outside a view's handler (a bad Host header, a form of
    too many parts read by middleware): the API's error shape under /api/, Django's page elsewhere."""
    if request.path.startswith("/api/"):
        if isinstance(exception, TooManyFieldsSent | TooManyFilesSent):
            refused = too_many_parts_error(exception)
            return JsonResponse(error_body(refused.code, refused.message, refused.details), status=400)
        reason = str(exception).rstrip(".") if isinstance(exception, SuspiciousOperation) else ""
        message = f"The request was refused as malformed: {reason or 'see the API reference'}."
        return JsonResponse(error_body("validation_error", message), status=400)
    return defaults.bad_request(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """500: the API's error shape under /api/; the traceback is in the log, never in the answer."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("internal_error", "The server failed on this request; it is logged."), status=500)
    return defaults.server_error(request)


# The body of every 4xx and 5xx (API.md, "Errors"), as an OpenAPI component.
ERROR_SCHEMA_NAME = "ApiError"
ERROR_SCHEMA = {
    "type": "object",
    "description": 'Every 4xx and 5xx answer: {"error": {"code", "message", "details"}}.',
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Stable and snake_case: what went wrong, for code to act on."},
                "message": {"type": "string", "description": "A sentence for a human: what happened and what to do."},
                "details": {
                    "type": "object",
                    "additionalProperties": {},
                    "description": "For validation_error, each field's errors; otherwise what the code names.",
                },
            },
            "required": ["code", "message", "details"],
        }
    },
    "required": ["error"],
}
ERROR_CONTENT = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}}}

# What each shared status means; an operation's own codes (409 job_finished, 502 from an MCP
# server, ...) are declared on its view with a description, and get the error body here too.
_ERROR_DESCRIPTIONS = {
    "400": "validation_error (field errors in details), parse_error, or the operation's own code.",
    "401": "not_authenticated or authentication_failed: no key, or an unknown, expired or revoked one.",
    "403": "permission_denied (not staff; a job-scoped key outside POST /api/v1/tools/execute) or the operation's own code.",
    "404": "not_found: no such object or page, or another user's.",
    "413": "code_too_large: the body, or the code in it, is over the limit.",
    "415": "unsupported_media_type: the body is not application/json.",
    "503": "database_unavailable or broker_unavailable: nothing was done; retry after Retry-After seconds.",
}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait before retrying."}}
_METHODS = ("get", "put", "post", "patch", "delete")


def _error_statuses(operation: dict[str, Any]) -> list[str]:
    """The shared error statuses ``operation`` can answer (see _ERROR_DESCRIPTIONS)."""
    parameters = operation.get("parameters", [])
    statuses = ["503"]
    if operation.get("requestBody") or any(p["in"] != "path" for p in parameters):
        statuses.append("400")  # a path parameter's own 400s (none is free text) are declared on its view
    if operation.get("security"):
        # DRF authenticates every view: a job-scoped key gets 403 on all but POST /tools/execute.
        statuses += ["401", "403"]
    if any(p["in"] == "path" or p["name"] == "page" for p in parameters):
        statuses.append("404")  # an unknown object, or a page past the end
    if operation.get("requestBody"):
        statuses += ["413", "415"]
    return statuses


def document_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """Give every operation the error responses it can answer, each with the ApiError body: the
    shared ones by what the operation takes (input, auth, a path or page), and its own declared ones."""
    result.setdefault("components", {}).setdefault("schemas", {})[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
    for operations in result.get("paths", {}).values():
        for method in _METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            for status in _error_statuses(operation):
                responses.setdefault(status, {"description": _ERROR_DESCRIPTIONS[status]})
            for status, response in responses.items():
                if status[0] in "45":
                    response.setdefault("content", ERROR_CONTENT)
                    if status in ("429", "503"):
                        response.setdefault("headers", _RETRY_AFTER)
            operation["responses"] = dict(sorted(responses.items()))
    return result


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
                "400": {"description": "invalid_last_event_id: Last-Event-ID is not an event id", "content": ERROR_CONTENT},
                "401": {"description": "No or bad key", "content": ERROR_CONTENT},
                "404": {"description": "No such job, or another user's", "content": ERROR_CONTENT},
                "429": {
                    "description": "throttled: you have PTC_EVENT_STREAMS_PER_USER event streams open; close one",
                    "content": ERROR_CONTENT,
                    "headers": _RETRY_AFTER,
                },
                "503": {"description": _ERROR_DESCRIPTIONS["503"], "content": ERROR_CONTENT, "headers": _RETRY_AFTER},
            },
        }
    }
    return result


class LengthRequiredMiddleware:
    """A body sent chunked, without a Content-Length, is 411 in the API's error shape: Django reads
    a body only as far as its Content-Length, so it would be taken for empty ("code: This field is
    required", "No file was submitted")."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        chunked = "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower()
        if chunked and "CONTENT_LENGTH" not in request.META and request.path.startswith("/api/"):
            return error_response(
                ApplicationError("length_required", "Send the body with a Content-Length: a chunked body is not read.")
            )
        return self.get_response(request)


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
