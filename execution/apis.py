from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any
from uuid import UUID

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DatabaseError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.parsers import MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import ListSerializer
from rest_framework.views import APIView

from execution.events import FOLLOW_RETRY_SECONDS, FollowPlace, db_read, event_stream, follow_admit, job_view, valid_event_id
from execution.models import ExecJob, ExecSession, ToolCall, WorkFile
from execution.selectors import (
    exec_jobs_visible,
    sessions_for,
    sessions_in_state,
    tool_calls_for,
    work_files_of,
)
from execution.serializers import (
    ApprovalSerializer,
    ExecCreateSerializer,
    ExecJobSerializer,
    ExecListQuerySerializer,
    SessionCreateSerializer,
    SessionListQuerySerializer,
    SessionSerializer,
    ToolCallListQuerySerializer,
    ToolCallSerializer,
    ToolExecuteSerializer,
    ToolResultSerializer,
    WorkFileQuerySerializer,
    WorkFileSerializer,
    WorkFileUploadSerializer,
    job_json_parts,
)
from execution.services.calls import tool_call_standalone
from execution.services.jobs import exec_job_cancel_await, exec_job_submit
from execution.services.sessions import (
    exec_session_create,
    exec_session_delete,
    session_file_upload,
    session_file_withdraw,
    work_files_decode,
    work_path_check,
)
from execution.services.waiting import tool_call_decide, tool_results_submit
from ptcproject import rows
from ptcproject.accounts.authentication import JOB_KEY_ELSEWHERE, KEY_REFUSED, request_key, signed_in_user
from ptcproject.accounts.services import api_key_authenticate, still_signed_in
from ptcproject.errors import ApplicationError, error_body
from ptcproject.lists import FilteredListApi, json_streamed

RATE_LIMITED = OpenApiResponse(
    description="rate_limited: past one of your tenant quotas (jobs at once, tool calls in flight, jobs per minute); "
    "nothing was created. Retry after Retry-After seconds; `details` names the quota and its limit."
)


JOB_NOT_RUNNING = OpenApiResponse(
    description="job_ended: with a job-scoped key, the job is no longer running. job_finished: with container_id, "
    "that container's job has ended (cancelled, or closed after PTC_CONTAINER_IDLE_SECONDS without a call)."
)
CALL_LIMITED = OpenApiResponse(
    description="rate_limited: with a user's key (a standalone call, or a managed container's), you have your quota "
    "of tool calls in flight (max_concurrent_tool_calls), or a new container_id's first call finds you with "
    "PTC_MAX_CONTAINERS_PER_USER managed containers' jobs open; `details` names the quota and its limit. parallel_limit: "
    "with a job-scoped key, the job has its parallel cap of calls in flight, its code's and those over HTTP together "
    "(1 when sequential); past max_tool_calls "
    "it is 403 tool_call_limit. Either way nothing was recorded or charged: retry after Retry-After seconds."
)
CALL_UNAVAILABLE = OpenApiResponse(
    description="database_unavailable or broker_unavailable: nothing was done. worker_unavailable: with a job-scoped "
    "key, the job's worker did not answer within PTC_JOB_LEASE_SECONDS whether the call may start; nothing was run. "
    "Either way, retry after Retry-After seconds."
)


