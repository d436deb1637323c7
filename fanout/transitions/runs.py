"""Every status change of a run, each a named function: one conditional UPDATE whose row count
says whether it happened (a run that moved on meanwhile is left as it is).

open: pending -> running (its work list is written); join: running -> joining (one joiner is
elected); end: joining, pending, compensating -> a final status; cancel: an open run ->
cancelled; reopen: an ended run -> running again (or compensating again);
begin_compensation: a failing run -> compensating, its succeeded items to be undone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from django.db.models import Case, F, PositiveIntegerField, Q, When

from ..clock import DbNow, db_now_plus
from ..models import TERMINAL_RUN_STATUSES, BatchRun, RunSample, RunStatus
from . import items

OPEN = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.JOINING)
# Runs that may turn to compensating: failing ones, and one an operator cancels to compensate.
COMPENSABLE = (RunStatus.RUNNING, RunStatus.JOINING, RunStatus.FAILED)


def _move(run_id: int, from_: Iterable[str], to: str, guard: Q | None = None, **fields: Any) -> int:
    runs = BatchRun.objects.filter(pk=run_id, status__in=list(from_))
    if guard is not None:
        runs = runs.filter(guard)
    return runs.update(status=to, **fields)


def open(run_id: int, writer: uuid.UUID, **written: Any) -> bool:
    """Its work list is written (by the writer holding ``writer``): it runs."""
    moved = _move(
        run_id,
        [RunStatus.PENDING],
        RunStatus.RUNNING,
        Q(materialize_token=writer),
        started_at=DbNow(),
        **written,
    )
    return bool(moved)


def join(run_id: int, token: uuid.UUID, lease_seconds: float) -> bool:
    """Elect the joiner: the run is joining, under ``token``, unless another joiner's lease
    is live."""
    moved = _move(
        run_id,
        [RunStatus.RUNNING, RunStatus.JOINING],
        RunStatus.JOINING,
        Q(join_token__isnull=True) | Q(join_lease_expires_at__lte=DbNow()),
        join_token=token,
        join_lease_expires_at=db_now_plus(lease_seconds),
    )
    return bool(moved)


def leave_join(run_id: int, token: uuid.UUID) -> bool:
    """An item was reopened after the joiner was elected: the run runs on."""
    moved = _move(
        run_id,
        [RunStatus.JOINING],
        RunStatus.RUNNING,
        Q(join_token=token),
        join_token=None,
        join_lease_expires_at=None,
    )
    return bool(moved)


def end(run_id: int, status: str, token: uuid.UUID, result: Any, error: str) -> bool:
    """The joiner records the verdict; a run cancelled meanwhile stays cancelled."""
    moved = _move(
        run_id,
        [RunStatus.JOINING],
        status,
        Q(join_token=token),
        join_result=result,
        error=error,
        join_failures=0,
        finished_at=DbNow(),
        join_token=None,
        join_lease_expires_at=None,
        stalled="",  # a stale drain failure noted after a worker ran it says nothing now
    )
    return bool(moved)


def end_writing(run_id: int, writer: uuid.UUID, error: str) -> bool:
    """A child run's work list failed: it ends failed, saying why."""
    moved = _move(
        run_id,
        [RunStatus.PENDING],
        RunStatus.FAILED,
        Q(materialize_token=writer),
        error=error,
        finished_at=DbNow(),
        materialize_token=None,
        materialize_lease_expires_at=None,
    )
    return bool(moved)


def end_compensation(run_id: int, status: str) -> bool:
    """No compensation is left: compensated, or compensation_failed. Its ``compensating``
    counter is left as it is: one that is not zero here has drifted, and the audit reports it."""
    moved = _move(run_id, [RunStatus.COMPENSATING], status, finished_at=DbNow(), stalled="")
    return bool(moved)


def cancel(run_id: int, reason: str) -> bool:
    """An operator (or a cancelled parent) stops an open run."""
    moved = _move(run_id, OPEN, RunStatus.CANCELLED, finished_at=DbNow(), error=reason, stalled="")
    return bool(moved)


def reopen(run_id: int) -> bool:
    """Items of the run were put back to pending: it runs (and joins) again. The caller holds
    the run's lock."""
    reopened = Case(
        # A run that had ended starts a new span of its trace (fanout.telemetry).
        When(status__in=TERMINAL_RUN_STATUSES, then=F("reopened") + 1),
        default=F("reopened"),
        output_field=PositiveIntegerField(),
    )
    moved = (
        BatchRun.objects.filter(pk=run_id)
        .exclude(status=RunStatus.PENDING)
        .update(
            reopened=reopened,
            status=RunStatus.RUNNING,
            finished_at=None,
            join_token=None,
            join_lease_expires_at=None,
            join_failures=0,
            error="",
        )
    )
    # Its samples' windows counted the items put back as ended: they no longer hold, and the
    # run's charts count its items (fanout.charts), open or not.
    RunSample.objects.filter(run_id=run_id).update(upto=None)
    return bool(moved)


def reopen_compensation(run_id: int) -> bool:
    """Compensations that used up their attempts were put back: the run compensates again."""
    moved = _move(
        run_id,
        [RunStatus.COMPENSATION_FAILED],
        RunStatus.COMPENSATING,
        finished_at=None,
        reopened=F("reopened") + 1,
    )
    return bool(moved)


def begin_compensation(
    run_id: int,
    reason: str = "",
    joiner: uuid.UUID | None = None,
    result: Any = None,
) -> bool:
    """A failing (or cancelled) run compensates, and its succeeded items are to be undone.

    With ``joiner``, the joiner found the run failed: only a run still joined by it turns
    (one an operator cancelled meanwhile stays cancelled), and the join's result is kept."""
    if joiner is None:
        fields: dict[str, Any] = {"finished_at": None}
        if reason:
            fields["error"] = reason
        moved = _move(run_id, COMPENSABLE, RunStatus.COMPENSATING, **fields)
    else:
        moved = _move(
            run_id,
            [RunStatus.JOINING],
            RunStatus.COMPENSATING,
            Q(join_token=joiner),
            join_result=result,
            error=reason,
            join_failures=0,
            join_token=None,
            join_lease_expires_at=None,
        )
    if moved:
        items.compensate(run_id)
    return bool(moved)
