"""What a run looks like now: its items counted per status, the held ones and why, why the
others are not running, its failures by error class, and the final report.

One ``Progress`` serves the admin's pages and their poll, run_fanout's live line (``snapshot``)
and its --json report (``final_report``); why items wait is decided in ``waiting``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Count, Min, Q, QuerySet

from .clock import db_now
from .models import BatchRun, ItemClaim, ItemStatus
from .nest import descendants
from .spend import run_report
from .text import last_line
from .waiting import (
    RETRY_NOT_DUE,
    STALLED,
    PoolState,
    RunActivity,
    last_claims,
    may_stall,
    pool_hold,
    pool_states,
    why_run_waits,
)

__all__ = [
    "SEGMENTS",
    "HELD_BACK",
    "FailureGroup",
    "PoolState",
    "Progress",
    "failure_groups",
    "final_report",
    "held_back",
    "pool_states",
    "progress_of",
    "snapshot",
]

FAILED_LISTED = 10_000  # a report lists at most this many failed items
FAILURE_GROUPS = 20  # error classes listed on a run's page
# The progress bar's segment of pending items held back (a retry not yet due, a full pool): not
# ItemStatus.WAITING, an item waiting on its child run. Its key stays "waiting" (templates).
HELD_BACK = "waiting"
DONE = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.CANCELLED,
    ItemStatus.COMPENSATED,
    ItemStatus.COMPENSATION_FAILED,
)
# Items whose handler ran to an outcome (an item being undone had succeeded first).
PROCESSED = (
    ItemStatus.SUCCEEDED,
    ItemStatus.FAILED,
    ItemStatus.COMPENSATING,
    ItemStatus.COMPENSATED,
    ItemStatus.COMPENSATION_FAILED,
)
# The progress bar's segments, left to right; "waiting" are the pending items held back.
SEGMENTS = (
    "succeeded",
    "compensated",
    "failed",
    "compensation_failed",
    "running",
    "compensating",
    HELD_BACK,
    "pending",
    "cancelled",
)
BAR_WIDTH = 1000  # the scale segments are placed on


@dataclass
class Progress:
    """A run's items now: counts per status, the pending ones held back and why, and why the
    others are not running."""

    run: BatchRun
    at: datetime
    # Per item status; "pending" includes the held ones.
    counts: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in ItemStatus})
    # Pending items held back now, per reason: a retry not yet due, a pool that admits nothing.
    # Not items in status "waiting", which wait on a child run.
    held_back: dict[str, int] = field(default_factory=dict)
    pool_items: dict[str, int] = field(default_factory=dict)
    # Pending items per pool, and per pool with a rate of calls the seconds that rate needs
    # to admit them (what its bucket holds now goes at once).
    pool_pending: dict[str, int] = field(default_factory=dict)
    pool_pace: dict[str, float] = field(default_factory=dict)
    activity: RunActivity = field(default_factory=RunActivity)
    # Why its claimable items are not running: max_parallel, busy workers, stalled; or "".
    why: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def done(self) -> int:
        """Items with nothing left to do: an undone item (compensated, or its compensation
        failed for good) is done; one whose compensation is due is not."""
        return sum(self.counts.get(s, 0) for s in DONE)

    @property
    def processed(self) -> int:
        """Items a handler ran to an outcome: what a rate is made of."""
        return sum(self.counts.get(s, 0) for s in PROCESSED)

    @property
    def held(self) -> int:
        return sum(self.held_back.values())

    @property
    def held_back_text(self) -> str:
        """The held items' reasons in one line: "pool-a: pool paused (9); retry not yet due (2)"."""
        return "; ".join(f"{reason} ({n:,})" for reason, n in self.held_back.items())

    @property
    def stalled(self) -> bool:
        """Whether nothing will move until an operator acts (no live worker, say)."""
        return self.why.startswith(STALLED)

    @property
    def percent_done(self) -> float:
        return 100.0 * self.done / self.total if self.total else 0.0

    @property
    def by_segment(self) -> dict[str, int]:
        """Counts per progress-bar segment: "pending" without the held ones, which are "waiting"."""
        out = {s: self.counts.get(s, 0) for s in SEGMENTS}
        # Items waiting on a child run (status "waiting") are under way: drawn as running.
        out[ItemStatus.RUNNING] += self.counts.get(ItemStatus.WAITING, 0)
        out[HELD_BACK] = self.held
        out[ItemStatus.PENDING] -= self.held
        # Compensation's segments only where a run compensates.
        for status in (ItemStatus.COMPENSATING, ItemStatus.COMPENSATED, "compensation_failed"):
            if not out.get(status):
                out.pop(status, None)
        return out

    def segments(self) -> list[dict[str, Any]]:
        """The bar's non-empty segments, placed on a BAR_WIDTH-wide scale."""
        total = self.total
        out: list[dict[str, Any]] = []
        x = 0.0
        for status, n in self.by_segment.items():
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

    def rate(self) -> float | None:
        """Items per second since the run started (until it finished)."""
        run = self.run
        if run.started_at is None:
            return None
        seconds = ((run.finished_at or self.at) - run.started_at).total_seconds()
        return self.processed / seconds if seconds > 0 else None

    def eta(self, rate: float | None) -> tuple[float | None, str]:
        """Seconds until every item is done at ``rate`` items/s, but no sooner than the pools'
        rates admit the pending ones; and the pool whose rate sets it, or "". None when
        nothing says (no rate, no rate-limited pool) or the run is over."""
        left = self.total - self.done
        if self.run.is_terminal or left <= 0:
            return None, ""
        at_rate = left / rate if rate else None
        pool = max(self.pool_pace, key=self.pool_pace.__getitem__, default="")
        if pool and (at_rate is None or self.pool_pace[pool] > at_rate):
            return self.pool_pace[pool], pool
        return at_rate, ""

    def _pace(self, states: Mapping[str, PoolState]) -> None:
        """How long each pool's rate takes to admit this run's pending items in it: a lower
        bound, since other runs may share the pool's rate."""
        for name, n in self.pool_pending.items():
            state = states.get(name)
            pool = state.pool if state is not None else None
            if pool is None or pool.rate_count is None or pool.rate_unit or not n:
                continue  # a rate of units (tokens) goes by estimates this does not read
            wanted = n - (pool.tokens or 0.0)
            if wanted > 0:
                self.pool_pace[name] = wanted * pool.rate_period / pool.rate_count

    def _add(self, row: Mapping[str, Any], states: dict[str, PoolState]) -> None:
        """Count one (status, pool) group of the run's items."""
        status, pool, n = row["status"], row["pool"], row["n"]
        self.counts[status] = self.counts.get(status, 0) + n
        if pool:
            self.pool_items[pool] = self.pool_items.get(pool, 0) + n
        if status == ItemStatus.RUNNING:
            self.activity.live += row["live"]
            self.activity.expired += n - row["live"]
        elif status == ItemStatus.PENDING:
            if pool:
                self.pool_pending[pool] = self.pool_pending.get(pool, 0) + n
            self._hold(RETRY_NOT_DUE, row["later"])
            due = n - row["later"]
            reason = pool_hold(pool, states)
            if reason:
                self._hold(reason, due)
            else:
                self.activity.ready += due
                if due and pool:
                    self.activity.ready_pools.add(pool)

    def _hold(self, reason: str, n: int) -> None:
        if n:
            self.held_back[reason] = self.held_back.get(reason, 0) + n