class ExecListCreateApi(FilteredListApi):
    serializer_class = ExecJobSerializer
    query_serializer = ExecListQuerySerializer
    chunk_rows = 1  # a job may carry PTC_MAX_JOB_TOOL_BYTES of calls: each is written in parts

    def rows(self) -> QuerySet[ExecJob]:
        return exec_jobs_visible(user=signed_in_user(self.request))

    def rendered(self, rows: list[ExecJob]) -> Iterator[bytes]:
        for job in rows:
            yield b","
            yield from job_json_parts(job)

    def filter_rows(self, rows: QuerySet[ExecJob], query: dict[str, Any]) -> QuerySet[ExecJob]:
        return rows.filter(status=query["status"]) if "status" in query else rows

    @extend_schema(parameters=[ExecListQuerySerializer], responses=ExecJobSerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)

    @extend_schema(
        request=ExecCreateSerializer,
        responses={
            201: ExecJobSerializer,
            404: OpenApiResponse(description="not_found: no such session, or another user's."),
            409: OpenApiResponse(description="session_busy: a job is queued or running in the session."),
            410: OpenApiResponse(description="session_expired or session_lost: the session has ended."),
            429: RATE_LIMITED,
        },
    )
    def post(self, request: Request) -> HttpResponseBase:
        body = ExecCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        user = signed_in_user(request)
        session = get_object_or_404(sessions_for(user=user), pk=data["session"]) if data.get("session") else None
        job, end = exec_job_submit(
            wait=data["wait"],
            session=session,
            files=work_files_decode(files=data["files"]),
            user=user,
            code=data["code"],
            toolsets=data.get("toolsets"),
            timeout=data.get("timeout"),
            title=data["title"],
            max_credits=data.get("max_credits"),
            client_tools=[dict(tool) for tool in data["client_tools"]],
        )
        # What the job ended as comes with its end. Without a wait, the job as created (queued, no
        # calls yet) is the answer; a wait that ended without it (still running, or too large to
        # push) reads the record.
        headers = {"Location": f"/api/v1/exec/{job.pk}"}
        if end is not None and end.job is not None:
            return Response(end.job, status=status.HTTP_201_CREATED, headers=headers)
        if data["wait"] == 0:
            rows.prefetched(job, "tool_calls", [])
            return Response(job_view(job), status=status.HTTP_201_CREATED, headers=headers)
        job = exec_jobs_visible(user=user).get(pk=job.pk)
        return json_streamed(request, job_json_parts(job), status=status.HTTP_201_CREATED, headers=headers)


def _file_response(row: WorkFile) -> HttpResponse:
    response = HttpResponse(bytes(row.content), content_type="application/octet-stream")
    # RFC 6266's filename*= for a name that is not ASCII (Django's header, quoted and escaped).
    response["Content-Disposition"] = content_disposition_header(True, row.path.rsplit("/", 1)[-1])
    return response


_FILE_RESPONSES = {
    (200, "application/octet-stream"): OpenApiTypes.BINARY,
    400: OpenApiResponse(description="invalid_path: the path is not a plain path under /work."),
}


class ExecFileApi(APIView):
    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, job_id: str, file_path: str) -> HttpResponse:
        """Download a file the job's code wrote under /work (a job without a session)."""
        job = get_object_or_404(exec_jobs_visible(user=signed_in_user(request)), pk=job_id)
        work_path_check(file_path)
        return _file_response(get_object_or_404(WorkFile.objects.filter(exec_job=job, kind=WorkFile.Kind.OUTPUT), path=file_path))


class SessionListCreateApi(FilteredListApi):
    serializer_class = SessionSerializer
    query_serializer = SessionListQuerySerializer

    def rows(self) -> QuerySet[ExecSession]:
        return sessions_for(user=signed_in_user(self.request))

    def filter_rows(self, rows: QuerySet[ExecSession], query: dict[str, Any]) -> QuerySet[ExecSession]:
        # As each is shown (SessionSerializer): by its status as of now, not as last recorded.
        return sessions_in_state(rows, query["status"]) if "status" in query else rows

    @extend_schema(parameters=[SessionListQuerySerializer], responses=SessionSerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)

    @extend_schema(
        request=SessionCreateSerializer,
        responses={
            201: SessionSerializer,
            409: OpenApiResponse(description="too_many_sessions: the user has as many active sessions as allowed."),
            429: RATE_LIMITED,
        },
    )
    def post(self, request: Request) -> Response:
        """Start a session: a sandbox kept between jobs (globals, imports and /work persist)."""
        body = SessionCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        session = exec_session_create(
            user=signed_in_user(request),
            toolsets=data.get("toolsets"),
            idle_timeout=data.get("idle_timeout"),
            max_lifetime=data.get("max_lifetime"),
            memory_mb=data["limits"].get("memory_mb"),
        )
        return Response(
            SessionSerializer(session).data,
            status=status.HTTP_201_CREATED,
            headers={"Location": f"/api/v1/sessions/{session.pk}"},
        )


class SessionDetailApi(APIView):
    @extend_schema(responses=SessionSerializer)
    def get(self, request: Request, session_id: str) -> Response:
        session = get_object_or_404(sessions_for(user=signed_in_user(request)), pk=session_id)
        return Response(SessionSerializer(session).data)

    @extend_schema(responses=SessionSerializer)
    def delete(self, request: Request, session_id: str) -> Response:
        """End the session now (its running job is cancelled, its sandbox killed). Idempotent."""
        session = get_object_or_404(sessions_for(user=signed_in_user(request)), pk=session_id)
        return Response(SessionSerializer(exec_session_delete(session=session)).data)


