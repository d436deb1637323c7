"""Spend: what items cost, reserved against budgets when admitted, settled with their outcomes.

An item's estimate ({unit: amount}, from its definition's ``cost=``) is written with the item.
While the item runs, its estimate is held (``reserved``) on every budget it counts against:
its run's (``max_spend``) and its pool's. Its outcome's transaction replaces the reservation
with what the call reported (a success that reported nothing cost its estimate). A call cut off
by a crash keeps its reservation as spent, because nobody knows what it spent.

Admission stops when spent plus reserved would pass a budget, so spend exceeds a budget by at
most the sum of (actual - estimate) over the items in flight; with estimates that are upper
bounds, never. Budgets are rows (``SpendAccount``) written only under their own row locks, taken
after the run's and pools' rows and, within the accounts, the run's before the pools' in name
order: the order every transaction keeps (see ``transitions``).

A definition without ``cost=`` and a run without a budget touch none of this.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Case, F, FloatField, Q, Value, When

from .clock import DbNow, calendar_end, calendar_start, db_now
from .cost import Units, add, amount, describe, total
from .models import CapacityPool, ItemClaim, ItemStatus, SpendAccount

if TYPE_CHECKING:
    from .transitions import ExecutionOutcome

_EPSILON = 1e-9

# ------------------------------------------------------------------------------ budgets


def open_run_budget(run_id: int, max_spend: Mapping[str, float]) -> None:
    """Give the run its budget, one account per unit (a run's budget is set once: raising it
    is an operator's edit of the account)."""
    rows = [SpendAccount(run_id=run_id, unit=u, budget=b) for u, b in max_spend.items()]
    SpendAccount.objects.bulk_create(rows, ignore_conflicts=True)


def open_pool_budget(name: str, units: Mapping[str, float], period: float | str | None) -> None:
    """Give the pool a budget per unit, holding what its running items reserve already.

    ``period``: seconds of a rolling period, or the name of a calendar one ("month")."""
    calendar = period if isinstance(period, str) else ""
    seconds = None if calendar else period
    held = total(
        ItemClaim.objects.running()
        .filter(pool=name)
        .filter(estimate__isnull=False)
        .values_list("estimate", flat=True)
    )
    for unit, budget in units.items():
        try:
            with transaction.atomic():
                SpendAccount.objects.get_or_create(
                    pool=name,
                    unit=unit,
                    defaults=dict(
                        budget=budget,
                        period=seconds,
                        calendar=calendar,
                        reserved=held.get(unit, 0.0),
                    ),
                )
        except IntegrityError:  # pragma: no cover - another process made it first
            pass
    # The period is the settings' alone (the admin shows it read-only): a row made under an
    # older meaning of it ("day" was a rolling 24 hours) counts as the settings say now.
    SpendAccount.objects.filter(pool=name, unit__in=list(units)).exclude(
        period=seconds, calendar=calendar
    ).update(period=seconds, calendar=calendar)


@dataclass
class _Account:
    pk: int
    run_id: int | None
    pool: str | None
    unit: str
    budget: float
    spent: float
    reserved: float
    period: float | None
    calendar: str
    period_started_at: datetime | None
    spent_delta: float = 0.0
    reserved_delta: float = 0.0
    reset: bool = False  # the period rolled over: spent restarts from what this claim settled
    begun: bool = False  # its first period began: spent so far is spent in it
    kept: float = 0.0  # rolled over: what this transaction had settled before, spent anew

    @property
    def used(self) -> float:
        return self.spent + self.reserved

    def reason(self) -> str:
        return describe(self.unit, self.spent, self.budget, self.reserved)

    def period_ends(self) -> datetime | None:
        return period_end(self.period, self.calendar, self.period_started_at)


_ACCOUNT_FIELDS = (
    "pk",
    "run_id",
    "pool",
    "unit",
    "budget",
    "spent",
    "reserved",
    "period",
    "calendar",
    "period_started_at",
)


def period_end(period: float | None, calendar: str, started: datetime | None) -> datetime | None:
    """When a budget's period that began at ``started`` ends; None when it never rolls over."""
    if started is None:
        return None
    if calendar:
        return calendar_end(started, calendar)
    return started + timedelta(seconds=period) if period is not None else None


def _lock(accounts: Any, skip_locked: bool = False) -> list[_Account]:
    rows = accounts.order_by("run_id", "pool", "unit")
    if connection.features.has_select_for_update:
        rows = rows.select_for_update(skip_locked=skip_locked)
    return [_Account(*values) for values in rows.values_list(*_ACCOUNT_FIELDS)]


def _roll(account: _Account, now: datetime) -> None:
    """A pool's period that has passed starts again from zero spent (reservations carry)."""
    if account.calendar:
        _roll_calendar(account, now)
        return
    if account.period is None:
        return
    if account.period_started_at is None:
        account.period_started_at, account.begun = now, True
        return
    ends = account.period_ends()
    if ends is not None and now >= ends:
        periods = math.floor((now - account.period_started_at).total_seconds() / account.period)
        account.period_started_at += timedelta(seconds=periods * account.period)
        account.spent, account.reset = 0.0, True


def _roll_calendar(account: _Account, now: datetime) -> None:
    """A calendar period counts from its boundary (in UTC): a budget first used, or last
    used in a period that has ended, starts the one that holds ``now``."""
    ends = account.period_ends()
    if ends is None:
        # First used: what was spent since the budget was made stays (items that were running
        # when it was made), in the period that holds now.
        account.period_started_at, account.begun = calendar_start(now, account.calendar), True
        return
    if now < ends:
        return
    account.period_started_at, account.reset = calendar_start(now, account.calendar), True
    account.spent = 0.0  # what apply() writes: spent in this period, from zero


@dataclass
class Gate:
    """A claim's view of the budgets it admits against, locked for its transaction."""

    run_id: int
    now: datetime
    run: list[_Account] = field(default_factory=list)
    pools: dict[str, list[_Account]] = field(default_factory=dict)
    reason: str = ""  # why the run's budget admits nothing more, when it does not
    blocked_until: datetime | None = None
    charged: list[dict] = field(default_factory=list)  # reclaimed items: cut-off calls
    # What this transaction settled on the pools' budgets before the gate opened (the batch a
    # claim records first), by (pool, unit): a period rolled over now keeps it.
    settled: Mapping[tuple[str, str], float] = field(default_factory=dict)

    @classmethod
    def open(cls, run_id: int, now: datetime, settled: Mapping | None = None) -> Gate:
        gate = cls(run_id, now, settled=settled or {})
        gate.run = _lock(SpendAccount.objects.filter(run_id=run_id))
        return gate

    def open_pools(self, names: Sequence[str], skip_locked: bool, now: datetime) -> set[str]:
        """Lock the named pools' budgets (call with their pool rows locked); return those whose
        budgets were locked by another claimer (a later round skips them).

        ``now`` is the claim's clock read after the pools' locks: a period that ended while
        the claim waited for them rolls over here, as it would for the next claim."""
        self.now = max(self.now, now)
        found = _lock(SpendAccount.objects.filter(pool__in=names), skip_locked=skip_locked)
        for name in names:
            self.pools.setdefault(name, [])
        for account in found:
            _roll(account, self.now)
            if account.reset:
                # The claim's own transaction settled this before the roll: it commits in the
                # new period, and stays spent there.
                account.kept = self.settled.get((account.pool or "", account.unit), 0.0)
                account.spent = account.kept
            self.pools[account.pool or ""].append(account)
        if not skip_locked or not connection.features.has_select_for_update:
            return set()
        # A pool with budgets none of which we got: another claimer holds them.
        every = set(SpendAccount.objects.filter(pool__in=names).values_list("pool", flat=True))
        return every - {a.pool for a in found if a.pool}

    def admit(self, estimate: Mapping[str, float] | None, pool: str, reclaim: bool) -> str:
        """Take the item's reservation if every budget allows it; else say why not.

        A reclaimed item's cut-off call keeps its reservation as spent, and its new call
        reserves again: spent grows by the estimate, reserved stays.
        """
        accounts = [*self.run, *self.pools.get(pool, ())]
        need = estimate or {}
        for account in accounts:
            n = need.get(account.unit, 0.0)
            after = account.used + n
            if after > account.budget + _EPSILON or (n == 0 and account.used >= account.budget):
                return self._refused(account)
        for account in accounts:
            n = need.get(account.unit, 0.0)
            if reclaim:
                account.spent += n
            else:
                account.reserved += n
        return ""

    def _refused(self, account: _Account) -> str:
        reason = account.reason()
        if account.run_id is not None:
            self.reason = reason
        until = account.period_ends()
        if until is not None and (self.blocked_until is None or until < self.blocked_until):
            self.blocked_until = until
        return reason

    def pool_spent(self, pool: str) -> str:
        """Why the pool's budget admits nothing at all now ("" while it admits some)."""
        for account in self.pools.get(pool, ()):
            if account.used >= account.budget - _EPSILON:
                return self._refused(account)
        return ""

    def apply(self, fresh: Sequence[dict], reclaimed: Sequence[dict], lost: Sequence[dict]) -> None:
        """Write what the claim did: fresh items reserve their estimates; reclaimed ones and
        expired ones that fail keep their cut-off calls' reservations as spent."""
        cut_off = [r for r in (*reclaimed, *lost) if r["status"] == ItemStatus.RUNNING]
        _charge_items(cut_off)
        moves = [(r, 0.0, 1.0) for r in fresh] + [(r, 1.0, 0.0) for r in reclaimed]
        moves += [(r, 1.0, -1.0) for r in lost if r["status"] == ItemStatus.RUNNING]
        for row, spent, reserved in moves:
            for account in [*self.run, *self.pools.get(row["pool"], ())]:
                n = (row.get("estimate") or {}).get(account.unit, 0.0)
                account.spent_delta += spent * n
                account.reserved_delta += reserved * n
        for account in [*self.run, *(a for name in sorted(self.pools) for a in self.pools[name])]:
            moved = account.spent_delta or account.reserved_delta
            if not (moved or account.reset or account.begun):
                continue
            changes: dict[str, Any] = {}
            if account.reset or account.begun:
                changes.update(period_started_at=account.period_started_at)
            if account.reset:
                # The period rolled over: spent restarts from what this transaction settled
                # before the roll, plus what this claim spent.
                changes.update(spent=account.kept + account.spent_delta)
            _move(SpendAccount.objects.filter(pk=account.pk), account, changes)


def _move(rows: Any, account: _Account, changes: dict[str, Any]) -> None:
    if "spent" not in changes:
        changes["spent"] = F("spent") + account.spent_delta
    changes["reserved"] = F("reserved") + account.reserved_delta
    rows.update(**changes)


def _charge_items(rows: Sequence[dict]) -> None:
    """Calls cut off by a crash cost their item its estimate (what they may have spent)."""
    charged = [r for r in rows if r.get("estimate")]
    if not charged:
        return
    for row in charged:
        ItemClaim.objects.filter(pk=row["pk"]).update(cost=add(row.get("cost"), row["estimate"]))


# ---------------------------------------------------------------- settling with outcomes


def actual(outcome: ExecutionOutcome, estimate: Mapping[str, float] | None) -> Units:
    """What a finished call cost: what it reported; a success that reported nothing, or one
    whose answer's cost could not be read, its estimate; a failed or throttled call that
    reported nothing, nothing."""
    if outcome.cost is not None:
        return dict(outcome.cost)
    if outcome.kind == ItemStatus.SUCCEEDED or outcome.cost_unread:
        return dict(estimate or {})
    return {}


def _shift(changes: dict[tuple[int | None, str | None], dict[str, list[float]]]) -> int:
    """Move accounts by {(run, pool): {unit: [spent, reserved]}}: the run's first, then the
    pools' in name order (the lock order), one statement per owner; return the rows moved."""
    moved = 0
    for key in sorted(changes, key=_lock_order):
        units = {u: d for u, d in changes[key].items() if d[0] or d[1]}
        if not units:
            continue
        run_id, pool = key
        collecting = _settling.get()
        if collecting is not None and pool:
            for unit, d in units.items():
                collecting[(pool, unit)] = collecting.get((pool, unit), 0.0) + d[0]
        rows = SpendAccount.objects.filter(unit__in=list(units))
        if run_id is not None:
            rows = rows.filter(run_id=run_id)
        else:
            rows = rows.filter(pool=pool)
            _roll_ended(rows)
        moved += rows.update(spent=_plus("spent", units, 0), reserved=_plus("reserved", units, 1))
    return moved


# What the spend settled in the current claim's transaction moved onto pools' budgets, by
# (pool, unit), while settled_here() collects it (None: nobody asks).
_settling: ContextVar[dict[tuple[str, str], float] | None] = ContextVar(
    "fanout_spend_settling", default=None
)


@contextlib.contextmanager
def settled_here() -> Iterator[dict[tuple[str, str], float]]:
    """Collect what settlements spend on pools' budgets inside the block (a claim records its
    batch first, then rolls periods over: what the batch settled must survive the roll)."""
    collected: dict[tuple[str, str], float] = {}
    token = _settling.set(collected)
    try:
        yield collected
    finally:
        _settling.reset(token)


def _roll_ended(accounts: Any) -> None:
    """Start again the pool's periods that have ended, as the next claim would: what a call
    spent counts in the period it settles in, not in one a claim will wipe."""
    started = accounts.filter(period_started_at__isnull=False).order_by("unit")
    if connection.features.has_select_for_update:
        started = started.select_for_update()
    rows = list(started.values_list("pk", "period", "calendar", "period_started_at"))
    if not rows:
        return
    # Read once the budgets are held: a period that ended while this waited for another
    # transaction's lock on them (a hand-over's) rolls over now.
    now = db_now()
    for pk, period, calendar, began in rows:
        if calendar:
            start = calendar_start(now, calendar)
            if began >= start:
                continue
        elif period is None or now < began + timedelta(seconds=period):
            continue
        else:
            periods = math.floor((now - began).total_seconds() / period)
            start = began + timedelta(seconds=periods * period)
        # Only from the start it was read with: a claim that rolled it meanwhile wins.
        SpendAccount.objects.filter(pk=pk, period_started_at=began).update(
            spent=0.0, period_started_at=start
        )


def _lock_order(key: tuple[int | None, str | None]) -> tuple[int, Any]:
    return (0, key[0]) if key[0] is not None else (1, key[1])


def _plus(column: str, units: dict[str, list[float]], at: int) -> Any:
    """``column`` plus each unit's change (``at`` 0: spent, 1: reserved), in one expression."""
    if len(units) == 1:
        (change,) = (d[at] for d in units.values())
        return F(column) + change
    return F(column) + Case(
        *(When(unit=u, then=Value(d[at])) for u, d in units.items()),
        default=Value(0.0),
        output_field=FloatField(),
    )


def settle(rows: Sequence[tuple[int, int, str]], outcomes: Sequence[ExecutionOutcome]) -> None:
    """Replace the items' reservations by what their calls cost, in the outcomes' transaction.

    ``rows`` are the items' (pk, run, pool), locked and held by the writer.
    """
    if not any(o.accounted for o in outcomes):
        return
    by_pk = {o.pk: o for o in outcomes}
    where = {pk: (run_id, pool) for pk, run_id, pool in rows if pk in by_pk}
    found = ItemClaim.objects.filter(pk__in=list(where)).values_list("pk", "estimate", "cost")
    changes: dict[tuple[int | None, str | None], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0.0, 0.0])
    )
    corrections: dict[str, Units] = defaultdict(dict)
    for pk, estimate, cost in found:
        spent = actual(by_pk[pk], estimate)
        if spent:
            ItemClaim.objects.filter(pk=pk).update(cost=add(cost, spent))
        run_id, pool = where[pk]
        if pool:
            corrections[pool] = add(corrections[pool], overran(spent, estimate))
        for owner in ((run_id, None), (None, pool)) if pool else ((run_id, None),):
            for unit, n in spent.items():
                changes[owner][unit][0] += n
            for unit, n in (estimate or {}).items():
                changes[owner][unit][1] -= n
    correct_buckets(corrections)
    _shift(changes)


