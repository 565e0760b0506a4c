"""Input and output shapes of the toolset, SDK and context endpoints (API.md, "Tools")."""

from typing import Any

from django.conf import settings
from rest_framework import serializers

from ptcproject.fields import JsonValueField, KnownKeysOnly, NamesField, NumberField
from ptcproject.queues import tools_queue_problem
from ptcproject.storage import POSITIVE_INT_MAX
from tools.anthropic_managed import CODE_EXECUTION_VERSIONS
from tools.classification import direct_only_tools, tool_is_ptc
from tools.context import FORMATS
from tools.models import Tool, Toolset
from tools.sdk import tool_signature
from tools.secret_refs import secret_names_problem
from tools.services import TOOLSET_FIELDS


# -- Output --------------------------------------------------------------------------------------
class ToolSerializer(serializers.ModelSerializer):
    signature = serializers.SerializerMethodField(help_text="The compact one-line form: add(a: number, b: number) -> number")
    ptc = serializers.SerializerMethodField(help_text="True if code may call it; false for a direct tool.")
    input_schema = serializers.JSONField()
    output_schema = serializers.JSONField(allow_null=True)
    allowed_callers = serializers.ListField(child=serializers.CharField())
    http = serializers.JSONField(allow_null=True)

    class Meta:
        model = Tool
        fields = [
            "name",
            "signature",
            "description",
            "input_schema",
            "output_schema",
            "allowed_callers",
            "ptc",
            "read_only",
            "timeout",
            "price",
            "billing_free",
            "requires_approval",
            "http",
        ]

    def get_signature(self, tool: Tool) -> str:
        return tool_signature(tool)

    def get_ptc(self, tool: Tool) -> bool:
        direct_only = self.context.get("direct_only")
        if direct_only is None:
            # DRF's context is the root serializer's dict, shared by the whole tree: a cache for one
            # serialisation. drf-stubs type it as a read-only Mapping.
            direct_only = self.context["direct_only"] = direct_only_tools()  # type: ignore[index]
        return tool_is_ptc(tool=tool, toolset=tool.toolset, direct_only=direct_only)


class ToolsetSerializer(serializers.ModelSerializer):
    """A toolset as the API shows it: never its secrets' values, only their names; its ``config``
    only to staff and its owner (the ``viewer`` in the context): another user's view of a global
    toolset has none (``null``). A config holds the operator's internals (hosts, commands, an
    MCP server's environment), which a tenant uses through the tools, never needs to read."""

    config = serializers.JSONField(allow_null=True, help_text="null unless the caller is staff or the toolset's owner.")
    secret_names = serializers.SerializerMethodField(help_text="The names of the secrets set; values are write-only.")
    tools = ToolSerializer(many=True)

    class Meta:
        model = Toolset
        fields = [
            *TOOLSET_FIELDS,  # what a write may set, in the same order
            "secret_names",
            "tools",
            "created_at",
            "updated_at",
        ]

    def to_representation(self, toolset: Toolset) -> dict[str, Any]:
        shown = super().to_representation(toolset)
        viewer = self.context.get("viewer")
        if viewer is None or not (viewer.is_staff or toolset.owner_id == viewer.pk):
            shown["config"] = None
        return shown

    def get_secret_names(self, toolset: Toolset) -> list[str]:
        return sorted(toolset.secrets or {})


class McpSyncSerializer(serializers.Serializer):
    added = serializers.ListField(child=serializers.CharField())
    updated = serializers.ListField(child=serializers.CharField())
    disabled = serializers.ListField(child=serializers.CharField(), help_text="No longer listed by the server: kept, disabled.")
    skipped = serializers.ListField(child=serializers.DictField(child=serializers.CharField()))
    toolset = ToolsetSerializer()


class DefinitionToolSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    input_schema = serializers.JSONField()
    output_schema = serializers.JSONField(allow_null=True)


class DefinitionToolsetSerializer(serializers.Serializer):
    key = serializers.CharField()
    name = serializers.CharField()
    tools = DefinitionToolSerializer(many=True)


class DefinitionsSerializer(serializers.Serializer):
    toolsets = DefinitionToolsetSerializer(many=True)


class SdkSerializer(serializers.Serializer):
    hash = serializers.CharField()
    files = serializers.DictField(child=serializers.CharField(), help_text="Path → content of each file of ptc_tools.")
    docs = serializers.DictField(child=serializers.CharField(), help_text="Toolset key → markdown.")


class ContextStatsSerializer(serializers.Serializer):
    schema_chars = serializers.IntegerField(help_text="Every tool with its full JSON schema, as the provider tool list.")
    compact_chars = serializers.IntegerField(help_text="What this context sends: its tool list plus the system prompt.")


class ContextSerializer(serializers.Serializer):
    ptc_enabled = serializers.BooleanField()
    reason = serializers.CharField()
    sequential = serializers.BooleanField()
    tools = serializers.ListField(child=serializers.DictField(), help_text="In the requested provider's tool format.")
    system_prompt = serializers.CharField(allow_blank=True)
    sdk_hash = serializers.CharField()
    stats = ContextStatsSerializer()
    routes = serializers.DictField(
        child=serializers.DictField(child=serializers.CharField()),
        required=False,
        help_text="anthropic-managed only: each tool name's {toolset, tool}, for POST /tools/execute.",
    )


