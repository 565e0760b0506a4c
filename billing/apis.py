from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.models import CreditUsage
from billing.selectors import usage_for
from billing.serializers import BalanceSerializer, CreditsSerializer, LedgerEntrySerializer, UsageQuerySerializer, UsageSerializer
from billing.services import account_get, credits_adjust, credits_adjust_once
from ptcproject.accounts.authentication import signed_in_user
from ptcproject.lists import FilteredListApi


class BalanceApi(APIView):
    @extend_schema(responses=BalanceSerializer)
    def get(self, request: Request) -> Response:
        account = account_get(user=signed_in_user(request))
        body = {
            "balance": account.balance,
            "reserved": account.reserved,
            "plan": account.plan.key if account.plan else None,
            "plan_expires_at": account.plan_expires_at,
        }
        return Response(BalanceSerializer(body).data)


class UsageListApi(FilteredListApi):
    serializer_class = UsageSerializer
    query_serializer = UsageQuerySerializer

    def rows(self) -> QuerySet[CreditUsage]:
        return usage_for(user=signed_in_user(self.request))

    def filter_rows(self, rows: QuerySet[CreditUsage], query: dict[str, Any]) -> QuerySet[CreditUsage]:
        return rows.filter(exec_job_id=query["exec"]) if "exec" in query else rows

    @extend_schema(parameters=[UsageQuerySerializer])
    def get(self, request: Request) -> Response:
        return super().get(request)


class CreditsApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(
        request=CreditsSerializer,
        responses={
            201: LedgerEntrySerializer,
            409: OpenApiResponse(description="conflict: the idempotency_key was used for a different grant; nothing changed."),
        },
    )
    def post(self, request: Request) -> Response:
        body = CreditsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = get_user_model().objects.get(username=body.validated_data["username"])
        grant = {"user": user, "amount": body.validated_data["amount"], "reason": body.validated_data["reason"]}
        key = body.validated_data.get("idempotency_key")
        if key is None:
            entry = credits_adjust(**grant, created_by=signed_in_user(request))
        else:
            # A repeat is answered as the first post was: same status, same entry, the balance it left.
            entry = credits_adjust_once(**grant, created_by=signed_in_user(request), idempotency_key=key)
        data = {
            "id": entry.pk,
            "kind": entry.kind,
            "delta": entry.delta,
            "reason": entry.reason,
            # Entries made before balance_after was kept (an admin form's, reused as a key) have none.
            "balance": entry.balance_after if entry.balance_after is not None else entry.account.balance,
            "created_at": entry.created_at,
        }
        return Response(LedgerEntrySerializer(data).data, status=status.HTTP_201_CREATED)