def overran(spent: Mapping[str, float], estimate: Mapping[str, float] | None) -> Units:
    """What a call cost beyond its estimate, by unit (negative: below it)."""
    units = set(spent) | set(estimate or {})
    return {u: spent.get(u, 0.0) - (estimate or {}).get(u, 0.0) for u in units}


def correct_buckets(corrections: Mapping[str, Mapping[str, float]]) -> None:
    """Pools whose rate counts a unit took items' estimates from their buckets: what the calls
    cost beyond (or below) them is taken (or given back) now. The pools' rows are locked by
    the caller already (it gave their slots back), in name order."""
    for name in sorted(corrections):
        units = {u: d for u, d in corrections[name].items() if d}
        if not units:
            continue
        CapacityPool.objects.filter(name=name, rate_unit__in=list(units)).filter(
            tokens__isnull=False
        ).update(
            tokens=F("tokens")
            - Case(
                *(When(rate_unit=u, then=Value(d)) for u, d in units.items()),
                default=Value(0.0),
                output_field=FloatField(),
            )
        )


def charge_lost(pks: Sequence[int]) -> None:
    """Items leaving a dead or stopped owner: their cut-off calls keep their reservations as
    spent. The caller holds the items' rows (and took the runs' and pools' after them)."""
    found = list(
        ItemClaim.objects.filter(pk__in=list(pks))
        .filter(estimate__isnull=False)
        .values("pk", "run_id", "pool", "estimate", "cost", "status")
    )
    if not found:
        return
    changes: dict[tuple[int | None, str | None], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0.0, 0.0])
    )
    for row in found:
        owners = [(row["run_id"], None)] + ([(None, row["pool"])] if row["pool"] else [])
        for owner in owners:
            for unit, n in row["estimate"].items():
                changes[owner][unit][0] += n
                changes[owner][unit][1] -= n
    for row in found:
        row["status"] = ItemStatus.RUNNING
    _charge_items(found)
    _shift(changes)


