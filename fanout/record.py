"""Record: write items' outcomes, fenced by the claim token that ran them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.db import connections, transaction
from django.db.models import F, Field, Q
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
    """Update rows still held under the claim token, in one statement whatever the values."""
    first = rows[0]
    varying = [f for f in fields if any(getattr(r, f) != getattr(first, f) for r in rows[1:])]
    if not varying:
        return held.filter(pk__in=[r.pk for r in rows]).update(
            **{f: getattr(first, f) for f in fields}
        )
    connection = connections[held.db]
    if connection.vendor == "postgresql":
        return _write_values(held, rows, fields, varying)
    # Elsewhere Django's CASE WHEN per row and field: slow to build, but portable.
    return held.bulk_update(rows, fields)


def _write_values(held: Any, rows: list[ItemClaim], fields: list[str], varying: list[str]) -> int:
    """One UPDATE ... FROM (VALUES ...): per-row values without Django's CASE WHEN per field.

    bulk_update() builds and compiles a When() per row and field: at 200 outcomes per batch
    that is about 1 ms of CPU per item, more than everything else a worker does.
    """
    connection = connections[held.db]
    meta = ItemClaim._meta

    def qn(field: Field) -> str:
        return connection.ops.quote_name(str(field.column))

    first = rows[0]
    sets, params = [], []
    for name in fields:
        field = cast(Field, meta.get_field(name))
        if name in varying:
            sets.append(f"{qn(field)} = v.{qn(field)}")
        else:
            sets.append(f"{qn(field)} = %s")
            params.append(field.get_db_prep_save(getattr(first, name), connection))
    pk = cast(Field, meta.pk)
    columns = [pk, *(cast(Field, meta.get_field(name)) for name in varying)]
    row_sql = "(" + ", ".join(f"%s::{f.db_type(connection)}" for f in columns) + ")"
    # The fence: only rows still held under the claim token (and running) are written.
    where, where_params = held.query.get_compiler(held.db).compile(held.query.where)
    table = connection.ops.quote_name(meta.db_table)
    written = 0
    with connection.cursor() as cursor:
        for start in range(0, len(rows), _VALUES_PER_STATEMENT):
            part = rows[start : start + _VALUES_PER_STATEMENT]
            values = [
                f.get_db_prep_save(getattr(row, f.attname), connection)
                for row in part
                for f in columns
            ]
            cursor.execute(
                f"UPDATE {table} SET {', '.join(sets)} "
                f"FROM (VALUES {', '.join([row_sql] * len(part))}) "
                f"AS v({', '.join(qn(f) for f in columns)}) "
                f"WHERE {table}.{qn(pk)} = v.{qn(pk)} AND {where}",
                [*params, *values, *where_params],
            )
            written += cursor.rowcount
    return written


_VALUES_PER_STATEMENT = 1000  # far below PostgreSQL's 65,535 parameters per statement


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
