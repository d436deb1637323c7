"""Why items are not running: held back (a retry not yet due, a pool that admits nothing),
waiting their turn (the run's max_parallel, busy workers), or stalled (no live worker claims
them). Decided here once, for the admin's pages, run_fanout's progress and its --json report.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Case, Count, F, Max, Min, Q, When

from .definition import get_definition
from .errors import FanoutError
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from .pools import headroom, refill
from .spend import pool_holds, run_hold
from .text import human_duration

# Live workers claim the next item as they record the last and idle ones look again within
# a second, so claimable items with nothing claimed for this long mean no worker is there.
STALLED_AFTER = timedelta(seconds=15)
RETRY_NOT_DUE = "retry not yet due"
READY = "ready: the next free worker claims it"
STALLED = "stalled:"  # how a reason that no worker will end by itself begins


# ---------------------------------------------------------------------------------- pools


@dataclass
class PoolState:
    """A pool as an operator sees it: its row, its live leases, and why it admits nothing."""

    name: str
    pool: CapacityPool | None
    in_flight: int
    reason: str  # "" while it has headroom

    @property
    def label(self) -> str:
        """The reason to the second ("rate limited until 10:00:01"), or "admitting": a badge's
        milliseconds widened the run page's Pools panel past a laptop's screen."""
        return re.sub(r"(\d\d:\d\d:\d\d)\.\d+", r"\1", self.reason) or "admitting"

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
    spent = pool_holds(wanted, now)
    return {
        name: pool_state(name, pools.get(name), in_flight.get(name, 0), now, spent.get(name, ""))
        for name in wanted
    }


def pool_state(
    name: str, pool: CapacityPool | None, in_flight: int, now: datetime, budget: str | None = None
) -> PoolState:
    """The pool's state given its live leases; its token bucket is brought up to ``now``.
    ``budget``: why its budget admits nothing (read when not given)."""
    if pool is None:
        return PoolState(name, None, in_flight, "pool missing")
    refill(pool, now)
    reason = headroom(pool, in_flight, now).reason
    if not reason:
        reason = pool_holds([name], now).get(name, "") if budget is None else budget
    return PoolState(name, pool, in_flight, reason)


# ----------------------------------------------------------------------------------- runs


@dataclass
class RunActivity:
    """What the claim side of a run looks like now, counted from its items."""

    ready: int = 0  # pending, not held back: claimable now
    expired: int = 0  # running, but the lease ran out: the owner is gone, claimable now
    live: int = 0  # running under a live lease
    last_claimed_at: datetime | None = None
    claimable_since: datetime | None = None  # the longest-waiting claimable item's, if read
    ready_pools: set[str] = field(default_factory=set)  # the pools of its ready items


def may_stall(run: BatchRun, activity: RunActivity, now: datetime) -> bool:
    """Whether the run has claimable items and nothing running for longer than a live worker
    would leave them (then its last claim tells whether it stalled)."""
    return (
        run.status == RunStatus.RUNNING
        and activity.live == 0
        and activity.ready + activity.expired > 0
        and (run.started_at is None or now - run.started_at >= STALLED_AFTER)
    )


def last_claims(
    run_ids: Iterable[int], now: datetime
) -> dict[int, tuple[datetime | None, datetime | None]]:
    """When each run last had an item claimed, and since when its longest-waiting claimable
    item has been claimable (a pending item since it was due, a lost one since its lease ran
    out): one query, only for runs that may have stalled."""
    ids = list(run_ids)
    if not ids:
        return {}
    claimable = Q(status=ItemStatus.PENDING, next_attempt_at__lte=now) | Q(
        status=ItemStatus.RUNNING, lease_expires_at__lte=now
    )
    rows = (
        ItemClaim.objects.filter(run_id__in=ids)
        .values("run_id")
        .annotate(
            last=Max("claimed_at"),
            since=Min(
                Case(
                    When(status=ItemStatus.PENDING, then=F("next_attempt_at")),
                    default=F("lease_expires_at"),
                ),
                filter=claimable,
            ),
        )
        .order_by()
        .values_list("run_id", "last", "since")
    )
    return {run_id: (last, since) for run_id, last, since in rows}


def why_run_waits(
    run: BatchRun,
    activity: RunActivity,
    now: datetime,
    states: dict[str, PoolState] | None = None,
) -> str:
    """Why the run's claimable items are not running now; "" while workers take them as fast
    as its limits allow, or when it has none (held items say why themselves). ``states``: the
    pools of its ready items, whose rate may be what paces it."""
    if run.status == RunStatus.PENDING:
        return f"writing its work list: {run.materialized_upto:,} items so far"
    if run.status != RunStatus.RUNNING or activity.ready + activity.expired == 0:
        return ""
    if run.stalled and not activity.live:
        # A worker said why it could not run it (see fanout.supervise): the surest reason.
        return f"{STALLED} {run.stalled}"
    if activity.live >= run.max_parallel:
        return f"run at max_parallel ({activity.live}/{run.max_parallel})"
    held = run_hold(run.pk, now)
    if held:
        return held
    if activity.live:
        short_of = _rate_of(activity.ready_pools, states or {}) or _short_of(run)
        return f"{activity.live} running, up to {run.max_parallel} allowed: {short_of}"
    if not may_stall(run, activity, now):
        return ""
    return _stalled(run, activity, now)


def _rate_of(pools: set[str], states: dict[str, PoolState]) -> str:
    """A rated pool of the run's ready items whose bucket is drawn down: its rate paces the run,
    between the moments it holds them back (it refills a token at a time, and each is taken at
    once). A bucket at least half full is not what keeps threads from the run's items."""
    for name in sorted(pools):
        pool = states[name].pool if name in states else None
        if pool is None or pool.rate_count is None or pool.tokens is None:
            continue
        if pool.tokens < (pool.capacity or 0) / 2:
            return f"pool {name} admits {pool.describe_rate()}"
    return ""