# ---------------------------------------------------------------------- the hand-over

# Per run, in this process: whether it has a budget of its own (made with the run, never later).
_run_budgets: dict[int, bool] = {}


def run_has_budget(run_id: int) -> bool:
    known = _run_budgets.get(run_id)
    if known is None:
        if len(_run_budgets) > 10_000:
            _run_budgets.clear()
        known = _run_budgets[run_id] = SpendAccount.objects.filter(run_id=run_id).exists()
    return known


def after_hand_over(
    outcome: ExecutionOutcome, run_id: int, next_pk: int | None, run_budget: bool = True
) -> bool:
    """Settle a handed-over item and reserve for the one that took its slot, in the hand-over's
    transaction; False when a budget refuses the next item. Its reservation stays until the
    caller records it released (by the record path, which takes the locks in their order)."""
    pks = [outcome.pk] + ([next_pk] if next_pk is not None else [])
    found = {
        pk: (estimate, cost)
        for pk, estimate, cost in ItemClaim.objects.filter(pk__in=pks).values_list(
            "pk", "estimate", "cost"
        )
    }
    estimate, cost = found.get(outcome.pk, (None, None))
    spent = actual(outcome, estimate)
    if spent:
        ItemClaim.objects.filter(pk=outcome.pk).update(cost=add(cost, spent))
    if outcome.pool:
        correct_buckets({outcome.pool: overran(spent, estimate)})
    reserve = (found.get(next_pk, (None, None))[0] or {}) if next_pk is not None else {}
    # A run's budget is made with the run, never later: a run without one has nothing to move.
    owners: list[tuple[int | None, str | None]] = [(run_id, None)] if run_budget else []
    if outcome.pool:
        owners.append((None, outcome.pool))
        # Every one of the pool's periods that has ended starts again, as a claim (and the
        # hand-over routines) roll them: not only those of the units this call moves, or the
        # next item is admitted against an ended period's spend.
        _roll_ended(SpendAccount.objects.filter(pool=outcome.pool))
    _shift(_settle_and_reserve(owners, spent, estimate or {}, reserve))
    # Asked even when nothing moved: a budget reached already refuses an item that reserves
    # nothing, as the claim (Gate.admit) and fanout_hand_over_spend do.
    if next_pk is None or not owners:
        return True
    return not _over_budget(run_id, outcome.pool, reserve)


