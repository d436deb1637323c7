"""Compensate: undo the items of a failed run that succeeded, durably, like the items themselves.

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
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import F

from .claim import host_lock, lock_run
from .clock import DbNow, db_now_plus
from .conf import host_name
from .definition import FanOut, Item
from .lease import keep_alive
from .models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from .nest import cancel_children
from .transitions import ClaimedItem, cancel_pending, release_expired

logger = logging.getLogger("fanout")

REVERSE, PARALLEL = "reverse", "parallel"
LOST = "WorkerLost"
ORDERS = (REVERSE, PARALLEL)


def begin(run_id: int, reason: str = "") -> bool:
    """Turn a failing (or cancelled) run to compensating; True if this call did."""
    with transaction.atomic():
        changed = BatchRun.objects.filter(
            pk=run_id, status__in=(RunStatus.RUNNING, RunStatus.JOINING, RunStatus.FAILED)
        ).update(
            status=RunStatus.COMPENSATING,
            finished_at=None,
            **({"error": reason} if reason else {}),
        )
        if changed:
            _sweep(run_id)
            # Its child runs are forward work too: cancelled once the turn has committed.
            transaction.on_commit(lambda: cancel_children(run_id, reason or "compensating"))
    return bool(changed)


def begin_after_join(run_id: int, token: uuid.UUID, result: Any, error: str) -> bool:
    """The join found the run failed: compensate instead of ending it; False if the run was
    cancelled meanwhile."""
    with transaction.atomic():
        turned = BatchRun.objects.filter(
            pk=run_id, join_token=token, status=RunStatus.JOINING
        ).update(
            status=RunStatus.COMPENSATING,
            join_result=result,
            error=error,
            join_failures=0,
            join_token=None,
            join_lease_expires_at=None,
        )
        if turned:  # not a run an operator cancelled while it was being joined
            _sweep(run_id)
    return bool(turned)


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


def _sweep(run_id: int) -> int:
    """Items that succeeded (so far) are to be compensated."""
    return ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.SUCCEEDED).update(
        status=ItemStatus.COMPENSATING,
        compensation_attempt=0,
        claim_token=None,
        lease_expires_at=None,
        next_attempt_at=DbNow(),
    )


@dataclass
class Taken:
    token: uuid.UUID | None
    items: list[tuple[ClaimedItem, Any]] = field(default_factory=list)  # (item, its result)
    run_status: str = RunStatus.COMPENSATING
    reason: str = ""


def claim(run_id: int, definition: FanOut, owner: str) -> Taken:
    """Take the compensations the order and the budget allow, in one short transaction.

    With ``host_max_parallel``, at most that many of the definition's compensations run at once
    on this host, counted apart from its items (a lock of their own serialises the count).
    """
    most = definition.host_max_parallel
    with host_lock((f"{definition.name}:compensate", most) if most else None):
        return _claim(run_id, definition, owner)


def _claim(run_id: int, definition: FanOut, owner: str) -> Taken:
    # Forward items whose workers died give their slots back first, in a transaction of their
    # own: releasing them locks their pools, and the claim below locks the compensations'
    # pools; in one transaction the two sets would be locked out of name order (the lock
    # order is the run's row, then pool rows in name order), and a claim or settle of another
    # run spanning both would deadlock with it. A read first: most claims find none, and
    # need not take the run's lock twice.
    forward = ItemClaim.objects.filter(run_id=run_id)
    if (forward.expired() | forward.filter(status=ItemStatus.PENDING)).exists():
        release_lost(run_id)
    with transaction.atomic():
        run = lock_run(run_id)
        if run is None or run["status"] != RunStatus.COMPENSATING:
            return Taken(None, run_status=run["status"] if run else "deleted")
        _sweep(run_id)
        items = ItemClaim.objects.filter(run_id=run_id)
        if items.filter(status__in=(ItemStatus.RUNNING, ItemStatus.WAITING)).exists():
            # Strict reverse order needs every forward item finished first.
            return Taken(None, reason="waiting for running items to finish")
        full = _host_full(definition)
        if full:
            return Taken(None, reason=full)
        comp = items.filter(status=ItemStatus.COMPENSATING)
        fields = ("pk", "key", "index", "payload", "pool", "compensation_attempt", "result")
        order = ("-finished_at", "-index") if definition.compensate_order == REVERSE else ("index",)
        # A compensation whose worker died is taken over; it keeps its budget slot.
        expired = list(
            comp.filter(claim_token__isnull=False, lease_expires_at__lte=DbNow())
            .order_by(*order)
            .select_for_update(skip_locked=True)
            .values(*fields, "owner")[:1]
        )
        if expired and not _within_crash_budget(run_id, definition, expired[0]):
            return Taken(None, reason="a compensation used up its crash budget")
        room = _budget(definition, run["max_parallel"]) - run.get("compensating", 0)
        fresh: list[dict] = []
        if room > 0 and not expired:
            due = comp.filter(claim_token__isnull=True, next_attempt_at__lte=DbNow())
            if definition.compensate_order == REVERSE:
                # Strictly one after another: the latest finished first, retries included.
                due = comp.filter(claim_token__isnull=True)
            # One per claim: each worker thread runs one compensation at a time, so the budget
            # is spread over threads instead of queued behind one.
            candidates = list(
                due.order_by(*order).select_for_update(skip_locked=True).values(*fields)[:1]
            )
            if definition.compensate_order == REVERSE:
                candidates = [c for c in candidates[:1] if _due(c["pk"])]
            fresh = _admit_pools(candidates)
        taken = expired + fresh
        if not taken:
            return Taken(None, reason="no compensation due")
        token = uuid.uuid4()
        held = dict(
            claim_token=token,
            owner=owner[:200],
            lease_expires_at=db_now_plus(definition.lease_seconds),
        )
        # A takeover continues the attempt its dead worker had begun: like an item's, a crash
        # uses no attempt. Only a fresh claim (the first, or a retry after a failure) does.
        ItemClaim.objects.filter(pk__in=[c["pk"] for c in expired]).update(**held)
        ItemClaim.objects.filter(pk__in=[c["pk"] for c in fresh]).update(
            compensation_attempt=F("compensation_attempt") + 1, **held
        )
        for c in fresh:
            c["compensation_attempt"] += 1
        if fresh:
            BatchRun.objects.filter(pk=run_id).update(compensating=F("compensating") + len(fresh))
        return Taken(
            token,
            [
                (
                    ClaimedItem(
                        c["pk"],
                        c["key"],
                        c["index"],
                        c["payload"],
                        c["pool"],
                        c["compensation_attempt"],
                    ),
                    c["result"],
                )
                for c in taken
            ],
        )


def _within_crash_budget(run_id: int, definition: FanOut, lost: dict) -> bool:
    """Note that the compensation's worker died; fail it once more than ``crash_budget`` of
    its workers died in one attempt (a compensation that kills its worker is not taken over
    for ever), giving back its budget and pool slots. True if it may be taken over."""
    ItemAttempt.objects.create(
        item_id=lost["pk"],
        attempt=lost["compensation_attempt"],
        owner=lost["owner"],
        error_class=f"compensation: {LOST}",
        error="its worker died or stopped renewing the lease mid-compensation",
        finished_at=DbNow(),
    )
    crashes = ItemAttempt.objects.filter(
        item_id=lost["pk"],
        attempt=lost["compensation_attempt"],
        error_class=f"compensation: {LOST}",
    ).count()
    if crashes <= definition.crash_budget:
        return True
    ItemClaim.objects.filter(pk=lost["pk"]).update(
        status=ItemStatus.COMPENSATION_FAILED,
        claim_token=None,
        lease_expires_at=None,
        error=f"{LOST}: {crashes} workers died running its compensation "
        f"(crash_budget={definition.crash_budget})",
    )
    BatchRun.objects.filter(pk=run_id).update(compensating=F("compensating") - 1)
    if lost["pool"]:
        CapacityPool.objects.filter(name=lost["pool"]).update(in_flight=F("in_flight") - 1)
    return False


def _host_full(definition: FanOut) -> str:
    """Why this host may start no more of the definition's compensations ("" if it may)."""
    most = definition.host_max_parallel
    if not most:
        return ""
    host = host_name()
    live = ItemClaim.objects.filter(
        run__definition=definition.name,
        status=ItemStatus.COMPENSATING,
        claim_token__isnull=False,
        lease_expires_at__gt=DbNow(),
        owner__startswith=f"{host}:",
    ).count()
    if live < most:
        return ""
    return f"host {host} at host_max_parallel for compensations ({live}/{most})"


