from django.urls import path

from execution import apis

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
    path("tool-calls/<slug:call_id>/approval", apis.ToolCallApprovalApi.as_view(), name="tool-call-approval"),
    path("tools/execute", apis.ToolExecuteApi.as_view(), name="tool-execute"),
]
