"""Budgets: what each run and pool spent and holds against its budget, raised by an operator
(the budget is the only field an operator edits; spent and reserved are the workers')."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html

from ..clock import DbNow, db_now
from ..cost import amount
from ..definition import get_definition
from ..errors import DefinitionNotFound
from ..models import BatchRun, ItemClaim, ItemStatus, SpendAccount
from ..spend import budget_rows, run_report
from .common import FanoutAdmin


def bar(row: Mapping[str, Any]) -> dict[str, Any]:
    """One budget (a row of fanout.spend.budget_rows) as budget_bar.html draws it."""
    unit = row["unit"]
    return {
        "unit": unit,
        "percent": min(100, round(100 * row["fraction"])),
        "label": f"{amount(unit, row['spent'] + row['reserved'])} of {amount(unit, row['budget'])}",
        "title": f"{amount(unit, row['spent'])} spent, {amount(unit, row['reserved'])} reserved",
    }


def budget_bars(accounts: Iterable[SpendAccount], now: datetime) -> list[dict[str, Any]]:
    return [bar(row) for row in budget_rows(accounts, now)]


def spend_table(
    spent: Mapping[str, float], reserved: Mapping[str, float], budgets: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """Spent and reserved by unit, each beside its budget's bar: spend_panel.html's rows."""
    bars = {b["unit"]: bar(b) for b in budgets}
    units = sorted({*spent, *reserved, *bars})
    rows = [
        {
            "unit": u,
            "spent": amount(u, spent.get(u, 0.0)),
            "reserved": amount(u, reserved.get(u, 0.0)),
            "bar": bars.get(u),
        }
        for u in units
    ]
    return {"budgeted": bool(bars), "rows": rows}


def run_spend(run: BatchRun, now: datetime) -> dict[str, Any] | None:
    """The run page's spend; None, without reading its items, for a run that counts no cost."""
    if not _accounted(run.definition) and not SpendAccount.objects.filter(run_id=run.pk).exists():
        return None
    report = run_report(run.pk, now).get("spend")
    if not report:
        return None
    return spend_table(report["spent"], report["reserved"], report["budgets"])


def item_spend(item: ItemClaim) -> dict[str, Any] | None:
    """What an item's calls cost, and the estimate it holds while it runs."""
    held = item.estimate if item.status == ItemStatus.RUNNING else None
    if not item.cost and not held:
        return None
    return spend_table(item.cost or {}, held or {}, ())


def _accounted(definition: str) -> bool:
    try:
        return get_definition(definition).accounted
    except DefinitionNotFound:
        return False  # a run of a definition this process does not know: its budget tells


@admin.register(SpendAccount)
class SpendAccountAdmin(FanoutAdmin):
    list_display = ("owner", "unit", "budget_gauge", "spent_text", "reserved_text", "budget")
    list_editable = ("budget",)
    list_filter = ("unit",)
    search_fields = ("pool", "unit", "run__definition")
    ordering = ("-spent",)  # the accounts that spent most first
    fields = (
        "owner",
        "unit",
        "budget",
        "spent_text",
        "reserved_text",
        "period",
        "calendar",
        "period_start",
    )
    readonly_fields = (
        "owner",
        "unit",
        "spent_text",
        "reserved_text",
        "period",
        "calendar",
        "period_start",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # made with their run or pool

    @admin.display(description="Run or pool")
    def owner(self, obj: SpendAccount) -> str:
        if obj.run_id is not None:
            url = reverse("admin:fanout_batchrun_change", args=[obj.run_id])
            return format_html('<a href="{}">run {}</a>', url, obj.run_id)
        url = reverse("admin:fanout_capacitypool_changelist") + f"?q={obj.pool}"
        return format_html('<a href="{}">pool {}</a>', url, obj.pool)

    def get_queryset(self, request: HttpRequest) -> Any:
        # The database's clock, read with each row: it says whether a period has passed.
        return super().get_queryset(request).annotate(clock=DbNow())

    @admin.display(description="Spent + reserved of budget")
    def budget_gauge(self, obj: SpendAccount) -> str:
        now = getattr(obj, "clock", None) or db_now()
        (row,) = budget_bars([copy.copy(obj)], now)  # a passed period reads 0
        return render_to_string("fanout/admin/budget_bar.html", {"bar": row})

    @admin.display(description="Spent", ordering="spent")
    def spent_text(self, obj: SpendAccount) -> str:
        return amount(obj.unit, obj.spent)

    @admin.display(description="Reserved", ordering="reserved")
    def reserved_text(self, obj: SpendAccount) -> str:
        return amount(obj.unit, max(obj.reserved, 0.0))

    @admin.display(description="Period started")
    def period_start(self, obj: SpendAccount) -> Any:
        return obj.period_started_at
