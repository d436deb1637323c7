"""Sample what a running run's unfinished items wait on, for the run page's chart.

The item rows say why an item waits only now; a RunSample keeps that answer for a moment of
the run's life. The supervisor that tends a running run writes one at most every
FANOUT_SAMPLE_SECONDS (the fleet's election makes it one supervisor per run per period), so a
run of any size gets a few rows a minute, and its samples go when its row is pruned.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Count, Q

from .clock import db_now
from .conf import conf
from .models import BatchRun, ItemClaim, ItemStatus, RunSample, RunStatus
from .waiting import pool_states

# The columns of a sample, in the order the chart stacks them.
WAITS = (
    "running",
    "ready",
    "max_parallel",
    "pool_full",
    "rate_limited",
    "throttled",
    "paused",
    "retry_due",
    "child_runs",
)


def sample_run(run: BatchRun, now: datetime | None = None) -> RunSample | None:
    """Write a sample of a running run unless its last one is younger than SAMPLE_SECONDS."""
    if run.status != RunStatus.RUNNING:
        return None
    now = now or db_now()
    recent = now - timedelta(seconds=float(conf.SAMPLE_SECONDS))
    if RunSample.objects.filter(run_id=run.pk, at__gt=recent).exists():
        return None
    sample = measure(run, now)
    sample.save()
    return sample


def measure(run: BatchRun, now: datetime) -> RunSample:
    """What the run's unfinished items are doing at ``now``, in two queries (and the pools')."""
    due = Q(status=ItemStatus.PENDING, next_attempt_at__lte=now) | Q(
        status=ItemStatus.RUNNING, lease_expires_at__lte=now
    )
    rows = (
        ItemClaim.objects.filter(run_id=run.pk)
        .unfinished()
        .values("pool")
        .annotate(
            running=Count("pk", filter=Q(status=ItemStatus.RUNNING, lease_expires_at__gt=now)),
            due=Count("pk", filter=due),
            later=Count("pk", filter=Q(status=ItemStatus.PENDING, next_attempt_at__gt=now)),
            children=Count("pk", filter=Q(status=ItemStatus.WAITING)),
        )
        .order_by()
    )
    by_pool = {r["pool"]: r for r in rows}
    states = pool_states(list(by_pool), now)
    sample = RunSample(run_id=run.pk, at=now)
    # What holds the run's slots: a claimable item beyond them waits for max_parallel.
    held = sum(r["running"] + r["children"] for r in by_pool.values())
    at_limit = held >= run.max_parallel
    for name, r in by_pool.items():
        sample.running += r["running"]
        sample.retry_due += r["later"]
        sample.child_runs += r["children"]
        state = states.get(name)
        reason = state.reason if state is not None else ""
        if not reason:
            field = "max_parallel" if at_limit else "ready"
        elif reason in ("pool missing", "pool paused"):
            field = "paused"
        elif reason.startswith("pool full"):
            field = "pool_full"
        elif reason.startswith("throttled"):
            field = "throttled"
        else:
            field = "rate_limited"
        setattr(sample, field, getattr(sample, field) + r["due"])
    return sample
