import json

from django import forms
from django.contrib import admin
from django.utils.html import format_html

from tools.models import Tool, Toolset
from tools.sdk import tool_signature


class PrettyJSONWidget(forms.Textarea):
    def format_value(self, value: object) -> str:
        try:
            return json.dumps(json.loads(value) if isinstance(value, str) else value, indent=2, sort_keys=True)
        except (TypeError, ValueError):
            return str(value)


class ToolInline(admin.StackedInline):
    model = Tool
    extra = 0
    fields = (
        "name",
        "description",
        "input_schema",
        "output_schema",
        "allowed_callers",
        "read_only",
        "timeout",
        "price",
        "billing_free",
        "enabled",
        "http",
    )
    formfield_overrides = {
        # JSONField's form field; pretty-printed so a schema is readable when edited.
        Tool._meta.get_field("input_schema").__class__: {"widget": PrettyJSONWidget(attrs={"rows": 12, "cols": 80})},
    }


@admin.register(Toolset)
class ToolsetAdmin(admin.ModelAdmin):
    list_display = ("key", "name", "kind", "owner", "is_global", "enabled", "price", "billing_free")
    list_filter = ("kind", "is_global", "enabled", "billing_free")
    search_fields = ("key", "name", "description")
    inlines = [ToolInline]
    exclude = ("secrets",)  # write-only; edited through the API until the catalog issue adds a form


@admin.register(Tool)
class ToolAdmin(admin.ModelAdmin):
    list_display = ("name", "toolset", "signature", "read_only", "enabled", "price")
    list_filter = ("toolset", "read_only", "enabled")
    search_fields = ("name", "description", "toolset__key")
    readonly_fields = ("signature", "schema_pretty")

    @admin.display(description="signature")
    def signature(self, tool: Tool) -> str:
        return tool_signature(tool)

    @admin.display(description="input schema")
    def schema_pretty(self, tool: Tool) -> str:
        return format_html("<pre>{}</pre>", json.dumps(tool.input_schema, indent=2, sort_keys=True))
