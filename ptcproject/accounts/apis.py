"""A user's own API keys (README, "Keys over the API"). A job-scoped key is refused here by
ApiKeyAuthentication (these views don't set allow_job_keys), and never listed."""

from django.db.models import QuerySet
from django.http import Http404
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ptcproject.accounts.authentication import request_key, signed_in_user
from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.selectors import api_key_listed, api_keys_listed
from ptcproject.accounts.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeyExpireSerializer,
    ApiKeySerializer,
)
from ptcproject.accounts.services import api_key_create, api_key_expire, api_key_revoke
from ptcproject.lists import FilteredListApi

REVOKED_OR_TOO_MANY = OpenApiResponse(
    description="conflict: the key is revoked; its expiry can't change. too_many_keys: the key has expired, and "
    "PTC_MAX_KEYS_PER_USER of the user's keys work: it can't be made to work again until one is revoked."
)
OUTLIVES = OpenApiResponse(
    description="permission_denied: the request's key expires, and the key would work past that (no expiry, or a later one); "
    "or a job-scoped key."
)


def _own_key_or_404(request: Request, key_id: object) -> ApiKey:
    key = api_key_listed(user=signed_in_user(request), key_id=key_id)
    if key is None:
        raise Http404
    return key


class _NoFilters(serializers.Serializer):
    """The list takes only ``page`` and ``page_size`` (the paginator's)."""


class ApiKeyListCreateApi(FilteredListApi):
    serializer_class = ApiKeySerializer
    query_serializer = _NoFilters

    def rows(self) -> QuerySet[ApiKey]:
        return api_keys_listed(user=signed_in_user(self.request))

    @extend_schema(responses=ApiKeySerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)

    @extend_schema(
        request=ApiKeyCreateSerializer,
        responses={
            201: ApiKeyCreatedSerializer,
            403: OUTLIVES,
            409: OpenApiResponse(description="too_many_keys: PTC_MAX_KEYS_PER_USER of the user's keys work; revoke one."),
        },
    )
    def post(self, request: Request) -> Response:
        body = ApiKeyCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = signed_in_user(request)
        key, plaintext = api_key_create(
            user=user, actor=user, source="api", acting_key=request_key(request), bounded=True, **body.validated_data
        )
        key.key = plaintext  # type: ignore[attr-defined]  # for the serializer only; never stored
        return Response(ApiKeyCreatedSerializer(key).data, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(APIView):
    @extend_schema(responses=ApiKeySerializer)
    def get(self, request: Request, key_id: str) -> Response:
        return Response(ApiKeySerializer(_own_key_or_404(request, key_id)).data)

    @extend_schema(request=ApiKeyExpireSerializer, responses={200: ApiKeySerializer, 403: OUTLIVES, 409: REVOKED_OR_TOO_MANY})
    def patch(self, request: Request, key_id: str) -> Response:
        key = _own_key_or_404(request, key_id)
        body = ApiKeyExpireSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key = api_key_expire(
            key=key,
            expires_at=body.validated_data["expires_at"],
            actor=signed_in_user(request),
            source="api",
            acting_key=request_key(request),
            bounded=True,
        )
        return Response(ApiKeySerializer(key).data)


class ApiKeyRevokeApi(APIView):
    @extend_schema(request=None, responses=ApiKeySerializer)
    def post(self, request: Request, key_id: str) -> Response:
        key = api_key_revoke(key=_own_key_or_404(request, key_id), actor=signed_in_user(request), source="api")
        return Response(ApiKeySerializer(key).data)
