from drf_spectacular.utils import extend_schema
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ptcproject.accounts.authentication import signed_in_user
from ptcproject.policy.selectors import policy_get
from ptcproject.policy.serializers import PolicySerializer
from ptcproject.policy.services import policy_update


class PolicyApi(APIView):
    permission_classes = [IsAdminUser]

    @extend_schema(responses=PolicySerializer)
    def get(self, request: Request) -> Response:
        return Response(PolicySerializer(policy_get()).data)

    @extend_schema(request=PolicySerializer, responses=PolicySerializer)
    def patch(self, request: Request) -> Response:
        body = PolicySerializer(policy_get(), data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        policy = policy_update(changed_by=signed_in_user(request), values=dict(body.validated_data))
        return Response(PolicySerializer(policy).data)