class SessionFilesApi(FilteredListApi):
    serializer_class = WorkFileSerializer
    query_serializer = WorkFileQuerySerializer
    # Uploads only: the one view of this API that takes a body other than JSON.
    parser_classes = [MultiPartParser]

    def rows(self) -> QuerySet[WorkFile]:
        session = get_object_or_404(sessions_for(user=signed_in_user(self.request)), pk=self.kwargs["session_id"])
        return work_files_of(session=session)

    @extend_schema(responses=WorkFileSerializer(many=True))
    def get(self, request: Request, session_id: str) -> Response:
        """The session's files: uploaded (``input``; ``pending`` until its next job) and written by its code."""
        return super().get(request)

    @extend_schema(
        request={"multipart/form-data": WorkFileUploadSerializer},
        responses={
            201: WorkFileSerializer,
            410: OpenApiResponse(description="session_expired or session_lost: the session has ended."),
            413: OpenApiResponse(description="files_too_large or too_many_files: over the session's files quota."),
        },
    )
    def post(self, request: Request, session_id: str) -> Response:
        """Upload a file into the session's /work; its sandbox gets it with the session's next job."""
        session = get_object_or_404(sessions_for(user=signed_in_user(request)), pk=session_id)
        size = int(request.META.get("CONTENT_LENGTH") or 0)
        if size > settings.PTC_FILES_MAX_BYTES + (64 << 10):  # refused before a byte of it is read
            raise ApplicationError(
                "files_too_large",
                f"The upload is {size} bytes; files may be {settings.PTC_FILES_MAX_BYTES} bytes in all.",
                status=413,
                details={"size": size, "limit": settings.PTC_FILES_MAX_BYTES},
            )
        # One of each: the serializer would keep the last and drop the rest.
        for field, parts in (("file", request.FILES), ("path", request.POST)):
            if len(parts.getlist(field)) > 1:
                raise ApplicationError(
                    "validation_error", f"Send one {field} per upload.", details={field: [f"one {field} per upload"]}
                )
        body = WorkFileUploadSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        upload = body.validated_data["file"]
        row = session_file_upload(
            session=session, path=body.validated_data.get("path") or upload.name or "", content=upload.read()
        )
        return Response(WorkFileSerializer(row).data, status=status.HTTP_201_CREATED)


class SessionFileApi(APIView):
    @extend_schema(responses=_FILE_RESPONSES)
    def get(self, request: Request, session_id: str, file_path: str) -> HttpResponse:
        """Download one of the session's files."""
        session = get_object_or_404(sessions_for(user=signed_in_user(request)), pk=session_id)
        work_path_check(file_path)
        return _file_response(get_object_or_404(WorkFile.objects.filter(session=session), path=file_path))

    @extend_schema(
        responses={
            204: None,
            409: OpenApiResponse(description="conflict (in /work already: the code removes it) or session_busy (a job runs)."),
        }
    )
    def delete(self, request: Request, session_id: str, file_path: str) -> Response:
        """Withdraw an upload the session's sandbox has not received yet (one that can't be written to /work)."""
        session = get_object_or_404(sessions_for(user=signed_in_user(request)), pk=session_id)
        session_file_withdraw(session=session, path=work_path_check(file_path))
        return Response(status=204)


# A job's view is sent as it is read, its calls a few at a time (job_json_parts): a job may carry
# PTC_MAX_JOB_TOOL_BYTES of them, which, built whole, took about three times that per request.
class ExecDetailApi(APIView):
    renderer_classes = [JSONRenderer]

    @extend_schema(responses=ExecJobSerializer)
    def get(self, request: Request, job_id: str) -> StreamingHttpResponse:
        job = get_object_or_404(exec_jobs_visible(user=signed_in_user(request)), pk=job_id)
        return json_streamed(request, job_json_parts(job))


class ExecCancelApi(APIView):
    renderer_classes = [JSONRenderer]

    @extend_schema(
        request=None,
        responses={200: ExecJobSerializer, 409: OpenApiResponse(description="job_finished: the job has already finished.")},
        description=(
            "Cancel a queued or running job: its sandbox and every descendant are killed, and its queued tool "
            "calls never run. Answers with the job as its end was announced (as exec_end carries it): calls a "
            "tools worker was already running finish first, and are in it ended and charged. That takes "
            "milliseconds when none is running; past 10 s, the answer is the job as recorded, and exec_end follows."
        ),
    )
    def post(self, request: Request, job_id: str) -> HttpResponseBase:
        job = get_object_or_404(exec_jobs_visible(user=signed_in_user(request)), pk=job_id)
        # The answer is the job as its end announced it: final, the calls it was running ended.
        end = exec_job_cancel_await(job=job)
        if end is not None and end.job is not None:
            return Response(end.job)
        return json_streamed(request, job_json_parts(exec_jobs_visible(user=signed_in_user(request)).get(pk=job.pk)))


