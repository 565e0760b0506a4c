import uuid
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.safestring import mark_safe

from billing.charts import stacked_bars_svg
from billing.models import CreditAccount, CreditUsage, Discount, LedgerEntry, Plan, Reservation
from billing.selectors import usage_by_day
from billing.services import credits_adjust
from ptcproject.accounts.authentication import signed_in_user
from ptcproject.admin_deletes import CountedDeleteAdmin
from ptcproject.admin_search import IndexedSearchAdmin
from ptcproject.errors import ApplicationError
from ptcproject.readonly import ReadOnlyAdmin
from ptcproject.storage import BIGINT_MAX


@admin.register(Plan)
class PlanAdmin(CountedDeleteAdmin):
    list_display = ("key", "name", "free_tool_access")


@admin.register(Discount)
class DiscountAdmin(CountedDeleteAdmin):
    list_display = ("__str__", "plan", "toolset", "percent")
    list_select_related = ("plan", "toolset")  # as for the accounts' plans
    # The toolsets that have a discount, and the toolset searched for: every user's own toolsets,
    # as many as they make, were read and drawn on each load.
    list_filter = ("plan", ("toolset", admin.RelatedOnlyFieldListFilter))
    autocomplete_fields = ("toolset",)


class CreditsForm(forms.Form):
    """What POST /api/v1/billing/credits takes, less the user: the accounts chosen in the list."""

    amount = forms.IntegerField(
        min_value=-BIGINT_MAX, max_value=BIGINT_MAX, help_text="Credits to add; negative to remove (the balance may go below 0)."
    )
    reason = forms.CharField(max_length=300, help_text="Kept on the ledger entry.")
    # New each time the form is drawn: the same form posted again (a resubmit, a double click)
    # changes no account twice (credits_adjust's idempotency_key).
    token = forms.UUIDField(widget=forms.HiddenInput, initial=uuid.uuid4)

    def clean_amount(self) -> int:
        amount: int = self.cleaned_data["amount"]
        if amount == 0:
            raise forms.ValidationError("The amount must not be 0.")
        return amount


@admin.register(CreditAccount)
class CreditAccountAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("user", "balance", "reserved", "plan", "plan_expires_at", "updated_at")
    # Named: Django's own joins follow only the columns that can't be null, so each row's plan was
    # a query of its own (a page of 100 accounts, 100 more queries), as was each entry's created_by.
    list_select_related = ("user", "plan")
    list_filter = ("plan",)
    search_fields = ("user__username",)  # matched whole, by its index (IndexedSearchAdmin)
    search_help_text = "A username, whole."
    readonly_fields = ("user", "balance", "reserved", "updated_at")
    fields = ("user", "balance", "reserved", "plan", "plan_expires_at", "updated_at")
    actions = ("adjust_credits",)

    @admin.action(description="Add or remove credits", permissions=["change"])
    def adjust_credits(self, request: HttpRequest, queryset: QuerySet[CreditAccount]) -> TemplateResponse | None:
        """Ask how many credits and why, then add them to (or remove them from) each chosen account
        through the ledger (credits_adjust: the account locked, what its running calls hold left as it
        is), as POST /api/v1/billing/credits does. The balance itself stays read-only: a form's save
        of it wrote over the holds and charges of the calls running meanwhile."""
        form = CreditsForm(request.POST if "apply" in request.POST else None)
        if not form.is_valid():
            context = {
                **self.admin_site.each_context(request),
                "title": "Add or remove credits",
                "form": form,
                "accounts": queryset.select_related("user"),
                "opts": self.model._meta,
            }
            return TemplateResponse(request, "admin/billing/creditaccount/adjust_credits.html", context)
        amount, reason, token = form.cleaned_data["amount"], form.cleaned_data["reason"], form.cleaned_data["token"]
        for account in queryset.select_related("user"):
            try:
                credits_adjust(
                    user=account.user, amount=amount, reason=reason, created_by=signed_in_user(request), idempotency_key=token
                )
            except ApplicationError as exc:  # out of the balance's range, or this form applied already: that account unchanged
                self.message_user(request, f"{account.user}: {exc.message}", messages.ERROR)
            else:
                self.message_user(request, f"{account.user}: {amount:+d} credits ({reason}).", messages.SUCCESS)
        return None

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # created with the user's first credits; balances move through the ledger

    def save_model(self, request: HttpRequest, obj: CreditAccount, form: Any, change: bool) -> None:
        # The plan only: a whole row's save wrote back the balance and the amount held as the form
        # read them, over the holds and charges of calls running meanwhile (the ledger broke).
        obj.save(update_fields=["plan", "plan_expires_at", "updated_at"])


@admin.register(LedgerEntry)
class LedgerEntryAdmin(IndexedSearchAdmin, ReadOnlyAdmin):
    list_display = ("created_at", "account", "kind", "delta", "reason", "created_by")
    list_select_related = ("account__user", "created_by")  # as for the accounts' plans
    list_filter = ("kind", "created_at")
    # Matched whole, by their indexes (IndexedSearchAdmin); not the reason, which no index serves.
    search_fields = ("account__user__username", "tool_call_id")
    search_help_text = "A username or a call id (ptc_…, standalone_…), whole."
    # A row a call charged or refunded, and created_at has no index: the model's ordering by it read
    # and sorted every entry each load. Newest first by id reads a page of the primary key.
    ordering = ("-id",)
    show_full_result_count = False


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    list_display = ("tool_call_id", "account", "amount", "status", "created_at", "closed_at")
    list_filter = ("status",)
    show_full_result_count = False  # a row a call: one count of them a load, not two


@admin.register(CreditUsage)
class CreditUsageAdmin(IndexedSearchAdmin, ReadOnlyAdmin):
    list_display = ("created_at", "user", "tool_call_id", "usage_type", "amount", "due_amount")
    list_filter = ("usage_type", "created_at")
    search_fields = ("user__username", "tool_call_id")  # matched whole, by their indexes (IndexedSearchAdmin)
    search_help_text = "A username or a call id (ptc_…, standalone_…), whole."
    # A row a call: no date hierarchy (its distinct days were a scan of every row each load; the
    # created-at filter's links stay), and one count a load, not two.
    show_full_result_count = False

    def get_urls(self) -> list[URLPattern]:
        chart = path("chart/", self.admin_site.admin_view(self.chart), name="billing_creditusage_chart")
        return [chart, *super().get_urls()]

    def chart(self, request: HttpRequest) -> TemplateResponse:
        """Credits spent over the last 30 days, per day, stacked by toolset and by user."""
        if not self.has_view_permission(request):  # admin_view asks only that the reader be staff
            raise PermissionDenied
        charts = []
        for group in ("toolset", "user"):
            days, series = usage_by_day(days=30, group=group)
            charts.append((group, mark_safe(stacked_bars_svg(labels=days, series=series))))  # noqa: S308 - escaped inside
        context = {
            **self.admin_site.each_context(request),
            "title": "Credits spent, last 30 days",
            "charts": charts,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/billing/usage_chart.html", context)
