from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from billing.selectors import usage_for
from billing.serializers import BalanceSerializer, CreditsSerializer, LedgerEntrySerializer, UsageQuerySerializer, UsageSerializer
from billing.services import account_get, credits_adjust


class BalanceApi(APIView):
    @extend_schema(responses=BalanceSerializer)
    def get(self, request: Request) -> Response:
        account = account_get(user=request.user)
        body = {
            "balance": account.balance,
            "reserved": account.reserved,
            "plan": account.plan.key if account.plan else None,
            "plan_expires_at": account.plan_expires_at,
        }
        return Response(BalanceSerializer(body).data)


class UsageListApi(generics.ListAPIView):
    serializer_class = UsageSerializer

    def get_queryset(self):  # type: ignore[no-untyped-def]
        query = UsageQuerySerializer(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        rows = usage_for(user=self.request.user)
        if "exec" in query.validated_data:
            rows = rows.filter(exec_job_id=query.validated_data["exec"])
        return rows

    @extend_schema(parameters=[UsageQuerySerializer])
    def get(self, request: Request) -> Response:
        return super().get(request)


class CreditsApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(request=CreditsSerializer, responses={201: LedgerEntrySerializer})
    def post(self, request: Request) -> Response:
        body = CreditsSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = get_user_model().objects.get(username=body.validated_data["username"])
        entry = credits_adjust(
            user=user, amount=body.validated_data["amount"], reason=body.validated_data["reason"], created_by=request.user
        )
        data = {
            "id": entry.pk,
            "kind": entry.kind,
            "delta": entry.delta,
            "reason": entry.reason,
            "balance": entry.account.balance,
            "created_at": entry.created_at,
        }
        return Response(LedgerEntrySerializer(data).data, status=status.HTTP_201_CREATED)