def _due(pk: int) -> bool:
    return ItemClaim.objects.filter(pk=pk, next_attempt_at__lte=DbNow()).exists()


def _budget(definition: FanOut, max_parallel: int) -> int:
    if definition.compensate_order == REVERSE:
        return 1
    return definition.compensate_max_parallel or max_parallel


def _admit_pools(candidates: list[dict]) -> list[dict]:
    """Compensations run in their item's pool: take its slots under its lock (name order)."""
    names = sorted({c["pool"] for c in candidates if c["pool"]})
    free: dict[str, int] = {}
    for pool in CapacityPool.objects.filter(name__in=names).order_by("name").select_for_update():
        free[pool.name] = 0 if pool.paused else pool.max_concurrency - pool.in_flight
    admitted, used = [], dict.fromkeys(names, 0)
    for c in candidates:
        if c["pool"]:
            if free.get(c["pool"], 0) - used[c["pool"]] <= 0:
                continue
            used[c["pool"]] += 1
        admitted.append(c)
    for name, n in used.items():
        if n:
            CapacityPool.objects.filter(name=name).update(in_flight=F("in_flight") + n)
    return admitted


def execute(
    definition: FanOut, run: BatchRun, item: ClaimedItem, result: Any
) -> tuple[bool, str, str]:
    """Run the compensation once: (succeeded, error class, error)."""
    assert definition.compensate is not None
    handed = Item(item.key, item.index, item.payload, item.attempt, run.pk, item.pool, run.params)
    try:
        definition.compensate(handed, result)
    except Exception as exc:
        text = "".join(traceback.format_exception(exc, limit=-6))[-4000:]
        return False, type(exc).__name__, text
    return True, "", ""


