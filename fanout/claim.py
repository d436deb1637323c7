"""Claim: take new slots for admissible items in one short transaction.

This is the path of a worker that holds no slot (it starts, or its last item handed over
nothing). It locks the run's row, whose ``in_flight`` counter decides ``max_parallel``, then each
pool row it admits into (blocking, in name order: concurrency and token buckets are decided
from the locked rows), then the items with SKIP LOCKED. Handlers run after it commits: it must
stay short, because claimers taking new slots of the same run wait on it. A worker that
finishes an item does not come here: it hands its slot to the next item in one statement
(``transitions.hand_over``), touching neither row.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.db.models import Count, F

from . import transitions
from .backends import backend
from .clock import db_now
from .conf import conf, host_name
from .errors import HostLockBusy
from .join import fail_fast
from .models import (
    BatchRun,
    CapacityPool,
    FailurePolicy,
    ItemAttempt,
    ItemClaim,
    ItemStatus,
    RunStatus,
)
from .pools import (
    Headroom,
    PoolState,
    fair_room,
    headroom,
    refill,
    share_of,
    waiting_runs,
)
from .spend import Gate
from .transitions import ClaimedItem

if TYPE_CHECKING:
    from .definition import FanOut

__all__ = ["ClaimResult", "ClaimedItem", "claim", "lock_run"]

# Candidates looked at per admitted slot when items choose their pool: enough to see past
# items of a full pool without locking a whole run's worth of rows.
_LOOKAHEAD = 4
_ROUNDS = 3


@dataclass
class ClaimResult:
    token: uuid.UUID | None
    items: list[ClaimedItem] = field(default_factory=list)
    run_status: str = RunStatus.RUNNING
    failure_policy: str = "collect"
    # Why nothing more was claimed, and when it is worth trying again: the database's time,
    # and the seconds until then (what a worker waits: hosts' clocks may disagree).
    reason: str = ""
    retry_at: datetime | None = None
    retry_in: float | None = None
    # Items failed because their owners kept dying (crash budget spent).
    crashed_out: int = 0
    # Pools that refused for want of a free slot.
    full: list[str] = field(default_factory=list)
    # What the ``before`` step returned.
    before: Any = None
    # Compensations: the result of each claimed item, which its compensation undoes.
    results: dict[int, Any] = field(default_factory=dict)
    # Seconds until a budget period of the claimed items' pools ends (fanout.spend).
    budget_rolls_in: float | None = None

    @property
    def run_open(self) -> bool:
        return self.run_status == RunStatus.RUNNING


_RUN_FIELDS = ("status", "max_parallel", "failure_policy", "in_flight", "compensating")


def lock_run(run_id: int, freed: int = 0) -> dict[str, Any] | None:
    """Lock the run's row for this transaction (on every backend) and read what claims need;
    first give its counter back ``freed`` slots (transitions.slots_freed)."""
    runs = BatchRun.objects.filter(pk=run_id)
    if freed:
        row = backend().lock_run_freeing(run_id, freed, _RUN_FIELDS)
        if row is not None:
            return row or None
        runs.update(in_flight=F("in_flight") - freed)
    if connection.features.has_select_for_update:
        # NO KEY UPDATE (PostgreSQL): a writer's second update of an item in its transaction
        # checks the item's run with KEY SHARE, which FOR UPDATE would make wait on this claim.
        no_key = connection.features.has_select_for_no_key_update
        runs = runs.select_for_update(no_key=no_key)
        return dict(runs.values(*_RUN_FIELDS).first() or {}) or None
    # SQLite has no row locks: writing first serialises claimers as FOR UPDATE would.
    backend().take_write_lock(runs)
    return dict(runs.values(*_RUN_FIELDS).first() or {}) or None


def claim(
    run_id: int,
    owner: str,
    limit: int,
    lease_seconds: float,
    crash_budget: int,
    static_pool: str | None,
    before: Callable[[], Any] | None = None,
    host_limit: tuple[str, int] | None = None,
    spend: bool = False,
) -> ClaimResult:
    """Claim up to ``limit`` items of the run for ``owner``; say why when fewer are claimed.

    ``before`` runs first in the same transaction: a worker records its last outcomes there,
    so that finishing items and claiming the next cost one commit, not two. ``host_limit``
    (definition name, N): at most N of that definition's items run on this host at once.
    ``spend``: the run's items have estimates to reserve against budgets (fanout.spend).
    """
    args = (run_id, owner, limit, lease_seconds, crash_budget, static_pool)
    with host_lock(host_limit):
        result = _claim(*args, before=before, host_limit=host_limit, spend=spend)
        if result.full and not result.items and before is None:
            # A pool full of leases whose owners died (perhaps another run's, which no worker
            # of ours may reclaim): give those slots back, then try once more.
            if transitions.release_expired(ItemClaim.objects.filter(pool__in=result.full)):
                result = _claim(*args, host_limit=host_limit, spend=spend)
    return result


# How long a claimer waits for its host's lock (MySQL's GET_LOCK; a claim holds it briefly).
HOST_LOCK_WAIT_SECONDS = 60


@contextlib.contextmanager
def host_lock(host_limit: tuple[str, int] | None) -> Iterator[None]:
    """Serialise this host's claimers of one definition, so its host limit is exact.

    A session lock (PostgreSQL's advisory lock, MySQL's GET_LOCK), held around the claim's
    transaction; SQLite serialises every writer already.
    """
    if host_limit is None:
        yield
        return
    name = f"fanout-host:{host_limit[0]}:{host_name()}"
    with backend().session_lock(name, HOST_LOCK_WAIT_SECONDS) as taken:
        if not taken:
            raise HostLockBusy(
                f"host lock {name[:64]!r} not taken in {HOST_LOCK_WAIT_SECONDS}s: another "
                "claimer on this host holds it; nothing was claimed"
            )
        yield


def _claim(
    run_id: int,
    owner: str,
    limit: int,
    lease_seconds: float,
    crash_budget: int,
    static_pool: str | None,
    before: Callable[[], Any] | None = None,
    host_limit: tuple[str, int] | None = None,
    spend: bool = False,
) -> ClaimResult:
    with transaction.atomic():
        # The outcomes' run slots are given back by the statement that locks the run.
        with transitions.slots_freed(run_id) as freed:
            done = before() if before is not None else None
        run = lock_run(run_id, freed[run_id])
        if run is None:
            result = ClaimResult(None, run_status="deleted", reason="run deleted")
        elif run["status"] != RunStatus.RUNNING:
            result = ClaimResult(None, run_status=run["status"], reason=f"run {run['status']}")
            result.failure_policy = run["failure_policy"]
        else:
            taking = _Claim(
                run_id,
                run,
                owner,
                lease_seconds,
                crash_budget,
                static_pool,
                before is not None,
                spend,
            )
            if host_limit is not None:
                taking.limit_host(*host_limit)
            result = taking.take(limit)
        result.before = done
        return result


# When this process last looked for a run's expired leases (time.monotonic()).
_expired_checked: dict[int, float] = {}
EXPIRED_CHECK_SECONDS = 0.5
_FIELDS = (
    "pk",
    "key",
    "index",
    "payload",
    "pool",
    "attempt",
    "crashes",
    "status",
    "owner",
    "started_at",
    "lease_expires_at",
)
_SPEND_FIELDS = (*_FIELDS, "estimate", "cost")


class _Claim:
    """One claim transaction's state: the run's room, the pools' headroom, what was admitted."""

    def __init__(
        self,
        run_id: int,
        run: dict[str, Any],
        owner: str,
        lease_seconds: float,
        crash_budget: int,
        static_pool: str | None,
        recorded: bool = False,
        spend: bool = False,
    ) -> None:
        self.run_id = run_id
        # Outcomes recorded first in this transaction hold pool locks out of name order, so
        # this claim must not wait for any other pool's lock: it skips locked pools instead.
        self.recorded = recorded
        self.run = run
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.crash_budget = crash_budget
        self.static_pool = static_pool
        # Read after the run's lock: time spent waiting for it must not age the decision.
        self.now = db_now()
        self.room = run["max_parallel"] - run["in_flight"]  # new slots the run allows
        self.pools: dict[str, CapacityPool] = {}
        self.waiters_read: dict[str, dict] = {}
        self.rooms: dict[str, Headroom] = {}
        self.blocked: set[str] = set()
        self.fresh: list[dict] = []  # pending items taking new slots
        self.reclaimed: list[dict] = []  # expired items keeping their slots
        self.lost: list[dict] = []  # expired items whose crash budget is spent
        self.host_room: int | None = None  # new items this host may still run (host limit)
        self.host_reason = ""
        # Budgets to reserve estimates against (fanout.spend), locked after the run's row.
        self.gate = Gate.open(run_id, self.now) if spend else None
        self.fields = _SPEND_FIELDS if spend else _FIELDS

    def limit_host(self, definition: str, most: int) -> None:
        """At most ``most`` of the definition's items run on this host: count its live leases
        (a new statement under the host's lock, so it sees every claim that committed)."""
        host = host_name()
        live = (
            ItemClaim.objects.in_flight(self.now)
            .filter(run__definition=definition, owner__startswith=f"{host}:")
            .count()
        )
        self.host_room = most - live
        self.host_reason = f"host {host} at host_max_parallel ({live}/{most})"

    def take(self, limit: int) -> ClaimResult:
        result = ClaimResult(None, failure_policy=self.run["failure_policy"])
        if self.static_pool:
            # Pools are locked before items so that admission is decided on one consistent view.
            self._open_pools([self.static_pool], skip_locked=self.recorded)
        for round_no in range(_ROUNDS):
            want = limit - len(self.fresh) - len(self.reclaimed)
            if want <= 0:
                break
            per_pool = self.static_pool is not None or round_no == _ROUNDS - 1
            found = self._candidates(want if per_pool else want * _LOOKAHEAD)
            if not found:
                break
            new_pools = sorted({c["pool"] for c in found if c["pool"]} - set(self.rooms))
            if new_pools:
                # Only the first round may wait for pool locks: it takes them in name order,
                # and later rounds skip locked pools: no two claimers wait on each other.
                self._open_pools(new_pools, skip_locked=self.recorded or round_no > 0)
            for cand in found:
                if len(self.fresh) + len(self.reclaimed) >= limit:
                    break
                self._admit(cand)
            if self.static_pool is not None:
                break
        self._apply(result)
        self._explain(result, limit)
        return result

    def _candidates(self, limit: int) -> list[dict]:
        seen = {c["pk"] for c in (*self.fresh, *self.reclaimed, *self.lost)}
        found: list[dict] = []

        def look(qs: Any) -> None:
            qs = qs.filter(run_id=self.run_id)
            if self.blocked:
                qs = qs.exclude(pool__in=self.blocked)
            skip = seen | {c["pk"] for c in found}
            if skip:
                qs = qs.exclude(pk__in=skip)
            found.extend(
                qs.order_by("index")
                .select_for_update(skip_locked=True)
                .values(*self.fields)[: limit - len(found)]
            )

        with walking_indexes():
            return self._look(limit, seen, found, look)

    def _look(self, limit: int, seen: set[int], found: list[dict], look: Any) -> list[dict]:
        # Expired leases first: their owners died, and they are the oldest work. Looking costs a
        # query, so a process looks at most twice a second per run, and whenever pending ones
        # run out or the run has no room for new slots (expired items keep theirs).
        mono = time.monotonic()
        looked = mono - _expired_checked.get(self.run_id, 0.0) >= EXPIRED_CHECK_SECONDS
        if looked:
            look(ItemClaim.objects.expired(self.now))
            # While expired leases turn up, the next claim looks again: a dead owner's items are
            # reclaimed as fast as new ones are claimed, not two a second per process.
            _expired_checked[self.run_id] = 0.0 if found else mono
        room = self.room - len(self.fresh)
        if len(found) < limit and room > 0:
            pending = ItemClaim.objects.pending_due(self.now)
            before = len(found)
            look(pending)
            # No more new slots than the run has room for.
            del found[before + room :]
        if len(found) < limit and not looked:
            look(ItemClaim.objects.expired(self.now))
        return found

    def _open_pools(self, names: list[str], skip_locked: bool) -> None:
        rows = CapacityPool.objects.filter(name__in=names).order_by("name")
        locked = {p.name: p for p in rows.select_for_update(skip_locked=skip_locked)}
        if not skip_locked and locked:
            # Waiting for a pool's lock (another run's claim) must not age the decision either;
            # the clock only moves forward, so what was decided before stays conservative.
            self.now = max(self.now, db_now())
        by_run = _pool_runs(list(locked))
        busy = self.gate.open_pools(list(locked), skip_locked) if self.gate else set()
        for name in names:
            pool = locked.get(name)
            if pool is None:
                # Missing (deleted) or, in a later round, locked by another claimer.
                self.rooms[name] = Headroom(0, f"pool {name} unavailable")
            else:
                refill(pool, self.now)
                self.pools[name] = pool
                self.waiters_read[name] = dict(pool.waiters or {})
                self.rooms[name] = fair_share(pool, by_run[name], self.run_id, self.now)
                if self.gate is not None:
                    self._budget_room(name, busy)
            if self.rooms[name].count <= 0:
                self.blocked.add(name)

    def _expired(self, cand: dict) -> bool:
        return cand["status"] == ItemStatus.RUNNING

    def _budget_room(self, name: str, busy: set[str]) -> None:
        """A pool whose budgets another claimer holds, or whose budget is spent, admits none."""
        assert self.gate is not None
        if name in busy:
            self.rooms[name] = Headroom(0, f"pool {name} unavailable")
            return
        spent = self.gate.pool_spent(name)
        if spent:
            self.rooms[name] = Headroom(0, spent, self.gate.blocked_until)

    def _admit(self, cand: dict) -> None:
        expired = self._expired(cand)
        # An expired item's owner died now; a pending one may have been given back by a reaper.
        if cand["crashes"] + expired > self.crash_budget:
            self.lost.append(cand)
            return
        if self.host_room is not None and self.host_room <= 0:
            return  # this host runs as many of the definition's items as it may
        if expired:
            self._admit_reclaimed(cand)
        else:
            self._admit_fresh(cand)

    def _admit_reclaimed(self, cand: dict) -> None:
        """An expired item keeps its slot: only the rate limit (a new call to the provider)
        applies."""
        name = cand["pool"]
        pool = self.pools.get(name)
        need = _bucket_need(cand, pool)
        if pool is not None and pool.tokens is not None:
            if pool.tokens < need - 1e-9:
                self._short(name, pool, need)
                return
            if not self._reserve(cand, reclaim=True):
                return
            self._spend_token(name, pool, need)
        elif name and pool is None:
            return
        elif not self._reserve(cand, reclaim=True):
            return
        self._take_host_slot()
        self.reclaimed.append(cand)

    def _admit_fresh(self, cand: dict) -> None:
        """A fresh item takes a slot of the run and of its pool, and the pool's tokens."""
        name = cand["pool"]
        pool = self.pools.get(name)
        need = _bucket_need(cand, pool)
        if len(self.fresh) >= self.room:
            return
        if name and self.rooms[name].count <= 0:
            return
        if pool is not None and pool.tokens is not None and pool.tokens < need - 1e-9:
            self._short(name, pool, need)
            return
        if not self._reserve(cand, reclaim=False):
            return
        if name:
            self.rooms[name].count -= 1
            if pool is not None and pool.tokens is not None:
                pool.tokens -= need
        self._take_host_slot()
        self.fresh.append(cand)

    def _reserve(self, cand: dict, reclaim: bool) -> bool:
        """Hold the item's estimate against its budgets; False when one of them refuses."""
        if self.gate is None:
            return True
        return not self.gate.admit(cand.get("estimate"), cand["pool"], reclaim)

    def _short(self, name: str, pool: CapacityPool, need: float) -> None:
        """The bucket holds less than the item takes: the pool admits nothing more now (the
        items behind it wait their turn), until the bucket holds enough."""
        assert pool.tokens is not None and pool.rate_count is not None
        wait = (need - pool.tokens) * pool.rate_period / pool.rate_count
        until = self.now + timedelta(seconds=wait)
        self.rooms[name] = Headroom(0, f"rate limited until {until:%H:%M:%S.%f}"[:-3], until)
        self.blocked.add(name)

    def _spend_token(self, name: str, pool: CapacityPool, need: float = 1.0) -> bool:
        """Take a reclaimed item's tokens; the tokens left bound the fresh items too.

        The pool's room was counted from the tokens before these were spent: left as it
        was, a fresh item of the same claim could take a token that is gone.
        """
        if pool.tokens is None or pool.tokens < need - 1e-9:
            return False
        pool.tokens -= need
        if pool.rate_unit:
            return True  # fresh items are measured against the bucket one by one
        whole = math.floor(pool.tokens + 1e-9)
        if whole < self.rooms[name].count:
            self.rooms[name].count = whole
        if whole <= 0:
            # Why the fresh items wait, and until when: the bucket's next token.
            self.rooms[name] = headroom(pool, 0, self.now)
            self.blocked.add(name)
        return True

    def _take_host_slot(self) -> None:
        if self.host_room is not None:
            self.host_room -= 1

    def _apply(self, result: ClaimResult) -> None:
        if self.lost:
            transitions.fail_lost(self.run_id, self.lost, self.crash_budget)
            result.crashed_out = len(self.lost)
            if self.run["failure_policy"] == FailurePolicy.FAIL_FAST:
                # A lost item is a failed item: fail fast as record() does for handler failures.
                self.fresh, self.reclaimed = [], []
                fail_fast(self.run_id, self.lost[0]["key"])
        admitted = self.reclaimed + self.fresh
        if admitted:
            result.token = uuid.uuid4()
            args = (self.owner, result.token, self.lease_seconds, self.now)
            transitions.reclaim(self.reclaimed, *args)
            transitions.start(self.run_id, self.fresh, *args)
        if self.gate is not None:
            self.gate.apply(self.fresh, self.reclaimed, self.lost)
            result.budget_rolls_in = self.gate.rolls_in()
        self._save_pools(admitted)
        admitted.sort(key=lambda c: c["index"])
        result.items = [
            ClaimedItem(
                c["pk"], c["key"], c["index"], c["payload"], c["pool"], c["attempt"], self.now
            )
            for c in admitted
        ]

    def _save_pools(self, admitted: list[dict]) -> None:
        """Write back what admission changed on the locked pool rows: tokens, waiters."""
        for name, pool in self.pools.items():
            changed: dict[str, Any] = {}
            if pool.tokens is not None and any(c["pool"] == name for c in admitted):
                changed.update(tokens=pool.tokens, tokens_at=pool.tokens_at)
            if pool.waiters != self.waiters_read[name]:
                changed["waiters"] = pool.waiters
            if changed:
                CapacityPool.objects.filter(pk=pool.pk).update(**changed)

    def _explain(self, result: ClaimResult, limit: int) -> None:
        if len(result.items) >= limit and result.items:
            return
        result.full = [n for n in sorted(self.blocked) if self.rooms[n].full]
        if self.blocked:
            reasons = [self.rooms[n] for n in sorted(self.blocked)]
            result.reason = "; ".join(f"{n}: {self.rooms[n].reason}" for n in sorted(self.blocked))
            times = [r.until for r in reasons if r.until]
            result.retry_at = min(times) if times else None
        elif self.gate is not None and self.gate.reason and not result.items:
            # The run's budget: nothing comes due by itself, an operator raises it.
            result.reason = self.gate.reason
            result.retry_in = float(conf.IDLE_MAX_SECONDS)
        elif self.host_room is not None and self.host_room <= 0 and not result.items:
            result.reason = self.host_reason
            result.retry_in = float(conf.IDLE_MAX_SECONDS)
        elif self.room <= 0 and not result.items:
            used, limit_ = self.run["in_flight"], self.run["max_parallel"]
            result.reason = f"run at max_parallel ({used}/{limit_})"
            # A lease running out is a slot coming back (its owner may be dead): a drain about
            # to leave idle stays for it, or nobody but the supervisor would reclaim it.
            result.retry_at = _next_due(self.run_id, self.now)
        elif not result.items:
            result.reason = "nothing claimable"
            result.retry_at = _next_due(self.run_id, self.now)
        if result.retry_at is not None:
            result.retry_in = max(0.0, (result.retry_at - self.now).total_seconds())


