"""Join: once no item is left unfinished, one conditional UPDATE picks who runs the join."""

from __future__ import annotations

import json
import logging
import traceback
import uuid
from collections.abc import Iterator

from django.db.models import Count, Q

from .clock import DbNow, db_now_plus
from .definition import FanOut, Outcome, get_definition
from .errors import DefinitionNotFound
from .lease import keep_alive
from .models import BatchRun, FailurePolicy, ItemClaim, ItemStatus, JoinMode, RunStatus

logger = logging.getLogger("fanout")

_JOIN_LEASE_SECONDS = 60.0


def outcomes(run_id: int) -> Iterator[Outcome]:
    """Every item's outcome in index order, read in chunks so a million items stay cheap."""
    rows = (
        ItemClaim.objects.filter(run_id=run_id)
        .order_by("index")
        .values_list("key", "index", "status", "result", "error", "attempt")
    )
    for key, index, status, result, error, attempt in rows.iterator(chunk_size=2000):
        yield Outcome(key, index, status, result, error, attempt)


def status_counts(run_id: int) -> dict[str, int]:
    rows = ItemClaim.objects.filter(run_id=run_id).values("status").annotate(n=Count("pk"))
    counts = {s.value: 0 for s in ItemStatus}
    counts.update({r["status"]: r["n"] for r in rows})
    return counts


def verdict(policy: str, mode: str, counts: dict[str, int]) -> str:
    """The run's final status from its items' outcomes."""
    if policy == FailurePolicy.TOLERATE:
        return RunStatus.SUCCEEDED
    if mode == JoinMode.ANY:
        ok = counts[ItemStatus.SUCCEEDED] > 0
        if policy == FailurePolicy.FAIL_FAST:
            ok = ok and counts[ItemStatus.FAILED] == 0
    else:
        ok = counts[ItemStatus.FAILED] == 0 and counts[ItemStatus.CANCELLED] == 0
    return RunStatus.SUCCEEDED if ok else RunStatus.FAILED


def maybe_join(run_id: int, definition: FanOut | None = None) -> bool:
    """Run the join if every item is terminal and nobody else holds it; True if this call did.

    Called after the caller's outcome has committed, so of two workers finishing the last
    two items at once, the later one always sees both and joins.
    """
    if ItemClaim.objects.filter(run_id=run_id).unfinished().exists():
        return False
    token = uuid.uuid4()
    won = (
        BatchRun.objects.filter(pk=run_id, status__in=(RunStatus.RUNNING, RunStatus.JOINING))
        .filter(Q(join_token__isnull=True) | Q(join_lease_expires_at__lte=DbNow()))
        .update(
            status=RunStatus.JOINING,
            join_token=token,
            join_lease_expires_at=db_now_plus(_JOIN_LEASE_SECONDS),
        )
    )
    if not won:
        return False
    run = BatchRun.objects.get(pk=run_id)
    if ItemClaim.objects.filter(run_id=run_id).unfinished().exists():
        # An item was reopened (retry-failed) between the check and the update.
        BatchRun.objects.filter(pk=run_id, join_token=token).update(
            status=RunStatus.RUNNING, join_token=None, join_lease_expires_at=None
        )
        return False
    counts = status_counts(run_id)
    status = verdict(run.failure_policy, run.join_mode, counts)
    result, error = None, ""
    try:
        definition = definition or get_definition(run.definition)
    except DefinitionNotFound as exc:
        definition, status, error = None, RunStatus.FAILED, str(exc)
    if definition is not None and definition.join is not None:
        BatchRun.objects.filter(pk=run_id, join_token=token).update(join_runs=run.join_runs + 1)

        def renew() -> None:
            BatchRun.objects.filter(pk=run_id, join_token=token).update(
                join_lease_expires_at=db_now_plus(_JOIN_LEASE_SECONDS)
            )

        try:
            with keep_alive(renew, _JOIN_LEASE_SECONDS / 3):
                value = definition.join(outcomes(run_id))
            result = json.loads(json.dumps(value))
        except Exception as exc:
            logger.exception("join of run %s raised", run_id)
            status = RunStatus.FAILED
            if isinstance(exc, TypeError | ValueError) and "JSON" in str(exc):
                error = f"the join returned something that is not JSON: {exc}"
            else:
                error = (
                    f"the join raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
                )
    BatchRun.objects.filter(pk=run_id, join_token=token).update(
        status=status,
        join_result=result,
        error=error,
        finished_at=DbNow(),
        join_token=None,
        join_lease_expires_at=None,
    )
    logger.info("run %s joined: %s %s", run_id, status, counts)
    return True
