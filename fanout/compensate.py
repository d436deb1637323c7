"""Compensate: the policy of an item's second phase, which undoes the items of a failed run
that succeeded. Which items (those that succeeded), which function (``compensate(item,
result)``), which order and budget: the rest is the item path's. The claim is
``claim.claim_compensations`` (the same pool admission, host limit and crash budget as an
item's), the call is ``call.execute`` (Throttled, PermanentError, retries with backoff), the
lease is the worker's LeaseKeeper (so a compensation past its ``timeout`` is taken over), and
the writes are named transitions (``transitions.items.compensate``, ``compensated``, ...).

A FanOut with ``compensate=`` whose run fails (fail-fast, a threshold, a join mode not met, a join
that raised), or that an operator cancels with compensation, enters ``compensating``: every item
that succeeded (including those that succeed later) becomes ``compensating``, and workers claim,
lease, fence and retry their compensations (``compensate(item, result)``) up to the definition's
``max_attempts``. ``compensate_order="reverse"`` (the default) runs them strictly one after
another, the latest finished item first, like a saga; ``"parallel"`` runs up to
``compensate_max_parallel`` at once, a budget of their own (the run row's ``compensating``
counter) so that rollback never takes forward work's slots. Each runs in its item's pool, and
``host_max_parallel`` bounds them on each host apart from the items. The run
ends ``compensated``, or ``compensation_failed`` if any compensation used up its attempts (it
stays visible, and an operator can retry it).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.db import transaction

from .audit import audit_run
from .call import backoff
from .call import execute as run_item
from .claim import claim_compensations, lock_run
from .conf import conf
from .definition import FanOut
from .errors import ride_out
from .join import cancel_children
from .lease import LeaseKeeper
from .models import BatchRun, ItemClaim, ItemStatus, RunStatus
from .pools import throttle_pool
from .signals import run_finished, send
from .transitions import (
    FAILED,
    RETRY,
    SUCCEEDED,
    THROTTLED,
    ClaimedItem,
    ExecutionOutcome,
    cancel_pending,
    compensated,
    release_expired,
    runs,
)
from .transitions import items as items_

logger = logging.getLogger("fanout")

REVERSE, PARALLEL = "reverse", "parallel"
LOST = "WorkerLost"
ORDERS = (REVERSE, PARALLEL)


def begin(run_id: int, reason: str = "") -> bool:
    """Turn a failing (or cancelled) run to compensating; True if this call did."""
    with transaction.atomic():
        changed = runs.begin_compensation(run_id, reason)
        if changed:
            # Its child runs are forward work too: cancelled once the turn has committed.
            transaction.on_commit(lambda: cancel_children(run_id, reason or "compensating"))
    return changed


def release_lost(run_id: int) -> int:
    """Release the forward items of a compensating run whose workers died; return how many."""
    with transaction.atomic():
        run = lock_run(run_id)
        if run is None or run["status"] != RunStatus.COMPENSATING:
            return 0
        return _release_lost(run_id)


def _release_lost(run_id: int) -> int:
    """A compensating run runs nothing forward: an item whose worker died is released (a crash
    counted, its slots given back) and cancelled, like what is still pending. Nothing else
    would: a forward claim takes only a running run's items. The caller holds the run's lock."""
    items = ItemClaim.objects.filter(run_id=run_id)
    released = release_expired(items)
    # Named rows only: an UPDATE over the run's items would lock every row it scans on
    # InnoDB, and a compensation being recorded holds one of them while it waits for the run.
    pending = list(items.filter(status=ItemStatus.PENDING).values_list("pk", flat=True))
    if pending:
        cancel_pending(
            ItemClaim.objects.filter(pk__in=pending),
            "cancelled: its worker died, and the run compensates",
        )
    return released


@dataclass
class Taken:
    token: uuid.UUID | None
    items: list[tuple[ClaimedItem, Any]] = field(default_factory=list)  # (item, its result)
    run_status: str = RunStatus.COMPENSATING
    reason: str = ""
    retry_in: float | None = None


def claim(run_id: int, definition: FanOut, owner: str) -> Taken:
    """Take the compensation the order and the budget allow (claim.claim_compensations)."""
    # Forward items whose workers died give their slots back first, in a transaction of their
    # own: releasing them locks their pools, and the claim locks the compensations' pools; in
    # one transaction the two sets would be locked out of name order. A read first: most
    # claims find none, and need not take the run's lock twice.
    forward = ItemClaim.objects.filter(run_id=run_id)
    if (forward.expired() | forward.filter(status=ItemStatus.PENDING)).exists():
        release_lost(run_id)
    result = claim_compensations(run_id, definition, owner)
    taken = [(item, result.results[item.pk]) for item in result.items]
    return Taken(result.token, taken, result.run_status, result.reason, result.retry_in)


def execute(definition: FanOut, run: BatchRun, item: ClaimedItem, result: Any) -> ExecutionOutcome:
    """Run the compensation once, as an item's handler is run (call.execute)."""
    return run_item(definition, run.pk, run.params, item, undoing=(result,))


