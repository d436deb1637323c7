"""Retention: finished runs leave with their items, attempt history and child runs.

A tree goes with its root, never a part of it: only roots (runs that decide no parent item) are
chosen, and only when every run of the tree has ended, longer ago than the limit. Rows go
leaves first, a batch per transaction, each batch deleted by primary key: the rows of finished
runs are the only ones locked, and no claim, hand-over or admin page waits on those. A prune
cut off midway leaves the root with part of its tree; the next prune finishes it.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, Exists, OuterRef, Q

from .clock import DbNow, db_now, db_now_plus
from .conf import conf
from .errors import FanoutError
from .models import (
    TERMINAL_RUN_STATUSES,
    BatchRun,
    ItemAttempt,
    ItemClaim,
    ItemStatus,
    RunSample,
)
from .nest import descendants

# Rows of one kind deleted per transaction: short enough for the locks to be brief, long
# enough for the commit to be a small part of it.
BATCH_ROWS = 2000
# Seconds fanout_prune rests after each full batch, by default: the database's time goes back
# to the live runs beside it (bench/run.py's retention phase; docs/operating.md).
PAUSE_SECONDS = 1.0
# How long a pruner holds a tree it took (the supervisors' election).
HOLD_SECONDS = 300.0
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """Parse "30d", "12h", "90m", "45s", "2w" into a timedelta."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", str(text))
    if not match:
        raise FanoutError(
            f"age {text!r} is not a number with a unit, like 30d, 12h, 90m, 45s or 2w"
        )
    return timedelta(seconds=float(match[1]) * _UNITS[match[2]])


def parse_statuses(text: str | Iterable[str]) -> list[str]:
    """Finished statuses, from "succeeded,failed" or a list; an open one is an error."""
    names = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    wrong = [s for s in names if s not in TERMINAL_RUN_STATUSES]
    if wrong or not names:
        raise FanoutError(
            f"status {', '.join(wrong) or '(none)'} is not a finished run's: "
            f"choose among {', '.join(TERMINAL_RUN_STATUSES)}"
        )
    return names


@dataclass
class Pruned:
    """What a prune removed (or, dry, would remove)."""

    roots: list[int] = field(default_factory=list)
    runs: int = 0
    items: int = 0
    attempts: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    # Trees another pruner holds: skipped, that one is deleting them.
    held: list[int] = field(default_factory=list)

    def add(self, other: Pruned) -> None:
        self.roots += other.roots
        self.runs += other.runs
        self.items += other.items
        self.attempts += other.attempts
        self.by_status.update(other.by_status)
        self.held += other.held

    def as_dict(self) -> dict[str, Any]:
        return {
            "roots": self.roots,
            "runs": self.runs,
            "items": self.items,
            "attempts": self.attempts,
            "by_status": dict(self.by_status),
            "held": self.held,
        }


def roots(
    older_than: timedelta,
    statuses: Iterable[str] = TERMINAL_RUN_STATUSES,
    definition: str | None = None,
    keep_runs: bool = False,
) -> Iterator[int]:
    """Roots finished longer ago than ``older_than`` whose whole tree has ended as long ago."""
    cutoff = db_now() - older_than
    found = BatchRun.objects.filter(
        parent_item__isnull=True, status__in=list(statuses), finished_at__lte=cutoff
    )
    if definition:
        found = found.filter(definition=definition)
    if keep_runs:  # a run already kept without its items has nothing left to prune
        found = found.filter(Exists(ItemClaim.objects.filter(run_id=OuterRef("pk"))))
    for root in found.order_by("finished_at", "pk").values_list("pk", flat=True).iterator():
        if _tree_done(_tree(root), cutoff):
            yield root


def _tree(root: int) -> list[int]:
    return [root, *descendants(root)]


# Items that hold a slot or a claim, or may still: a cancelled run's running items finish after
# it ended, and their outcomes (and the slots they give back) must not be deleted under them.
_BUSY = (ItemStatus.PENDING, ItemStatus.RUNNING, ItemStatus.WAITING, ItemStatus.COMPENSATING)


def _tree_done(tree: list[int], cutoff: Any) -> bool:
    """Every run of the tree has ended, before the cutoff, and none of its items is busy."""
    return not (
        BatchRun.objects.filter(pk__in=tree)
        .filter(~Q(status__in=TERMINAL_RUN_STATUSES) | Q(finished_at__gt=cutoff))
        .exists()
        or ItemClaim.objects.filter(run_id__in=tree, status__in=_BUSY).exists()
    )


def measure(root: int) -> Pruned:
    """What pruning this tree removes, counted, nothing changed."""
    tree = _tree(root)
    status = BatchRun.objects.filter(pk=root).values_list("status", flat=True).first()
    return Pruned(
        roots=[root],
        runs=len(tree),
        items=ItemClaim.objects.filter(run_id__in=tree).count(),
        attempts=ItemAttempt.objects.filter(item__run_id__in=tree).count(),
        by_status=Counter([status] if status else []),
    )


def take(root: int) -> bool:
    """Hold a tree for this pruner: one conditional UPDATE, as supervisors elect runs."""
    return bool(
        BatchRun.objects.filter(pk=root, status__in=TERMINAL_RUN_STATUSES)
        .filter(Q(tended_until__isnull=True) | Q(tended_until__lte=DbNow()))
        .update(tended_until=db_now_plus(HOLD_SECONDS))
    )