def _settle_and_reserve(
    owners: list[tuple[int | None, str | None]],
    spent: Mapping[str, float],
    released: Mapping[str, float],
    reserve: Mapping[str, float],
) -> dict[tuple[int | None, str | None], dict[str, list[float]]]:
    """Each owner's change: ``spent`` spent, ``released`` no longer reserved, ``reserve`` taken."""
    changes: dict[tuple[int | None, str | None], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0.0, 0.0])
    )
    for owner in owners:
        for unit, n in spent.items():
            changes[owner][unit][0] += n
        for unit, n in released.items():
            changes[owner][unit][1] -= n
        for unit, n in reserve.items():
            changes[owner][unit][1] += n
    return changes


def _over_budget(run_id: int, pool: str, reserve: Mapping[str, float]) -> bool:
    """Whether the next item's reservation, just taken, passed a budget or one was reached."""
    over = SpendAccount.objects.filter(
        Q(run_id=run_id) | Q(pool=pool) if pool else Q(run_id=run_id)
    ).values_list("unit", "spent", "reserved", "budget")
    for unit, acc_spent, acc_reserved, budget in over:
        n = reserve.get(unit, 0.0)
        used_before = acc_spent + acc_reserved - n
        if acc_spent + acc_reserved > budget + _EPSILON or (n == 0 and used_before >= budget):
            return True
    return False


