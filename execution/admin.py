import json
from typing import Any

from django.contrib import admin
from django.utils.html import format_html, format_html_join

from execution.models import ExecJob, ToolCall


def _pre(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True)
    return format_html('<pre style="white-space:pre-wrap;max-height:30em;overflow:auto">{}</pre>', text)


class ToolCallInline(admin.TabularInline):
    model = ToolCall
    extra = 0
    can_delete = False
    fields = ("call_id", "toolset_key", "tool_name", "status", "credits", "started_at", "duration")
    readonly_fields = fields
    show_change_link = True

    @admin.display(description="duration (ms)")
    def duration(self, call: ToolCall) -> float | None:
        return call.duration_ms

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(ExecJob)
class ExecJobAdmin(admin.ModelAdmin):
    list_display = ("call_id", "user", "status", "title", "created_at", "execution_time_seconds")
    list_filter = ("status", "created_at", "user")
    search_fields = ("call_id", "id", "title", "user__username")
    date_hierarchy = "created_at"
    inlines = [ToolCallInline]
    fields = (
        "id",
        "call_id",
        "user",
        "status",
        "title",
        "toolsets",
        "sdk_hash",
        "timeout_seconds",
        "created_at",
        "started_at",
        "finished_at",
        "worker",
        "code_pre",
        "stdout_pre",
        "stderr_pre",
        "return_value_pre",
        "error_pre",
        "timings_pre",
        "limits",
    )
    readonly_fields = fields

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    @admin.display(description="code")
    def code_pre(self, job: ExecJob) -> str:
        lines = format_html_join("", "<span>{}</span>", ((line,) for line in job.code.splitlines()))
        return format_html('<div class="ptc-code">{}</div>', lines)

    @admin.display(description="stdout")
    def stdout_pre(self, job: ExecJob) -> str:
        return _pre(job.stdout)

    @admin.display(description="stderr")
    def stderr_pre(self, job: ExecJob) -> str:
        return _pre(job.stderr)

    @admin.display(description="return value")
    def return_value_pre(self, job: ExecJob) -> str:
        return _pre(job.return_value)

    @admin.display(description="error")
    def error_pre(self, job: ExecJob) -> str:
        return _pre(job.error)

    @admin.display(description="timings")
    def timings_pre(self, job: ExecJob) -> str:
        return _pre(job.timings)


@admin.register(ToolCall)
class ToolCallAdmin(admin.ModelAdmin):
    list_display = ("call_id", "type", "toolset_key", "tool_name", "status", "user", "credits", "started_at")
    list_filter = ("status", "type", "toolset_key", "started_at")
    search_fields = ("call_id", "ptc_call_id", "tool_name", "user__username")
    date_hierarchy = "started_at"
    readonly_fields = [f.name for f in ToolCall._meta.fields]

    def has_add_permission(self, request: Any) -> bool:
        return False
