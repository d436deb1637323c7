"""Join: once no item is left unfinished, one conditional UPDATE picks who runs the join."""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

from django.db.models import Count, F

from .clock import db_now_plus
from .conf import conf
from .definition import FanOut, Outcome, get_definition
from .errors import DefinitionNotFound
from .lease import keep_alive
from .models import BatchRun, FailurePolicy, ItemClaim, ItemStatus, JoinMode, RunStatus
from .transitions import runs

logger = logging.getLogger("fanout")


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
    two items at once, the later one always sees both and joins. A join that raises is
    retried with backoff (by whoever finds its lease run out: a worker's supervisor) up to
    FANOUT_JOIN_ATTEMPTS runs; the run records the result of the one that succeeded, once.
    """
    token = _elect(run_id)
    if token is None:
        return False
    return conclude(run_id, token, definition)


def conclude(run_id: int, token: uuid.UUID, definition: FanOut | None = None) -> bool:
    """The elected joiner's part: judge the run, call the join, record the end once."""
    run = BatchRun.objects.get(pk=run_id)
    try:
        definition = definition or get_definition(run.definition)
    except DefinitionNotFound as exc:
        # Not this worker's to judge: one that knows the definition joins it.
        _hold(run_id, token, float(conf.SUPERVISE_SECONDS))
        from .supervise import note_stall

        note_stall(run_id, f"{exc} (the join waits for a worker that has it)")
        return False
    counts = status_counts(run_id)
    status = verdict(run.failure_policy, run.join_mode, counts)
    result, error = None, ""
    crossed = definition.threshold_crossed(counts[ItemStatus.FAILED], sum(counts.values()))
    if crossed:
        status, error = RunStatus.FAILED, f"the run failed: {crossed}"
    if definition.join is not None:
        try:
            result = _join_with_retries(run_id, token, definition, run.join_failures)
        except _JoinFailed as failed:
            status, error = RunStatus.FAILED, failed.error
    if status == RunStatus.FAILED and definition.compensate is not None:
        # It failed: undo what succeeded before calling it over (see compensate.py).
        from .compensate import begin_after_join

        if not begin_after_join(run_id, token, result, error):
            return False
        logger.info("run %s failed: compensating %s", run_id, counts)
        return True
    # Only a run still joining ends here: one an operator cancelled meanwhile stays cancelled.
    if not runs.end(run_id, status, token, result, error):
        logger.info("run %s ended while it was being joined: the join is not recorded", run_id)
        return False
    logger.info("run %s joined: %s %s", run_id, status, counts)
    from .signals import run_finished, send

    send(run_finished, BatchRun, run=BatchRun.objects.get(pk=run_id))
    if run.parent_item_id is not None:
        from .nest import settle_up

        settle_up(run_id)
    return True


class _JoinFailed(Exception):
    def __init__(self, error: str) -> None:
        self.error = error


def _join_with_retries(run_id: int, token: uuid.UUID, definition: FanOut, failures: int) -> Any:
    """Call the join; while it raises, show the error on the run, wait and call it again.

    The join stays taken throughout (its lease renewed while this process waits), so a crash
    mid-wait hands it to a supervisor once the lease runs out, with the failures counted.
    """
    attempts = int(conf.JOIN_ATTEMPTS)
    lease = float(conf.JOIN_LEASE_SECONDS)
    while True:
        try:
            return _call_join(run_id, token, definition)
        except Exception as exc:
            logger.exception("join of run %s raised", run_id)
            error = _describe(exc)
            failures += 1
            if failures >= attempts:
                raise _JoinFailed(error) from None
            backoff = float(conf.JOIN_RETRY_BACKOFF) * 2 ** (failures - 1)
            BatchRun.objects.filter(pk=run_id, join_token=token).update(
                join_failures=failures,
                error=f"{error}\n(join run {failures} of {attempts} raised; "
                f"run again in {backoff:g}s)",
            )
            with keep_alive(lambda: _hold(run_id, token, lease), lease / 3):
                time.sleep(backoff)


def _elect(run_id: int) -> uuid.UUID | None:
    """One conditional UPDATE picks the joiner; None if the run is not ready or not ours."""
    if ItemClaim.objects.filter(run_id=run_id).unfinished().exists():
        return None
    token = uuid.uuid4()
    if not runs.join(run_id, token, float(conf.JOIN_LEASE_SECONDS)):
        return None
    if ItemClaim.objects.filter(run_id=run_id).unfinished().exists():
        # An item was reopened (retry-failed) between the check and the update.
        runs.leave_join(run_id, token)
        return None
    return token


def _hold(run_id: int, token: uuid.UUID, seconds: float) -> None:
    """Keep the join taken for ``seconds`` more: then anyone may take it over."""
    BatchRun.objects.filter(pk=run_id, join_token=token).update(
        join_lease_expires_at=db_now_plus(seconds)
    )


def _call_join(run_id: int, token: uuid.UUID, definition: FanOut) -> Any:
    """Run the join function under a renewed lease; return its result as stored JSON."""
    assert definition.join is not None
    lease = float(conf.JOIN_LEASE_SECONDS)
    BatchRun.objects.filter(pk=run_id, join_token=token).update(join_runs=F("join_runs") + 1)
    with keep_alive(lambda: _hold(run_id, token, lease), lease / 3):
        value = definition.join(outcomes(run_id))
    return json.loads(json.dumps(value))


def _describe(exc: Exception) -> str:
    if isinstance(exc, TypeError | ValueError) and "JSON" in str(exc):
        return f"the join returned something that is not JSON: {exc}"
    return f"the join raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
