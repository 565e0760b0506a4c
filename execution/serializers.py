from collections.abc import Iterator
from typing import Any

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from execution.models import ExecJob, ExecSession, ToolCall, WorkFile
from ptcproject import rows
from ptcproject.errors import ApplicationError
from ptcproject.fields import JsonValueField, KnownKeysOnly, NamesField, NumberField, TextField
from ptcproject.storage import MAX_JSON_DEPTH, POSITIVE_INT_MAX, json_depth_exceeds
from tools.serializers import ClientToolSerializer


class ToolCallSerializer(serializers.ModelSerializer):
    toolset = serializers.CharField(source="toolset_key")
    tool = serializers.CharField(source="tool_name")
    input = serializers.JSONField()
    output = serializers.JSONField(allow_null=True)
    error = serializers.JSONField(allow_null=True)
    duration_ms = serializers.FloatField(allow_null=True)
    caller = serializers.JSONField(
        allow_null=True, help_text="Who called it from code, as POST /tools/execute said: {type, tool_id}."
    )
    decided_by: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="username", read_only=True, allow_null=True, help_text="Who approved or denied the call."
    )

    class Meta:
        model = ToolCall
        fields = [
            "call_id",
            "type",
            "ptc_call_id",
            "toolset",
            "tool",
            "input",
            "output",
            "error",
            "status",
            "credits",
            "started_at",
            "finished_at",
            "duration_ms",
            "decision",
            "decided_by",
            "decided_at",
            "decision_reason",
            "caller",
        ]


class ErrorSerializer(serializers.Serializer):
    type = serializers.CharField()
    message = serializers.CharField()
    traceback = serializers.CharField(required=False)


class OutputFileSerializer(serializers.Serializer):
    path = serializers.CharField()
    size = serializers.IntegerField()


class ExecJobSerializer(serializers.ModelSerializer):
    success = serializers.BooleanField(allow_null=True)
    return_value = serializers.JSONField(allow_null=True)
    error = serializers.SerializerMethodField()
    toolsets = serializers.ListField(child=serializers.CharField())
    execution_time_seconds = serializers.FloatField(allow_null=True)
    timeout_limit_seconds = serializers.FloatField(source="timeout_seconds")
    tool_calls = ToolCallSerializer(many=True)
    client_tools = serializers.ListField(child=serializers.DictField(), help_text="The tools this job's caller runs.")
    credits_charged = serializers.SerializerMethodField()
    session = serializers.UUIDField(source="session_id", allow_null=True, help_text="The session it ran in, if any.")
    output_files = OutputFileSerializer(
        many=True,
        help_text="Files under /work the code wrote or changed: the session's files, or this job's "
        "(GET /api/v1/exec/{id}/files/{path}).",
    )
    output_files_omitted = serializers.ListField(
        child=serializers.CharField(), help_text="Files the code wrote that were not kept: over the files quota."
    )

    class Meta:
        model = ExecJob
        fields = [
            "id",
            "call_id",
            "status",
            "success",
            "title",
            "toolsets",
            "code",
            "stdout",
            "stderr",
            "stdout_truncated",
            "stderr_truncated",
            "return_value",
            "error",
            "execution_time_seconds",
            "timeout_limit_seconds",
            "sequential",
            "max_credits",
            "client_tools",
            "container_id",
            "tool_calls",
            "credits_charged",
            "session",
            "output_files",
            "output_files_omitted",
            "sdk_hash",
            "created_at",
            "started_at",
            "finished_at",
        ]

    @extend_schema_field(ErrorSerializer(allow_null=True))
    def get_error(self, job: ExecJob) -> dict[str, Any] | None:
        return job.error

    def get_credits_charged(self, job: ExecJob) -> int:
        return sum(call.credits for call in job.tool_calls.all())


# A job's calls read and written at a time when its view is sent in parts: up to 16 of
# PTC_MAX_TOOL_OUTPUT_BYTES each way, where the whole job may carry PTC_MAX_JOB_TOOL_BYTES.
CALLS_PER_PART = 16