# The most results one POST .../tool-results takes: a job has at most this many calls in flight.
MAX_WAITING_RESULTS = 1024


class ExecToolResultsApi(APIView):
    @extend_schema(
        request=ToolResultSerializer(many=True),
        responses={
            200: ToolCallSerializer(many=True),
            404: OpenApiResponse(description="not_found (no such job, or another user's) or call_not_found."),
            409: OpenApiResponse(
                description="call_not_awaiting (not waiting on the client) or result_conflict (answered already); "
                "nothing changed."
            ),
        },
        description=(
            "Answer client tool calls of this job: a list of Anthropic-style tool_result blocks "
            "`[{tool_use_id, content, is_error}]`, each `tool_use_id` the `id` of a `tool_call_pending` event. "
            "All are recorded, or none. Returns the calls as recorded."
        ),
    )
    def post(self, request: Request, job_id: str) -> Response:
        job = get_object_or_404(exec_jobs_visible(user=signed_in_user(request)), pk=job_id)
        # No more results than a job may have calls waiting: MAX_WAITING_RESULTS.
        body: ListSerializer[Any] = ListSerializer(
            child=ToolResultSerializer(), data=request.data, allow_empty=False, max_length=MAX_WAITING_RESULTS
        )
        body.is_valid(raise_exception=True)
        calls = tool_results_submit(job=job, results=[dict(r) for r in body.validated_data])
        return Response(ToolCallSerializer(calls, many=True).data)


class ToolCallApprovalApi(APIView):
    @extend_schema(
        request=ApprovalSerializer,
        responses={
            200: ToolCallSerializer,
            404: OpenApiResponse(description="not_found: no such call, or another user's."),
            409: OpenApiResponse(description="decision_conflict (decided already) or call_not_awaiting; nothing changed."),
        },
        description=(
            "Approve or deny a call that waits for an approval (staff, or the job's owner). Approved, it runs; "
            'denied, the code gets ToolError(code="denied"). Who and when are recorded on the call.'
        ),
    )
    def post(self, request: Request, call_id: str) -> Response:
        call = get_object_or_404(tool_calls_for(user=signed_in_user(request)), call_id=call_id)
        body = ApprovalSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        call = tool_call_decide(
            call=call, actor=signed_in_user(request), approve=body.validated_data["approve"], reason=body.validated_data["reason"]
        )
        return Response(ToolCallSerializer(call).data)


class ToolCallListApi(FilteredListApi):
    serializer_class = ToolCallSerializer
    query_serializer = ToolCallListQuerySerializer
    chunk_rows = 16  # a call's input and output may be PTC_MAX_TOOL_OUTPUT_BYTES each

    def rows(self) -> QuerySet[ToolCall]:
        return tool_calls_for(user=signed_in_user(self.request))

    def filter_rows(self, rows: QuerySet[ToolCall], query: dict[str, Any]) -> QuerySet[ToolCall]:
        if "exec" in query:
            return rows.filter(exec_job_id=query["exec"])
        if signed_in_user(self.request).is_staff:
            # Every user's calls, in the order they were recorded (each is recorded as it starts):
            # started_at has no index of its own (a call writes its row twice, into every index),
            # and ordered by it, each page read and sorted every call of the deployment.
            return rows.order_by("id")
        return rows

    @extend_schema(parameters=[OpenApiParameter("exec", str, description="An exec job's id.")])
    def get(self, request: Request) -> Response:
        return super().get(request)


class ToolExecuteApi(APIView):
    # The one endpoint a job-scoped key may call: a sandbox on another host calls back through it.
    allow_job_keys = True

    @extend_schema(
        request=ToolExecuteSerializer,
        responses={200: ToolCallSerializer, 409: JOB_NOT_RUNNING, 429: CALL_LIMITED, 503: CALL_UNAVAILABLE},
        parameters=[
            OpenApiParameter(
                "x-ptc-call-id",
                str,
                OpenApiParameter.HEADER,
                required=False,
                description="With a job-scoped key: the job's call_id; the call is then recorded under that job. "
                "With a user's key it is refused (403 call_id_mismatch): only a job's own key makes its calls.",
            )
        ],
    )
    def post(self, request: Request) -> Response:
        body = ToolExecuteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        key = request_key(request)
        if data.get("container_id") and key is not None and key.exec_job_id is not None:
            raise ApplicationError(
                "validation_error",
                "A job-scoped key calls for its own job; container_id is for a user's key.",
                details={"container_id": ["not with a job-scoped key"]},
            )
        call = tool_call_standalone(
            user=signed_in_user(request),
            key=key,
            toolset=data["toolset"],
            tool=data["tool"],
            arguments=data["arguments"],
            job_call_id=request.headers.get("x-ptc-call-id", ""),
            container_id=data.get("container_id") or "",
            caller=dict(data["caller"]) if data.get("caller") else None,
        )
        return Response(ToolCallSerializer(call).data)