def record(
    run_id: int,
    definition: FanOut,
    token: uuid.UUID,
    item: ClaimedItem,
    outcome: ExecutionOutcome | tuple[bool, str, str],
) -> bool:
    """Write one compensation's outcome if this worker still holds it; give its slots back.

    ``outcome`` may also be (succeeded, error class, error), as a retry or failure is told."""
    done = _told(definition, item, *outcome) if isinstance(outcome, tuple) else outcome
    with transaction.atomic():
        written = bool(compensated(run_id, token, [done]))
        if written and done.kind == THROTTLED and done.pool:
            # The provider said so: the whole pool waits, not just this compensation.
            throttle_pool(done.pool, done.retry_after)
    return written


def _told(
    definition: FanOut, item: ClaimedItem, ok: bool, error_class: str, error: str
) -> ExecutionOutcome:
    kind = SUCCEEDED if ok else RETRY if item.attempt < definition.max_attempts else FAILED
    after = backoff(definition, item.attempt) if kind == RETRY else 0.0
    return ExecutionOutcome(item.pk, item.key, kind, item.pool, None, error, error_class, after)


def finish(run_id: int) -> str | None:
    """End the run once no compensation is left; return its final status, or None.

    Under the run's lock (run row, then pools, as everywhere): items that succeeded since the
    run turned are made compensations first, and no retry of failed compensations can reopen
    one between the look and the end."""
    with transaction.atomic():
        run = lock_run(run_id)
        if run is None or run["status"] != RunStatus.COMPENSATING:
            return None
        if items_.compensate(run_id):
            return None  # items that succeeded meanwhile are to be undone first
        items = ItemClaim.objects.filter(run_id=run_id)
        if items.filter(
            status__in=(ItemStatus.COMPENSATING, ItemStatus.RUNNING, ItemStatus.WAITING)
        ).exists():
            return None
        failed = items.filter(status=ItemStatus.COMPENSATION_FAILED).exists()
        status = RunStatus.COMPENSATED if not failed else RunStatus.COMPENSATION_FAILED
        # None is under way now: a budget counter that says otherwise drifted, and is
        # reported (and corrected) by the audit, not zeroed unseen by the end.
        audit_run(run_id)
        if not runs.end_compensation(run_id, status):
            return None
    send(run_finished, BatchRun, run=BatchRun.objects.get(pk=run_id))
    return status


def retry_failed_compensations(run: BatchRun) -> int:
    """Put compensations that used up their attempts back to due, and reopen the run."""
    with transaction.atomic():
        lock_run(run.pk)
        count = items_.reopen_compensations(run.pk)
        if count:
            runs.reopen_compensation(run.pk)
    run.refresh_from_db()
    return count


def drain(
    definition: FanOut,
    run_id: int,
    owner: str,
    stop: Any,
    deadline: float | None,
    ran: Callable[[int], None] = lambda n: None,
    leave_when_idle: bool = False,
    keeper: LeaseKeeper | None = None,
) -> str:
    """A worker's loop while its run compensates: claim, run, record, until none is left.

    ``ran`` hears of each compensation run. With ``leave_when_idle`` (a thread that serves
    every run of its queue) it leaves as soon as nothing is claimable, instead of waiting in a
    run that undoes one item at a time while other runs have work. ``keeper`` renews the
    leases (and lets one run past the definition's timeout expire, like an item's)."""
    run = BatchRun.objects.get(pk=run_id)
    own = keeper is None
    keeper = keeper or LeaseKeeper(definition.lease_seconds).start()
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            # A deadlock's victim (MariaDB's claims and records lock the run's row and its
            # items) or a restarting server is tried again, as the forward path's are.
            taken = ride_out(lambda: claim(run_id, definition, owner), stop, f"run {run_id}")
            if taken is None:
                break
            if taken.run_status != RunStatus.COMPENSATING:
                return f"run {taken.run_status}"
            if not taken.items:
                if finish(run_id):
                    return "run compensated"
                if leave_when_idle:
                    return "nothing to compensate now"
                wait = conf.IDLE_MAX_SECONDS
                stop.wait(min(wait, taken.retry_in) if taken.retry_in is not None else wait)
                continue
            ran(len(taken.items))
            assert taken.token is not None
            _run_taken(definition, run, taken, keeper, stop)
    finally:
        if own:
            keeper.stop()
    return "stopped"


def _run_taken(
    definition: FanOut, run: BatchRun, taken: Taken, keeper: LeaseKeeper, stop: Any
) -> None:
    assert taken.token is not None
    keeper.hold(taken.token, [item.pk for item, _ in taken.items])
    try:
        for item, result in taken.items:
            keeper.started(item.pk, definition.timeout_for(item.key))
            outcome = execute(definition, run, item, result)
            keeper.finished(item.pk)
            # Fenced by the claim's token: a try rolled back is tried again whole; a worker
            # that stops first leaves the item to its lease, and it is compensated again.
            done = partial(record, run.pk, definition, taken.token, item, outcome)
            ride_out(done, stop, f"run {run.pk}")
    finally:
        keeper.drop([item.pk for item, _ in taken.items])