# -- Input ---------------------------------------------------------------------------------------
class ToolWriteSerializer(KnownKeysOnly, serializers.Serializer):
    also_known = frozenset(ToolSerializer.Meta.fields)  # a tool as GET answered it may be sent back
    # Names, schemas and http specs are checked in tools.validation, which gives each problem its own code.
    name = serializers.CharField(max_length=128)
    description = serializers.CharField(required=False, allow_blank=True, default="")
    input_schema = JsonValueField(required=False, default=dict)
    output_schema = JsonValueField(required=False, allow_null=True, default=None)
    allowed_callers = serializers.ListField(child=serializers.CharField(), required=False, default=list)
    # A declared field, which DRF's metaclass takes out of the class body: it never shadows Field.read_only.
    read_only = serializers.BooleanField(required=False, default=False)  # type: ignore[assignment]
    # No call outlives the longest job, so no tool's timeout needs to.
    timeout = NumberField(required=False, allow_null=True, default=None, min_value=0.1, max_value=settings.PTC_TIMEOUT_CEILING)
    price = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=0, max_value=POSITIVE_INT_MAX)
    billing_free = serializers.BooleanField(required=False, default=False)
    requires_approval = serializers.BooleanField(required=False, default=False, help_text="Each call waits for an approval.")
    enabled = serializers.BooleanField(required=False, default=True)
    http = JsonValueField(required=False, allow_null=True, default=None)

    def validate_input_schema(self, value: Any) -> Any:
        return value if value != {} else {"type": "object", "properties": {}}


class ToolsetWriteSerializer(KnownKeysOnly, serializers.Serializer):
    also_known = frozenset(ToolsetSerializer.Meta.fields)  # a toolset as GET answered it may be sent back
    key = serializers.CharField(max_length=64)
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True)
    kind = serializers.ChoiceField(choices=Toolset.Kind.choices)
    is_global = serializers.BooleanField(required=False)
    enabled = serializers.BooleanField(required=False)
    price = serializers.IntegerField(required=False, min_value=0, max_value=POSITIVE_INT_MAX)
    billing_free = serializers.BooleanField(required=False)
    queue = serializers.CharField(
        required=False, max_length=64, help_text="The tools queue its calls run on (default tools); one of PTC_TOOLS_QUEUES."
    )
    requires_approval = serializers.BooleanField(required=False, help_text="Every call of its tools waits for an approval.")
    config = JsonValueField(required=False)
    secrets = serializers.DictField(
        child=serializers.CharField(allow_null=True, allow_blank=False, trim_whitespace=False),
        required=False,
        write_only=True,
        help_text="Write-only. PUT replaces them, PATCH merges them (null removes one); left out, they are kept.",
    )
    tools = ToolWriteSerializer(many=True, required=False)

    def validate_queue(self, value: str) -> str:
        problem = tools_queue_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value

    def validate_config(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object")
        return value

    def validate_secrets(self, value: dict[str, Any]) -> dict[str, Any]:
        problem = secret_names_problem(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class ToolsetKeysQuerySerializer(serializers.Serializer):
    toolset_keys = serializers.CharField(
        required=False, allow_blank=True, help_text="Comma-separated toolset keys; all visible toolsets when left out."
    )

    def keys(self) -> list[str] | None:
        raw = self.validated_data.get("toolset_keys")
        return None if raw is None else [k.strip() for k in raw.split(",") if k.strip()]


class ClientToolSerializer(serializers.Serializer):
    # Names and schemas are checked in tools.client, with the same rules as a toolset's tools.
    name = serializers.CharField(max_length=128, help_text="A Python identifier: Client.<name>(...) in the code.")
    description = serializers.CharField(required=False, allow_blank=True, default="", max_length=10_000)
    input_schema = JsonValueField(required=False, default=dict, help_text='A JSON Schema object: {"type": "object", ...}.')
    output_schema = JsonValueField(required=False, allow_null=True, default=None)
    timeout = NumberField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0.1,
        max_value=settings.PTC_TIMEOUT_CEILING,
        help_text=f"Seconds a call waits for its result (default {settings.PTC_CLIENT_TOOL_TIMEOUT}); then tool_timeout.",
    )


class ContextRequestSerializer(KnownKeysOnly, serializers.Serializer):
    toolsets = NamesField(max_name=64, required=False, allow_null=True)
    title = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)
    format = serializers.ChoiceField(choices=FORMATS, required=False, default="anthropic")
    discovery = serializers.BooleanField(
        required=False, default=False, help_text="Tool names only in the prompt; code reads schemas with ptc_tools.describe()."
    )
    client_tools = ClientToolSerializer(
        many=True, required=False, default=list, help_text="The client tools the turn's job will declare (POST /exec)."
    )
    code_execution_version = serializers.ChoiceField(
        choices=CODE_EXECUTION_VERSIONS,
        required=False,
        allow_null=True,
        default=None,
        help_text="anthropic-managed only: the code-execution tool version the tools' allowed_callers name.",
    )