def _short_of(run: BatchRun) -> str:
    """What would run more of a run whose limits allow more than runs: its executor's threads."""
    if run.executor == "inline":
        return "every thread of its run_fanout is busy (--workers sets how many)"
    return "no other worker thread is free (another rqworker adds threads)"


def _stalled(run: BatchRun, activity: RunActivity, now: datetime) -> str:
    known = (activity.last_claimed_at, run.started_at)
    since = max((t for t in known if t is not None), default=run.created_at)
    # A stall is claimable items that nobody claims: items that became claimable a moment ago
    # (a retry of failed items, a reopened run) have not stalled, however old the last claim.
    waited = max(since, activity.claimable_since or since)
    if now - waited < STALLED_AFTER:
        return ""
    idle = f"{STALLED} nothing running, no item claimed for {human_duration(now - since)}"
    try:
        definition = get_definition(run.definition)
    except FanoutError:
        return f"{idle}; definition {run.definition!r} is not registered, so no worker can run it"
    if run.executor == "inline":
        return (
            f"{idle}; its inline workers are gone: resume it with "
            f"`manage.py run_fanout --resume {run.pk}`"
        )
    return (
        f"{idle}; no live worker takes its drain jobs: start "
        f"`manage.py rqworker {definition.queue}`, "
        "or re-dispatch it"
    )


# ---------------------------------------------------------------------------------- items


def held_q(now: datetime) -> Q:
    """Pending items held back now: a retry not yet due, or a pool that admits nothing."""
    blocked = [s.name for s in pool_states(None, now).values() if s.reason]
    held = Q(next_attempt_at__gt=now)
    if blocked:
        held |= Q(pool__in=blocked)
    return Q(status=ItemStatus.PENDING) & held


def pool_hold(pool: str, states: dict[str, PoolState]) -> str:
    """Why due items of ``pool`` are held back now, in words that group them; "" if not."""
    state = states.get(pool)
    if state is not None and state.reason:
        return f"{pool}: {state.short_reason}"
    return ""


def why_items_wait(items: list[ItemClaim], now: datetime) -> dict[int, tuple[str, bool]]:
    """Why each of these pending items (their runs loaded) is not running, and whether it is
    held back (a "waiting" item): in at most four queries for any number of items."""
    if not items:
        return {}
    states = pool_states({i.pool for i in items}, now)
    runs = {i.run_id: i.run for i in items}
    live = dict(
        ItemClaim.objects.in_flight(now)
        .filter(run_id__in=list(runs))
        .values("run_id")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("run_id", "n")
    )
    # An item that is not held back is itself claimable: its run has one ready item at least.
    pools = {pk: {i.pool for i in items if i.run_id == pk and i.pool} for pk in runs}
    activity = {
        pk: RunActivity(ready=1, live=live.get(pk, 0), ready_pools=pools[pk]) for pk in runs
    }
    quiet = [pk for pk, a in activity.items() if may_stall(runs[pk], a, now)]
    for pk, (last, since) in last_claims(quiet, now).items():
        activity[pk].last_claimed_at, activity[pk].claimable_since = last, since
    why = {pk: why_run_waits(run, activity[pk], now, states) for pk, run in runs.items()}
    return {item.pk: _why_item_waits(item, now, states, why[item.run_id]) for item in items}


def _why_item_waits(
    item: ItemClaim, now: datetime, states: dict[str, PoolState], run_why: str
) -> tuple[str, bool]:
    """Why a pending item is not running, and whether it is held back; ``run_why`` is what
    holds its run's claimable items."""
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
    return run_why or READY, False
