from django.urls import path, register_converter

from execution import apis


class CallIdConverter:
    """A tool call's id (``ptc_<hex>``, ``standalone_<hex>``): any other text is no call (404),
    never a query (PostgreSQL refuses a NUL in text with an error)."""

    regex = "[A-Za-z0-9_-]{1,80}"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(CallIdConverter, "call_id")

urlpatterns = [
    path("exec", apis.ExecListCreateApi.as_view(), name="exec-list"),
    path("exec/<uuid:job_id>", apis.ExecDetailApi.as_view(), name="exec-detail"),
    path("exec/<uuid:job_id>/cancel", apis.ExecCancelApi.as_view(), name="exec-cancel"),
    path("exec/<uuid:job_id>/events", apis.exec_events_api, name="exec-events"),
    path("exec/<uuid:job_id>/tool-results", apis.ExecToolResultsApi.as_view(), name="exec-tool-results"),
    path("exec/<uuid:job_id>/files/<path:file_path>", apis.ExecFileApi.as_view(), name="exec-file"),
    path("sessions", apis.SessionListCreateApi.as_view(), name="session-list"),
    path("sessions/<uuid:session_id>", apis.SessionDetailApi.as_view(), name="session-detail"),
    path("sessions/<uuid:session_id>/files", apis.SessionFilesApi.as_view(), name="session-files"),
    path("sessions/<uuid:session_id>/files/<path:file_path>", apis.SessionFileApi.as_view(), name="session-file"),
    path("tool-calls", apis.ToolCallListApi.as_view(), name="tool-call-list"),
    path("tool-calls/<call_id:call_id>/approval", apis.ToolCallApprovalApi.as_view(), name="tool-call-approval"),
    path("tools/execute", apis.ToolExecuteApi.as_view(), name="tool-execute"),
]
