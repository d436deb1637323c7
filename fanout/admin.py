"""The operator's console: how far along a run is, what failed and why, why an item waits,
which pool is saturated, and the actions that retry, cancel, release and re-dispatch.

Every page reads what it shows in a fixed number of queries (see admin_views); actions narrow
their queryset to eligible rows and delegate to recover/dispatch. Fields written by workers
are read-only: an item's status changes only through these actions.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import path, reverse
from django.utils import formats, timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.text import Truncator

from . import recover
from .admin_views import (
    ACTIVE_RUN_STATUSES,
    BAR_WIDTH,
    POLL_MILLISECONDS,
    SEGMENTS,
    Progress,
    failure_groups,
    human_duration,
    human_rate,
    last_line,
    progress_of,
    run_progress_view,
)
from .definition import get_definition
from .dispatch import dispatch
from .errors import FanoutError
from .filters import ItemClaimFilter
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from .pools import headroom, refill
from .report import pool_states

BOTH = [admin.ActionLocation.CHANGE_LIST, admin.ActionLocation.CHANGE_FORM]
# Runs whose failed items may be retried: a pending run is still writing items, and retrying
# would silently reopen a run an operator cancelled.
RETRYABLE_RUNS = (RunStatus.RUNNING, RunStatus.JOINING, RunStatus.SUCCEEDED, RunStatus.FAILED)
CANCELLABLE_RUNS = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _items_url(**params: Any) -> str:
    return f"{reverse('admin:fanout_itemclaim_changelist')}?{urlencode(params)}"


def _json_block(value: Any) -> str:
    if value is None:
        return "—"
    return format_html('<pre class="fanout-json">{}</pre>', json.dumps(value, indent=2))


def _short_time(value: datetime | None, time_only: bool = False) -> str:
    """A compact local time for a list column; the full one is in its tooltip."""
    if value is None:
        return ""
    local = timezone.localtime(value)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        formats.date_format(local, "DATETIME_FORMAT"),
        formats.date_format(local, "H:i:s" if time_only else "M j, H:i"),
    )


class PageChangeList(ChangeList):
    """A changelist whose admin reads what its columns show for the whole page at once."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        # Evaluates the page (the template then iterates the cached rows).
        self.model_admin.read_page(request, list(self.result_list))  # type: ignore[attr-defined]


class EstimatedCountPaginator(Paginator):
    """Counts filtered lists exactly, but takes PostgreSQL's estimate for a whole big table."""

    ESTIMATE_ABOVE = 50_000

    @cached_property
    def count(self) -> int:  # type: ignore[override]
        qs: QuerySet = self.object_list  # type: ignore[assignment]
        connection = connections[qs.db]
        if connection.vendor == "postgresql" and not qs.query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                    [qs.model._meta.db_table],
                )
                row = cursor.fetchone()
            if row and row[0] >= self.ESTIMATE_ABOVE:
                return int(row[0])
        return super().count


class _PermissionsMixin:
    """has_<name>_permission for the custom permissions named in the models' Meta."""

    custom_permissions: dict[str, str] = {}

    def _has(self, request: HttpRequest, name: str) -> bool:
        return request.user.has_perm(f"fanout.{self.custom_permissions[name]}")


def _runs(pks: list[int]) -> str:
    return f"run {pks[0]}" if len(pks) == 1 else f"runs {', '.join(map(str, sorted(pks)))}"


def _redispatch(model_admin: admin.ModelAdmin, request: HttpRequest, runs: list[BatchRun]) -> None:
    """Wake workers for the running ones among ``runs``, and tell the operator what happened."""
    inline, woken = [], []
    for run in runs:
        if run.status != RunStatus.RUNNING:
            continue
        if run.executor == "inline":
            # Worker threads must not run inside the web server, tied to its processes' lives.
            inline.append(run.pk)
            continue
        try:
            dispatch(run, get_definition(run.definition), run.executor)
        except (ImportError, FanoutError) as exc:
            model_admin.message_user(
                request, f"run {run.pk} could not be dispatched: {exc}", messages.ERROR
            )
        else:
            woken.append(run.pk)
    if woken:
        model_admin.message_user(request, f"Workers woken for {_runs(woken)}.", messages.INFO)
    if inline:
        command = f"`manage.py run_fanout --resume {inline[0] if len(inline) == 1 else 'ID'}`"
        model_admin.message_user(
            request,
            f"{_runs(inline)} {'uses' if len(inline) == 1 else 'use'} the inline executor: "
            f"start {'its' if len(inline) == 1 else 'their'} workers with {command}",
            messages.WARNING,
        )


