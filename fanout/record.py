"""Record: write items' outcomes, fenced by the claim token that ran them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from .models import CapacityPool, FailurePolicy, ItemClaim, ItemStatus

# What an execution ended in; RETRY, THROTTLED and RELEASED put the item back to pending.
SUCCEEDED, FAILED, RETRY, THROTTLED, RELEASED = (
    "succeeded",
    "failed",
    "retry",
    "throttled",
    "released",
)


@dataclass
class ExecutionOutcome:
    pk: int
    key: str
    kind: str
    pool: str = ""
    result: Any = None
    error: str = ""
    error_class: str = ""
    next_attempt_at: datetime | None = None
    retry_after: float = 0.0
    finished_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return self.kind in (SUCCEEDED, FAILED)


@dataclass
class Recorded:
    written: int
    dropped: int
    terminal: int
    failed: int


def record(
    run_id: int, token: uuid.UUID, outcomes: list[ExecutionOutcome], failure_policy: str
) -> Recorded:
    """Write outcomes for items still held under ``token``; drop the rest (their lease was lost).

    A writer that lost its lease must not overwrite the new owner's state: every UPDATE is
    filtered on the claim token, and its row count says what was written.
    """
    if not outcomes:
        return Recorded(0, 0, 0, 0)
    now = timezone.now()
    held = ItemClaim.objects.filter(claim_token=token, status=ItemStatus.RUNNING)
    released = dict(status=ItemStatus.PENDING, claim_token=None, lease_expires_at=None)
    written = terminal = failed = 0
    by_kind: dict[str, list[ExecutionOutcome]] = {}
    for outcome in outcomes:
        by_kind.setdefault(outcome.kind, []).append(outcome)
    if (
        failure_policy == FailurePolicy.FAIL_FAST
        and RETRY in by_kind
        and (
            FAILED in by_kind
            or ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED).exists()
        )
    ):
        # The run has failed fast: a retry would be new work, so the item fails with its error.
        for o in by_kind.pop(RETRY):
            o.kind = FAILED
            by_kind.setdefault(FAILED, []).append(o)
    # No savepoint: this often runs first in the claim transaction, and a savepoint costs a trip.
    with transaction.atomic(savepoint=False):
        if SUCCEEDED in by_kind:
            rows = [
                ItemClaim(
                    pk=o.pk,
                    status=ItemStatus.SUCCEEDED,
                    result=o.result,
                    finished_at=o.finished_at or now,
                    claim_token=None,
                    lease_expires_at=None,
                    error="",
                    error_class="",
                )
                for o in by_kind[SUCCEEDED]
            ]
            n = _write(
                held,
                rows,
                [
                    "status",
                    "result",
                    "finished_at",
                    "claim_token",
                    "lease_expires_at",
                    "error",
                    "error_class",
                ],
            )
            written += n
            terminal += n
        if FAILED in by_kind:
            rows = [
                ItemClaim(
                    pk=o.pk,
                    status=ItemStatus.FAILED,
                    error=o.error,
                    error_class=o.error_class,
                    finished_at=o.finished_at or now,
                    claim_token=None,
                    lease_expires_at=None,
                )
                for o in by_kind[FAILED]
            ]
            n = _write(
                held,
                rows,
                [
                    "status",
                    "error",
                    "error_class",
                    "finished_at",
                    "claim_token",
                    "lease_expires_at",
                ],
            )
            written += n
            terminal += n
            failed += n
        if RETRY in by_kind:
            rows = [
                ItemClaim(
                    pk=o.pk,
                    error=o.error,
                    error_class=o.error_class,
                    next_attempt_at=o.next_attempt_at or now,
                    finished_at=o.finished_at or now,
                    **released,
                )
                for o in by_kind[RETRY]
            ]
            # The attempt number moves on only here: a handler exception used it up.
            pks = [o.pk for o in by_kind[RETRY]]
            held.filter(pk__in=pks).update(attempt=F("attempt") + 1)
            written += _write(
                held,
                rows,
                [
                    "status",
                    "claim_token",
                    "lease_expires_at",
                    "error",
                    "error_class",
                    "next_attempt_at",
                    "finished_at",
                ],
            )
        for kind in (THROTTLED, RELEASED):
            for o in by_kind.get(kind, []):
                written += held.filter(pk=o.pk).update(
                    next_attempt_at=now + timedelta(seconds=o.retry_after), **released
                )
        for o in by_kind.get(THROTTLED, []):
            if o.pool:
                # The provider said so: the whole pool waits, not just this item.
                until = now + timedelta(seconds=o.retry_after)
                CapacityPool.objects.filter(name=o.pool).filter(
                    Q(backoff_until__isnull=True) | Q(backoff_until__lt=until)
                ).update(backoff_until=until)
        if failed and failure_policy == FailurePolicy.FAIL_FAST:
            first = next(o.key for o in by_kind[FAILED])
            fail_fast(run_id, first, now)
    return Recorded(written, len(outcomes) - written, terminal, failed)


def _write(held: Any, rows: list[ItemClaim], fields: list[str]) -> int:
    """Update rows still held under the claim token, in one statement where values agree."""
    first = rows[0]
    if all(all(getattr(r, f) == getattr(first, f) for f in fields) for r in rows[1:]):
        return held.filter(pk__in=[r.pk for r in rows]).update(
            **{f: getattr(first, f) for f in fields}
        )
    return held.bulk_update(rows, fields)


FAILED_FAST = "FailedFast"  # error_class of items cancelled because a fail_fast run failed


def cancel_pending(
    run_id: int, reason: str, now: datetime | None = None, error_class: str = "Cancelled"
) -> int:
    """Cancel the run's items nobody holds; running ones finish and are recorded."""
    return ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.PENDING).update(
        status=ItemStatus.CANCELLED,
        finished_at=now or timezone.now(),
        error=reason,
        error_class=error_class,
    )


def fail_fast(run_id: int, key: str, now: datetime) -> int:
    """The run failed fast because ``key`` failed: cancel what nobody has claimed yet."""
    reason = f"cancelled: the run fails fast and item {key!r} failed"
    return cancel_pending(run_id, reason, now, error_class=FAILED_FAST)
