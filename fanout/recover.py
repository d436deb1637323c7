"""Recover: operator actions that give items back (retry failed, release) or stop a run."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from .claim import lock_run
from .models import BatchRun, ItemClaim, ItemStatus, RunStatus
from .record import FAILED_FAST, cancel_pending


def retry_failed(run: BatchRun, items: QuerySet[ItemClaim] | None = None) -> int:
    """Put failed items (all of the run's, or the given ones) back to pending with fresh attempts.

    One UPDATE whatever the count; only failed items (and those a fail_fast run cancelled
    unrun) are touched, so a completed item never runs again and no live lease is disturbed.
    A finished run is reopened so its join runs again.
    """
    now = timezone.now()
    with transaction.atomic():
        # Lock the run so a join cannot decide between our reopening and our items changing.
        lock_run(run.pk)
        qs = (items if items is not None else ItemClaim.objects.all()).filter(run_id=run.pk)
        # Items a fail_fast run cancelled when it failed go back with the failed ones: they
        # never ran, and without them the run could never succeed.
        qs = qs.filter(
            Q(status=ItemStatus.FAILED) | Q(status=ItemStatus.CANCELLED, error_class=FAILED_FAST)
        )
        count = qs.update(
            status=ItemStatus.PENDING,
            attempt=1,
            crashes=0,
            next_attempt_at=now,
            claim_token=None,
            lease_expires_at=None,
            finished_at=None,
            owner="",
            error="",
            error_class="",
        )
        if count:
            BatchRun.objects.filter(pk=run.pk).exclude(status=RunStatus.PENDING).update(
                status=RunStatus.RUNNING,
                finished_at=None,
                join_token=None,
                join_lease_expires_at=None,
                error="",
            )
    run.refresh_from_db()
    return count


def cancel_run(run: BatchRun, reason: str = "cancelled by an operator") -> int:
    """Cancel the run: pending items are cancelled at once, running ones finish."""
    now = timezone.now()
    with transaction.atomic():
        updated = BatchRun.objects.filter(
            pk=run.pk, status__in=(RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)
        ).update(status=RunStatus.CANCELLED, finished_at=now, error=reason)
        count = cancel_pending(run.pk, reason, now) if updated else 0
    run.refresh_from_db()
    return count


def cancel_items(items: QuerySet[ItemClaim], reason: str = "cancelled by an operator") -> int:
    """Cancel the given items that nobody holds (pending ones)."""
    return items.filter(status=ItemStatus.PENDING).update(
        status=ItemStatus.CANCELLED,
        finished_at=timezone.now(),
        error=reason,
        error_class="Cancelled",
    )


def release(tokens: Iterable[uuid.UUID]) -> int:
    """Give back claims this process holds: no attempt is used, anyone may claim them again."""
    tokens = list(tokens)
    if not tokens:
        return 0
    return ItemClaim.objects.filter(claim_token__in=tokens, status=ItemStatus.RUNNING).update(
        status=ItemStatus.PENDING,
        claim_token=None,
        lease_expires_at=None,
        next_attempt_at=timezone.now(),
    )


def force_release(items: QuerySet[ItemClaim]) -> int:
    """Take leases away from their holders: the old holder's late write is then refused."""
    return items.filter(status=ItemStatus.RUNNING).update(
        status=ItemStatus.PENDING,
        claim_token=None,
        lease_expires_at=None,
        next_attempt_at=timezone.now(),
    )