def walking_indexes() -> contextlib.AbstractContextManager[None]:
    """Plan the claim's picks so that they walk fanout_item_claim_idx in work-list order even
    when statistics have not seen the run yet (the backend's ordered_picks)."""
    return backend().ordered_picks()


def _bucket_need(cand: dict, pool: CapacityPool | None) -> float:
    """What an admission takes from the pool's bucket: one call, or, for a pool whose rate
    counts a unit ("90000 tokens/m"), the item's estimate in that unit."""
    if pool is None or not pool.rate_unit:
        return 1.0
    return float((cand.get("estimate") or {}).get(pool.rate_unit, 0.0))


def _pool_runs(names: list[str]) -> dict[str, Counter[int]]:
    """Items holding slots per pool, per run: each run's fair share of a pool.

    A new statement after the pools' locks are held, so it sees what committed meanwhile.
    """
    rows = (
        ItemClaim.objects.holding_pool_slots()
        .filter(pool__in=names)
        .values("pool", "run_id")
        .annotate(n=Count("pk"))
        .values_list("pool", "run_id", "n")
    )
    by_pool: dict[str, Counter[int]] = {name: Counter() for name in names}
    for pool, run, n in rows:
        by_pool[pool][run] = n
    return by_pool


WAITER_SECONDS = 2.0  # how long a refused run counts as waiting for a pool