def prune_tree(
    root: int,
    keep_runs: bool = False,
    batch: int = BATCH_ROWS,
    max_items: int | None = None,
    pause: float = 0.0,
) -> Pruned:
    """Delete a finished tree, leaves first; with ``keep_runs`` only the item rows go.

    With ``max_items`` it may stop early, the root still there: the next prune goes on. With
    ``pause`` it rests that many seconds after each full batch, outside any transaction.
    """
    pruned = Pruned(roots=[root])
    status = BatchRun.objects.filter(pk=root).values_list("status", flat=True).first()
    tree = _tree(root)
    for run_id in reversed(tree):  # level by level from the top: reversed, leaves first
        if keep_runs:
            _keep_counts(run_id)
        left = None if max_items is None else max_items - pruned.items
        items, attempts, done = _delete_items(root, run_id, batch, keep_runs, left, pause)
        pruned.items += items
        pruned.attempts += attempts
        if not done:
            _let_go(root)
            return pruned
        if not keep_runs:
            pruned.runs += _delete_run(run_id)
    if keep_runs:
        pruned.runs = len(tree)
        _let_go(root)
    if status:
        pruned.by_status[status] += 1
    return pruned


def _delete_run(run_id: int) -> int:
    """Delete a run whose items are gone, with its samples."""
    with transaction.atomic():
        RunSample.objects.filter(run_id=run_id)._raw_delete(connection.alias)
        return BatchRun.objects.filter(pk=run_id)._raw_delete(connection.alias)


def _let_go(root: int) -> None:
    BatchRun.objects.filter(pk=root).update(tended_until=None)


def _keep_counts(run_id: int) -> None:
    """A run kept without its items keeps what its items said: their counts by status."""
    kept = BatchRun.objects.filter(pk=run_id).values_list("item_counts", flat=True).first()
    if kept:  # counted by an earlier, interrupted prune: its items are partly gone
        return
    counts = dict(
        ItemClaim.objects.filter(run_id=run_id)
        .order_by()
        .values_list("status")
        .annotate(n=Count("pk"))
        .values_list("status", "n")
    )
    BatchRun.objects.filter(pk=run_id).update(item_counts=counts)


def _still_finished(root: int) -> bool:
    """Lock the tree's root and say whether it is still finished: a retry or a compensation
    that reopened it since (under the same lock) stops the prune. The hold is renewed with
    each batch, so that rests between batches do not let a second pruner take the tree."""
    runs = BatchRun.objects.filter(pk=root, status__in=TERMINAL_RUN_STATUSES)
    if not runs.select_for_update().exists():
        return False
    runs.update(tended_until=db_now_plus(HOLD_SECONDS))
    return True


def _delete_items(
    root: int, run_id: int, batch: int, detach_children: bool, most: int | None, pause: float
) -> tuple[int, int, bool]:
    """Delete a run's items and their attempts, ``batch`` items per transaction, ``most`` in
    all, resting ``pause`` seconds after each full batch; say how many, and whether none is
    left."""
    items = attempts = 0
    while True:
        size = batch if most is None else min(batch, most - items)
        if size <= 0:
            return items, attempts, False
        if items and items % batch == 0 and pause > 0:
            time.sleep(pause)  # after a full batch's commit: no lock is held while resting
        with transaction.atomic():
            if not _still_finished(root):
                return items, attempts, False
            pks = list(
                ItemClaim.objects.filter(run_id=run_id)
                .order_by()
                .values_list("pk", flat=True)[:size]
            )
            if not pks:
                return items, attempts, True
            if detach_children:  # kept child runs no longer point at a deleted item
                BatchRun.objects.filter(parent_item_id__in=pks).update(parent_item=None)
            attempts += ItemAttempt.objects.filter(item_id__in=pks)._raw_delete(connection.alias)
            items += ItemClaim.objects.filter(pk__in=pks)._raw_delete(connection.alias)


def prune(
    older_than: timedelta,
    statuses: Iterable[str] = TERMINAL_RUN_STATUSES,
    definition: str | None = None,
    dry_run: bool = False,
    keep_runs: bool = False,
    max_items: int | None = None,
    batch: int = BATCH_ROWS,
    pause: float = 0.0,
) -> Pruned:
    """Prune every finished tree older than ``older_than``; stop after ``max_items`` items;
    rest ``pause`` seconds after each full batch of items."""
    total = Pruned()
    for root in roots(older_than, statuses, definition, keep_runs):
        left = None if max_items is None else max_items - total.items
        if left is not None and left <= 0:
            break
        if dry_run:
            total.add(measure(root))
        elif take(root):
            total.add(prune_tree(root, keep_runs, batch, left, pause))
        else:
            total.held.append(root)
    return total


def retention() -> dict[str, timedelta]:
    """FANOUT_RETENTION, parsed: {finished status: age}."""
    configured = conf.RETENTION or {}
    if not configured:
        return {}
    parse_statuses(list(configured))
    return {status: parse_age(age) for status, age in configured.items()}


def prune_by_retention(max_items: int = 5 * BATCH_ROWS) -> Pruned:
    """One supervision round's prune, by FANOUT_RETENTION; nothing when it is not set."""
    total = Pruned()
    for status, age in retention().items():
        left = max_items - total.items
        if left <= 0:
            break
        total.add(prune(age, [status], max_items=left))
    return total
