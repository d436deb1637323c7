"""Nest: an item handed to a child run (``Item.spawn``) takes the child run's outcome.

While its child runs, the parent item is ``waiting``: it holds a slot of its run's
``max_parallel`` (so ``max_parallel=4`` means at most 4 child runs at once) but no lease and no
pool slot. The child's run key comes from the parent run and the item's key, so a crash between
spawning and recording, or a resumed parent, finds the same child instead of making another.
When the child run ends, its parent item succeeds with the child's join result, or fails naming
the child; the parent run may then join, and so on up the tree.

This module names the tree; fanout.dispatch starts a child run (``start_child``), and
fanout.join moves the tree when a run ends (``settle_up``, ``cancel_children``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .models import TERMINAL_RUN_STATUSES, BatchRun


def child_run_key(parent_run_id: int, item_key: str) -> str:
    key = f"spawn:{parent_run_id}:{item_key}"
    if len(key) <= 255:
        return key
    return f"spawn:{parent_run_id}:sha256:{hashlib.sha256(item_key.encode()).hexdigest()}"


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
