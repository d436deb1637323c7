"""Claim: take ownership of admissible items in one short transaction.

The transaction locks the run row (serialising claimers of one run, so max_parallel is
decided from an exact count of live leases), then each pool row it admits into (blocking,
in name order, so pools' concurrency and token buckets are decided under their lock), then
the items themselves with SKIP LOCKED. Handlers run after it commits: it must stay short,
because every claimer of the same run and pool waits on it.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, F
from django.utils import timezone

from .models import (
    BatchRun,
    CapacityPool,
    FailurePolicy,
    ItemClaim,
    ItemClaimQuerySet,
    ItemStatus,
    RunStatus,
)
from .pools import Headroom, headroom, refill
from .record import fail_fast

# Candidates looked at per admitted slot when items choose their pool: enough to see past
# items of a full pool without locking a whole run's worth of rows.
_LOOKAHEAD = 4
_ROUNDS = 3


@dataclass(frozen=True)
class ClaimedItem:
    pk: int
    key: str
    index: int
    payload: Any
    pool: str
    attempt: int


@dataclass
class ClaimResult:
    token: uuid.UUID | None
    items: list[ClaimedItem] = field(default_factory=list)
    run_status: str = RunStatus.RUNNING
    failure_policy: str = "collect"
    # Why nothing more was claimed, and the earliest time worth trying again.
    reason: str = ""
    retry_at: datetime | None = None
    # Items failed because their owners kept dying (crash budget spent).
    crashed_out: int = 0
    # What the ``before`` step returned.
    before: Any = None

    @property
    def run_open(self) -> bool:
        return self.run_status == RunStatus.RUNNING


def lock_run(run_id: int) -> dict[str, Any] | None:
    """Lock the run's row for this transaction (on every backend) and read what claims need."""
    runs = BatchRun.objects.filter(pk=run_id)
    fields = ("status", "max_parallel", "failure_policy")
    if connection.features.has_select_for_update:
        return dict(runs.select_for_update().values(*fields).first() or {}) or None
    # SQLite has no row locks: writing first takes the database's write lock for the whole
    # transaction, which serialises claimers as FOR UPDATE would (and never upgrades a read lock).
    runs.update(status=F("status"))
    return dict(runs.values(*fields).first() or {}) or None


def _lock_pools(names: list[str], skip_locked: bool = False) -> dict[str, CapacityPool]:
    rows = CapacityPool.objects.filter(name__in=names).order_by("name")
    return {p.name: p for p in rows.select_for_update(skip_locked=skip_locked)}


def _pool_in_flight(names: list[str], now: datetime) -> dict[str, Counter[int]]:
    """Live leases per pool, per run: the pools' concurrency and each run's fair share."""
    rows = (
        ItemClaim.objects.in_flight(now)
        .filter(pool__in=names)
        .values("pool", "run_id")
        .annotate(n=Count("pk"))
        .values_list("pool", "run_id", "n")
    )
    by_pool: dict[str, Counter[int]] = {name: Counter() for name in names}
    for pool, run, n in rows:
        by_pool[pool][run] = n
    return by_pool


# When this process last looked for a run's expired leases (time.monotonic()).
_expired_checked: dict[int, float] = {}
EXPIRED_CHECK_SECONDS = 0.5


def _candidates(run_id: int, now: datetime, limit: int, exclude_pools: set[str]) -> list[dict]:
    fields = ("pk", "key", "index", "payload", "pool", "attempt", "crashes", "status")
    found: list[dict] = []

    def take(qs: ItemClaimQuerySet) -> None:
        qs = qs.filter(run_id=run_id)
        if exclude_pools:
            qs = qs.exclude(pool__in=exclude_pools)
        if found:
            qs = qs.exclude(pk__in=[c["pk"] for c in found])
        found.extend(
            qs.order_by("index")
            .select_for_update(skip_locked=True)
            .values(*fields)[: limit - len(found)]
        )

    # Expired leases first: their owners died, and they are the oldest work. Looking costs a
    # query, so a process looks at most twice a second per run, and whenever pending ones run out.
    mono = time.monotonic()
    looked = mono - _expired_checked.get(run_id, 0.0) >= EXPIRED_CHECK_SECONDS
    if looked:
        take(ItemClaim.objects.expired(now))
        # While expired leases turn up, the next claim looks again: a dead owner's items are
        # reclaimed as fast as new ones are claimed, not two a second per process.
        _expired_checked[run_id] = 0.0 if found else mono
    if len(found) < limit:
        take(ItemClaim.objects.pending_due(now))
    if len(found) < limit and not looked:
        take(ItemClaim.objects.expired(now))
    return found


