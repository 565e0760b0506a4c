from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework import serializers

from ptcproject.fields import KnownKeysOnly, NamesField
from ptcproject.policy.models import Policy
from ptcproject.policy.seed import BOUNDS
from tools.models import Toolset


class DebugField(serializers.ChoiceField):
    """``""``, ``opt-in`` or ``opt-out``; the legacy ``true`` means ``opt-in``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=["", "opt-in", "opt-out"], **kwargs)

    def to_internal_value(self, data: Any) -> str:
        if data is True or data == "true":
            return "opt-in"
        if data is False:
            return ""
        return super().to_internal_value(data)


def _bounded(name: str) -> serializers.IntegerField:
    low, high = BOUNDS[name]
    return serializers.IntegerField(min_value=low, max_value=high, required=False)


class PolicySerializer(KnownKeysOnly, serializers.ModelSerializer):
    user_allowlist = NamesField(max_name=150, required=False)
    toolset_allowlist = NamesField(max_name=64, required=False)
    toolset_blocklist = NamesField(max_name=64, required=False)
    direct_only_tools = NamesField(max_name=128, required=False)
    rollout_percent = _bounded("rollout_percent")
    debug = DebugField(required=False, allow_blank=True)
    default_timeout = serializers.IntegerField(min_value=1, max_value=settings.PTC_TIMEOUT_CEILING, required=False)
    max_timeout = serializers.IntegerField(min_value=1, max_value=settings.PTC_TIMEOUT_CEILING, required=False)
    max_tool_calls = _bounded("max_tool_calls")
    max_parallel_tool_calls = _bounded("max_parallel_tool_calls")
    max_output_bytes = _bounded("max_output_bytes")
    memory_limit_mb = _bounded("memory_limit_mb")
    max_concurrent_jobs = _bounded("max_concurrent_jobs")
    max_concurrent_tool_calls = _bounded("max_concurrent_tool_calls")
    max_jobs_per_minute = _bounded("max_jobs_per_minute")
    max_client_wait = _bounded("max_client_wait")

    class Meta:
        model = Policy
        fields = [
            "mode",
            "user_allowlist",
            "toolset_allowlist",
            "toolset_blocklist",
            "rollout_percent",
            "rollout_salt",
            "debug",
            "sequential",
            "default_timeout",
            "max_timeout",
            "direct_only_tools",
            "max_tool_calls",
            "max_parallel_tool_calls",
            "max_output_bytes",
            "memory_limit_mb",
            "max_concurrent_jobs",
            "max_concurrent_tool_calls",
            "max_jobs_per_minute",
            "max_client_wait",
            "approval_for_writes",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]

    def validate_user_allowlist(self, value: list[str]) -> list[str]:
        known = set(get_user_model().objects.filter(username__in=value).values_list("username", flat=True))
        unknown = [name for name in value if name not in known]
        if unknown:
            raise serializers.ValidationError(f"Unknown usernames: {', '.join(unknown)}.")
        return list(dict.fromkeys(value))

    def _known_toolsets(self, value: list[str]) -> list[str]:
        known = set(Toolset.objects.filter(key__in=value).values_list("key", flat=True))
        unknown = [key for key in value if key not in known]
        if unknown:
            raise serializers.ValidationError(f"Unknown toolsets: {', '.join(unknown)}.")
        return list(dict.fromkeys(value))

    def validate_toolset_allowlist(self, value: list[str]) -> list[str]:
        return self._known_toolsets(value)

    def validate_toolset_blocklist(self, value: list[str]) -> list[str]:
        return self._known_toolsets(value)

    def validate_direct_only_tools(self, value: list[str]) -> list[str]:
        bad = [name for name in value if not name.isidentifier()]
        if bad:
            raise serializers.ValidationError(f"Not tool names: {', '.join(bad)}.")
        return list(dict.fromkeys(value))

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        current = self.instance
        default = attrs.get("default_timeout", current.default_timeout if current else None)
        maximum = attrs.get("max_timeout", current.max_timeout if current else None)
        if default is not None and maximum is not None and default > maximum:
            raise serializers.ValidationError({"default_timeout": [f"Must not exceed max_timeout ({maximum})."]})
        return attrs