def counted(run_ids: list[int], now: datetime) -> QuerySet[Any, Any]:
    """The runs' items counted per run, status and pool, and of those how many have a retry
    not yet due and how many a live lease: every item of the runs, read from the entries of
    an index of their own on MariaDB/MySQL (migration 0019), in the order they are grouped."""
    return (
        ItemClaim.objects.filter(run_id__in=run_ids)
        .values("run_id", "status", "pool")
        .annotate(
            n=Count("pk"),
            later=Count("pk", filter=Q(next_attempt_at__gt=now)),
            live=Count("pk", filter=Q(lease_expires_at__gt=now)),
        )
        .order_by()
    )


def progress_of(
    runs: Iterable[BatchRun], now: datetime
) -> tuple[dict[int, Progress], dict[str, PoolState]]:
    """Each run's progress from one grouped query over its items, plus the pools they use (two
    queries) and, only for runs that may have stalled, when they last claimed an item (one)."""
    by_pk = {run.pk: run for run in runs}
    progress = {pk: Progress(run, now) for pk, run in by_pk.items()}
    if not by_pk:
        return progress, {}
    rows = list(counted(list(by_pk), now))
    states = pool_states({r["pool"] for r in rows}, now)
    for r in rows:
        progress[r["run_id"]]._add(r, states)
    quiet = [pk for pk, p in progress.items() if may_stall(p.run, p.activity, now)]
    for pk, (last, since) in last_claims(quiet, now).items():
        progress[pk].activity.last_claimed_at = last
        progress[pk].activity.claimable_since = since
    for p in progress.values():
        p.why = why_run_waits(p.run, p.activity, now, states)
        p._pace(states)
    return progress, states


