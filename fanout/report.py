"""What a run looks like now: counts per status, why items wait, and the final report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Count, Q
from django.utils import timezone

from .join import status_counts
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus
from .pools import headroom, refill

FAILED_LISTED = 10_000  # a report lists at most this many failed items


@dataclass
class PoolState:
    """A pool as an operator sees it: its row, its live leases, and why it admits nothing."""

    name: str
    pool: CapacityPool | None
    in_flight: int
    reason: str  # "" while it has headroom

    @property
    def label(self) -> str:
        return self.reason or "admitting"

    @property
    def short_reason(self) -> str:
        """The reason without its time ("rate limited", not "rate limited until 10:00:01")."""
        return self.reason.split(" until ")[0]


def pool_states(names: Iterable[str] | None, now: datetime) -> dict[str, PoolState]:
    """The named pools (every pool for None) and their state, in two queries for any number."""
    pools_qs = CapacityPool.objects.all()
    if names is not None:
        wanted = sorted({n for n in names if n})
        if not wanted:
            return {}
        pools_qs = pools_qs.filter(name__in=wanted)
    pools = {p.name: p for p in pools_qs}
    if names is None:
        wanted = sorted(pools)
    in_flight = dict(
        ItemClaim.objects.in_flight(now)
        .filter(pool__in=wanted)
        .values("pool")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("pool", "n")
    )
    states = {}
    for name in wanted:
        pool = pools.get(name)
        count = in_flight.get(name, 0)
        if pool is None:
            states[name] = PoolState(name, None, count, "pool missing")
            continue
        refill(pool, now)
        states[name] = PoolState(name, pool, count, headroom(pool, count, now).reason)
    return states


def waiting(run_id: int, now: datetime | None = None) -> dict[str, int]:
    """Pending items held back by something other than their turn, counted per reason.

    An item waits when its retry is not yet due, or when its pool admits nothing now (paused,
    full, rate limited, throttled). Waiting for the run's own max_parallel is just "pending".
    """
    now = now or timezone.now()
    rows = list(
        ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.PENDING)
        .values("pool")
        .annotate(n=Count("pk"), later=Count("pk", filter=Q(next_attempt_at__gt=now)))
    )
    states = {n: s.reason for n, s in pool_states([r["pool"] for r in rows], now).items()}
    reasons: dict[str, int] = {}
    for r in rows:
        if r["later"]:
            reasons["retry not yet due"] = reasons.get("retry not yet due", 0) + r["later"]
        reason = states.get(r["pool"], "")
        due = r["n"] - r["later"]
        if reason and due:
            text = f"{r['pool']}: {reason.split(' until ')[0]}"
            reasons[text] = reasons.get(text, 0) + due
    return reasons


@dataclass
class Snapshot:
    run: BatchRun
    counts: dict[str, int]
    waiting: dict[str, int] = field(default_factory=dict)
    at: datetime = field(default_factory=timezone.now)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        return sum(
            self.counts[s] for s in (ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED)
        )


def snapshot(run: BatchRun, with_waiting: bool = True) -> Snapshot:
    run.refresh_from_db()
    now = timezone.now()
    return Snapshot(run, status_counts(run.pk), waiting(run.pk, now) if with_waiting else {}, now)


def final_report(run: BatchRun) -> dict[str, Any]:
    """The report ``run_fanout --json`` prints: every outcome accounted for."""
    run.refresh_from_db()
    failed = (
        ItemClaim.objects.filter(run_id=run.pk, status=ItemStatus.FAILED)
        .order_by("index")
        .values("key", "error_class", "error")[:FAILED_LISTED]
    )
    return {
        "run_id": run.pk,
        "run_key": run.run_key,
        "definition": run.definition,
        "status": run.status,
        "counts": status_counts(run.pk),
        "failed": [
            {"key": f["key"], "error": _last_line(f["error"]) or f["error_class"]} for f in failed
        ],
        "join_result": run.join_result,
        "error": run.error,
    }


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
