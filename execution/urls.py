from django.urls import path

from execution import apis

urlpatterns = [
    path("exec", apis.ExecListCreateApi.as_view(), name="exec-list"),
    path("exec/<uuid:job_id>", apis.ExecDetailApi.as_view(), name="exec-detail"),
    path("exec/<uuid:job_id>/cancel", apis.ExecCancelApi.as_view(), name="exec-cancel"),
    path("exec/<uuid:job_id>/events", apis.exec_events_api, name="exec-events"),
    path("exec/<uuid:job_id>/tool-results", apis.ExecToolResultsApi.as_view(), name="exec-tool-results"),
    path("tool-calls", apis.ToolCallListApi.as_view(), name="tool-call-list"),
    path("tool-calls/<str:call_id>/approval", apis.ToolCallApprovalApi.as_view(), name="tool-call-approval"),
    path("tools/execute", apis.ToolExecuteApi.as_view(), name="tool-execute"),
]