def snapshot(run: BatchRun) -> Progress:
    """The run as it is now, re-read from the database."""
    run.refresh_from_db()
    progress, _ = progress_of([run], db_now())
    return progress[run.pk]


def held_back(run_id: int, now: datetime | None = None) -> dict[str, int]:
    """The run's pending items held back now, counted per reason.

    An item waits when its retry is not yet due, or when its pool admits nothing now (paused,
    full, rate limited, throttled). Waiting for the run's own max_parallel is just "pending".
    """
    run = BatchRun.objects.get(pk=run_id)
    progress, _ = progress_of([run], now or db_now())
    return progress[run_id].held_back


@dataclass
class FailureGroup:
    error_class: str
    count: int
    example: ItemClaim | None


def failed_by_class(run_id: int) -> QuerySet[Any, Any]:
    """The run's failed items counted per error class, largest first, with the least pk of
    each: read from an index alone, never the rows (migration 0019)."""
    return (
        ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED)
        .values("error_class")
        .annotate(n=Count("pk"), example=Min("pk"))
        .order_by("-n", "error_class")
    )


def failure_groups(run_id: int, limit: int = FAILURE_GROUPS) -> list[FailureGroup]:
    """The run's failed items grouped by error class, largest first, one example each."""
    groups = list(failed_by_class(run_id)[:limit])
    if not groups:
        return []
    examples = ItemClaim.objects.only("key", "error", "attempt", "finished_at").in_bulk(
        [g["example"] for g in groups]
    )
    return [FailureGroup(g["error_class"], g["n"], examples.get(g["example"])) for g in groups]


CLASSIC_STATUSES = ("pending", "running", "succeeded", "failed", "cancelled")


def tree_report(run: BatchRun) -> dict[str, Any]:
    """For a run with child runs (Item.spawn): how many runs its tree has and their items'
    counts per status, summed over every level."""
    below = descendants(run.pk)
    if not below:
        return {}
    rows = (
        ItemClaim.objects.filter(run_id__in=[run.pk, *below])
        .values("status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    counts = {s.value: 0 for s in ItemStatus}
    counts.update({r["status"]: r["n"] for r in rows})
    return {"tree": {"runs": 1 + len(below), "counts": counts}}


def final_report(run: BatchRun) -> dict[str, Any]:
    """The report ``run_fanout --json`` prints: every outcome accounted for."""
    progress = snapshot(run)
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
        # The statuses of nesting and compensation only where a run has such items.
        "counts": {s: n for s, n in progress.counts.items() if n or s in CLASSIC_STATUSES},
        **tree_report(run),
        "failed": [
            {"key": f["key"], "error": last_line(f["error"]) or f["error_class"]} for f in failed
        ],
        "join_result": run.join_result,
        "error": run.error,
        # What its items cost and its budget, for a run that counts cost (fanout.spend).
        **run_report(run.pk, db_now()),
        # Why it waits or stalls, in the admin's words (a worker's own when it could not run it).
        **({"why": progress.why} if progress.why else {}),
    }