def fair_share(pool: CapacityPool, by_run: Counter[int], run_id: int, now: datetime) -> Headroom:
    """The pool's headroom for this run (pools.fair_room), kept on the locked pool row.

    A run refused by a full pool registers as a waiter on the pool row (under its lock); while
    any other run waits, a run may only grow up to its fair share, so the slots its finished
    items free go to the waiting runs instead (a finished item does not hand its slot over
    while any run waits on the pool: pools.hands_over).
    """
    state = PoolState.of(pool, by_run)
    stamp = now.timestamp()
    if pool.waiters and not waiting_runs(pool.waiters, now):
        pool.waiters = {}  # stale entries only: clear them
    room = fair_room(state, run_id, now)
    if room.count <= 0:
        mine, share = share_of(state, run_id, now)
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


# --- the claim of an item's second phase: its compensation --------------------------------

REVERSE = "reverse"
_UNDO_FIELDS = ("pk", "key", "index", "payload", "pool", "result", "owner", "claim_token")


def claim_compensations(run_id: int, definition: FanOut, owner: str) -> ClaimResult:
    """Take the compensation the order and the budget allow, in one short transaction.

    The same admission as an item's: the run's lock, then its pools' (concurrency, rate
    tokens, a Throttled backoff, pause, fair share), the host limit and the crash budget.
    What differs is data: the budget (``compensate_max_parallel``, counted by the run's
    ``compensating``), the order (strictly one at a time, latest finished first, for
    ``compensate_order="reverse"``), and the attempt number (``compensation_attempt``).
    One per claim: each worker thread runs one compensation at a time, so the budget is
    spread over threads instead of queued behind one.
    """
    most = definition.host_max_parallel
    with host_lock((f"{definition.name}:compensate", most) if most else None):
        with transaction.atomic():
            run = lock_run(run_id)
            if run is None or run["status"] != RunStatus.COMPENSATING:
                status = run["status"] if run else "deleted"
                return ClaimResult(None, run_status=status, reason=f"run {status}")
            transitions.compensate(run_id)  # items that succeeded since are undone too
            items = ItemClaim.objects.filter(run_id=run_id)
            if items.holding_run_slots().exists():
                # Strict reverse order needs every forward item finished first.
                reason = "waiting for running items to finish"
                return ClaimResult(None, run_status=run["status"], reason=reason)
            taking = _Undo(run_id, run, owner, definition)
            if most:
                taking.limit_host(definition.name, most)
            return taking.take(1)


