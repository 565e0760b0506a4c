"""Input and output shapes of /api/v1/keys (README, "Keys over the API")."""

from rest_framework import serializers

from ptcproject.accounts.models import ApiKey
from ptcproject.fields import KnownKeysOnly


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: never its secret nor its hash."""

    active = serializers.BooleanField(source="is_active", help_text="False once expired or revoked.")

    class Meta:
        model = ApiKey
        fields = ["id", "prefix", "name", "created_at", "expires_at", "last_used_at", "revoked_at", "active"]
        read_only_fields = fields


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="The key itself, `ptc_<prefix>_<secret>`: shown this once, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class ApiKeyCreateSerializer(KnownKeysOnly, serializers.Serializer):
    name = serializers.CharField(max_length=100, required=False, default="", allow_blank=True)
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, default=None, help_text="When it stops working; null: never."
    )


class ApiKeyExpireSerializer(KnownKeysOnly, serializers.Serializer):
    expires_at = serializers.DateTimeField(
        allow_null=True, help_text="When the key stops working: a time in the past (or now) ends it at once; null: never."
    )
