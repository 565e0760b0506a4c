from django.urls import path

from tools import apis

urlpatterns = [
    path("toolsets", apis.ToolsetListCreateApi.as_view(), name="toolset-list"),
    # Before <key>: "export-definitions" is not a toolset key (keys are identifiers, so no clash).
    path("toolsets/export-definitions", apis.ToolsetDefinitionsApi.as_view(), name="toolset-definitions"),
    path("toolsets/<str:key>", apis.ToolsetDetailApi.as_view(), name="toolset-detail"),
    path("toolsets/<str:key>/sync", apis.ToolsetSyncApi.as_view(), name="toolset-sync"),
    path("sdk", apis.SdkApi.as_view(), name="sdk"),
    path("ptc/context", apis.PtcContextApi.as_view(), name="ptc-context"),
]
