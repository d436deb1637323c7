"""What the admin pages show about runs, items and pools, read in a fixed number of queries per
page whatever the number of items, and the JSON endpoint a run's page polls for its progress."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Min, Q
from django.http import Http404, HttpRequest, JsonResponse
from django.utils import timezone

from .models import BatchRun, ItemClaim, ItemStatus, RunStatus
from .report import pool_states

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

WAITING = "waiting"
# The progress bar's segments, left to right.
SEGMENTS = ("succeeded", "failed", "running", WAITING, "pending", "cancelled")
ACTIVE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)
BAR_WIDTH = 1000  # the SVG bar's user units
FAILURE_GROUPS = 20  # error classes listed on a run's page
POLL_MILLISECONDS = 2000


# ---------------------------------------------------------------------------------- pools


def waiting_q(now: datetime) -> Q:
    """Pending items held back now: a retry not yet due, or a pool that admits nothing."""
    blocked = [s.name for s in pool_states(None, now).values() if s.reason]
    held = Q(next_attempt_at__gt=now)
    if blocked:
        held |= Q(pool__in=blocked)
    return Q(status=ItemStatus.PENDING) & held


# ---------------------------------------------------------------------------------- runs


@dataclass
class Progress:
    """One run's items counted by progress-bar segment; "pending" excludes the waiting ones."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEGMENTS, 0))
    waiting_reasons: dict[str, int] = field(default_factory=dict)
    pool_items: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return self.counts["succeeded"] + self.counts["failed"] + self.counts["cancelled"]

    @property
    def processed(self) -> int:
        """Items a handler ran to an outcome: what a rate is made of."""
        return self.counts["succeeded"] + self.counts["failed"]

    @property
    def percent_done(self) -> float:
        return 100.0 * self.done / self.total if self.total else 0.0

    def segments(self) -> list[dict[str, Any]]:
        """The bar's non-empty segments, placed on a BAR_WIDTH-wide scale."""
        total = self.total
        out: list[dict[str, Any]] = []
        x = 0.0
        for status in SEGMENTS:
            n = self.counts[status]
            if not n or not total:
                continue
            width = BAR_WIDTH * n / total
            out.append(
                {
                    "status": status,
                    "n": n,
                    "x": round(x, 2),
                    "width": round(width, 2),
                    "percent": round(100.0 * n / total, 1),
                }
            )
            x += width
        return out

    def rate(self, run: BatchRun, now: datetime) -> float | None:
        """Items per second since the run started (until it finished)."""
        if run.started_at is None:
            return None
        seconds = ((run.finished_at or now) - run.started_at).total_seconds()
        return self.processed / seconds if seconds > 0 else None


def progress_of(run_ids: Iterable[int], now: datetime) -> tuple[dict[int, Progress], dict]:
    """Progress of each run in one grouped query, plus the pools their items use (two more)."""
    ids = list(run_ids)
    progress = {pk: Progress() for pk in ids}
    if not ids:
        return progress, {}
    rows = list(
        ItemClaim.objects.filter(run_id__in=ids)
        .values("run_id", "status", "pool")
        .annotate(n=Count("pk"), later=Count("pk", filter=Q(next_attempt_at__gt=now)))
        .order_by()
    )
    states = pool_states({r["pool"] for r in rows}, now)
    for r in rows:
        p = progress[r["run_id"]]
        pool, n = r["pool"], r["n"]
        if pool:
            p.pool_items[pool] = p.pool_items.get(pool, 0) + n
        if r["status"] != ItemStatus.PENDING:
            p.counts[r["status"]] += n
            continue
        # As report.waiting: a retry not yet due, or a due item whose pool admits nothing.
        held = r["later"]
        if held:
            p.waiting_reasons["retry not yet due"] = (
                p.waiting_reasons.get("retry not yet due", 0) + held
            )
        state = states.get(pool)
        due = n - held
        if state is not None and state.reason and due:
            text = f"{pool}: {state.short_reason}"
            p.waiting_reasons[text] = p.waiting_reasons.get(text, 0) + due
            held += due
        p.counts[WAITING] += held
        p.counts["pending"] += n - held
    return progress, states


@dataclass
class FailureGroup:
    error_class: str
    count: int
    example: ItemClaim | None


def failure_groups(run_id: int, limit: int = FAILURE_GROUPS) -> list[FailureGroup]:
    """The run's failed items grouped by error class, largest first, one example each."""
    groups = list(
        ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED)
        .values("error_class")
        .annotate(n=Count("pk"), example=Min("pk"))
        .order_by("-n", "error_class")[:limit]
    )
    if not groups:
        return []
    examples = ItemClaim.objects.only("key", "error", "attempt", "finished_at").in_bulk(
        [g["example"] for g in groups]
    )
    return [FailureGroup(g["error_class"], g["n"], examples.get(g["example"])) for g in groups]


# -------------------------------------------------------------------------------- display


def last_line(text: str) -> str:
    """The line of a traceback that says what went wrong: its last non-blank one."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def human_duration(value: timedelta | float | None) -> str:
    if value is None:
        return ""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def human_rate(rate: float | None) -> str:
    if rate is None:
        return ""
    if rate >= 100:
        return f"{rate:,.0f}/s"
    if rate >= 1:
        return f"{rate:.1f}/s"
    return f"{rate:.2f}/s"


def progress_payload(run: BatchRun, progress: Progress, now: datetime) -> dict[str, Any]:
    """What the run page's poll needs to redraw its bar and counts."""
    return {
        "run": run.pk,
        "status": run.status,
        "status_label": run.get_status_display(),
        "active": run.status in ACTIVE_RUN_STATUSES,
        "counts": progress.counts,
        "total": progress.total,
        "done": progress.done,
        "percent_done": round(progress.percent_done, 1),
        "segments": progress.segments(),
        "rate": human_rate(progress.rate(run, now)),
        "duration": human_duration(run.duration),
        "waiting": progress.waiting_reasons,
    }


def run_progress_view(model_admin: ModelAdmin, request: HttpRequest, object_id: str) -> Any:
    """GET: the run's progress as JSON, for the poll on its change page."""
    run = model_admin.get_object(request, unquote(object_id))
    if run is None:
        raise Http404("no such run")
    if not model_admin.has_view_or_change_permission(request, run):
        raise PermissionDenied
    now = timezone.now()
    progress, _ = progress_of([run.pk], now)
    response = JsonResponse(progress_payload(run, progress[run.pk], now))
    response["Cache-Control"] = "no-store"
    return response