def spent_by(costs: Iterable[Mapping[str, float] | None]) -> Units:
    """Spend summed over items' costs (for reports)."""
    return total(costs)


# ------------------------------------------------------------------------ token-rate pools


def unfit(name: str, rows: Iterable[tuple[str, str, Mapping[str, float] | None]]) -> str:
    """Why some of these items (key, pool, estimate) could never be admitted by their pool's
    token bucket, "" when all can: an estimate larger than the bucket, or none at all for a
    pool whose rate counts a unit."""
    rows = list(rows)
    names = {pool for _, pool, _ in rows if pool}
    if not names:
        return ""
    pools = {
        p.name: p
        for p in CapacityPool.objects.filter(name__in=names, rate_count__isnull=False).exclude(
            rate_unit=""
        )
    }
    for key, pool_name, estimate in rows:
        pool = pools.get(pool_name)
        why = _never_admitted(name, key, pool, estimate) if pool is not None else ""
        if why:
            return why
    return ""


def _never_admitted(
    name: str, key: str, pool: CapacityPool, estimate: Mapping[str, float] | None
) -> str:
    if estimate is None:
        return (
            f"fan-out {name!r}: pool {pool.name!r} counts {pool.rate_unit} "
            f"({pool.describe_rate()}): give the definition a cost= in {pool.rate_unit}"
        )
    need = estimate.get(pool.rate_unit, 0.0)
    if pool.capacity is not None and need > pool.capacity + _EPSILON:
        return (
            f"fan-out {name!r}: item {key!r} is estimated at "
            f"{amount(pool.rate_unit, need)}, more than pool {pool.name!r}'s bucket holds "
            f"({pool.describe_rate()}): it could never be admitted"
        )
    return ""


