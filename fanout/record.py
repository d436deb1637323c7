"""Record: write items' outcomes, fenced by the claim token that ran them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import transaction

from . import transitions
from .definition import FanOut
from .join import cancel_pending, fail_fast, over_threshold
from .models import BatchRun, FailurePolicy, ItemClaim, ItemStatus
from .pools import throttle_pool
from .transitions import (
    FAILED,
    RELEASED,
    RETRY,
    SUCCEEDED,
    THROTTLED,
    ExecutionOutcome,
)

__all__ = [
    "FAILED",
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
    if failure_policy == FailurePolicy.FAIL_FAST or thresholds:
        _no_retry_once_failed(run_id, outcomes, definition)
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


def _no_retry_once_failed(
    run_id: int, outcomes: list[ExecutionOutcome], definition: FanOut | None
) -> None:
    """A run that has failed (fast, or by a threshold) retries nothing: a retry would be new
    work, so the item fails with its error."""
    if not any(o.kind == RETRY for o in outcomes):
        return
    if any(o.kind == FAILED for o in outcomes) or run_failed(run_id, definition):
        for o in outcomes:
            if o.kind == RETRY:
                o.kind = FAILED


def run_failed(run_id: int, definition: FanOut | None = None) -> bool:
    """Whether the run has already failed: any failed item under fail_fast, or its thresholds."""
    failed = ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED)
    if definition is None or not definition.has_thresholds:
        return failed.exists()
    total = BatchRun.objects.filter(pk=run_id).values_list("total_items", flat=True).first()
    return bool(definition.threshold_crossed(failed.count(), total or 0))