def claim(
    run_id: int,
    owner: str,
    limit: int,
    lease_seconds: float,
    crash_budget: int,
    static_pool: str | None,
    before: Callable[[], Any] | None = None,
) -> ClaimResult:
    """Claim up to ``limit`` items of the run for ``owner``; say why when fewer are claimed.

    ``before`` runs first in the same transaction: a worker records its last outcomes there,
    so that finishing one item and claiming the next cost one commit, not two.
    """
    with transaction.atomic():
        if before is not None:
            # Lock the run before recording: recording may lock a pool row (a Throttled
            # backoff), and claimers lock the run before its pools; the other order deadlocks.
            lock_run(run_id)
        done = before() if before is not None else None
        result = _claim(run_id, owner, limit, lease_seconds, crash_budget, static_pool)
        result.before = done
        return result


def _claim(
    run_id: int,
    owner: str,
    limit: int,
    lease_seconds: float,
    crash_budget: int,
    static_pool: str | None,
) -> ClaimResult:
    if True:  # the caller holds the transaction
        run = lock_run(run_id)
        if run is None:
            return ClaimResult(None, run_status="deleted", reason="run deleted")
        result = ClaimResult(None, run_status=run["status"], failure_policy=run["failure_policy"])
        if run["status"] != RunStatus.RUNNING:
            result.reason = f"run {run['status']}"
            return result
        # Read the clock after the lock: time spent waiting for it must not age the decision.
        now = timezone.now()
        in_flight = ItemClaim.objects.in_flight(now).filter(run_id=run_id).count()
        room = run["max_parallel"] - in_flight
        if room <= 0:
            result.reason = f"run at max_parallel ({in_flight}/{run['max_parallel']})"
            return result
        limit = min(limit, room)

        admitted: list[dict] = []
        failed_out: list[int] = []
        lost_keys: list[str] = []
        pools: dict[str, CapacityPool] = {}
        rooms: dict[str, Headroom] = {}
        blocked: set[str] = set()

        def open_pools(names: list[str], skip_locked: bool) -> None:
            nonlocal now
            locked = _lock_pools(names, skip_locked)
            # Waiting for a pool's lock (another run's claim) must not age the decision either;
            # the clock only moves forward, so what was decided before stays conservative.
            now = max(now, timezone.now())
            counts = _pool_in_flight(list(locked), now)
            for name in names:
                pool = locked.get(name)
                if pool is None:
                    # Missing (deleted) or, in a later round, locked by another claimer.
                    rooms[name] = Headroom(0, f"pool {name} unavailable")
                else:
                    refill(pool, now)
                    pools[name] = pool
                    rooms[name] = fair_share(pool, counts[name], run_id, now)
                if rooms[name].count <= 0:
                    blocked.add(name)

        if static_pool:
            # Pools are locked before items so that admission is decided on one consistent view.
            open_pools([static_pool], skip_locked=False)
            limit = min(limit, rooms[static_pool].count)
        for round_no in range(_ROUNDS):
            want = limit - len(admitted)
            if want <= 0:
                break
            lookahead = (
                want if static_pool is not None or round_no == _ROUNDS - 1 else want * _LOOKAHEAD
            )
            found = _candidates(run_id, now, lookahead, blocked)
            # An item failed out in an earlier round is still "running" in the database.
            seen = {a["pk"] for a in admitted} | set(failed_out)
            found = [c for c in found if c["pk"] not in seen]
            if not found:
                break
            new_pools = sorted({c["pool"] for c in found if c["pool"] and c["pool"] not in rooms})
            if new_pools:
                # Only the first round may wait for pool locks: it takes them in name order,
                # and later rounds skip locked pools: no two claimers wait on each other.
                open_pools(new_pools, skip_locked=round_no > 0)
            for cand in found:
                if len(admitted) >= limit:
                    break
                if cand["status"] == ItemStatus.RUNNING and cand["crashes"] + 1 > crash_budget:
                    failed_out.append(cand["pk"])
                    lost_keys.append(cand["key"])
                    continue
                name = cand["pool"]
                if name:
                    if rooms[name].count <= 0:
                        continue
                    rooms[name].count -= 1
                    if pools[name].tokens is not None:
                        pools[name].tokens = (pools[name].tokens or 0.0) - 1
                admitted.append(cand)
            if static_pool is not None or not found:
                break

        if failed_out:
            ItemClaim.objects.filter(pk__in=failed_out).update(
                status=ItemStatus.FAILED,
                claim_token=None,
                lease_expires_at=None,
                crashes=F("crashes") + 1,
                finished_at=now,
                error_class="WorkerLost",
                error=f"the worker running this item died {crash_budget + 1} times "
                f"(crash budget {crash_budget})",
            )
            result.crashed_out = len(failed_out)
            if run["failure_policy"] == FailurePolicy.FAIL_FAST:
                # A lost item is a failed item: fail fast as record() does for handler failures.
                admitted = []
                fail_fast(run_id, lost_keys[0], now)

        if admitted:
            token = uuid.uuid4()
            result.token = token
            lease = now + timedelta(seconds=lease_seconds)
            values = dict(
                status=ItemStatus.RUNNING,
                owner=owner[:200],
                claim_token=token,
                lease_expires_at=lease,
                claimed_at=now,
                started_at=now,
                finished_at=None,
            )
            reclaimed = [c["pk"] for c in admitted if c["status"] == ItemStatus.RUNNING]
            fresh = [c["pk"] for c in admitted if c["status"] != ItemStatus.RUNNING]
            if reclaimed:
                # The previous owner's lease ran out while it held the item: that is a crash.
                ItemClaim.objects.filter(pk__in=reclaimed).update(
                    crashes=F("crashes") + 1, **values
                )
            if fresh:
                ItemClaim.objects.filter(pk__in=fresh).update(**values)
        for name, pool in pools.items():
            changed: dict[str, Any] = {}
            if pool.tokens is not None and any(c["pool"] == name for c in admitted):
                changed.update(tokens=pool.tokens, tokens_at=pool.tokens_at)
            if pool.waiters != pool._waiters_loaded:  # type: ignore[attr-defined]
                changed["waiters"] = pool.waiters
            if changed:
                CapacityPool.objects.filter(pk=pool.pk).update(**changed)
        result.items = [
            ClaimedItem(c["pk"], c["key"], c["index"], c["payload"], c["pool"], c["attempt"])
            for c in admitted
        ]

        if len(admitted) < limit or not admitted:
            reasons = [rooms[n] for n in sorted(blocked)]
            if reasons:
                result.reason = "; ".join(f"{n}: {rooms[n].reason}" for n in sorted(blocked))
                times = [r.until for r in reasons if r.until]
                result.retry_at = min(times) if times else None
            elif not admitted:
                result.reason = "nothing claimable"
                result.retry_at = _next_due(run_id, now)
        return result