# ---------------------------------------------------------------------------- visibility


def _open_account(account: SpendAccount, now: datetime) -> SpendAccount:
    """The account as the next claim will see it: a pool's period that has passed is spent
    from zero (not written here: the next claim, hand-over or record rolls it over). ``now``
    is the database's clock, which says when a period ends."""
    now = getattr(account, "clock", None) or now  # read with the row (_with_clock)
    ends = period_end(account.period, account.calendar, account.period_started_at)
    if ends is not None and now >= ends:
        account.spent = 0.0
    return account


def _with_clock(accounts: Any) -> Any:
    """The accounts, each read with the database's clock: whoever shows them (the admin,
    run_fanout, fanout_pools) may run on a host whose clock is hours off."""
    return accounts.annotate(clock=DbNow())


def _holds(account: SpendAccount, need: float) -> bool:
    used = account.spent + account.reserved
    return used + need > account.budget + _EPSILON or (need == 0 and used >= account.budget)


def run_hold(run_id: int, now: datetime) -> str:
    """Why the run's budget admits none of its due items now ("" when it admits the next, or
    it has no budget): its next due item's estimate is what a claim would hold."""
    accounts = [
        _open_account(a, now) for a in _with_clock(SpendAccount.objects.filter(run_id=run_id))
    ]
    if not accounts:
        return ""
    estimate = (
        ItemClaim.objects.pending_due(now)
        .filter(run_id=run_id)
        .order_by("index")
        .values_list("estimate", flat=True)
        .first()
    ) or {}
    for account in accounts:
        if _holds(account, estimate.get(account.unit, 0.0)):
            return describe(account.unit, account.spent, account.budget, account.reserved)
    return ""