def job_json_parts(job: ExecJob) -> Iterator[bytes]:
    """``job`` in JSON as ExecJobSerializer writes it, in parts: its calls read and written
    CALLS_PER_PART at a time (in start order, as listed), then the fields after them, its
    ``credits_charged`` the sum of the calls written. ``job`` comes without its calls."""
    calls = ToolCall.objects.filter(exec_job=job).order_by("started_at", "id")
    ids = list(calls.values_list("pk", flat=True))
    rows.prefetched(job, "tool_calls", [])
    data = ExecJobSerializer(job).data
    names = list(data)
    at = names.index("tool_calls")
    yield JSONRenderer().render({name: data[name] for name in names[:at]})[:-1] + b',"tool_calls":['
    credits, first = 0, True
    for start in range(0, len(ids), CALLS_PER_PART):
        chunk = ids[start : start + CALLS_PER_PART]
        found = {call.pk: call for call in calls.filter(pk__in=chunk).select_related("decided_by")}
        part = [found[pk] for pk in chunk if pk in found]  # one purged since is left out
        credits += sum(call.credits for call in part)
        for item in ToolCallSerializer(part, many=True).data:
            yield (b"" if first else b",") + JSONRenderer().render(item)
            first = False
    after = {name: data[name] for name in names[at + 1 :]} | {"credits_charged": credits}
    yield b"]," + JSONRenderer().render(after)[1:]


class CallerSerializer(serializers.Serializer):
    type = serializers.RegexField(
        r"^[A-Za-z0-9_.-]+$", max_length=64, help_text="The code-execution tool that called, e.g. a provider's dated type."
    )
    tool_id = serializers.RegexField(
        r"^[A-Za-z0-9_-]+$", max_length=200, help_text="The id of the code-execution tool use that made the call."
    )


class ToolExecuteSerializer(KnownKeysOnly, serializers.Serializer):
    toolset = serializers.CharField(max_length=64)
    tool = serializers.CharField(max_length=128)
    arguments = JsonValueField(default=dict, help_text=f"The tool's keyword arguments, nested at most {MAX_JSON_DEPTH} levels.")
    caller = CallerSerializer(
        required=False, allow_null=True, default=None, help_text="The code that called, as the provider said."
    )
    container_id = serializers.RegexField(
        r"^[A-Za-z0-9_.-]+$",
        max_length=200,
        required=False,
        help_text="A provider's code-execution container: the call is recorded as ptc under that container's job.",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("container_id") and attrs.get("caller") is None:
            raise serializers.ValidationError({"caller": ["A call from a container says its caller: {type, tool_id}."]})
        return attrs

    def to_internal_value(self, data: Any) -> Any:
        # Before any field walks them, and as the code a failed call's arguments get: nothing is recorded.
        arguments = data.get("arguments") if isinstance(data, dict) else None
        if json_depth_exceeds(arguments):
            raise ApplicationError(
                "invalid_arguments",
                f"The arguments nest deeper than {MAX_JSON_DEPTH} levels; send a flatter value.",
                details={"limit": MAX_JSON_DEPTH},
            )
        return super().to_internal_value(data)


class ExecCreateSerializer(KnownKeysOnly, serializers.Serializer):
    # The size limit is checked in the service, which answers 413 rather than a field error.
    code = TextField(trim_whitespace=False, allow_blank=True)
    toolsets = NamesField(max_name=64, required=False, allow_null=True)
    timeout = NumberField(required=False, allow_null=True, min_value=ExecJob.MIN_TIMEOUT)
    wait = NumberField(required=False, default=0, min_value=0, max_value=settings.PTC_MAX_WAIT)
    title = TextField(required=False, allow_blank=True, default="", max_length=500)
    max_credits = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=POSITIVE_INT_MAX,
        help_text="The most credits this job's tool calls may cost.",
    )
    client_tools = ClientToolSerializer(
        many=True,
        required=False,
        default=list,
        help_text="Tools the caller runs: `from ptc_tools.client import Client`. A call waits for POST /exec/{id}/tool-results.",
    )

    session = serializers.UUIDField(
        required=False, allow_null=True, help_text="Run in this session's sandbox (its toolsets; `toolsets` is ignored)."
    )
    files = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        required=False,
        default=dict,
        help_text="Files to write under /work before the code runs: {path: base64}. The body's size limit holds.",
    )


class ExecListQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=ExecJob.Status.choices, required=False)


class ToolCallListQuerySerializer(serializers.Serializer):
    exec = serializers.UUIDField(required=False)


class ToolResultSerializer(serializers.Serializer):
    """One client tool's result, as an Anthropic ``tool_result`` block (``type`` may be left out)."""

    type = serializers.ChoiceField(choices=["tool_result"], required=False, help_text="Ignored: tool_result.")
    tool_use_id = serializers.CharField(max_length=80, help_text="The id of the tool_call_pending event: the call's call_id.")
    content = JsonValueField(
        required=False,
        allow_null=True,
        default=None,
        help_text="The result: any JSON value; a list of text blocks [{type: text, text}] reaches the code as their text.",
    )
    is_error = serializers.BooleanField(
        required=False, default=False, help_text="True: the call fails client_error with content as its message."
    )


class ApprovalSerializer(KnownKeysOnly, serializers.Serializer):
    approve = serializers.BooleanField(help_text="True runs the call; false fails it with code denied.")
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)


class SessionLimitsSerializer(KnownKeysOnly, serializers.Serializer):
    memory_mb = serializers.IntegerField(
        required=False, min_value=16, max_value=POSITIVE_INT_MAX, help_text="At most the policy's memory limit."
    )


class SessionCreateSerializer(KnownKeysOnly, serializers.Serializer):
    toolsets = NamesField(max_name=64, required=False, allow_null=True)
    limits = SessionLimitsSerializer(required=False, default=dict)
    idle_timeout = NumberField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=settings.PTC_SESSION_MAX_IDLE_TIMEOUT,
        help_text=f"Seconds without a job before it expires (default {settings.PTC_SESSION_IDLE_TIMEOUT:g}).",
    )
    max_lifetime = NumberField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=settings.PTC_SESSION_MAX_MAX_LIFETIME,
        help_text=f"Seconds from its creation until it expires, used or not (default {settings.PTC_SESSION_MAX_LIFETIME:g}).",
    )


class SessionSerializer(serializers.ModelSerializer):
    # As of now (to_representation): a session past its time is expired, though the reaper has not recorded it yet.
    toolsets = serializers.ListField(child=serializers.CharField())
    limits = serializers.JSONField()
    idle_timeout = serializers.FloatField(source="idle_timeout_seconds")
    max_lifetime = serializers.FloatField(source="max_lifetime_seconds")
    current_job = serializers.UUIDField(source="current_job_id", allow_null=True)

    class Meta:
        model = ExecSession
        fields = [
            "id",
            "status",
            "end_reason",
            "toolsets",
            "limits",
            "idle_timeout",
            "max_lifetime",
            "current_job",
            "jobs_run",
            "created_at",
            "last_used_at",
            "expires_at",
            "max_expires_at",
            "ended_at",
        ]

    def to_representation(self, session: ExecSession) -> dict[str, Any]:
        data = super().to_representation(session)
        data["status"], data["end_reason"] = session.state()  # one reading of the clock for both
        return data


class SessionListQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=ExecSession.Status.choices, required=False)


class WorkFileSerializer(serializers.ModelSerializer):
    # A plain string (not an enum): "kind" names another choice set in this API already.
    kind = serializers.CharField(help_text="input (uploaded) or output (written by the code).")

    class Meta:
        model = WorkFile
        fields = ["path", "size", "kind", "pending", "updated_at"]


class WorkFileUploadSerializer(KnownKeysOnly, serializers.Serializer):
    # A browser's form signed in to the admin sends its CSRF token as a field.
    also_known = frozenset({"csrfmiddlewaretoken"})
    file = serializers.FileField(allow_empty_file=True)
    path = serializers.CharField(required=False, max_length=1024, help_text="Where under /work (default: the file's name).")


class WorkFileQuerySerializer(serializers.Serializer):
    pass
