import json
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Field, JSONField, QuerySet
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from rest_framework import serializers

from ptcproject import queues
from ptcproject.admin_deletes import CountedDeleteAdmin, pks_of
from ptcproject.errors import ApplicationError
from ptcproject.queues import tools_queue_problem
from ptcproject.storage import MAX_JSON_DEPTH, json_depth_exceeds, unstorable
from tools.models import Tool, Toolset
from tools.sdk import tool_signature
from tools.secret_refs import secret_names_problem
from tools.selectors import toolset_key_taken
from tools.serializers import ToolWriteSerializer
from tools.services import TOOL_FIELDS, TOOLSET_FIELDS, mcp_toolset_sync, tool_calls_unlink
from tools.validation import CLIENT_NOT_GATED, FieldError, config_errors, identifier_problem, tool_errors


class PrettyJSONWidget(forms.Textarea):
    def format_value(self, value: object) -> str:
        try:
            return json.dumps(json.loads(value) if isinstance(value, str) else value, indent=2, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            return str(value)


class StorableJSONField(forms.JSONField):
    """JSON that PostgreSQL's jsonb can hold and its readers can walk: a string or key with a NUL
    (\\u0000), NaN or Infinity, or lists nested past MAX_JSON_DEPTH are a field error. Each was a 500:
    the database refused the row (NUL, NaN), or json.loads ran out of stack."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError(f"nested deeper than {MAX_JSON_DEPTH} levels", code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:  # the form drawn again shows it as it was typed
            return InvalidJSONInput(data)

    def validate(self, value: Any) -> None:
        super().validate(value)
        if json_depth_exceeds(value):
            raise forms.ValidationError(f"nested deeper than {MAX_JSON_DEPTH} levels", code="invalid")
        problem = unstorable(value)
        if problem:
            raise forms.ValidationError(problem, code="invalid")


# Schemas and configs are edited as pretty-printed JSON, so they are readable.
_PRETTY: dict[type[Field], dict[str, Any]] = {
    JSONField: {"widget": PrettyJSONWidget(attrs={"rows": 10, "cols": 90}), "form_class": StorableJSONField}
}


def _add_errors(form: forms.BaseForm, errors: list[FieldError], prefix: str = "") -> None:
    for error in errors:
        field = error.path.removeprefix(prefix).split(".")[0].split("[")[0]
        form.add_error(field if field in form.fields else None, f"{error.path}: {error.message} [{error.code}]")


class ToolForm(forms.ModelForm):
    class Meta:
        model = Tool
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data  # what super().clean() returns for a ModelForm, typed as a dict
        toolset = data.get("toolset") or (self.instance.toolset if self.instance.toolset_id else None)
        kind = getattr(self, "parent_kind", None) or (toolset.kind if toolset else Toolset.Kind.BUILTIN)
        if self.instance._state.adding and (getattr(self, "parent_kind", None) == Toolset.Kind.BUILTIN or _builtin(toolset)):
            self.add_error(None, f"A builtin toolset's tools are defined in code; {BUILTIN_FIXED}")
        # The fields shown read-only (a builtin tool's) are checked as they are stored.
        stored = {name: getattr(self.instance, name) for name in ("name", *TOOL_FIELDS, "http") if name not in self.fields}
        _add_errors(self, tool_errors({**stored, **data}, kind=kind, path="tool"), prefix="tool.")
        if data.get("timeout") is not None:
            # The API's own bounds (0.1 s .. PTC_TIMEOUT_CEILING): no call outlives the longest job.
            # Past them a call's deadline (its claim plus this) could leave the calendar, and the
            # close of a job that such a call outlived raised OverflowError, its end never announced.
            try:
                ToolWriteSerializer().fields["timeout"].run_validation(data["timeout"])
            except serializers.ValidationError as exc:
                self.add_error("timeout", [str(message) for message in exc.detail])
        return data


class ToolFormSet(forms.BaseInlineFormSet):
    def _construct_form(self, i: int, **kwargs: Any) -> forms.Form:
        form = super()._construct_form(i, **kwargs)  # type: ignore[misc]  # private Django API, absent from django-stubs
        # The toolset form has been applied to self.instance already: its kind is the one being saved.
        form.parent_kind = self.instance.kind
        return form


# What `migrate` rewrites from code (tools.services.builtin_toolsets_sync), so what the admin shows
# read-only on a builtin toolset and its tools, as the API refuses it (builtin_toolset): changed
# here, it did not last (a price the admin set went back to the code's at the next deploy, charging
# the code's), and until then it broke the running jobs' calls (a tool renamed: tool_not_found).
# Which of them run, where, and with approval, are the admin's (and a tool's timeout): migrate keeps those.
BUILTIN_TOOLSET_EDITABLE = ("enabled", "queue", "requires_approval")
BUILTIN_TOOL_EDITABLE = ("enabled", "timeout", "requires_approval")
BUILTIN_FIXED = "`migrate` rewrites them from the code: only enabled, queue, requires_approval and a tool's timeout change here."


def _builtin(toolset: Toolset | None) -> bool:
    return toolset is not None and toolset.kind == Toolset.Kind.BUILTIN


class ToolInline(admin.StackedInline):
    model = Tool
    form = ToolForm
    formset = ToolFormSet
    extra = 0
    fields = ("name", "remote_name", *TOOL_FIELDS)  # what the API writes, in the same order
    formfield_overrides = _PRETTY

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # ``obj`` is the toolset.
        return [name for name in self.fields if name not in BUILTIN_TOOL_EDITABLE] if _builtin(obj) else ()

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not _builtin(obj) and super().has_add_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # ``obj`` is the toolset: a builtin's tools are kept, as from their own page (BUILTIN_KEPT).
        builtin = obj is not None and obj.kind == Toolset.Kind.BUILTIN
        return not builtin and super().has_delete_permission(request, obj)


class WriteOnlyTextarea(forms.Textarea):
    """A textarea drawn empty whatever it was given, as a password input is: the form drawn again
    after an error (of any field) showed the secrets just typed, in the clear."""

    def format_value(self, value: object) -> None:
        return None


class ToolsetForm(forms.ModelForm):
    set_secrets = forms.JSONField(
        required=False,
        widget=WriteOnlyTextarea(attrs={"rows": 3, "cols": 90}),
        help_text='Write-only. A JSON object {"NAME": "value"}: sets those secrets; null removes one. '
        "Left empty, the secrets stay as they are. Reference them in config as {{secrets.NAME}}.",
    )

    class Meta:
        model = Toolset
        exclude = ("secrets",)  # never rendered: secrets are write-only here too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = sorted(self.instance.secrets or {}) if self.instance.pk else []
        self.fields["set_secrets"].help_text += f" Set now: {', '.join(names) if names else 'none'}."
        if self.is_bound and (self.data.get(self.add_prefix("set_secrets")) or "").strip():
            # Drawn again (a field had an error), the box is empty: what was typed in it is not kept.
            self.fields["set_secrets"].help_text += " The secrets you typed are not shown again: type them again."
        # A choice of this deployment's tools queues (and the current one, should it have left
        # PTC_TOOLS_QUEUES: shown, then refused by clean() until it is changed). Empty means tools.
        current = self.instance.queue or queues.TOOLS
        choices = dict.fromkeys([*queues.tools_queues(), current])
        self.fields["queue"] = forms.ChoiceField(
            choices=[(q, q) for q in choices],
            required=False,
            initial=current,
            help_text=Toolset._meta.get_field("queue").help_text,
        )

    def clean_queue(self) -> str:
        return self.cleaned_data.get("queue") or queues.TOOLS

    def clean_set_secrets(self) -> dict[str, Any]:
        value = self.cleaned_data.get("set_secrets") or {}
        if not isinstance(value, dict) or not all(isinstance(v, str | None) for v in value.values()):
            raise forms.ValidationError('must be a JSON object of strings: {"NAME": "value"}')
        problem = secret_names_problem(value)
        if problem:
            raise forms.ValidationError(problem)
        return value

    def clean(self) -> dict[str, Any]:
        super().clean()
        # The fields shown read-only (a builtin's, its key once made) are checked as they are stored.
        stored = {name: getattr(self.instance, name) for name in ("key", "owner", *TOOLSET_FIELDS) if name not in self.fields}
        data = {**stored, **self.cleaned_data}  # what super().clean() returns for a ModelForm, typed as a dict
        problem = identifier_problem(data.get("key")) if "key" in self.fields else None  # read-only once made
        if problem:
            self.add_error("key", problem)
        queue_problem = tools_queue_problem(data.get("queue") or "")
        if queue_problem:
            self.add_error("queue", queue_problem)
        key, owner = data.get("key"), data.get("owner")
        if key and not problem and toolset_key_taken(key=key, owner=owner, exclude=self.instance):
            # The key is read-only once made, so Django's own check of the (key, owner) constraints
            # skipped them on a change: an owner changed to a user with a toolset of that key, or
            # one made ownerless where a global toolset has it, was an IntegrityError, a 500.
            whose = "A global toolset" if owner is None else f"{owner} has a toolset"
            self.add_error("owner", f"{whose} with key '{key}' already: choose another owner, or change that one.")
        if not data.get("is_global") and data.get("owner") is None:
            # Only a toolset's owner sees one that is not global (tools.selectors): with no owner, nobody would.
            self.add_error(
                "owner", "A toolset that is not global needs an owner, the one user who sees it: choose one, or tick is global."
            )
        if data.get("kind") in (Toolset.Kind.HTTP, Toolset.Kind.MCP):
            _add_errors(self, config_errors(data.get("config") or {}, kind=data["kind"], secrets=self._secrets()))
        if data.get("kind") == Toolset.Kind.CLIENT and data.get("requires_approval"):
            self.add_error("requires_approval", CLIENT_NOT_GATED)
        if self.instance._state.adding and data.get("kind") == Toolset.Kind.BUILTIN:
            self.add_error(
                "kind", "Builtin toolsets are defined in code and made by `migrate`: make an http or mcp toolset here."
            )
        return self.cleaned_data

    def _secrets(self) -> dict[str, str]:
        """The toolset's secrets as this form would leave them: those set now over the stored ones,
        a null one removed."""
        merged = {**(self.instance.secrets or {}), **(self.cleaned_data.get("set_secrets") or {})}
        return {name: value for name, value in merged.items() if value is not None}

    def save(self, commit: bool = True) -> Toolset:
        toolset = super().save(commit=False)
        toolset.secrets = self._secrets()
        if commit:
            toolset.save()
        return toolset


# Why the admin keeps a builtin toolset, or a tool of one, from a delete: the API refuses it
# (builtin_toolset). Deleted, every job's calls of it failed unknown_tool and new jobs
# unknown_toolset until the next migrate, and its discounts, which migrate does not bring back,
# went with it.
BUILTIN_KEPT = "migrate brings it back: disable it instead"


def _also_protected(deleted: tuple[Any, Any, Any, list[Any]], kept: list[str]) -> tuple[Any, ...]:
    """``deleted`` (what ModelAdmin.get_deleted_objects returns) with ``kept`` named as protected:
    the admin then deletes nothing, and says why."""
    to_delete, counts, perms_needed, protected = deleted
    return to_delete, counts, perms_needed, [*kept, *protected]


@admin.register(Toolset)
class ToolsetAdmin(CountedDeleteAdmin):
    form = ToolsetForm
    list_display = ("key", "name", "kind", "owner", "is_global", "enabled", "price", "billing_free", "queue", "requires_approval")
    # Named: Django's own joins follow only the columns that can't be null, so each owned toolset's
    # owner was a query of its own (a page of 100, 100 more queries).
    list_select_related = ("owner",)
    list_filter = ("kind", "is_global", "enabled", "billing_free", "queue")
    search_fields = ("key", "name", "description")
    # The owner is searched for: the add and change forms drew every user of the deployment in a
    # select (50,000 users, 3.8 MB of HTML and 20 s a load).
    autocomplete_fields = ("owner",)
    inlines = [ToolInline]
    formfield_overrides = _PRETTY
    actions = ["sync_mcp_tools"]
    delete_shows = ("key",)  # not its config, nor its secrets, each decrypted (CountedDeleteAdmin)

    def get_readonly_fields(self, request: HttpRequest, obj: Toolset | None = None) -> Any:
        # A toolset's key is fixed once made, as the API says (key_mismatch): the policy's lists,
        # the jobs' toolsets, their calls and the generated SDK name it; renamed, a blocklisted
        # toolset would have left the blocklist.
        if _builtin(obj):
            return [name for name in ("key", "owner", *TOOLSET_FIELDS) if name not in BUILTIN_TOOLSET_EDITABLE]
        return ("key",) if obj is not None else ()

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        if _builtin(obj) and request.method == "GET":
            self.message_user(request, f"'{obj.key}' is a builtin toolset: {BUILTIN_FIXED}", messages.INFO)
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)

    # Its tools' calls unlinked a batch at a time first (tool_calls_unlink): Django's delete unlinks
    # them in one statement, past PTC_DB_STATEMENT_TIMEOUT for a tool of millions of calls.
    def delete_model(self, request: HttpRequest, obj: Toolset) -> None:
        tool_calls_unlink(tools=obj.tools.all())
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Toolset]) -> None:
        tool_calls_unlink(tools=Tool.objects.filter(toolset__in=queryset))
        super().delete_queryset(request, queryset)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        if formset.model is Tool:  # the tools deleted on the toolset's page
            gone = [tool.pk for tool in (f.instance for f in formset.deleted_forms) if tool.pk is not None]
            tool_calls_unlink(tools=Tool.objects.filter(pk__in=gone))
        super().save_formset(request, form, formset, change)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        builtin = Toolset.objects.filter(pk__in=pks_of(objs), kind=Toolset.Kind.BUILTIN).values_list("key", flat=True)
        kept = [f"builtin toolset {key} ({BUILTIN_KEPT})" for key in builtin[:20]]
        return _also_protected(super().get_deleted_objects(objs, request), kept)

    @admin.action(description="Sync tools from the MCP server", permissions=["change"])
    def sync_mcp_tools(self, request: HttpRequest, queryset: QuerySet[Toolset]) -> None:
        for toolset in queryset:
            try:
                result = mcp_toolset_sync(toolset=toolset)
            except ApplicationError as exc:
                self.message_user(request, f"Could not sync '{toolset.key}' [{exc.code}]: {exc.message}", messages.ERROR)
                continue
            skipped = f", skipped {len(result.skipped)}" if result.skipped else ""
            self.message_user(
                request,
                f"Synced '{toolset.key}': added {len(result.added)}, updated {len(result.updated)}, "
                f"disabled {len(result.disabled)}{skipped}.",
                messages.SUCCESS,
            )


@admin.register(Tool)
class ToolAdmin(CountedDeleteAdmin):
    form = ToolForm
    list_display = ("name", "toolset", "signature", "read_only", "enabled", "price")
    # Not by toolset, and the toolset searched for: any user makes toolsets of their own, as many as
    # they like, and the filter and the form's select read and drew every one (126 MB for 20,000).
    list_filter = ("read_only", "enabled")
    search_fields = ("name", "description", "toolset__key")
    autocomplete_fields = ("toolset",)
    readonly_fields = ("signature", "schema_pretty")
    formfield_overrides = _PRETTY
    delete_shows = ("name", "toolset__key")  # not its schemas; its toolset's key joined, not read a row at a time

    def get_readonly_fields(self, request: HttpRequest, obj: Tool | None = None) -> Any:
        if obj is not None and _builtin(obj.toolset):
            fields = [field.name for field in Tool._meta.fields if field.editable and field.name not in BUILTIN_TOOL_EDITABLE]
            return (*self.readonly_fields, *fields)
        return self.readonly_fields

    def delete_model(self, request: HttpRequest, obj: Tool) -> None:
        tool_calls_unlink(tools=Tool.objects.filter(pk=obj.pk))  # as ToolsetAdmin's
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Tool]) -> None:
        tool_calls_unlink(tools=queryset)
        super().delete_queryset(request, queryset)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        builtin = Tool.objects.filter(pk__in=pks_of(objs), toolset__kind=Toolset.Kind.BUILTIN)
        kept = [
            f"tool {name} of the builtin toolset {key} ({BUILTIN_KEPT})"
            for key, name in builtin.values_list("toolset__key", "name")[:20]
        ]
        return _also_protected(super().get_deleted_objects(objs, request), kept)

    @admin.display(description="signature")
    def signature(self, tool: Tool) -> str:
        return tool_signature(tool)

    @admin.display(description="input schema")
    def schema_pretty(self, tool: Tool) -> str:
        return format_html("<pre>{}</pre>", json.dumps(tool.input_schema, indent=2, sort_keys=True))