# ------------------------------------------------------------------------------------ runs


@admin.register(BatchRun)
class BatchRunAdmin(_PermissionsMixin, admin.ModelAdmin):
    custom_permissions = {"retry": "retry_run", "cancel": "cancel_run", "dispatch": "dispatch_run"}

    list_display = (
        "definition",
        "run_key_short",
        "status_badge",
        "progress_bar",
        "counts",
        "items_per_second",
        "started",
        "finished",
        "duration_display",
    )
    list_display_links = ("definition", "run_key_short")
    list_filter = ("status", "definition", ("created_at", admin.DateFieldListFilter))
    search_fields = ("run_key",)
    search_help_text = "Search by run key."
    actions = ("retry_failed_items", "cancel_runs", "redispatch_runs")
    change_form_template = "fanout/admin/batchrun/change_form.html"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    ("definition", "status"),
                    "run_key",
                    "params_display",
                    ("max_parallel", "executor"),
                    ("failure_policy", "join_mode"),
                )
            },
        ),
        ("Timing", {"fields": (("created_at", "started_at", "finished_at"),)}),
        (
            "Bookkeeping",
            {
                "classes": ("collapse",),
                "fields": (
                    ("total_items", "materialized_upto"),
                    ("materialize_token", "materialize_lease_expires_at"),
                    ("join_token", "join_lease_expires_at"),
                ),
            },
        ),
    )
    # Only max_parallel is the operator's: the next claim of every worker obeys it.
    readonly_fields = (
        "definition",
        "status",
        "run_key",
        "params_display",
        "executor",
        "failure_policy",
        "join_mode",
        "created_at",
        "started_at",
        "finished_at",
        "total_items",
        "materialized_upto",
        "materialize_token",
        "materialize_lease_expires_at",
        "join_token",
        "join_lease_expires_at",
    )

    class Media:
        css = {"all": ("fanout/admin.css",)}
        js = ("fanout/run_progress.js",)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return PageChangeList

    def read_page(self, request: HttpRequest, runs: list[BatchRun]) -> None:
        now = timezone.now()
        progress, _ = progress_of([r.pk for r in runs], now)
        for run in runs:
            run.fanout_progress = progress[run.pk]  # type: ignore[attr-defined]
            run.fanout_now = now  # type: ignore[attr-defined]

    # Runs are created by starting a definition, and deleting one would list all its items.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "retry")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "cancel")

    def has_dispatch_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "dispatch")

    def get_urls(self) -> list:
        progress = self.admin_site.admin_view(
            lambda request, object_id: run_progress_view(self, request, object_id)
        )
        return [
            path("<path:object_id>/progress/", progress, name="fanout_batchrun_progress"),
            *super().get_urls(),
        ]

    def save_model(self, request: HttpRequest, obj: BatchRun, form: Any, change: bool) -> None:
        # Write only what the operator changed: every other column belongs to the workers.
        if change:
            fields = [f for f in form.changed_data if f not in self.readonly_fields]
            if fields:
                obj.save(update_fields=fields)
            return
        super().save_model(request, obj, form, change)

    # ------------------------------------------------------------------ columns

    @admin.display(description="run key", ordering="run_key")
    def run_key_short(self, run: BatchRun) -> str:
        return format_html(
            '<span title="{}">{}</span>', run.run_key, Truncator(run.run_key).chars(40)
        )

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: BatchRun) -> str:
        return format_html(
            '<span class="fanout-badge fanout-{}">{}</span>', run.status, run.get_status_display()
        )

    @admin.display(description="progress")
    def progress_bar(self, run: BatchRun) -> str:
        return render_to_string(
            "fanout/admin/progress_bar.html",
            {"progress": run.fanout_progress, "width": BAR_WIDTH, "compact": True},  # type: ignore[attr-defined]
        )

    @admin.display(description="items")
    def counts(self, run: BatchRun) -> str:
        p: Progress = run.fanout_progress  # type: ignore[attr-defined]
        return render_to_string("fanout/admin/run_counts.html", {"progress": p, "run": run})

    @admin.display(description="items/s")
    def items_per_second(self, run: BatchRun) -> str:
        return human_rate(run.fanout_progress.rate(run, run.fanout_now))  # type: ignore[attr-defined]

    @admin.display(description="started", ordering="started_at")
    def started(self, run: BatchRun) -> str:
        return _short_time(run.started_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, run: BatchRun) -> str:
        same_day = (
            run.started_at is not None
            and run.finished_at is not None
            and timezone.localdate(run.started_at) == timezone.localdate(run.finished_at)
        )
        return _short_time(run.finished_at, time_only=same_day)

    @admin.display(description="duration")
    def duration_display(self, run: BatchRun) -> str:
        return human_duration(run.duration)

    @admin.display(description="params")
    def params_display(self, run: BatchRun) -> str:
        return _json_block(run.params)

    # ------------------------------------------------------------------ change page

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: BatchRun | None = None,
    ) -> Any:
        if obj is not None:
            context.update(self.summary(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def summary(self, request: HttpRequest, run: BatchRun) -> dict[str, Any]:
        """Everything the run's page shows above its fields, in five queries."""
        now = timezone.now()
        progress_by_run, states = progress_of([run.pk], now)
        progress = progress_by_run[run.pk]
        actions = self.get_actions(request, action_location=admin.ActionLocation.CHANGE_FORM)
        buttons = []
        failed = progress.counts["failed"]
        if "retry_failed_items" in actions and failed and run.status in RETRYABLE_RUNS:
            buttons.append(("retry_failed_items", f"Retry {_plural(failed, 'failed item')}", ""))
        if "redispatch_runs" in actions and run.status == RunStatus.RUNNING:
            buttons.append(("redispatch_runs", "Re-dispatch", ""))
        if "cancel_runs" in actions and run.status in CANCELLABLE_RUNS:
            buttons.append(
                (
                    "cancel_runs",
                    "Cancel run",
                    "Cancel this run? Its pending items are cancelled; running ones finish.",
                )
            )
        pools = []
        for name, n in sorted(progress.pool_items.items()):
            state = states[name]
            limit = state.pool.max_concurrency if state.pool else 0
            pools.append(
                {
                    "state": state,
                    "items": n,
                    "url": self._pool_url(state.pool),
                    "high": max(1, limit - 1),
                    "gauge_label": f"{state.in_flight} / {limit}",
                }
            )
        return {
            "run": run,
            "progress": progress,
            "segments": SEGMENTS,
            "bar_width": BAR_WIDTH,
            "rate": human_rate(progress.rate(run, now)),
            "duration": human_duration(run.duration),
            "active": run.status in ACTIVE_RUN_STATUSES,
            "poll_url": reverse("admin:fanout_batchrun_progress", args=[run.pk]),
            "poll_ms": POLL_MILLISECONDS,
            "items_url": _items_url(run=run.pk),
            "legend": [
                {"status": s, "n": progress.counts[s], "url": _items_url(run=run.pk, status=s)}
                for s in SEGMENTS
            ],
            "join_result_json": json.dumps(run.join_result, indent=2),
            "failures": [
                {
                    "group": g,
                    "error": last_line(g.example.error) if g.example else "",
                    "url": _items_url(run=run.pk, status="failed", error_class=g.error_class)
                    if g.error_class
                    else _items_url(run=run.pk, status="failed"),
                }
                for g in failure_groups(run.pk)
            ],
            "pools": pools,
            "buttons": buttons,
            "action_field": f"{admin.ActionLocation.CHANGE_FORM.value}-action",
        }

    @staticmethod
    def _pool_url(pool: CapacityPool | None) -> str:
        if pool is None:
            return ""
        return reverse("admin:fanout_capacitypool_change", args=[pool.pk])

    # ------------------------------------------------------------------ actions

    @admin.action(description="Retry failed items", permissions=["retry"], location=BOTH)
    def retry_failed_items(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> None:
        failed = ItemClaim.objects.filter(run=OuterRef("pk"), status=ItemStatus.FAILED)
        runs = list(queryset.filter(status__in=RETRYABLE_RUNS).filter(Exists(failed)))
        retried = 0
        for run in runs:
            count = recover.retry_failed(run)
            retried += count
            self.log_change(request, run, f"Retried {_plural(count, 'failed item')}.")
        self.message_user(
            request,
            f"{_plural(retried, 'failed item')} of {_plural(len(runs), 'run')} back to pending.",
            messages.SUCCESS if retried else messages.WARNING,
        )
        _redispatch(self, request, runs)

    @admin.action(description="Cancel run", permissions=["cancel"], location=BOTH)
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> None:
        runs = list(queryset.filter(status__in=CANCELLABLE_RUNS))
        cancelled_items = 0
        for run in runs:
            cancelled_items += recover.cancel_run(run)
            self.log_change(request, run, "Cancelled.")
        self.message_user(
            request,
            f"Cancelled {_plural(len(runs), 'run')}: {_plural(cancelled_items, 'pending item')} "
            "cancelled; running items finish.",
            messages.SUCCESS if runs else messages.WARNING,
        )

    @admin.action(description="Re-dispatch (wake workers)", permissions=["dispatch"], location=BOTH)
    def redispatch_runs(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> None:
        runs = list(queryset.filter(status=RunStatus.RUNNING))
        if not runs:
            self.message_user(request, "No running run selected.", messages.WARNING)
        _redispatch(self, request, runs)


# ----------------------------------------------------------------------------------- items


@admin.register(ItemClaim)
class ItemClaimAdmin(_PermissionsMixin, admin.ModelAdmin):
    custom_permissions = {
        "retry": "retry_item",
        "cancel": "cancel_item",
        "force_release": "force_release_item",
    }

    list_display = (
        "key_short",
        "run_link",
        "status_badge",
        "attempts",
        "owner_short",
        "lease_expires_in",
        "why_it_waits",
        "last_error",
        "duration_display",
    )
    list_filter = (ItemClaimFilter,)
    list_select_related = ("run",)
    search_fields = ("key", "error")
    search_help_text = "Search by item key or error text."
    show_facets = admin.ShowFacets.NEVER
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    # Work-list order, served by the (run, index) unique index.
    ordering = ("run_id", "index")
    actions = ("retry_items", "cancel_items", "force_release_leases")
    fieldsets = (
        (None, {"fields": (("key", "index"), "run", ("status", "pool"), "payload_display")}),
        (
            "Claim",
            {
                "fields": (
                    ("owner", "claim_token"),
                    ("claimed_at", "lease_expires_at"),
                    ("attempt", "crashes", "next_attempt_at"),
                    "why_it_waits_now",
                )
            },
        ),
        (
            "Outcome",
            {
                "fields": (
                    ("started_at", "finished_at"),
                    "result_display",
                    "error_class",
                    "error_display",
                )
            },
        ),
    )

    class Media:
        css = {"all": ("fanout/admin.css",)}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return PageChangeList

    def read_page(self, request: HttpRequest, items: list[ItemClaim]) -> None:
        """Decide "why it waits" for the page: pools and runs' live leases read once, grouped."""
        now = timezone.now()
        pending = [i for i in items if i.status == ItemStatus.PENDING]
        states = pool_states({i.pool for i in pending}, now) if pending else {}
        run_ids = {i.run_id for i in pending}
        in_flight = (
            dict(
                ItemClaim.objects.in_flight(now)
                .filter(run_id__in=run_ids)
                .values("run_id")
                .annotate(n=Count("pk"))
                .order_by()
                .values_list("run_id", "n")
            )
            if run_ids
            else {}
        )
        for item in items:
            item.fanout_now = now  # type: ignore[attr-defined]
            item.fanout_waits, item.fanout_held = (  # type: ignore[attr-defined]
                self._why_it_waits(item, now, states, in_flight.get(item.run_id, 0))
                if item.status == ItemStatus.PENDING
                else ("", False)
            )

    @staticmethod
    def _why_it_waits(
        item: ItemClaim, now: datetime, states: dict, in_flight: int
    ) -> tuple[str, bool]:
        """Why a pending item is not running, and whether it is held back (a "waiting" item)."""
        run = item.run
        if run.status == RunStatus.PENDING:
            return "its run is still writing items", False
        if run.status != RunStatus.RUNNING:
            return f"its run is {run.get_status_display().lower()}", False
        if item.next_attempt_at > now:
            return f"retry due in {human_duration(item.next_attempt_at - now)}", True
        state = states.get(item.pool)
        if state is not None and state.reason:
            return f"{item.pool}: {state.reason}", True
        if in_flight >= run.max_parallel:
            return f"run at max_parallel ({in_flight}/{run.max_parallel})", False
        return "ready: the next free worker claims it", False

    # Items change only through the actions below.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "retry")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "cancel")

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "force_release")

    # ------------------------------------------------------------------ columns

    @admin.display(description="run", ordering="run_id")
    def run_link(self, item: ItemClaim) -> str:
        url = reverse("admin:fanout_batchrun_change", args=[item.run_id])
        return format_html('<a href="{}" title="{}">#{}</a>', url, str(item.run), item.run_id)

    @admin.display(description="key", ordering="key")
    def key_short(self, item: ItemClaim) -> str:
        return format_html('<span title="{}">{}</span>', item.key, Truncator(item.key).chars(40))

    @admin.display(description="lease holder", ordering="owner")
    def owner_short(self, item: ItemClaim) -> str:
        if not item.owner:
            return ""
        return format_html(
            '<span title="{}">{}</span>', item.owner, Truncator(item.owner).chars(28)
        )

    @admin.display(description="status", ordering="status")
    def status_badge(self, item: ItemClaim) -> str:
        if getattr(item, "fanout_held", False):
            return format_html(
                '<span class="fanout-badge fanout-waiting" title="{}">waiting</span>',
                "pending, held back",
            )
        return format_html(
            '<span class="fanout-badge fanout-{}">{}</span>', item.status, item.get_status_display()
        )

    @admin.display(description="attempt", ordering="attempt")
    def attempts(self, item: ItemClaim) -> str:
        try:
            most = str(get_definition(item.run.definition).max_attempts)
        except FanoutError:
            most = "?"
        return f"{item.attempt}/{most}"

    @admin.display(description="lease expires", ordering="lease_expires_at")
    def lease_expires_in(self, item: ItemClaim) -> str:
        if item.status != ItemStatus.RUNNING or item.lease_expires_at is None:
            return ""
        now = getattr(item, "fanout_now", None) or timezone.now()
        left = item.lease_expires_at - now
        if left <= timedelta(0):
            return format_html(
                '<span class="fanout-expired">expired {} ago</span>', human_duration(-left)
            )
        return f"in {human_duration(left)}"

    @admin.display(description="why it waits")
    def why_it_waits(self, item: ItemClaim) -> str:
        return getattr(item, "fanout_waits", "")

    @admin.display(description="last error")
    def last_error(self, item: ItemClaim) -> str:
        line = last_line(item.error)
        if not line:
            return ""
        return format_html(
            '<span class="fanout-error" title="{}">{}</span>', line, Truncator(line).chars(80)
        )

    @admin.display(description="duration")
    def duration_display(self, item: ItemClaim) -> str:
        return human_duration(item.duration)

    @admin.display(description="why it waits")
    def why_it_waits_now(self, item: ItemClaim) -> str:
        if item.status != ItemStatus.PENDING:
            return ""
        now = timezone.now()
        in_flight = ItemClaim.objects.in_flight(now).filter(run_id=item.run_id).count()
        reason, _ = self._why_it_waits(item, now, pool_states([item.pool], now), in_flight)
        return reason

    @admin.display(description="payload")
    def payload_display(self, item: ItemClaim) -> str:
        return _json_block(item.payload)

    @admin.display(description="result")
    def result_display(self, item: ItemClaim) -> str:
        return _json_block(item.result)

    @admin.display(description="error")
    def error_display(self, item: ItemClaim) -> str:
        return (
            format_html('<pre class="fanout-traceback">{}</pre>', item.error) if item.error else ""
        )

    # ------------------------------------------------------------------ actions

    @admin.action(description="Retry selected failed items", permissions=["retry"], location=BOTH)
    def retry_items(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> None:
        failed = queryset.filter(status=ItemStatus.FAILED)
        runs = list(
            BatchRun.objects.filter(
                pk__in=failed.values("run_id"), status__in=RETRYABLE_RUNS
            ).order_by("pk")
        )
        retried = sum(recover.retry_failed(run, failed) for run in runs)
        skipped = queryset.count() - retried
        text = f"{_plural(retried, 'failed item')} back to pending."
        if skipped:
            text += (
                f" {_plural(skipped, 'item')} skipped: not failed, or their run is pending"
                " or cancelled."
            )
        self.message_user(request, text, messages.SUCCESS if retried else messages.WARNING)
        _redispatch(self, request, runs)

    @admin.action(
        description="Cancel selected pending items", permissions=["cancel"], location=BOTH
    )
    def cancel_items(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> None:
        pending = queryset.filter(status=ItemStatus.PENDING)
        run_ids = list(pending.values_list("run_id", flat=True).distinct().order_by())
        cancelled = recover.cancel_items(pending)
        self.message_user(
            request,
            f"Cancelled {_plural(cancelled, 'pending item')}.",
            messages.SUCCESS if cancelled else messages.WARNING,
        )
        done = (
            BatchRun.objects.filter(pk__in=run_ids, status=RunStatus.RUNNING)
            .exclude(Exists(ItemClaim.objects.filter(run=OuterRef("pk")).unfinished()))
            .values_list("pk", flat=True)
        )
        for pk in done:
            # The join runs in a worker, never in a web request.
            self.message_user(
                request,
                f"run {pk} has no unfinished items left: its workers join it; if none are "
                f"running, `manage.py run_fanout --resume {pk}` does.",
                messages.INFO,
            )

    @admin.action(
        description="Force-release the lease of selected running items",
        permissions=["force_release"],
        location=BOTH,
    )
    def force_release_leases(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> None:
        released = recover.force_release(queryset)
        self.message_user(
            request,
            f"Released {_plural(released, 'lease')}: those items are pending again, and their "
            "old holders' late writes will be refused.",
            messages.SUCCESS if released else messages.WARNING,
        )


# ----------------------------------------------------------------------------------- pools


@admin.register(CapacityPool)
class CapacityPoolAdmin(_PermissionsMixin, admin.ModelAdmin):
    custom_permissions = {"pause": "pause_pool"}

    list_display = (
        "name",
        "state",
        "concurrency_gauge",
        "admissions",
        "waiting_items",
        "paused_flag",
        "limits",
    )
    list_filter = ("paused",)
    search_fields = ("name",)
    actions = ("pause_pools", "resume_pools")
    fieldsets = (
        (None, {"fields": ("name", "paused_flag")}),
        (
            "Limits",
            {"fields": ("max_concurrency", ("rate_count", "rate_period"), "burst")},
        ),
        (
            "Admission state (written by workers)",
            {
                "classes": ("collapse",),
                "fields": (
                    ("tokens", "tokens_at"),
                    "backoff_until",
                    "waiters",
                    ("created_at", "updated_at"),
                ),
            },
        ),
    )
    worker_fields = ("tokens", "tokens_at", "backoff_until", "waiters", "created_at", "updated_at")
    editable_fields = ("name", "max_concurrency", "rate_count", "rate_period", "burst")

    class Media:
        css = {"all": ("fanout/admin.css",)}

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # Pausing has its own permission (the actions); a pool's items refer to it by name.
        fixed = ("paused_flag", *self.worker_fields)
        return ("name", *fixed) if obj is not None else fixed

    def get_actions(
        self, request: HttpRequest, action_location: Any = admin.ActionLocation.CHANGE_LIST
    ) -> dict[str, Any]:
        actions = super().get_actions(request, action_location=action_location)
        # A pool is deleted one at a time, where its page can refuse it while items use it.
        actions.pop("delete_selected", None)
        return actions

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and ItemClaim.objects.filter(pool=obj.name).unfinished().exists():
            return False  # its unfinished items would wait for it forever
        return super().has_delete_permission(request, obj)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "pause")

    def save_model(self, request: HttpRequest, obj: CapacityPool, form: Any, change: bool) -> None:
        # Never write back the token bucket or backoff read when the form was opened.
        if change:
            fields = [f for f in form.changed_data if f in self.editable_fields]
            if fields:
                obj.save(update_fields=[*fields, "updated_at"])
            return
        super().save_model(request, obj, form, change)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return PageChangeList

    def read_page(self, request: HttpRequest, pools: list[CapacityPool]) -> None:
        """Live leases, admissions in each pool's rate period and pending items: one query."""
        if not pools:
            return
        now = timezone.now()
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
                waiting=Count("pk", filter=Q(status=ItemStatus.PENDING)),
            )
            .order_by()
        }
        for pool in pools:
            row = rows.get(pool.name, {})
            pool.fanout_in_flight = row.get("in_flight", 0)  # type: ignore[attr-defined]
            pool.fanout_admitted = row.get("admitted", 0)  # type: ignore[attr-defined]
            pool.fanout_waiting = row.get("waiting", 0)  # type: ignore[attr-defined]
            refill(pool, now)
            pool.fanout_reason = headroom(pool, pool.fanout_in_flight, now).reason  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ columns

    @admin.display(description="state")
    def state(self, pool: CapacityPool) -> str:
        reason = getattr(pool, "fanout_reason", "")
        css = "paused" if pool.paused else ("blocked" if reason else "admitting")
        return format_html(
            '<span class="fanout-badge fanout-pool-{}">{}</span>', css, reason or "admitting"
        )

    @admin.display(description="in flight")
    def concurrency_gauge(self, pool: CapacityPool) -> str:
        n, limit = getattr(pool, "fanout_in_flight", 0), pool.max_concurrency
        return render_to_string(
            "fanout/admin/gauge.html",
            {"value": n, "limit": limit, "high": max(1, limit - 1), "label": f"{n} / {limit}"},
        )

    @admin.display(description="admitted in the last period")
    def admissions(self, pool: CapacityPool) -> str:
        n = getattr(pool, "fanout_admitted", 0)
        period = f"{pool.rate_period:g}s"
        if pool.rate_count is None:
            return f"{n} in {period} (no rate limit)"
        return render_to_string(
            "fanout/admin/gauge.html",
            {
                "value": min(n, pool.rate_count),
                "limit": pool.rate_count,
                "high": max(1, pool.rate_count - 1),
                "label": f"{n} / {pool.rate_count} per {period}",
            },
        )

    @admin.display(description="waiting items")
    def waiting_items(self, pool: CapacityPool) -> str:
        n = getattr(pool, "fanout_waiting", 0)
        if not n:
            return "0"
        return format_html(
            '<a href="{}">{}</a>', _items_url(pool=pool.name, status="pending"), f"{n:,}"
        )

    @admin.display(description="paused", ordering="paused")
    def paused_flag(self, pool: CapacityPool) -> str:
        # Not the admin's boolean icon: its green tick would call a paused pool healthy.
        return "paused" if pool.paused else ""

    @admin.display(description="limits")
    def limits(self, pool: CapacityPool) -> str:
        return f"{pool.max_concurrency} at once · {pool.describe_rate()}"

    # ------------------------------------------------------------------ actions

    @admin.action(description="Pause selected pools", permissions=["pause"], location=BOTH)
    def pause_pools(self, request: HttpRequest, queryset: QuerySet[CapacityPool]) -> None:
        count = queryset.filter(paused=False).update(paused=True, updated_at=timezone.now())
        self.message_user(
            request, f"Paused {_plural(count, 'pool')}: they admit no new items.", messages.SUCCESS
        )

    @admin.action(description="Resume selected pools", permissions=["pause"], location=BOTH)
    def resume_pools(self, request: HttpRequest, queryset: QuerySet[CapacityPool]) -> None:
        count = queryset.filter(paused=True).update(paused=False, updated_at=timezone.now())
        self.message_user(request, f"Resumed {_plural(count, 'pool')}.", messages.SUCCESS)
