from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.safestring import mark_safe

from billing.charts import stacked_bars_svg
from billing.models import CreditAccount, CreditUsage, Discount, LedgerEntry, Plan, Reservation
from billing.selectors import usage_by_day
from ptcproject.readonly import ReadOnlyAdmin


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ("key", "name", "free_tool_access")


@admin.register(Discount)
class DiscountAdmin(admin.ModelAdmin):
    list_display = ("__str__", "plan", "toolset", "percent")
    # The toolsets that have a discount, and the toolset searched for: every user's own toolsets,
    # as many as they make, were read and drawn on each load.
    list_filter = ("plan", ("toolset", admin.RelatedOnlyFieldListFilter))
    autocomplete_fields = ("toolset",)


@admin.register(CreditAccount)
class CreditAccountAdmin(admin.ModelAdmin):
    list_display = ("user", "balance", "reserved", "plan", "plan_expires_at", "updated_at")
    list_filter = ("plan",)
    search_fields = ("user__username",)
    readonly_fields = ("user", "balance", "reserved", "updated_at")
    fields = ("user", "balance", "reserved", "plan", "plan_expires_at", "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # created with the user's first credits; balances move through the ledger

    def save_model(self, request: HttpRequest, obj: CreditAccount, form: Any, change: bool) -> None:
        # The plan only: a whole row's save wrote back the balance and the amount held as the form
        # read them, over the holds and charges of calls running meanwhile (the ledger broke).
        obj.save(update_fields=["plan", "plan_expires_at", "updated_at"])


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "account", "kind", "delta", "reason", "created_by")
    list_filter = ("kind", "created_at")
    search_fields = ("account__user__username", "reason", "tool_call_id")


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    list_display = ("tool_call_id", "account", "amount", "status", "created_at", "closed_at")
    list_filter = ("status",)


@admin.register(CreditUsage)
class CreditUsageAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "user", "tool_call_id", "usage_type", "amount", "due_amount")
    list_filter = ("usage_type", "created_at")
    search_fields = ("user__username", "tool_call_id")
    date_hierarchy = "created_at"

    def get_urls(self) -> list[URLPattern]:
        chart = path("chart/", self.admin_site.admin_view(self.chart), name="billing_creditusage_chart")
        return [chart, *super().get_urls()]

    def chart(self, request: HttpRequest) -> TemplateResponse:
        """Credits spent over the last 30 days, per day, stacked by toolset and by user."""
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
