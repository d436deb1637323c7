"""Budgets: what each run and pool spent and holds against its budget, raised by an operator
(the budget is the only field an operator edits; spent and reserved are the workers')."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from ..cost import amount
from ..models import SpendAccount
from .common import FanoutAdmin, gauge


@admin.register(SpendAccount)
class SpendAccountAdmin(FanoutAdmin):
    list_display = ("owner", "unit", "budget_gauge", "spent_text", "reserved_text", "budget")
    list_editable = ("budget",)
    list_filter = ("unit",)
    search_fields = ("pool", "unit", "run__definition")
    ordering = ("-spent",)  # the accounts that spent most first
    fields = ("owner", "unit", "budget", "spent_text", "reserved_text", "period", "period_start")
    readonly_fields = ("owner", "unit", "spent_text", "reserved_text", "period", "period_start")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # made with their run or pool

    @admin.display(description="Run or pool")
    def owner(self, obj: SpendAccount) -> str:
        if obj.run_id is not None:
            url = reverse("admin:fanout_batchrun_change", args=[obj.run_id])
            return format_html('<a href="{}">run {}</a>', url, obj.run_id)
        url = reverse("admin:fanout_capacitypool_changelist") + f"?q={obj.pool}"
        return format_html('<a href="{}">pool {}</a>', url, obj.pool)

    @admin.display(description="Spent + reserved of budget")
    def budget_gauge(self, obj: SpendAccount) -> str:
        used = obj.spent + max(obj.reserved, 0.0)
        scale = 100 / obj.budget if obj.budget else 0
        label = f"{amount(obj.unit, used)} of {amount(obj.unit, obj.budget)}"
        return gauge(round(used * scale), 100, label)

    @admin.display(description="Spent", ordering="spent")
    def spent_text(self, obj: SpendAccount) -> str:
        return amount(obj.unit, obj.spent)

    @admin.display(description="Reserved", ordering="reserved")
    def reserved_text(self, obj: SpendAccount) -> str:
        return amount(obj.unit, max(obj.reserved, 0.0))

    @admin.display(description="Period started")
    def period_start(self, obj: SpendAccount) -> Any:
        return obj.period_started_at
