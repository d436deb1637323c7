"""Definitions of the group commit tests (tests/test_group_commit.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fanout import FanOut, Item

from .ledger import executing

# The first two items' slots are given up on their own pool's row, the others' on this one.
GROUP_POOL_FIRST = "group-first"
GROUP_POOL = "group-rest"


def _finish_on_cue(item: Item) -> Any:
    """On its first execution, return once the file named by the item's key appears in the
    run's ``cue_dir`` (60 s at most); at once after."""
    with executing(item) as first:
        if first:
            cue = Path(item.params["cue_dir"]) / item.key
            deadline = time.monotonic() + 60
            while not cue.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gave up waiting for {cue}")
                time.sleep(0.01)
        return {"i": item.payload}


FanOut(
    "group_kill",
    over=lambda params: range(int(params.get("n", 4))),
    key=lambda i: f"k{i:05d}",
    payload=lambda i: i,
    do=_finish_on_cue,
    pool=lambda item: GROUP_POOL_FIRST if item.payload < 2 else GROUP_POOL,
    max_parallel=8,
    lease_seconds=3,
)

# Pools named against the work list's order: the first item's pool sorts after the second's,
# so a group orders its items against their ids.
GROUP_POOL_LATE_NAME = "group-z"
GROUP_POOL_EARLY_NAME = "group-a"

FanOut(
    "group_pools_against_ids",
    over=lambda params: range(int(params.get("n", 2))),
    key=lambda i: f"p{i:05d}",
    payload=lambda i: i,
    do=lambda item: {"i": item.payload},
    pool=lambda item: GROUP_POOL_LATE_NAME if item.payload % 2 == 0 else GROUP_POOL_EARLY_NAME,
    max_parallel=8,
    lease_seconds=30,
)