def pool_holds(names: Iterable[str], now: datetime) -> dict[str, str]:
    """Pools whose budget is spent (spent plus reserved at the budget), and why, in words."""
    held: dict[str, str] = {}
    accounts = _with_clock(SpendAccount.objects.filter(pool__in=list(names)))
    for account in accounts.order_by("pool", "unit"):
        account = _open_account(account, now)
        if account.pool and account.pool not in held and _holds(account, 0.0):
            held[account.pool] = describe(
                account.unit, account.spent, account.budget, account.reserved
            )
    return held


def budget_rows(accounts: Iterable[SpendAccount], now: datetime) -> list[dict[str, Any]]:
    """Budgets as the admin, the --json report and the metrics show them."""
    rows = []
    for account in accounts:
        account = _open_account(account, now)
        rows.append(
            {
                "unit": account.unit,
                "budget": account.budget,
                "spent": round(account.spent, 9),
                "reserved": round(max(account.reserved, 0.0), 9),
                "fraction": (account.spent + account.reserved) / account.budget
                if account.budget
                else 1.0,
                **({"period_seconds": account.period} if account.period else {}),
                **({"calendar_period": account.calendar} if account.calendar else {}),
                **(
                    {"period_started_at": account.period_started_at}
                    if account.period_started_at
                    else {}
                ),
            }
        )
    return rows


def run_report(run_id: int, now: datetime) -> dict[str, Any]:
    """A run's spend for its report: what its items cost by unit, what its running items hold,
    and its budget; {} for a run that counts nothing."""
    items = ItemClaim.objects.filter(run_id=run_id)
    costs = items.filter(cost__isnull=False).values_list("cost", flat=True)
    held = items.running().filter(estimate__isnull=False).values_list("estimate", flat=True)
    budgets = budget_rows(_with_clock(SpendAccount.objects.filter(run_id=run_id)), now)
    spent, reserved = total(costs), total(held)
    if not (spent or reserved or budgets):
        return {}
    return {"spend": {"spent": spent, "reserved": reserved, "budgets": budgets}}