def record(
    run_id: int, definition: FanOut, token: uuid.UUID, item: ClaimedItem, outcome: tuple
) -> bool:
    """Write one compensation's outcome if this worker still holds it; give its slots back."""
    succeeded, error_class, error = outcome
    with transaction.atomic():
        held = (
            ItemClaim.objects.filter(pk=item.pk, claim_token=token, status=ItemStatus.COMPENSATING)
            .select_for_update()
            .values("compensation_attempt", "owner", "pool")
            .first()
        )
        if held is None:
            return False  # it was taken over: the new holder records it
        row = ItemClaim.objects.filter(pk=item.pk)
        released = dict(claim_token=None, lease_expires_at=None)
        if succeeded:
            row.update(status=ItemStatus.COMPENSATED, **released)
        else:
            ItemAttempt.objects.create(
                item_id=item.pk,
                attempt=held["compensation_attempt"],
                owner=held["owner"],
                error_class=f"compensation: {error_class}",
                error=error,
                finished_at=DbNow(),
            )
            if held["compensation_attempt"] < definition.max_attempts:
                from .run import backoff

                row.update(
                    next_attempt_at=db_now_plus(backoff(definition, held["compensation_attempt"])),
                    **released,
                )
            else:
                row.update(status=ItemStatus.COMPENSATION_FAILED, error=error, **released)
        BatchRun.objects.filter(pk=run_id).update(compensating=F("compensating") - 1)
        if held["pool"]:
            CapacityPool.objects.filter(name=held["pool"]).update(in_flight=F("in_flight") - 1)
    return True


def finish(run_id: int) -> str | None:
    """End the run once no compensation is left; return its final status, or None."""
    items = ItemClaim.objects.filter(run_id=run_id)
    if items.filter(
        status__in=(ItemStatus.COMPENSATING, ItemStatus.RUNNING, ItemStatus.WAITING)
    ).exists():
        return None
    failed = items.filter(status=ItemStatus.COMPENSATION_FAILED).exists()
    status = RunStatus.COMPENSATION_FAILED if failed else RunStatus.COMPENSATED
    ended = BatchRun.objects.filter(pk=run_id, status=RunStatus.COMPENSATING).update(
        status=status, finished_at=DbNow(), compensating=0, stalled=""
    )
    if not ended:
        return None
    from .signals import run_finished, send

    send(run_finished, BatchRun, run=BatchRun.objects.get(pk=run_id))
    return status


def retry_failed_compensations(run: BatchRun) -> int:
    """Put compensations that used up their attempts back to due, and reopen the run."""
    with transaction.atomic():
        lock_run(run.pk)
        count = ItemClaim.objects.filter(
            run_id=run.pk, status=ItemStatus.COMPENSATION_FAILED
        ).update(
            status=ItemStatus.COMPENSATING,
            compensation_attempt=0,
            next_attempt_at=DbNow(),
            error="",
        )
        if count:
            BatchRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATION_FAILED).update(
                status=RunStatus.COMPENSATING, finished_at=None, reopened=F("reopened") + 1
            )
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
) -> str:
    """A worker's loop while its run compensates: claim, run, record, until none is left.

    ``ran`` hears of each compensation run. With ``leave_when_idle`` (a thread that serves
    every run of its queue) it leaves as soon as nothing is claimable, instead of waiting in a
    run that undoes one item at a time while other runs have work."""
    from .conf import conf

    run = BatchRun.objects.get(pk=run_id)
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        taken = claim(run_id, definition, owner)
        if taken.run_status != RunStatus.COMPENSATING:
            return f"run {taken.run_status}"
        if not taken.items:
            if finish(run_id):
                return "run compensated"
            if leave_when_idle:
                return "nothing to compensate now"
            stop.wait(conf.IDLE_MAX_SECONDS)
            continue
        ran(len(taken.items))
        assert taken.token is not None
        token = taken.token

        def renew(token: uuid.UUID = token) -> None:
            ItemClaim.objects.filter(
                claim_token=token, status=ItemStatus.COMPENSATING, lease_expires_at__gt=DbNow()
            ).update(lease_expires_at=db_now_plus(definition.lease_seconds))

        with keep_alive(renew, definition.lease_seconds / 3):
            for item, result in taken.items:
                outcome = execute(definition, run, item, result)
                record(run_id, definition, token, item, outcome)
    return "stopped"
