"""Actions: what an operator does to a run: retry failed items, release claims, cancel it."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from django.db import transaction
from django.db.models import QuerySet

from . import transitions
from .claim import lock_run
from .compensate import begin
from .definition import get_definition
from .errors import FanoutError
from .join import cancel, cancel_pending
from .models import BatchRun, ItemClaim, ItemStatus, RunStatus
from .transitions import CHILD_FAILED, runs

# Runs whose failed items may be retried: a pending run is still writing its items, and a
# cancelled one was stopped by an operator, whom a retry must not overrule.
RETRYABLE_RUNS = (RunStatus.RUNNING, RunStatus.JOINING, RunStatus.SUCCEEDED, RunStatus.FAILED)


def check_retryable(run: BatchRun) -> None:
    """Refuse, with the reason, to retry a run that may not be reopened."""
    if run.status not in RETRYABLE_RUNS:
        why = {
            RunStatus.CANCELLED: "it was cancelled, and a retry does not overrule that",
            RunStatus.PENDING: "its items are still being written",
        }.get(run.status, f"it is {run.status}")
        raise FanoutError(
            f"run {run.pk} cannot be retried: {why}; start a fresh run with --run-key NEW_KEY"
        )


def retry_failed(run: BatchRun, items: QuerySet[ItemClaim] | None = None) -> int:
    """Put failed items (all of the run's, or the given ones) back to pending with fresh attempts.

    One UPDATE whatever the count; only failed items (and those a fail_fast run cancelled
    unrun) are touched, so a completed item never runs again and no live lease is disturbed.
    A finished run is reopened so its join runs again. Raises FanoutError, as
    check_retryable does, if the run is no longer retryable once its row is locked.
    """
    qs = (items if items is not None else ItemClaim.objects.all()).filter(run_id=run.pk)
    with transaction.atomic():
        # Lock the run so a join cannot decide between our reopening and our items changing,
        # and decide under that lock: a cancel that committed since the caller looked stands.
        # Its children are reopened only after that, under the same lock: a cancel of this run
        # waits for it and then cancels them, rather than leaving them running under it.
        if lock_run(run.pk) is None:
            raise FanoutError(f"run {run.pk} cannot be retried: it was deleted")
        run.refresh_from_db(fields=["status"])
        check_retryable(run)
        # Items whose child run failed wait on it again, once its own failed items are
        # reopened: the child's succeeded items never run again, at any depth.
        children = list(
            BatchRun.objects.filter(
                parent_item__in=qs.filter(status=ItemStatus.FAILED, error_class=CHILD_FAILED)
            ).exclude(status=RunStatus.SUCCEEDED)
        )
        for child in children:
            retry_failed(child)
        rewait = [c.parent_item_id for c in children if c.status == RunStatus.RUNNING]
        count = transitions.rewait(run.pk, rewait)
        count += transitions.reopen(qs.exclude(pk__in=rewait))
        if count:
            runs.reopen(run.pk)
    run.refresh_from_db()
    return count


def cancel_run(
    run: BatchRun, reason: str = "cancelled by an operator", compensate: bool = False
) -> int:
    """Cancel the run: pending items are cancelled at once, running ones finish.

    With ``compensate``, the run compensates what succeeded (see compensate.py) instead of
    ending cancelled; its definition must have ``compensate=``.
    """
    if compensate:
        definition = get_definition(run.definition)
        if definition.compensate is None:
            raise FanoutError(f"fan-out {run.definition!r} has no compensate= to undo items with")
        with transaction.atomic():
            count = cancel_pending(run.pk, reason)
            if not begin(run.pk, reason):
                raise FanoutError(f"run {run.pk} is {run.status}: it cannot be compensated now")
        run.refresh_from_db()
        return count
    return cancel(run, reason)


def cancel_items(items: QuerySet[ItemClaim], reason: str = "cancelled by an operator") -> int:
    """Cancel the given items that nobody holds (pending ones)."""
    return transitions.cancel_pending(items, reason)


def release(held: Mapping[int, uuid.UUID] | Iterable[uuid.UUID]) -> int:
    """Give back claims this process holds: no attempt is used, anyone may claim them again.

    ``held`` is a lease keeper's {item pk: claim token}, or claim tokens (every item under them).
    """
    if isinstance(held, Mapping):
        if not held:
            return 0
        items = ItemClaim.objects.filter(pk__in=list(held), claim_token__in=set(held.values()))
    else:
        tokens = list(held)
        if not tokens:
            return 0
        items = ItemClaim.objects.filter(claim_token__in=tokens)
    return transitions.release(items)


def force_release(items: QuerySet[ItemClaim]) -> int:
    """Take leases away from their holders: the old holder's late write is then refused."""
    return transitions.release(items)