class _Undo(_Claim):
    """A claim of compensations: _Claim's admission over a compensating run's items."""

    def __init__(self, run_id: int, run: dict[str, Any], owner: str, definition: FanOut) -> None:
        lease, budget = definition.lease_seconds, definition.crash_budget
        super().__init__(run_id, run, owner, lease, budget, None)
        self.reverse = definition.compensate_order == REVERSE
        most = 1 if self.reverse else definition.compensate_max_parallel or run["max_parallel"]
        self.room = most - run["compensating"]
        self.order = ("-finished_at", "-index") if self.reverse else ("index",)

    def limit_host(self, definition: str, most: int) -> None:
        """Compensations count apart from items on a host (a lock of their own)."""
        host = host_name()
        live = (
            ItemClaim.objects.filter(run__definition=definition, claim_token__isnull=False)
            .filter(status=ItemStatus.COMPENSATING, lease_expires_at__gt=self.now)
            .filter(owner__startswith=f"{host}:")
            .count()
        )
        self.host_room = most - live
        self.host_reason = f"host {host} at host_max_parallel for compensations ({live}/{most})"

    def _expired(self, cand: dict) -> bool:
        return cand["claim_token"] is not None

    def _candidates(self, limit: int) -> list[dict]:
        if self.fresh or self.reclaimed or self.lost:
            return []  # one per claim
        comp = ItemClaim.objects.filter(run_id=self.run_id, status=ItemStatus.COMPENSATING)
        # A compensation whose worker died is taken over first; it keeps its budget slot.
        found = self._pick(comp.filter(claim_token__isnull=False, lease_expires_at__lte=self.now))
        if not found and self.room > 0:
            due = comp.filter(claim_token__isnull=True)
            if not self.reverse:
                due = due.filter(next_attempt_at__lte=self.now)
            found = self._pick(due)
            if self.reverse and found and found[0]["next_attempt_at"] > self.now:
                found = []  # strictly in order: the next one's retry is not due yet
        for cand in found:
            cand["crashes"] = _compensation_crashes(cand) if cand["claim_token"] else 0
        return found

    def _pick(self, qs: Any) -> list[dict]:
        if self.blocked and not self.reverse:
            qs = qs.exclude(pool__in=self.blocked)  # another pool's may be admitted
        fields = (*_UNDO_FIELDS, "next_attempt_at", "compensation_attempt")
        qs = qs.order_by(*self.order).select_for_update(skip_locked=True)
        return list(qs.values(*fields)[:1])

    def _apply(self, result: ClaimResult) -> None:
        if self.lost:
            transitions.compensation_lost(self.run_id, self.lost, self.crash_budget)
            result.crashed_out = len(self.lost)
        admitted = self.reclaimed + self.fresh
        if admitted:
            result.token = uuid.uuid4()
            args = (self.owner, result.token, self.lease_seconds)
            transitions.retake_compensations(self.reclaimed, *args)
            transitions.claim_compensations(self.run_id, self.fresh, *args)
            for c in self.fresh:
                c["compensation_attempt"] += 1  # a fresh claim begins an attempt
        self._save_pools(admitted)
        result.items = [
            ClaimedItem(
                c["pk"],
                c["key"],
                c["index"],
                c["payload"],
                c["pool"],
                c["compensation_attempt"],
                self.now,
            )
            for c in admitted
        ]
        result.results = {c["pk"]: c["result"] for c in admitted}
        result.run_status = RunStatus.COMPENSATING

    def _explain(self, result: ClaimResult, limit: int) -> None:
        if result.items:
            return
        # Only a time still ahead: a due compensation's past retry time would ask the drain to
        # claim again at once, in a loop of run- and pool-row locks until a slot comes back.
        if self.blocked:
            result.reason = "; ".join(f"{n}: {self.rooms[n].reason}" for n in sorted(self.blocked))
            until = [self.rooms[n].until for n in self.blocked]
            times = [t for t in until if t is not None]
            # A paused or full pool has no time: wait the idle time, or be woken.
            result.retry_at = min(times) if times else None
        elif self.host_room is not None and self.host_room <= 0:
            result.reason = self.host_reason
            result.retry_at = _next_compensation(self.run_id, self.now, due=False)
        elif self.room <= 0:
            result.reason = f"at the compensation budget ({self.run['compensating']} under way)"
            # A slot comes back when a compensation is recorded, or when its lease runs out.
            result.retry_at = _next_compensation(self.run_id, self.now, due=False)
        else:
            result.reason = "no compensation due"
            result.retry_at = _next_compensation(self.run_id, self.now)
        if result.retry_at is not None:
            result.retry_in = max(0.0, (result.retry_at - self.now).total_seconds())


def _compensation_crashes(cand: dict) -> int:
    """Workers that died running this attempt of the compensation (noted in its history)."""
    return ItemAttempt.objects.filter(
        item_id=cand["pk"],
        attempt=cand["compensation_attempt"],
        error_class=transitions.COMPENSATION_LOST,
    ).count()


def _next_compensation(run_id: int, now: datetime, due: bool = True) -> datetime | None:
    """When the run's next compensation becomes claimable after ``now`` (a lease running out,
    or with ``due`` a retry coming due); None if nothing will by itself."""
    comp = ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.COMPENSATING)
    lease = comp.filter(claim_token__isnull=False, lease_expires_at__gt=now)
    times = [lease.order_by("lease_expires_at").values_list("lease_expires_at", flat=True).first()]
    if due:
        retry = comp.filter(claim_token__isnull=True, next_attempt_at__gt=now)
        times.append(
            retry.order_by("next_attempt_at").values_list("next_attempt_at", flat=True).first()
        )
    found = [t for t in times if t is not None]
    return min(found) if found else None