WAITER_SECONDS = 2.0  # how long a refused run counts as waiting for a pool


def fair_share(pool: CapacityPool, by_run: Counter[int], run_id: int, now: datetime) -> Headroom:
    """The pool's headroom for this run: no run takes more than its share while others wait.

    A run refused by a full pool registers as a waiter on the pool row (under its lock); while
    any other run waits, a run may only grow up to ceil(max_concurrency / contending runs),
    so the slots its finished items free go to the waiting runs instead.
    """
    stamp = now.timestamp()
    pool._waiters_loaded = dict(pool.waiters or {})  # type: ignore[attr-defined]
    waiters = {int(r) for r, until in (pool.waiters or {}).items() if until > stamp}
    room = headroom(pool, sum(by_run.values()), now)
    contenders = set(by_run) | waiters | {run_id}
    share = -(-pool.max_concurrency // len(contenders))
    mine = by_run.get(run_id, 0)
    if room.count <= 0:
        registered = (pool.waiters or {}).get(str(run_id), 0.0)
        # Refresh the registration only when half of it is spent: a refused claim then writes
        # the pool row at most once a second per run, not on every attempt.
        if (
            not pool.paused
            and mine < share
            and pool.max_concurrency > 0
            and registered < stamp + WAITER_SECONDS / 2
        ):
            pool.waiters = {str(r): u for r, u in (pool.waiters or {}).items() if u > stamp}
            pool.waiters[str(run_id)] = stamp + WAITER_SECONDS
        return room
    if waiters - {run_id} and mine + room.count > share:
        allowed = max(0, share - mine)
        if allowed < room.count:
            return Headroom(allowed, f"fair share ({mine}/{share}) while other runs wait")
    return room


def _next_due(run_id: int, now: datetime) -> datetime | None:
    """When the run's next item becomes claimable (a retry comes due or a lease runs out)."""
    items = ItemClaim.objects.filter(run_id=run_id)
    retry = (
        items.filter(status=ItemStatus.PENDING, next_attempt_at__gt=now)
        .order_by("next_attempt_at")
        .values_list("next_attempt_at", flat=True)
        .first()
    )
    lease = (
        items.filter(status=ItemStatus.RUNNING)
        .order_by("lease_expires_at")
        .values_list("lease_expires_at", flat=True)
        .first()
    )
    times = [t for t in (retry, lease) if t is not None]
    return min(times) if times else None
