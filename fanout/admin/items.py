"""Items: a list filtered with django-filter that says why each pending item waits and what
each failed one raised, an item's page, and retry, cancel and force-release. Items are written
by workers only: nobody adds, edits or deletes one by hand."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.dateformat import format as date_format
from django.utils.html import format_html, format_html_join

from .. import actions
from ..actions import RETRYABLE_RUNS
from ..clock import db_now
from ..definition import get_definition
from ..errors import FanoutError
from ..models import BatchRun, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from ..text import human_duration, last_line, plural
from ..waiting import why_items_wait
from .common import (
    TIME_FORMAT,
    FanoutAdmin,
    action,
    clipped,
    confirm_stranded,
    json_block,
    page_facts,
    redispatch,
    short_error,
    time_field,
    worker_name,
    wrapped,
)
from .filters import ItemClaimFilter

# The columns a status filter leaves empty, left out so the others have room.
EMPTY_COLUMNS = {
    "pending": ("lease", "duration_display"),
    "held": ("lease", "duration_display"),
    "running": ("why_it_waits", "duration_display"),
    "waiting": ("why_it_waits", "lease", "duration_display"),
    "succeeded": ("why_it_waits",),
    "failed": ("why_it_waits",),
    "cancelled": ("why_it_waits",),
    "compensating": ("why_it_waits",),
    "compensated": ("why_it_waits",),
    "compensation_failed": ("why_it_waits",),
}


WORKER_LOST = "WorkerLost"  # the error class of an attempt whose worker stopped renewing
PENDING_ONLY = ("why_it_waits_now", "next_attempt")


@dataclass(frozen=True)
class ItemRow:
    """An item's line in the list: the time the page was read at, why a pending item waits,
    and whether that holds it back (a full or paused pool, a retry not yet due)."""

    now: datetime
    why: str = ""
    held_back: bool = False


def _without(fields: Any, names: tuple[str, ...]) -> list[Any]:
    """A fieldset's fields (names, or tuples of names on one line) without ``names``."""
    kept: list[Any] = []
    for field in fields:
        if isinstance(field, tuple):
            field = tuple(f for f in field if f not in names)
            if field:
                kept.append(field)
        elif field not in names:
            kept.append(field)
    return kept


def attempt_took(attempt: ItemAttempt, lease_seconds: float | None) -> str:
    """How long an attempt ran. A lost worker's attempt ends when its lease ran out: it ran at
    least until its last renewal (a lease before that expiry), at most until the expiry."""
    took = attempt.duration
    if took is None:
        return "-"
    if attempt.error_class != WORKER_LOST:
        return human_duration(took)
    least = took - timedelta(seconds=lease_seconds or 0)
    if lease_seconds is None or least <= timedelta(0):
        return f"lost after at most {human_duration(took)}"
    return f"lost after {human_duration(least)} to {human_duration(took)}"


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


