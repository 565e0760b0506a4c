from typing import Any

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from execution.models import ExecJob, ToolCall
from ptcproject.errors import ApplicationError
from ptcproject.fields import JsonValueField, NumberField
from ptcproject.storage import MAX_JSON_DEPTH, POSITIVE_INT_MAX, json_depth_exceeds


class ToolCallSerializer(serializers.ModelSerializer):
    toolset = serializers.CharField(source="toolset_key")
    tool = serializers.CharField(source="tool_name")
    input = serializers.JSONField()
    output = serializers.JSONField(allow_null=True)
    error = serializers.JSONField(allow_null=True)
    duration_ms = serializers.FloatField(allow_null=True)

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
        ]


class ErrorSerializer(serializers.Serializer):
    type = serializers.CharField()
    message = serializers.CharField()
    traceback = serializers.CharField(required=False)


class ExecJobSerializer(serializers.ModelSerializer):
    success = serializers.BooleanField(allow_null=True)
    return_value = serializers.JSONField(allow_null=True)
    error = serializers.SerializerMethodField()
    toolsets = serializers.ListField(child=serializers.CharField())
    execution_time_seconds = serializers.FloatField(allow_null=True)
    timeout_limit_seconds = serializers.FloatField(source="timeout_seconds")
    tool_calls = ToolCallSerializer(many=True)
    credits_charged = serializers.SerializerMethodField()

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
            "tool_calls",
            "credits_charged",
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


class ToolExecuteSerializer(serializers.Serializer):
    toolset = serializers.CharField(max_length=64)
    tool = serializers.CharField(max_length=128)
    arguments = JsonValueField(default=dict, help_text=f"The tool's keyword arguments, nested at most {MAX_JSON_DEPTH} levels.")

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


class ExecCreateSerializer(serializers.Serializer):
    # The size limit is checked in the service, which answers 413 rather than a field error.
    code = serializers.CharField(trim_whitespace=False, allow_blank=True)
    toolsets = serializers.ListField(child=serializers.CharField(max_length=64), required=False, allow_null=True)
    timeout = NumberField(required=False, allow_null=True, min_value=0.1)
    wait = NumberField(required=False, default=0, min_value=0, max_value=settings.PTC_MAX_WAIT)
    title = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    max_credits = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=POSITIVE_INT_MAX,
        help_text="The most credits this job's tool calls may cost.",
    )


class ExecListQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=ExecJob.Status.choices, required=False)


class ToolCallListQuerySerializer(serializers.Serializer):
    exec = serializers.UUIDField(required=False)
