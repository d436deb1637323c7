"""Runs: a list with each run's progress and why it waits, a page that follows the run live
(progress, failures by error class, the join, its pools), and retry, cancel and re-dispatch."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Exists, OuterRef, QuerySet
from django.http import Http404, HttpRequest, HttpResponseRedirect, JsonResponse
from django.template.loader import render_to_string
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme

from .. import actions, compensate
from ..actions import RETRYABLE_RUNS
from ..clock import db_now
from ..definition import get_definition
from ..errors import FanoutError
from ..models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from ..report import (
    BAR_WIDTH,
    HELD_BACK,
    SEGMENTS,
    Progress,
    failure_groups,
    progress_of,
    tree_report,
)
from ..text import human_duration, human_rate, plural
from ..waiting import PoolState
from .charts import run_panels
from .common import (
    CANCELLABLE_RUNS,
    FanoutAdmin,
    action,
    confirm_stranded,
    counter_drift_display,
    gauge,
    items_url,
    json_block,
    page_action_form,
    page_actions,
    page_facts,
    redispatch,
    short_error,
    stranded_runs,
    time_field,
    timestamp,
    wrapped,
)
from .filters import HELD
from .spend import run_spend

ACTIVE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)
POLL_MILLISECONDS = 2000


def progress_payload(progress: Progress) -> dict[str, Any]:
    """What the run page's poll needs to redraw its bar, counts and reasons."""
    run = progress.run
    return {
        "run": run.pk,
        "status": run.status,
        "status_label": run.get_status_display(),
        "active": run.status in ACTIVE_RUN_STATUSES,
        "counts": progress.by_segment,
        "total": progress.total,
        "done": progress.done,
        "percent_done": round(progress.percent_done, 1),
        "segments": progress.segments(),
        "rate": human_rate(progress.rate()),
        "duration": human_duration(run.duration),
        "waiting": progress.held_back,  # the page's "Waiting:" line (run_progress.js)
        "why": progress.why,
        "stalled": progress.stalled,
    }


def key_part(run: BatchRun) -> str:
    """What tells a run apart from the other runs of its definition: its key without the
    definition's name, which has its own column (a default key is name:params)."""
    prefix = f"{run.definition}:"
    return run.run_key.removeprefix(prefix) if run.run_key != prefix else run.run_key


def why_it_failed(run: BatchRun, progress: Progress) -> str:
    """Why a failed run failed: its error, or (collect and all policies record none) how many
    items failed and the first one's error."""
    if run.status != RunStatus.FAILED:
        return ""
    if run.error:
        return short_error(run.error)
    first = (
        ItemClaim.objects.filter(run_id=run.pk, status=ItemStatus.FAILED)
        .order_by("finished_at", "index")
        .only("error")
        .first()
    )
    failed = progress.by_segment.get("failed", 0)
    text = f"{failed:,} of {progress.total:,} items failed"
    return f"{text}: {short_error(first.error)} (first)" if first and first.error else text


def _offers_retry(buttons: list[tuple]) -> bool:
    return any(name == "retry_failed_items" for name, *_ in buttons)


def get_definition_or_none(name: str) -> Any:
    try:
        return get_definition(name)
    except FanoutError:
        return None


