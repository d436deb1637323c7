"""Record: write items' outcomes, fenced by the claim token that ran them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import transaction

from . import transitions
from .definition import FanOut
from .models import BatchRun, FailurePolicy, ItemClaim, ItemStatus
from .pools import throttle_pool
from .transitions import (
    FAILED,
    FAILED_FAST,
    FAILURE_THRESHOLD,
    RELEASED,
    RETRY,
    SUCCEEDED,
    THROTTLED,
    ExecutionOutcome,
)

__all__ = [
    "FAILED",
    "FAILED_FAST",
    "RELEASED",
    "RETRY",
    "SUCCEEDED",
    "THROTTLED",
    "ExecutionOutcome",
    "Recorded",
    "cancel_pending",
    "fail_fast",
    "record",
]


@dataclass
class Recorded:
    written: int
    dropped: int
    terminal: int
    failed: int


def record(
    run_id: int,
    token: uuid.UUID,
    outcomes: list[ExecutionOutcome],
    failure_policy: str,
    definition: FanOut | None = None,
) -> Recorded:
    """Write outcomes for items still held under ``token``; drop the rest (their lease was lost).

    A writer that lost its lease must not overwrite the new owner's state: the rows are
    locked and re-checked against the claim token before anything is written.
    """
    if not outcomes:
        return Recorded(0, 0, 0, 0)
    thresholds = definition is not None and definition.has_thresholds
    if any(o.kind == RETRY for o in outcomes) and (
        failure_policy == FailurePolicy.FAIL_FAST or thresholds
    ):
        if any(o.kind == FAILED for o in outcomes) or run_failed(run_id, definition):
            # The run has failed fast: a retry would be new work, so the item fails with its error.
            for o in outcomes:
                if o.kind == RETRY:
                    o.kind = FAILED
    # No savepoint: this often runs first in the claim transaction, and a savepoint costs a trip.
    with transaction.atomic(savepoint=False):
        written = set(transitions.settle(run_id, token, outcomes))
        mine = [o for o in outcomes if o.pk in written]
        for o in mine:
            if o.kind == THROTTLED and o.pool:
                # The provider said so: the whole pool waits, not just this item. Its row is
                # locked already (settle gave its slot back).
                throttle_pool(o.pool, o.retry_after)
        failed = [o for o in mine if o.kind == FAILED]
        if failed and failure_policy == FailurePolicy.FAIL_FAST:
            fail_fast(run_id, failed[0].key)
        elif failed and thresholds:
            assert definition is not None
            over_threshold(run_id, definition)
    terminal = sum(o.kind in (SUCCEEDED, FAILED) for o in mine)
    return Recorded(len(mine), len(outcomes) - len(mine), terminal, len(failed))


def run_failed(run_id: int, definition: FanOut | None = None) -> bool:
    """Whether the run has already failed: any failed item under fail_fast, or its thresholds."""
    failed = ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED)
    if definition is None or not definition.has_thresholds:
        return failed.exists()
    total = BatchRun.objects.filter(pk=run_id).values_list("total_items", flat=True).first()
    return bool(definition.threshold_crossed(failed.count(), total or 0))


def over_threshold(run_id: int, definition: FanOut) -> str:
    """If the run's failures crossed a threshold, fail it now: cancel what nobody holds."""
    failed = ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED).count()
    total = BatchRun.objects.filter(pk=run_id).values_list("total_items", flat=True).first()
    reason = definition.threshold_crossed(failed, total or 0)
    if reason:
        BatchRun.objects.filter(pk=run_id, error="").update(error=f"the run failed: {reason}")
        cancel_pending(run_id, f"cancelled: {reason}", error_class=FAILURE_THRESHOLD)
        _cancel_children_later(run_id, f"cancelled: {reason}")
    return reason


def cancel_pending(run_id: int, reason: str, error_class: str = "Cancelled") -> int:
    """Cancel the run's items nobody holds; running ones finish and are recorded."""
    items = ItemClaim.objects.filter(run_id=run_id)
    return transitions.cancel_pending(items, reason, error_class)


def fail_fast(run_id: int, key: str) -> int:
    """The run failed fast because ``key`` failed: cancel what nobody has claimed yet."""
    reason = f"cancelled: the run fails fast and item {key!r} failed"
    count = cancel_pending(run_id, reason, error_class=FAILED_FAST)
    _cancel_children_later(run_id, reason)
    return count


def _cancel_children_later(run_id: int, reason: str) -> None:
    """Cancel the run's unfinished child runs once the failure that stops it has committed."""
    from .nest import cancel_children

    transaction.on_commit(lambda: cancel_children(run_id, reason))