@db_read
def _authenticate(request: HttpRequest) -> tuple[Any, Any] | JsonResponse:
    """The user of a Bearer key (not a job-scoped one) and the key's id, or of an admin session
    (no key), or the error response that refuses the request, as DRF's views answer it."""
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        key = api_key_authenticate(plaintext=header[7:].strip())
        if key is None:
            return _error(401, "authentication_failed", KEY_REFUSED)
        if key.exec_job_id is not None:
            return _error(403, "permission_denied", JOB_KEY_ELSEWHERE)
        return key.user, key.pk
    user = request.user
    if not user.is_authenticated:
        return _error(401, "not_authenticated", "Send Authorization: Bearer <api key>.")
    return user, None


def _visible(user: Any, job_id: UUID) -> bool:
    return exec_jobs_visible(user=user).filter(pk=job_id).exists()


_job_visible = db_read(_visible)


@db_read
def _still_reading(*, user_id: int, key_id: Any, job_id: UUID) -> bool:
    """Whether a job's stream, let in earlier, would still be: its reader still signed in
    (``still_signed_in``: key not revoked or expired, user not deactivated), and the job still
    theirs to read (staff read every user's: no longer staff, not another's). A database out of
    reach says yes, as ``still_signed_in`` does."""
    if not still_signed_in(user_id=user_id, key_id=key_id):
        return False
    try:
        user = get_user_model().objects.filter(pk=user_id).first()
        return user is not None and _visible(user, job_id)
    except DatabaseError:
        return True


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(error_body(code, message), status=status)


@csrf_exempt  # a Bearer key's request, as DRF's views are; other methods than GET answer 405 below
async def exec_events_api(request: HttpRequest, job_id: UUID) -> HttpResponseBase:
    """GET /api/v1/exec/{id}/events: the job's events as Server-Sent Events, pushed as they happen.

    An async view (not DRF): a slow client holds a coroutine, not a worker thread. ``Last-Event-ID``
    resumes after that event; a client that comes after the end gets the whole history, then the
    stream closes. Documented in the OpenAPI schema by ``ptcproject.api.add_event_stream_path``.
    """
    if request.method != "GET":
        return _error(405, "method_not_allowed", "Use GET.")
    signed_in = await _authenticate(request)
    if isinstance(signed_in, JsonResponse):
        return signed_in
    user, key_id = signed_in
    if not await _job_visible(user, job_id):
        return _error(404, "not_found", f"No such endpoint or object: {request.path}")
    last_event_id = request.headers.get("Last-Event-ID") or request.GET.get("last_event_id")
    if last_event_id is not None and not valid_event_id(last_event_id):
        return _error(
            400,
            "invalid_last_event_id",
            f"Last-Event-ID {last_event_id[:40]!r} is not an event id: send the id: of an event this stream sent, "
            "like 1732312345678-0, or none to start from the beginning.",
        )

    try:
        place = follow_admit(user_id=user.pk)
    except ApplicationError as exc:
        refused = _error(exc.status, exc.code, exc.message)
        refused["Retry-After"] = str(FOLLOW_RETRY_SECONDS)
        return refused

    async def frames(place: FollowPlace) -> AsyncGenerator[str, None]:
        # ``place`` is held by this generator's frame: from now, whether it ever starts, until it ends.
        yield "retry: 1000\n\n"
        async with aclosing(event_stream(job_id=job_id, last_event_id=last_event_id)) as events:
            async for item in events:
                if item is not None:
                    yield item.sse()
                elif await _still_reading(user_id=user.pk, key_id=key_id, job_id=job_id):
                    yield ": heartbeat\n\n"
                else:  # revoked (or no longer staff) since it opened: closed; the reconnect is told why (401, 404)
                    return

    response = StreamingHttpResponse(frames(place), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy must pass frames on, not buffer them
    return response