@admin.register(ItemClaim)
class ItemClaimAdmin(FanoutAdmin):
    list_display = (
        "key_short",
        "run_link",
        "status_badge",
        "attempts",
        "lease",
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
        (
            None,
            {
                "fields": (
                    ("key", "index"),
                    "run",
                    ("status", "pool"),
                    "child_run_link",
                    "payload_display",
                )
            },
        ),
        (
            "Claim",
            {
                "fields": (
                    ("owner", "claim_token"),
                    ("claimed", "lease_expires"),
                    ("attempt", "crashes", "next_attempt"),
                    "why_it_waits_now",
                )
            },
        ),
        (
            "Outcome",
            {
                "fields": (
                    ("started", "finished"),
                    "result_display",
                    "error_class",
                    "error_display",
                )
            },
        ),
        ("Failed attempts", {"fields": ("attempt_history",)}),
    )

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or obj.status == ItemStatus.PENDING:
            return fieldsets
        # Only a pending item waits for a next attempt: the others leave those lines out
        # instead of showing them blank or stale.
        return [
            (name, {**opts, "fields": _without(opts["fields"], PENDING_ONLY)})
            for name, opts in fieldsets
        ]

    def get_list_display(self, request: HttpRequest) -> tuple[str, ...]:
        empty = EMPTY_COLUMNS.get(request.GET.get("status", ""), ())
        return tuple(c for c in self.list_display if c not in empty)

    def read_page(self, request: HttpRequest, items: list[ItemClaim]) -> dict[int, ItemRow]:
        """Decide "why it waits" for the page's pending items at once."""
        now = db_now()
        why = why_items_wait([i for i in items if i.status == ItemStatus.PENDING], now)
        return {item.pk: ItemRow(now, *why.get(item.pk, ("", False))) for item in items}

    # Items change only through the actions below.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "retry_item")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "cancel_item")

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return self.has_fanout_permission(request, "force_release_item")

    # ------------------------------------------------------------------ columns

    @admin.display(description="history")
    def attempt_history(self, item: ItemClaim) -> str:
        """Every attempt that did not succeed: when, where, how long, and why."""
        rows = list(item.attempts.all())
        if not rows:
            return "none"
        try:
            lease: float | None = get_definition(item.run.definition).lease_seconds
        except FanoutError:
            lease = None
        cells = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
            '<td class="fanout-error" title="{}">{}</td></tr>',
            (_attempt_cells(a, lease) for a in rows),
        )
        return format_html(
            '<table class="fanout-attempts"><thead><tr><th>attempt</th><th>started</th>'
            "<th>worker</th><th>took</th><th>error</th><th>message</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            cells,
        )

    @admin.display(description="child run")
    def child_run_link(self, item: ItemClaim) -> str:
        """The run this item handed its work to (Item.spawn), if any."""
        child = BatchRun.objects.filter(parent_item=item).values_list("pk", "definition").first()
        if child is None:
            return "-"
        url = reverse("admin:fanout_batchrun_change", args=[child[0]])
        return format_html('<a href="{}">#{} {}</a>', url, child[0], child[1])

    @admin.display(description="run", ordering="run_id")
    def run_link(self, item: ItemClaim) -> str:
        url = reverse("admin:fanout_batchrun_change", args=[item.run_id])
        return format_html('<a href="{}" title="{}">#{}</a>', url, str(item.run), item.run_id)

    @admin.display(description="key", ordering="key")
    def key_short(self, item: ItemClaim) -> str:
        return clipped(item.key)

    @admin.display(description="status", ordering="status")
    def status_badge(self, item: ItemClaim) -> str:
        row: ItemRow | None = page_facts(item)
        if row is not None and row.held_back:
            return format_html(
                '<span class="fanout-badge fanout-waiting" title="{}">Held back</span>',
                "pending, held back: see why it waits",
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

    @admin.display(description="worker", ordering="owner")
    def lease(self, item: ItemClaim) -> str:
        """The lease holder (or the last one), and while it runs, when its lease expires."""
        if not item.owner:
            return ""
        holder = worker_name(item.owner, short=True)
        if item.status != ItemStatus.RUNNING or item.lease_expires_at is None:
            return holder
        row: ItemRow | None = page_facts(item)
        now = row.now if row is not None else db_now()
        left = item.lease_expires_at - now
        if left <= timedelta(0):
            return format_html(
                '{}<span class="fanout-sub fanout-expired">lease expired {} ago</span>',
                holder,
                human_duration(-left),
            )
        return format_html(
            '{}<span class="fanout-sub">lease expires in {}</span>', holder, human_duration(left)
        )

    @admin.display(description="why it waits")
    def why_it_waits(self, item: ItemClaim) -> str:
        row: ItemRow | None = page_facts(item)
        return clipped(row.why if row is not None else "", "fanout-why")

    @admin.display(description="last error")
    def last_error(self, item: ItemClaim) -> str:
        return wrapped(short_error(item.error), "fanout-error")

    @admin.display(description="duration")
    def duration_display(self, item: ItemClaim) -> str:
        return human_duration(item.duration)

    claimed = time_field("claimed_at", "claimed")
    lease_expires = time_field("lease_expires_at", "lease expires")
    next_attempt = time_field("next_attempt_at", "next attempt not before")
    started = time_field("started_at", "started")
    finished = time_field("finished_at", "finished")

    @admin.display(description="why it waits")
    def why_it_waits_now(self, item: ItemClaim) -> str:
        if item.status != ItemStatus.PENDING:
            return ""
        reason, _ = why_items_wait([item], db_now())[item.pk]
        return reason

    @admin.display(description="payload")
    def payload_display(self, item: ItemClaim) -> str:
        return json_block(item.payload)

    @admin.display(description="result")
    def result_display(self, item: ItemClaim) -> str:
        return json_block(item.result)

    @admin.display(description="error")
    def error_display(self, item: ItemClaim) -> str:
        return (
            format_html('<pre class="fanout-traceback">{}</pre>', item.error) if item.error else ""
        )

    # ------------------------------------------------------------------ actions

    @action(description="Retry selected failed items", permissions=["retry"])
    def retry_items(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> Any:
        failed = queryset.filter(status=ItemStatus.FAILED)
        runs = list(
            BatchRun.objects.filter(
                pk__in=failed.values("run_id"), status__in=RETRYABLE_RUNS
            ).order_by("pk")
        )
        if confirm := confirm_stranded(self, request, runs, "Retry selected failed items"):
            return confirm
        retried = sum(actions.retry_failed(run, failed) for run in runs)
        skipped = queryset.count() - retried
        text = f"{plural(retried, 'failed item')} back to pending."
        if skipped:
            text += (
                f" {plural(skipped, 'item')} skipped: not failed, or their run is pending"
                " or cancelled."
            )
        self.message_user(request, text, messages.SUCCESS if retried else messages.WARNING)
        redispatch(self, request, runs)

    @action(description="Cancel selected pending items", permissions=["cancel"])
    def cancel_items(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> None:
        pending = queryset.filter(status=ItemStatus.PENDING)
        run_ids = list(pending.values_list("run_id", flat=True).distinct().order_by())
        cancelled = actions.cancel_items(pending)
        self.message_user(
            request,
            f"Cancelled {plural(cancelled, 'pending item')}.",
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

    @action(
        description="Force-release the lease of selected running items",
        permissions=["force_release"],
    )
    def force_release_leases(self, request: HttpRequest, queryset: QuerySet[ItemClaim]) -> None:
        released = actions.force_release(queryset.filter(status=ItemStatus.RUNNING))
        self.message_user(
            request,
            f"Released {plural(released, 'lease')}: those items are pending again, and their "
            "old holders' late writes will be refused.",
            messages.SUCCESS if released else messages.WARNING,
        )


def _attempt_cells(attempt: Any, lease: float | None) -> tuple[Any, ...]:
    """One row of an item's attempt history: attempt, started, worker, took, error, message."""
    return (
        attempt.attempt,
        date_format(attempt.started_at, TIME_FORMAT) if attempt.started_at else "-",
        attempt.owner or "-",
        attempt_took(attempt, lease),
        attempt.error_class or "-",
        attempt.error,
        last_line(attempt.error),
    )
