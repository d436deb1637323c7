"""Capacity pools: in flight and admissions against their limits, why each admits nothing,
editable limits (never the token bucket the workers write), pause and resume."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from ..clock import db_now
from ..models import BatchRun, CapacityPool, ItemClaim, ItemStatus, SpendAccount
from ..pools import settings_drift
from ..text import plural
from ..waiting import pool_state
from .charts import pool_panels
from .common import (
    LOCATIONS,
    FanoutAdmin,
    action,
    counter_drift_display,
    gauge,
    items_url,
    page_facts,
    time_field,
)
from .spend import budget_bars

RUNS_SHOWN = 20


@dataclass(frozen=True)
class PoolRow:
    """A pool's line in the list: its live leases, admissions in its rate period, pending
    items, and why it admits nothing ("" while it admits)."""

    in_flight: int = 0
    admitted: int = 0
    pending: int = 0
    reason: str = ""


NO_ROW = PoolRow()


def pool_runs(name: str, limit: int = RUNS_SHOWN) -> list[dict[str, Any]]:
    """The runs with unfinished items in the pool, busiest first: its running and pending
    items per run, in two queries."""
    counts = list(
        ItemClaim.objects.filter(pool=name)
        .unfinished()
        .values("run_id")
        .annotate(
            running=Count("pk", filter=Q(status=ItemStatus.RUNNING)),
            pending=Count("pk", filter=Q(status=ItemStatus.PENDING)),
        )
        .order_by("-running", "-pending", "run_id")[:limit]
    )
    runs = BatchRun.objects.only("definition", "status").in_bulk([c["run_id"] for c in counts])
    return [
        {
            **c,
            "run": runs[c["run_id"]],
            "url": reverse("admin:fanout_batchrun_change", args=[c["run_id"]]),
            "items_url": items_url(run=c["run_id"], pool=name),
        }
        for c in counts
        if c["run_id"] in runs
    ]


@admin.register(CapacityPool)
class CapacityPoolAdmin(FanoutAdmin):
    list_display = (
        "name",
        "state",
        "concurrency_gauge",
        "admissions",
        "waiting_items",
    )
    list_filter = ("paused",)
    search_fields = ("name",)
    actions = ("pause_pools", "resume_pools")
    fieldsets = (
        (None, {"fields": ("name", "paused_flag")}),
        (
            "Limits",
            {"fields": ("max_concurrency", ("rate_count", "rate_period"), ("burst", "burst_now"))},
        ),
        ("Counter audit", {"fields": ("counter_drift_display",)}),
        (
            "Admission state (written by workers)",
            {
                "classes": ("collapse",),
                "fields": (
                    ("tokens", "tokens_refilled"),
                    "backoff",
                    "waiters",
                    ("created", "updated"),
                ),
            },
        ),
    )
    change_form_template = "fanout/admin/capacitypool/change_form.html"
    worker_fields = (
        "tokens",
        "tokens_refilled",
        "backoff",
        "waiters",
        "created",
        "updated",
        "counter_drift_display",
    )
    editable_fields = ("name", "max_concurrency", "rate_count", "rate_period", "burst")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # Pausing has its own permission (the actions); a pool's items refer to it by name.
        fixed = ("paused_flag", "burst_now", *self.worker_fields)
        return ("name", *fixed) if obj is not None else fixed

    def _without_delete(self, actions: dict[str, Any]) -> dict[str, Any]:
        # A pool is deleted one at a time, where its page can refuse it while items use it.
        actions.pop("delete_selected", None)
        return actions

    if LOCATIONS is not None:

        def get_actions(
            self, request: HttpRequest, action_location: Any = LOCATIONS.CHANGE_LIST
        ) -> dict[str, Any]:
            return self._without_delete(super().get_actions(request, action_location))

    else:

        def get_actions(self, request: HttpRequest) -> dict[str, Any]:
            return self._without_delete(super().get_actions(request))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and ItemClaim.objects.filter(pool=obj.name).unfinished().exists():
            return False  # its unfinished items would wait for it forever
        return super().has_delete_permission(request, obj)

    def change_view(self, request: HttpRequest, object_id: str, *args: Any, **kw: Any) -> Any:
        pool = self.get_object(request, object_id) if request.method == "GET" else None
        if pool is not None and (drift := settings_drift(pool)):
            messages.warning(
                request, f"{drift}: manage.py fanout_pools --sync applies FANOUT_POOLS"
            )
        return super().change_view(request, object_id, *args, **kw)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "pause_pool")

    def get_urls(self) -> list:
        switch = self.admin_site.admin_view(self.pause_view)
        return [
            path("<path:object_id>/pause/", switch, name="fanout_capacitypool_pause"),
            *super().get_urls(),
        ]

    def pause_view(self, request: HttpRequest, object_id: str) -> HttpResponseRedirect:
        """POST ``paused=1`` or ``paused=0``: the pause switch on a pool's own page."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])  # type: ignore[return-value]
        pool = self.get_object(request, unquote(object_id))
        if pool is None:
            raise Http404("no such pool")
        if not self.has_pause_permission(request):
            raise PermissionDenied
        pools = CapacityPool.objects.filter(pk=pool.pk)
        if request.POST.get("paused") == "1":
            self.pause_pools(request, pools)
        else:
            self.resume_pools(request, pools)
        self.log_change(
            request, pool, "Paused." if request.POST.get("paused") == "1" else "Resumed."
        )
        return HttpResponseRedirect(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if db_field.name == "burst" and field is not None:
            field.help_text = "Admissions allowed at once; leave blank to allow the rate count."
        return field

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: CapacityPool | None = None,
    ) -> Any:
        if obj is not None:
            context.update(self.summary(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def summary(self, request: HttpRequest, pool: CapacityPool) -> dict[str, Any]:
        """What the pool's page shows above its fields: its state, its switch, its runs."""
        now = db_now()  # leases, buckets and budget periods end by the database's clock
        in_flight = ItemClaim.objects.in_flight(now).filter(pool=pool.name).count()
        return {
            "pool_state": pool_state(pool.name, pool, in_flight, now),
            "pool_in_flight": in_flight,
            "may_pause": self.has_pause_permission(request),
            "pause_url": reverse("admin:fanout_capacitypool_pause", args=[pool.pk]),
            "pool_runs": pool_runs(pool.name),
            "charts": pool_panels(pool, now),
            "budget_bars": budget_bars(SpendAccount.objects.filter(pool=pool.name), now),
        }

    def save_model(self, request: HttpRequest, obj: CapacityPool, form: Any, change: bool) -> None:
        # Never write back the token bucket or backoff read when the form was opened.
        if change:
            fields = [f for f in form.changed_data if f in self.editable_fields]
            if fields:
                obj.save(update_fields=[*fields, "updated_at"])
            return
        super().save_model(request, obj, form, change)

    def read_page(self, request: HttpRequest, pools: list[CapacityPool]) -> dict[int, PoolRow]:
        """Live leases, admissions in each pool's rate period and pending items: one query."""
        if not pools:
            return {}
        now = db_now()
        admitted = Q()
        for pool in pools:
            admitted |= Q(pool=pool.name, claimed_at__gte=now - timedelta(seconds=pool.rate_period))
        live = Q(status=ItemStatus.RUNNING, lease_expires_at__gt=now)
        rows: dict[str, dict[str, Any]] = {
            r["pool"]: dict(r)
            for r in ItemClaim.objects.filter(pool__in=[p.name for p in pools])
            .filter(Q(status__in=(ItemStatus.RUNNING, ItemStatus.PENDING)) | admitted)
            .values("pool")
            .annotate(
                in_flight=Count("pk", filter=live),
                admitted=Count("pk", filter=admitted),
                pending=Count("pk", filter=Q(status=ItemStatus.PENDING)),
            )
            .order_by()
        }
        found = {}
        for pool in pools:
            row = rows.get(pool.name, {})
            in_flight = row.get("in_flight", 0)
            found[pool.pk] = PoolRow(
                in_flight=in_flight,
                admitted=row.get("admitted", 0),
                pending=row.get("pending", 0),
                reason=pool_state(pool.name, pool, in_flight, now).reason,
            )
        return found

    # ------------------------------------------------------------------ columns

    counter_drift_display = counter_drift_display
    tokens_refilled = time_field("tokens_at", "tokens counted at")
    backoff = time_field("backoff_until", "backing off until")
    created = time_field("created_at", "created")
    updated = time_field("updated_at", "updated")

    @admin.display(description="state")
    def state(self, pool: CapacityPool) -> str:
        reason = (page_facts(pool) or NO_ROW).reason
        css = "paused" if pool.paused else ("blocked" if reason else "admitting")
        return format_html(
            '<span class="fanout-badge fanout-pool-{}">{}</span>', css, reason or "admitting"
        )

    @admin.display(description="in flight")
    def concurrency_gauge(self, pool: CapacityPool) -> str:
        n = (page_facts(pool) or NO_ROW).in_flight
        return gauge(n, pool.max_concurrency, f"{n} / {pool.max_concurrency}")

    @admin.display(description="admitted in the last period")
    def admissions(self, pool: CapacityPool) -> str:
        n = (page_facts(pool) or NO_ROW).admitted
        period = f"{pool.rate_period:g}s"
        if pool.rate_count is None:
            return f"{n} in {period} (no rate limit)"
        label = f"{n} / {pool.rate_count} per {period}"
        return gauge(min(n, pool.rate_count), pool.rate_count, label, pool.describe_rate())

    @admin.display(description="pending items")
    def waiting_items(self, pool: CapacityPool) -> str:
        n = (page_facts(pool) or NO_ROW).pending
        if not n:
            return "0"
        return format_html(
            '<a href="{}">{}</a>', items_url(pool=pool.name, status="pending"), f"{n:,}"
        )

    @admin.display(description="paused", ordering="paused")
    def paused_flag(self, pool: CapacityPool) -> str:
        # Not the admin's boolean icon: its green tick would call a paused pool healthy.
        return "paused: admits no new items" if pool.paused else "no: admitting"

    @admin.display(description="burst now")
    def burst_now(self, pool: CapacityPool) -> str:
        """The burst the workers apply: the field's, or the rate count when it is blank."""
        if pool.rate_count is None:
            return "none: no rate limit"
        if pool.burst is None:
            return f"{pool.capacity} (the rate count)"
        return str(pool.capacity)

    # ------------------------------------------------------------------ actions

    @action(description="Pause selected pools", permissions=["pause"])
    def pause_pools(self, request: HttpRequest, queryset: QuerySet[CapacityPool]) -> None:
        count = queryset.filter(paused=False).update(paused=True, updated_at=timezone.now())
        self.message_user(
            request, f"Paused {plural(count, 'pool')}: they admit no new items.", messages.SUCCESS
        )

    @action(description="Resume selected pools", permissions=["pause"])
    def resume_pools(self, request: HttpRequest, queryset: QuerySet[CapacityPool]) -> None:
        count = queryset.filter(paused=True).update(paused=False, updated_at=timezone.now())
        self.message_user(request, f"Resumed {plural(count, 'pool')}.", messages.SUCCESS)
