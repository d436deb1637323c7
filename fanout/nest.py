"""Nest: an item handed to a child run (``Item.spawn``) takes the child run's outcome.

While its child runs, the parent item is ``waiting``: it holds a slot of its run's
``max_parallel`` (so ``max_parallel=4`` means at most 4 child runs at once) but no lease and no
pool slot. The child's run key comes from the parent run and the item's key, so a crash between
spawning and recording, or a resumed parent, finds the same child instead of making another.
When the child run ends, its parent item succeeds with the child's join result, or fails naming
the child; the parent run may then join, and so on up the tree.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

from django.db import transaction
from django.db.models import F

from .clock import DbNow
from .definition import Spawn, get_definition
from .models import TERMINAL_RUN_STATUSES, BatchRun, ItemClaim, ItemStatus, RunStatus
from .transitions import ClaimedItem

logger = logging.getLogger("fanout")

CHILD_FAILED = "ChildRunFailed"  # error_class of an item whose child run failed or was cancelled


def child_run_key(parent_run_id: int, item_key: str) -> str:
    key = f"spawn:{parent_run_id}:{item_key}"
    if len(key) <= 255:
        return key
    return f"spawn:{parent_run_id}:sha256:{hashlib.sha256(item_key.encode()).hexdigest()}"


def start_child(parent_run_id: int, item: ClaimedItem, spawn: Spawn) -> BatchRun:
    """Create (or find) the item's child run, write its items and dispatch it."""
    from .dispatch import dispatch
    from .materialize import WritingInterrupted, create_run, materialize

    parent = BatchRun.objects.get(pk=parent_run_id)
    definition = get_definition(spawn.definition)
    run_key = child_run_key(parent_run_id, item.key)
    # A child whose work list failed (it never started) gives way to a new one: the item runs
    # again (a retry), and a fixed definition starts clean.
    BatchRun.objects.filter(
        run_key=run_key, status=RunStatus.FAILED, started_at__isnull=True
    ).delete()
    child, _ = create_run(
        definition, spawn.params, run_key, executor=parent.executor, parent_item_id=item.pk
    )
    try:
        child = materialize(child, definition)
    except WritingInterrupted as exc:
        # The database went away mid-write, not the definition: the item waits for its child
        # all the same, whose writing a worker's supervisor finishes (and dispatches).
        logger.warning("run %s: child run kept for the next writer: %s", parent_run_id, exc)
        return child
    dispatch(child, definition, parent.executor)
    return child


def resolve(child_run_id: int) -> int | None:
    """Give a finished child run's outcome to its parent item; return the parent run's id.

    Idempotent: only an item still waiting is decided, under its row's lock, so the child's
    joiner and the parent's recorder (whichever comes second) decide it once.
    """
    child = BatchRun.objects.filter(pk=child_run_id).first()
    if child is None or child.parent_item_id is None or child.status not in TERMINAL_RUN_STATUSES:
        return None
    with transaction.atomic():
        item = (
            ItemClaim.objects.select_for_update()
            .filter(pk=child.parent_item_id, status=ItemStatus.WAITING)
            .values("pk", "run_id", "key")
            .first()
        )
        if item is None:
            return None
        decided = ItemClaim.objects.filter(pk=item["pk"])
        if child.status == RunStatus.SUCCEEDED:
            decided.update(
                status=ItemStatus.SUCCEEDED,
                result=child.join_result,
                error="",
                error_class="",
                finished_at=DbNow(),
            )
        else:
            why = (child.error or "").strip().splitlines()
            decided.update(
                status=ItemStatus.FAILED,
                error=f"child run {child.pk} ({child.definition}) {child.status}"
                + (f": {why[0]}" if why else ""),
                error_class=CHILD_FAILED,
                finished_at=DbNow(),
            )
        # The item gives its run slot back (it held no pool slot while it waited).
        BatchRun.objects.filter(pk=item["run_id"]).update(in_flight=F("in_flight") - 1)
        if child.status != RunStatus.SUCCEEDED:
            _fail_parent_by_policy(item["run_id"], item["key"])
    return item["run_id"]


def _fail_parent_by_policy(run_id: int, key: str) -> None:
    from .definition import get_definition as lookup
    from .errors import FanoutError
    from .models import FailurePolicy
    from .record import fail_fast, over_threshold

    run = BatchRun.objects.get(pk=run_id)
    if run.failure_policy == FailurePolicy.FAIL_FAST:
        fail_fast(run_id, key)
        return
    try:
        definition = lookup(run.definition)
    except FanoutError:
        return
    if definition.has_thresholds:
        over_threshold(run_id, definition)


def settle_up(child_run_id: int) -> None:
    """After a run ended: decide its parent item, and join the parent if that was its last."""
    from .join import maybe_join

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


def descendants(run_id: int) -> list[int]:
    """Ids of every run below this one, level by level (one query per level)."""
    found: list[int] = []
    frontier = [run_id]
    while frontier:
        frontier = list(
            BatchRun.objects.filter(parent_item__run_id__in=frontier).values_list("pk", flat=True)
        )
        found += frontier
    return found


def open_children(run_ids: Iterable[int]) -> list[BatchRun]:
    """Child runs, of the given runs' items, that have not ended."""
    return list(
        BatchRun.objects.filter(parent_item__run_id__in=list(run_ids)).exclude(
            status__in=TERMINAL_RUN_STATUSES
        )
    )


def cancel_children(run_id: int, reason: str) -> int:
    """Cancel the run's unfinished descendants (a cancelled or failed-fast parent)."""
    from .recover import cancel_run

    count = 0
    for child in open_children([run_id]):
        cancel_run(child, f"{reason} (parent run {run_id})")
        count += 1
    return count
