from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.widgets import AutocompleteSelect
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from ptcproject.accounts.authentication import signed_in_user
from ptcproject.accounts.models import UserSettings
from ptcproject.admin_lists import LargeListAdmin
from ptcproject.policy.models import Policy, PolicyChange
from ptcproject.policy.selectors import POLICY_PK, policy_get, ptc_decision
from ptcproject.policy.serializers import PolicySerializer
from ptcproject.policy.services import policy_ensure, policy_update
from ptcproject.readonly import ReadOnlyAdmin
from tools.models import Toolset


class PolicyForm(forms.ModelForm):
    class Meta:
        model = Policy
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        """Check with the API's own rules, so the admin and PATCH /api/v1/policy accept the same values."""
        super().clean()
        data = self.cleaned_data  # what super().clean() returns for a ModelForm, typed as a dict
        values = {k: v for k, v in data.items() if k in PolicySerializer.Meta.fields}
        checked = PolicySerializer(self.instance, data=values, partial=True)
        if not checked.is_valid():
            for field, errors in checked.errors.items():
                self.add_error(field if field in self.fields else None, errors)
        return data


# The policy's page shows this many of its latest changes; "Policy changes" lists every one.
CHANGES_SHOWN = 20


class PolicyChangeInline(admin.TabularInline):
    model = PolicyChange
    extra = 0
    can_delete = False
    fields = ("changed_at", "changed_by", "changes")
    readonly_fields = fields
    verbose_name_plural = f"the {CHANGES_SHOWN} latest changes (all of them: Policy changes)"

    def get_queryset(self, request: HttpRequest) -> QuerySet[PolicyChange]:
        # Every change ever made, each with its fields' old and new values (an allowlist's two
        # lists), was read and drawn on each load of the page: 1,000 edits of a 2,000-name
        # allowlist were 700 MB of Python.
        latest = PolicyChange.objects.order_by("-changed_at", "-pk").values("pk")[:CHANGES_SHOWN]
        return super().get_queryset(request).filter(pk__in=latest)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(PolicyChange)
class PolicyChangeAdmin(ReadOnlyAdmin):
    """Every change of the policy, newest first, a page at a time: read only, as it was recorded."""

    list_display = ("changed_at", "changed_by", "__str__")
    list_select_related = ("changed_by",)  # can be null, so Django's own join left it: a query a row
    list_per_page = 50
    fields = ("policy", "changed_at", "changed_by", "changes")
    readonly_fields = fields


class DecisionForm(forms.Form):
    # Searched for by username, as the admin's other user fields are: a select drew every user.
    user = forms.ModelChoiceField(
        queryset=get_user_model().objects.order_by("username"),
        widget=AutocompleteSelect(UserSettings._meta.get_field("user"), admin.site),
    )
    # The global toolsets, those the policy's lists are written for: every user's own ones, as many
    # as they make, were each a checkbox here.
    toolsets = forms.ModelMultipleChoiceField(
        queryset=Toolset.objects.filter(is_global=True).order_by("key"),
        to_field_name="key",
        required=False,
        widget=forms.CheckboxSelectMultiple,
    )
    title = forms.CharField(required=False, help_text="The node title; it feeds the debug opt-in and opt-out rules.")


@admin.register(Policy)
class PolicyAdmin(LargeListAdmin):
    form = PolicyForm
    inlines = [PolicyChangeInline]
    list_display = ("__str__", "rollout_percent", "debug", "sequential", "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # one row, created from the PTC_* seed

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        policy_ensure()  # the one row's page, whether or not migrate made it yet
        return HttpResponseRedirect(reverse("admin:policy_policy_change", args=[POLICY_PK]))

    def save_model(self, request: HttpRequest, obj: Policy, form: forms.ModelForm, change: bool) -> None:
        values = {field: form.cleaned_data[field] for field in form.changed_data}
        policy_update(changed_by=signed_in_user(request), values=values)  # records who changed what

    def get_urls(self) -> list[URLPattern]:
        return [
            path("try/", self.admin_site.admin_view(self.try_decision), name="policy_policy_try"),
            *super().get_urls(),
        ]

    def try_decision(self, request: HttpRequest) -> TemplateResponse:
        """The "try a decision" form: pick a user, toolsets and a title; see the answer and its reason."""
        if not self.has_view_permission(request):  # admin_view asks only that the reader be staff
            raise PermissionDenied
        form = DecisionForm(request.GET or None)
        decision = None
        if form.is_valid():
            decision = ptc_decision(
                policy=policy_get(),
                user=form.cleaned_data["user"],
                toolsets=[t.key for t in form.cleaned_data["toolsets"]],
                title=form.cleaned_data["title"],
            )
        context = {
            **self.admin_site.each_context(request),
            "title": "Try a PTC decision",
            "form": form,
            "decision": decision,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/policy/try_decision.html", context)