@admin.register(BatchRun)
class BatchRunAdmin(FanoutAdmin):
    list_display = (
        "run_id",
        "run_name",
        "status_badge",
        "progress_bar",
        "started",
        "duration_display",
    )
    list_display_links = ("run_id", "run_name")
    list_filter = ("status", "definition", ("created_at", admin.DateFieldListFilter))
    search_fields = ("run_key",)
    search_help_text = "Search by run key."
    actions = (
        "retry_failed_items",
        "cancel_runs",
        "cancel_and_compensate_runs",
        "retry_failed_compensations",
        "redispatch_runs",
    )
    change_form_template = "fanout/admin/batchrun/change_form.html"
    fieldsets = (
        (
            None,
            {
                "fields": (
                    ("definition", "status"),
                    "run_key",
                    ("parent_link", "tree_counts"),
                    "params_display",
                    ("max_parallel", "executor"),
                    ("failure_policy", "join_mode"),
                )
            },
        ),
        ("Timing", {"fields": (("created", "started", "finished"),)}),
        (
            "Bookkeeping",
            {
                "classes": ("collapse",),
                "fields": (
                    ("total_items", "materialized_upto"),
                    ("in_flight", "stalled"),
                    "counter_drift_display",
                    ("materialize_token", "materialize_lease_expires"),
                    ("join_token", "join_lease_expires"),
                    ("join_runs", "join_failures"),
                ),
            },
        ),
    )
    # Only max_parallel is the operator's: the next claim of every worker obeys it.
    readonly_fields = (
        "parent_link",
        "tree_counts",
        "definition",
        "status",
        "run_key",
        "params_display",
        "executor",
        "failure_policy",
        "join_mode",
        "created",
        "started",
        "finished",
        "total_items",
        "materialized_upto",
        "materialize_token",
        "materialize_lease_expires",
        "join_token",
        "join_lease_expires",
        "in_flight",
        "stalled",
        "counter_drift_display",
        "join_runs",
        "join_failures",
    )

    class Media:
        js = ("fanout/run_progress.js",)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[BatchRun], **kwargs: Any
    ) -> Any:
        """Before Django 6.1 a run page's buttons post to the list's actions: come back."""
        response = super().response_action(request, queryset, **kwargs)
        back = request.POST.get("_return_to", "")
        if (
            response is not None
            and response.status_code == 302
            and back
            and url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()})
        ):
            return HttpResponseRedirect(back)
        return response

    @admin.display(description="parent item")
    def parent_link(self, run: BatchRun) -> str:
        """The item of another run that handed its work to this one (Item.spawn)."""
        if run.parent_item_id is None:
            return "-"
        item = run.parent_item
        assert item is not None
        url = reverse("admin:fanout_itemclaim_change", args=[item.pk])
        return format_html('<a href="{}">{} of run #{}</a>', url, item.key, item.run_id)

    @admin.display(description="its tree")
    def tree_counts(self, run: BatchRun) -> str:
        """Runs below this one, and their items per status, summed over every level."""
        tree = tree_report(run).get("tree")
        if tree is None:
            return "-"
        counts = ", ".join(f"{n:,} {s}" for s, n in tree["counts"].items() if n)
        return f"{tree['runs']} runs: {counts}"

    def read_page(self, request: HttpRequest, runs: list[BatchRun]) -> dict[int, Progress]:
        """Each run's progress, for its status and its bar."""
        progress, _ = progress_of(runs, db_now())
        return progress

    # Runs are created by starting a definition, and deleting one would list all its items.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "retry_run")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "cancel_run")

    def has_dispatch_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "dispatch_run")

    def get_urls(self) -> list:
        progress = self.admin_site.admin_view(self.progress_view)
        return [
            path("<path:object_id>/progress/", progress, name="fanout_batchrun_progress"),
            *super().get_urls(),
        ]

    def progress_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """GET: the run's progress as JSON, for the poll on its change page."""
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404("no such run")
        if not self.has_view_or_change_permission(request, run):
            raise PermissionDenied
        progress, _ = progress_of([run], db_now())
        response = JsonResponse(progress_payload(progress[run.pk]))
        response["Cache-Control"] = "no-store"
        return response

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = super().get_readonly_fields(request, obj)
        if obj is not None and obj.is_terminal:
            return (*fields, "max_parallel")  # nothing claims for a finished run any more
        return fields

    def save_model(self, request: HttpRequest, obj: BatchRun, form: Any, change: bool) -> None:
        # Write only what the operator changed: every other column belongs to the workers.
        if change:
            fields = [f for f in form.changed_data if f not in self.readonly_fields]
            if fields:
                obj.save(update_fields=fields)
            return
        super().save_model(request, obj, form, change)

    # ------------------------------------------------------------------ columns

    @admin.display(description="id", ordering="pk")
    def run_id(self, run: BatchRun) -> str:
        return f"#{run.pk}"

    @admin.display(description="run", ordering="definition")
    def run_name(self, run: BatchRun) -> str:
        return format_html("{}{}", run.definition, wrapped(key_part(run), "fanout-sub"))

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: BatchRun) -> str:
        # An open run that nobody works on says so where the eye lands first, not only in the
        # reason under its bar: "Running" there read as all well.
        progress: Progress | None = page_facts(run)
        if progress is not None and progress.stalled and not run.is_terminal:
            return format_html(
                '<span class="fanout-badge fanout-failed" title="{}">Stalled</span>',
                run.get_status_display(),
            )
        return format_html(
            '<span class="fanout-badge fanout-{}">{}</span>', run.status, run.get_status_display()
        )

    @admin.display(description="progress")
    def progress_bar(self, run: BatchRun) -> str:
        progress: Progress | None = page_facts(run)
        if progress is None:
            return ""
        return render_to_string(
            "fanout/admin/run_progress_cell.html",
            {
                "progress": progress,
                "counts": progress.by_segment,
                "run": run,
                "width": BAR_WIDTH,
                "rate": human_rate(progress.rate()),
            },
        )

    counter_drift_display = counter_drift_display
    started = time_field("started_at", "started")
    created = time_field("created_at", "created")
    materialize_lease_expires = time_field(
        "materialize_lease_expires_at", "materialize lease expires"
    )
    join_lease_expires = time_field("join_lease_expires_at", "join lease expires")

    finished = time_field("finished_at", "finished")

    @admin.display(description="duration")
    def duration_display(self, run: BatchRun) -> str:
        if run.finished_at is None:
            return human_duration(run.duration)
        same_day = run.started_at is not None and timezone.localdate(
            run.started_at
        ) == timezone.localdate(run.finished_at)
        return format_html(
            '{}<span class="fanout-sub">until {}</span>',
            human_duration(run.duration),
            timestamp(run.finished_at, time_only=same_day),
        )

    @admin.display(description="params")
    def params_display(self, run: BatchRun) -> str:
        return json_block(run.params)

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
            if obj.is_terminal:
                # Nothing on a finished run's page is editable: no Save buttons.
                context.update(show_save=False, show_save_and_continue=False)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def summary(self, request: HttpRequest, run: BatchRun) -> dict[str, Any]:
        """Everything the run's page shows above its fields, in a handful of queries."""
        now = db_now()
        progress_by_run, states = progress_of([run], now)
        progress = progress_by_run[run.pk]
        counts = progress.by_segment
        buttons = self._buttons(request, run, counts["failed"])
        return {
            "run": run,
            "progress": progress,
            "counts": counts,
            "bar_width": BAR_WIDTH,
            "rate": human_rate(progress.rate()),
            "duration": human_duration(run.duration),
            "active": run.status in ACTIVE_RUN_STATUSES,
            "legend": _legend(run, counts),
            "join_result_json": json.dumps(run.join_result, indent=2),
            "counter_drift": counter_drift_display(self, run) if run.counter_drift else "",
            "lost": workers_lost(run),
            "failed_why": why_it_failed(run, progress),
            "failures": _failures(run),
            "pools": [
                self._pool_row(states[name], n) for name, n in sorted(progress.pool_items.items())
            ],
            "spend": run_spend(run, now),
            "charts": run_panels(run, now),
            "buttons": buttons,
            "retry_note": self._retry_note(run) if buttons and _offers_retry(buttons) else "",
            **_page_links(run),
        }

    def _pool_row(self, state: PoolState, n: int) -> dict[str, Any]:
        """A row of the Pools panel: the pool's state, this run's items in it, its gauge."""
        limit = state.pool.max_concurrency if state.pool else 0
        return {
            "state": state,
            "items": n,
            "url": self._pool_url(state.pool),
            "gauge": gauge(state.in_flight, limit, f"{state.in_flight} / {limit}"),
        }

    def _buttons(self, request: HttpRequest, run: BatchRun, failed: int) -> list[tuple]:
        """The run page's action buttons its viewer may press: (action, label, confirmation)."""
        actions = page_actions(self, request)
        buttons = []
        if "retry_failed_items" in actions and failed and run.status in RETRYABLE_RUNS:
            buttons.append(("retry_failed_items", f"Retry {plural(failed, 'failed item')}", ""))
        if "redispatch_runs" in actions and run.status == RunStatus.RUNNING:
            buttons.append(("redispatch_runs", "Re-dispatch", ""))
        if "cancel_runs" in actions and run.status in CANCELLABLE_RUNS:
            confirm = "Cancel this run? Its pending items are cancelled; running ones finish."
            buttons.append(("cancel_runs", "Cancel run", confirm))
        compensable = get_definition_or_none(run.definition)
        if (
            "cancel_and_compensate_runs" in actions
            and run.status in CANCELLABLE_RUNS
            and compensable is not None
            and compensable.compensate is not None
        ):
            confirm = "Cancel this run and undo every item that succeeded?"
            buttons.append(("cancel_and_compensate_runs", "Cancel and compensate", confirm))
        if "retry_failed_compensations" in actions and run.status == "compensation_failed":
            buttons.append(("retry_failed_compensations", "Retry failed compensations", ""))
        return buttons

    @staticmethod
    def _retry_note(run: BatchRun) -> str:
        """What the retry button does with an inline run, said before it is pressed."""
        if run.executor != "inline":
            return ""
        stranded = stranded_runs([run])
        if stranded:
            return (
                "This run uses the inline executor and RQ cannot take it over here "
                f"({stranded[0][1]}): retried items stay pending until someone runs "
                f"`manage.py run_fanout --resume {run.pk}`."
            )
        queue = get_definition(run.definition).queue
        return f"This run uses the inline executor: retried items run on RQ workers ({queue!r})."

    @staticmethod
    def _pool_url(pool: CapacityPool | None) -> str:
        if pool is None:
            return ""
        return reverse("admin:fanout_capacitypool_change", args=[pool.pk])

    # ------------------------------------------------------------------ actions

    @action(description="Retry failed items", permissions=["retry"])
    def retry_failed_items(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> Any:
        failed = ItemClaim.objects.filter(run=OuterRef("pk"), status=ItemStatus.FAILED)
        runs = list(queryset.filter(status__in=RETRYABLE_RUNS).filter(Exists(failed)))
        if confirm := confirm_stranded(self, request, runs, "Retry failed items"):
            return confirm
        retried = 0
        for run in runs:
            count = actions.retry_failed(run)
            retried += count
            self.log_change(request, run, f"Retried {plural(count, 'failed item')}.")
        self.message_user(
            request,
            f"{plural(retried, 'failed item')} of {plural(len(runs), 'run')} back to pending.",
            messages.SUCCESS if retried else messages.WARNING,
        )
        redispatch(self, request, runs)

    @action(description="Cancel run", permissions=["cancel"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> None:
        runs = list(queryset.filter(status__in=CANCELLABLE_RUNS))
        cancelled_items = 0
        for run in runs:
            cancelled_items += actions.cancel_run(run)
            self.log_change(request, run, "Cancelled.")
        self.message_user(
            request,
            f"Cancelled {plural(len(runs), 'run')}: {plural(cancelled_items, 'pending item')} "
            "cancelled; running items finish.",
            messages.SUCCESS if runs else messages.WARNING,
        )

    @action(description="Cancel and compensate (undo what succeeded)", permissions=["cancel"])
    def cancel_and_compensate_runs(
        self, request: HttpRequest, queryset: QuerySet[BatchRun]
    ) -> None:
        done, refused = [], []
        for run in queryset.filter(status__in=CANCELLABLE_RUNS):
            try:
                actions.cancel_run(run, compensate=True)
            except FanoutError as exc:
                refused.append(f"run {run.pk}: {exc}")
                continue
            self.log_change(request, run, "Cancelled to compensate.")
            done.append(run)
        if done:
            redispatch(self, request, done)
        text = f"Compensating {plural(len(done), 'run')}: their succeeded items are undone."
        if refused:
            text += " Not compensated: " + "; ".join(refused)
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @action(description="Retry failed compensations", permissions=["retry"])
    def retry_failed_compensations(
        self, request: HttpRequest, queryset: QuerySet[BatchRun]
    ) -> None:
        runs = list(queryset.filter(status=RunStatus.COMPENSATION_FAILED))
        count = sum(compensate.retry_failed_compensations(run) for run in runs)
        if runs:
            redispatch(self, request, runs)
        self.message_user(
            request,
            f"{plural(count, 'compensation')} of {plural(len(runs), 'run')} due again.",
            messages.SUCCESS if count else messages.WARNING,
        )

    @action(description="Re-dispatch (wake workers)", permissions=["dispatch"])
    def redispatch_runs(self, request: HttpRequest, queryset: QuerySet[BatchRun]) -> None:
        runs = list(queryset.filter(status=RunStatus.RUNNING))
        if not runs:
            self.message_user(request, "No running run selected.", messages.WARNING)
        redispatch(self, request, runs)


def _page_links(run: BatchRun) -> dict[str, Any]:
    """Where the run page polls its progress, lists its items and posts its buttons."""
    action_url, action_field = page_action_form(reverse("admin:fanout_batchrun_changelist"))
    return {
        "poll_url": reverse("admin:fanout_batchrun_progress", args=[run.pk]),
        "poll_ms": POLL_MILLISECONDS,
        "items_url": items_url(run=run.pk),
        "action_url": action_url,
        "action_field": action_field,
    }


def _legend(run: BatchRun, counts: dict[str, int]) -> list[dict[str, Any]]:
    """The progress bar's legend: each segment's count, linked to its items."""
    return [
        {
            "status": s,
            "n": counts[s],
            "url": items_url(run=run.pk, status=HELD if s == HELD_BACK else s),
        }
        for s in SEGMENTS
        if s in counts
    ]


def _failures(run: BatchRun) -> list[dict[str, Any]]:
    """The run's failed items by error class, each linked to its items, with an example."""
    return [
        {
            "group": g,
            "error": short_error(g.example.error) if g.example else "",
            "url": items_url(run=run.pk, status="failed", error_class=g.error_class)
            if g.error_class
            else items_url(run=run.pk, status="failed"),
        }
        for g in failure_groups(run.pk)
    ]


def workers_lost(run: BatchRun) -> str:
    """How many attempts of the run a dead (or stopped) worker cut off: each left a WorkerLost
    attempt in its item's history when its lease was reclaimed. One query over the attempt
    history, which holds failed attempts only."""
    lost = ItemAttempt.objects.filter(item__run_id=run.pk, error_class="WorkerLost").aggregate(
        attempts=Count("pk"), items=Count("item_id", distinct=True)
    )
    if not lost["attempts"]:
        return ""
    return (
        f"{plural(lost['attempts'], 'attempt')} of {plural(lost['items'], 'item')} "
        f"{'was' if lost['attempts'] == 1 else 'were'} cut off "
        "by a worker that stopped renewing its lease (each item ran again, or failed past its "
        "crash budget)"
    )
