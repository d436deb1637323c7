"""Audit: the counters are the rows. Supervisors recount them and correct what drifted.

Limits are decided from the ``in_flight`` counters of runs and pools, which every transition
keeps exact (fanout.transitions). A path that forgot a counter, or moved it twice, would let a
pool admit more than its limit (a counter too low) or starve it for good (too high). So every
supervision period each run a supervisor takes up, and a few pools elected the way runs are
(each pool by one supervisor per period), are recounted from their rows.

A count is compared under the counter's row lock: every transaction that moves a counter holds
that lock until it commits the rows it changed, so a count read after the lock is taken is
exact, and a count read without it is not evidence of anything. A difference is corrected in the
same transaction, logged as a warning, counted in ``fanout.counter_drift`` and recorded on the
row (``counter_drift``, ``drift_noted_at``) for the admin: it is a bug, not an incident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q

from .claim import lock_run
from .clock import DbNow, db_now_plus
from .conf import conf
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus
from .telemetry import counter_drifted

logger = logging.getLogger("fanout")

POOLS_PER_SWEEP = 20


@dataclass(frozen=True)
class Drift:
    """A counter that differed from its rows: what it said, and what the rows hold."""

    kind: str  # "run" or "pool"
    name: str  # the run's id, or the pool's name
    label: str  # what the metric names: the run's definition, or the pool's name
    counter: int
    rows: int


def run_slots(run_id: int) -> int:
    """What the run's in_flight counts: its running items and those waiting on a child run."""
    return ItemClaim.objects.filter(run_id=run_id).holding_run_slots().count()


def pool_slots(name: str) -> int:
    """What the pool's in_flight counts: its running items, and compensations under way
    (claimed and not yet recorded: a takeover keeps the slot its dead worker held)."""
    return ItemClaim.objects.filter(pool=name).holding_pool_slots().count()


def measure_run(run_id: int) -> tuple[int, int] | None:
    """(counter, rows) of a run, read under its lock; None if it is gone. Call it in a
    transaction: the lock is what makes the two agree."""
    run = lock_run(run_id)
    if run is None:
        return None
    return int(run["in_flight"]), run_slots(run_id)


def measure_pool(name: str) -> tuple[int, int] | None:
    """(counter, rows) of a pool, read under its lock; None if it is gone."""
    pools = CapacityPool.objects.filter(name=name)
    if not connection.features.has_select_for_update:
        pools.update(in_flight=F("in_flight"))  # SQLite: take the write lock first
    counter = pools.select_for_update().values_list("in_flight", flat=True).first()
    if counter is None:
        return None
    return int(counter), pool_slots(name)


def compensation_slots(run_id: int) -> int:
    """What the run's compensating counts: its compensations under way (claimed, not yet
    recorded)."""
    items = ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.COMPENSATING)
    return items.filter(claim_token__isnull=False).count()


def measure_compensating(run_id: int) -> tuple[int, int] | None:
    """(counter, rows) of a run's compensation budget, read under its lock; None if gone."""
    run = lock_run(run_id)
    if run is None:
        return None
    return int(run["compensating"]), compensation_slots(run_id)


def audit_run(run_id: int) -> Drift | None:
    """Recount one run's in_flight and compensating under its lock; correct and report a
    difference (in_flight's first, if both differ)."""
    with transaction.atomic():
        found = measure_run(run_id)
        budget = measure_compensating(run_id)
        if found is None or budget is None:
            return None
        drifts = []
        if found[0] != found[1]:
            drifts.append(("in_flight", found))
        if budget[0] != budget[1]:
            drifts.append(("compensating", budget))
        if not drifts:
            return None
        runs = BatchRun.objects.filter(pk=run_id)
        corrected = {field: rows for field, (_, rows) in drifts}
        runs.update(counter_drift=F("counter_drift") + 1, drift_noted_at=DbNow(), **corrected)
        definition = runs.values_list("definition", flat=True).first() or ""
    reports = [
        _report(Drift("run", _run_name(run_id, f), definition, c, r)) for f, (c, r) in drifts
    ]
    return reports[0]


def _run_name(run_id: int, counter: str) -> str:
    return str(run_id) if counter == "in_flight" else f"{run_id} compensating"


def audit_pool(name: str) -> Drift | None:
    """Recount one pool's in_flight under its lock; correct and report a difference."""
    with transaction.atomic():
        found = measure_pool(name)
        if found is None or found[0] == found[1]:
            return None
        counter, rows = found
        CapacityPool.objects.filter(name=name).update(
            in_flight=rows, counter_drift=F("counter_drift") + 1, drift_noted_at=DbNow()
        )
    return _report(Drift("pool", name, name, counter, rows))


def _report(drift: Drift) -> Drift:
    logger.warning(
        "%s %s: in_flight was %d but its rows hold %d slots; corrected (counter drift)",
        drift.kind,
        drift.name,
        drift.counter,
        drift.rows,
    )
    counter_drifted(drift.kind, drift.label)
    return drift


def take_pools(limit: int = POOLS_PER_SWEEP) -> list[str]:
    """Take up to ``limit`` pools that no other supervisor has audited this period.

    SKIP LOCKED: a pool a claim holds now is left for the next round rather than waited for.
    """
    period = float(conf.SUPERVISE_SECONDS)
    with transaction.atomic():
        due = (
            CapacityPool.objects.filter(
                Q(audited_until__isnull=True) | Q(audited_until__lte=DbNow())
            )
            .order_by(F("audited_until").asc(nulls_first=True), "pk")
            .select_for_update(skip_locked=True)
            .values_list("name", flat=True)[:limit]
        )
        names = list(due)
        if names:
            CapacityPool.objects.filter(name__in=names).update(
                audited_until=db_now_plus(period * 0.9)
            )
    return names


def audit(run_ids: Sequence[int], pools: Sequence[str] | None = None) -> list[Drift]:
    """Recount the runs a supervisor took up, then the pools it is elected to audit (taken
    here unless given); a failure on one counter does not stop the others."""
    found = [_safely(audit_run, run_id) for run_id in run_ids]
    names = (_safely(take_pools) or ()) if pools is None else pools
    found += [_safely(audit_pool, name) for name in names]
    return [d for d in found if d is not None]


def _safely[T](check: Callable[..., T], *args: Any) -> T | None:
    try:
        return check(*args)
    except Exception:  # the database is down or restarting: the next round audits again
        logger.exception("counter audit: %s%s failed", check.__name__, args)
        return None
