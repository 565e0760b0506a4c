from django.contrib.auth import get_user_model
from rest_framework import serializers

from billing.models import CreditUsage
from ptcproject.fields import KeyUuidField, KnownKeysOnly
from ptcproject.storage import BIGINT_MAX


class BalanceSerializer(serializers.Serializer):
    balance = serializers.IntegerField()
    reserved = serializers.IntegerField()
    plan = serializers.CharField(allow_null=True)
    plan_expires_at = serializers.DateTimeField(allow_null=True)


class UsageSerializer(serializers.ModelSerializer):
    exec_id = serializers.UUIDField(source="exec_job_id", allow_null=True)
    tool_call_meta = serializers.JSONField()

    class Meta:
        model = CreditUsage
        fields = ["id", "exec_id", "tool_call_id", "usage_type", "tool_call_meta", "amount", "due_amount", "created_at"]


class UsageQuerySerializer(serializers.Serializer):
    exec = serializers.UUIDField(required=False)


class CreditsSerializer(KnownKeysOnly, serializers.Serializer):
    username = serializers.CharField(max_length=150)
    # Within the balance column's range; credits_adjust also refuses one that would take the balance out of it.
    amount = serializers.IntegerField(min_value=-BIGINT_MAX, max_value=BIGINT_MAX)
    reason = serializers.CharField(max_length=300)
    idempotency_key = KeyUuidField(
        required=False,
        help_text="A UUID (a string) of the client's, new for each grant and sent again with each retry of it: a "
        "repeat grants nothing and is answered as the first post was (201, the entry and the balance it "
        "left then). Sent with another username, amount or reason, it is 409 conflict, nothing changed.",
    )

    def validate_username(self, value: str) -> str:
        if not get_user_model().objects.filter(username=value).exists():
            raise serializers.ValidationError(f"There is no user '{value}'.")
        return value

    def validate_amount(self, value: int) -> int:
        if value == 0:
            raise serializers.ValidationError("The amount must not be 0.")
        return value


class LedgerEntrySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.CharField()
    delta = serializers.IntegerField()
    reason = serializers.CharField()
    balance = serializers.IntegerField()
    created_at = serializers.DateTimeField()
