"""Toolsets, their definitions and SDK, and the prompt context (API.md, "Tools" and "The PTC decision")."""

from typing import Any

from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import permissions, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ptcproject.accounts.authentication import signed_in_user
from tools.context import ptc_context
from tools.models import Toolset
from tools.sdk import sdk_cached
from tools.selectors import toolset_listed, toolsets_listed, toolsets_named
from tools.serializers import (
    ContextRequestSerializer,
    ContextSerializer,
    DefinitionsSerializer,
    McpSyncSerializer,
    SdkSerializer,
    ToolsetKeysQuerySerializer,
    ToolsetSerializer,
    ToolsetWriteSerializer,
)
from tools.services import mcp_toolset_sync, toolset_create, toolset_delete, toolset_update

# Each error body is ApiError (ptcproject.api.document_error_responses).
TOOLSET_EXISTS = OpenApiResponse(
    description="toolset_exists: a toolset with that key exists already (a global one, or your own)."
)


class StaffWrites(permissions.BasePermission):
    message = "Only staff may change toolsets; anyone signed in may read them."

    def has_permission(self, request: Request, view: object) -> bool:
        return request.method in permissions.SAFE_METHODS or bool(request.user and request.user.is_staff)


def _toolset_or_404(request: Request, key: str) -> Toolset:
    toolset = toolset_listed(user=signed_in_user(request), key=key)
    if toolset is None:
        raise Http404
    return toolset


def _shown(request: Request, key: str) -> Any:
    """The toolset ``key`` as the API shows it to the request's user."""
    return ToolsetSerializer(_toolset_or_404(request, key), context={"viewer": signed_in_user(request)}).data


class ToolsetListCreateApi(APIView):
    permission_classes = [permissions.IsAuthenticated, StaffWrites]

    @extend_schema(responses=ToolsetSerializer(many=True))
    def get(self, request: Request) -> Response:
        user = signed_in_user(request)
        return Response(ToolsetSerializer(toolsets_listed(user=user), many=True, context={"viewer": user}).data)

    @extend_schema(request=ToolsetWriteSerializer, responses={201: ToolsetSerializer, 409: TOOLSET_EXISTS})
    def post(self, request: Request) -> Response:
        body = ToolsetWriteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        toolset = toolset_create(actor=signed_in_user(request), data=body.validated_data)
        return Response(
            _shown(request, toolset.key),
            status=status.HTTP_201_CREATED,
            headers={"Location": f"/api/v1/toolsets/{toolset.key}"},
        )


class ToolsetDetailApi(APIView):
    permission_classes = [permissions.IsAuthenticated, StaffWrites]

    @extend_schema(responses=ToolsetSerializer)
    def get(self, request: Request, key: str) -> Response:
        return Response(_shown(request, key))

    def _update(self, request: Request, key: str, partial: bool) -> Response:
        toolset = _toolset_or_404(request, key)
        body = ToolsetWriteSerializer(data=request.data, partial=partial)
        body.is_valid(raise_exception=True)
        toolset = toolset_update(toolset=toolset, actor=signed_in_user(request), data=body.validated_data, partial=partial)
        return Response(_shown(request, toolset.key))

    @extend_schema(request=ToolsetWriteSerializer, responses={200: ToolsetSerializer, 409: TOOLSET_EXISTS})
    def put(self, request: Request, key: str) -> Response:
        return self._update(request, key, partial=False)

    @extend_schema(request=ToolsetWriteSerializer, responses={200: ToolsetSerializer, 409: TOOLSET_EXISTS})
    def patch(self, request: Request, key: str) -> Response:
        return self._update(request, key, partial=True)

    @extend_schema(responses={204: OpenApiResponse(description="Deleted.")})
    def delete(self, request: Request, key: str) -> Response:
        toolset_delete(toolset=_toolset_or_404(request, key))
        return Response(status=status.HTTP_204_NO_CONTENT)


class ToolsetSyncApi(APIView):
    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        request=None,
        responses={
            200: McpSyncSerializer,
            400: OpenApiResponse(description="not_mcp: only an mcp toolset is synced."),
            502: OpenApiResponse(description="The MCP server could not be started or listed (mcp_start_failed, ...)."),
        },
    )
    def post(self, request: Request, key: str) -> Response:
        toolset = _toolset_or_404(request, key)
        result = mcp_toolset_sync(toolset=toolset)
        synced = {**result.__dict__, "toolset": _toolset_or_404(request, key)}
        return Response(McpSyncSerializer(synced, context={"viewer": signed_in_user(request)}).data)


class ToolsetDefinitionsApi(APIView):
    @extend_schema(parameters=[ToolsetKeysQuerySerializer], responses=DefinitionsSerializer)
    def get(self, request: Request) -> Response:
        query = ToolsetKeysQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        toolsets = toolsets_named(user=signed_in_user(request), keys=query.keys())
        return Response(DefinitionsSerializer({"toolsets": toolsets}).data)


class SdkApi(APIView):
    @extend_schema(parameters=[ToolsetKeysQuerySerializer], responses=SdkSerializer)
    def get(self, request: Request) -> Response:
        query = ToolsetKeysQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        sdk = sdk_cached(toolsets=toolsets_named(user=signed_in_user(request), keys=query.keys()))
        return Response(SdkSerializer(sdk).data)


class PtcContextApi(APIView):
    @extend_schema(request=ContextRequestSerializer, responses=ContextSerializer)
    def post(self, request: Request) -> Response:
        body = ContextRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        context = ptc_context(
            user=signed_in_user(request),
            keys=data.get("toolsets"),
            title=data["title"],
            fmt=data["format"],
            discovery=data["discovery"],
            client_tools=[dict(tool) for tool in data["client_tools"]],
            code_execution_version=data["code_execution_version"],
        )
        return Response(ContextSerializer(context).data)
