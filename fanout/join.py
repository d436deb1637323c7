"""Join: a run's end, and how it travels its tree.

Once no item is left unfinished, one conditional UPDATE picks who runs the join, which ends
the run. A run also ends when it fails fast, crosses a failure threshold or is cancelled. Each
end moves the tree: the run's open child runs are cancelled, and its parent item (if an
``Item.spawn`` made it) is decided, which may join, fail or cancel the parent run in turn.
These calls recurse through the tree, so they live in this one module.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

from django.db import transaction
from django.db.models import Count, F

from . import transitions
from .clock import db_now_plus
from .conf import conf
from .definition import FanOut, Outcome, get_definition
from .errors import DefinitionNotFound, FanoutError
from .lease import keep_alive
from .models import (
    TERMINAL_RUN_STATUSES,
    BatchRun,
    FailurePolicy,
    ItemClaim,
    ItemStatus,
    JoinMode,
    RunStatus,
)
from .nest import open_children
from .signals import run_finished, send
from .stall import note_stall
from .transitions import FAILED_FAST, FAILURE_THRESHOLD, items, runs

logger = logging.getLogger("fanout")


def outcomes(run_id: int) -> Iterator[Outcome]:
    """Every item's outcome in index order, read in chunks so a million items stay cheap."""
    rows = (
        ItemClaim.objects.filter(run_id=run_id)
        .order_by("index")
        .values_list("key", "index", "status", "result", "error", "attempt", "cost")
    )
    for key, index, status, result, error, attempt, cost in rows.iterator(chunk_size=2000):
        yield Outcome(key, index, status, result, error, attempt, cost)


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
        note_stall(run_id, f"{exc} (the join waits for a worker that has it)")
        return False
    status, result, error, counts = _judge(run, token, definition)
    if status == RunStatus.FAILED and definition.compensate is not None:
        # It failed: undo what succeeded before calling it over (see compensate.py); False if
        # the run was cancelled meanwhile.
        with transaction.atomic():
            if not runs.begin_compensation(run_id, error, joiner=token, result=result):
                return False
        logger.info("run %s failed: compensating %s", run_id, counts)
        return True
    # Only a run still joining ends here: one an operator cancelled meanwhile stays cancelled.
    if not runs.end(run_id, status, token, result, error):
        logger.info("run %s ended while it was being joined: the join is not recorded", run_id)
        return False
    logger.info("run %s joined: %s %s", run_id, status, counts)
    send(run_finished, BatchRun, run=BatchRun.objects.get(pk=run_id))
    if run.parent_item_id is not None:
        settle_up(run_id)
    return True


def _judge(
    run: BatchRun, token: uuid.UUID, definition: FanOut
) -> tuple[str, Any, str, dict[str, int]]:
    """The run's final status by its items and thresholds, the join's result or error, and
    the items' counts per status."""
    counts = status_counts(run.pk)
    status = verdict(run.failure_policy, run.join_mode, counts)
    result, error = None, ""
    crossed = definition.threshold_crossed(counts[ItemStatus.FAILED], sum(counts.values()))
    if crossed:
        status, error = RunStatus.FAILED, f"the run failed: {crossed}"
    if definition.join is not None:
        try:
            result = _join_with_retries(run.pk, token, definition, run.join_failures)
        except _JoinFailed as failed:
            status, error = RunStatus.FAILED, failed.error
    return status, result, error, counts


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


def cancel_pending(run_id: int, reason: str, error_class: str = "Cancelled") -> int:
    """Cancel the run's items nobody holds; running ones finish and are recorded."""
    return transitions.cancel_pending(ItemClaim.objects.filter(run_id=run_id), reason, error_class)


def fail_fast(run_id: int, key: str) -> int:
    """The run failed fast because ``key`` failed: cancel what nobody has claimed yet."""
    reason = f"cancelled: the run fails fast and item {key!r} failed"
    count = cancel_pending(run_id, reason, error_class=FAILED_FAST)
    _cancel_children_later(run_id, reason)
    return count


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


def _cancel_children_later(run_id: int, reason: str) -> None:
    """Cancel the run's unfinished child runs once the failure that stops it has committed."""
    transaction.on_commit(lambda: cancel_children(run_id, reason))


def cancel(run: BatchRun, reason: str) -> int:
    """Cancel the run and its open child runs; pending items are cancelled, running ones
    finish. Its parent item is decided. Returns the number of items cancelled."""
    with transaction.atomic():
        updated = runs.cancel(run.pk, reason)
        count = cancel_pending(run.pk, reason) if updated else 0
    if updated:
        cancel_children(run.pk, reason)
        settle_up(run.pk)
        run.refresh_from_db()
        send(run_finished, BatchRun, run=run)
    run.refresh_from_db()
    return count


def cancel_children(run_id: int, reason: str) -> int:
    """Cancel the run's unfinished descendants (a cancelled or failed-fast parent)."""
    count = 0
    for child in open_children([run_id]):
        cancel(child, f"{reason} (parent run {run_id})")
        count += 1
    return count


def resolve(child_run_id: int) -> int | None:
    """Give a finished child run's outcome to its parent item; return the parent run's id.

    Idempotent: only an item still waiting is decided, under its row's lock, so the child's
    joiner and the parent's recorder (whichever comes second) decide it once.
    """
    child = BatchRun.objects.filter(pk=child_run_id).first()
    if child is None or child.parent_item_id is None or child.status not in TERMINAL_RUN_STATUSES:
        return None
    item = ItemClaim.objects.filter(pk=child.parent_item_id).values("pk", "run_id", "key").first()
    if item is None:
        return None
    why = (child.error or "").strip().splitlines()
    failed = f"child run {child.pk} ({child.definition}) {child.status}" + (
        f": {why[0]}" if why else ""
    )
    succeeded = child.status == RunStatus.SUCCEEDED
    with transaction.atomic():
        if not items.child_ended(item["pk"], item["run_id"], succeeded, child.join_result, failed):
            return None
        if not succeeded:
            _fail_parent_by_policy(item["run_id"], item["key"])
    return item["run_id"]


def _fail_parent_by_policy(run_id: int, key: str) -> None:
    run = BatchRun.objects.get(pk=run_id)
    if run.failure_policy == FailurePolicy.FAIL_FAST:
        fail_fast(run_id, key)
        return
    try:
        definition = get_definition(run.definition)
    except FanoutError:
        return
    if definition.has_thresholds:
        over_threshold(run_id, definition)


def settle_up(child_run_id: int) -> None:
    """After a run ended: decide its parent item, and join the parent if that was its last."""
    parent_run_id = resolve(child_run_id)
    if parent_run_id is not None:
        maybe_join(parent_run_id)


def resolve_waiting(run_id: int) -> int:
    """Decide the run's waiting items whose child ended (a resolver died in between)."""
    children = BatchRun.objects.filter(
        parent_item__run_id=run_id,
        parent_item__status=ItemStatus.WAITING,
        status__in=TERMINAL_RUN_STATUSES,
    ).values_list("pk", flat=True)
    return sum(resolve(pk) is not None for pk in children)
