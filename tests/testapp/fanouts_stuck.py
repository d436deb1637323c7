"""Definitions of the stuck-run tests: slow work lists, and compensations over child runs.

Every handler call goes to the Execution ledger (with the worker's pid), so a test counts
executions per key instead of guessing.

Params understood by ``slow_list`` (the work list):
  n      elements (keys w00000, w00001, ...), default 10
  page   elements between two pauses, default 50
  pause  seconds the work list sleeps before each page after the first, default 0
Params understood by ``noted`` (the handler):
  sleep  seconds every call takes
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from fanout import FanOut, Item, Outcome

from .ledger import executing

__all__: list[str] = []  # nothing to import: constructing the definitions registers them


def slow_list(params: dict[str, Any]) -> Iterator[int]:
    """A deterministic work list that takes its time, page by page (a slow API, say)."""
    page, pause = int(params.get("page", 50)), float(params.get("pause", 0))
    for i in range(int(params.get("n", 10))):
        if i and i % page == 0 and pause:
            time.sleep(pause)
        yield i


def noted(item: Item) -> dict[str, Any]:
    with executing(item, worker=str(os.getpid())):
        if item.params.get("sleep"):
            time.sleep(float(item.params["sleep"]))
        return {"i": item.payload}


def tally(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counts = Counter(o.status for o in outcomes)
    return {"items": sum(counts.values()), "succeeded": counts["succeeded"]}


def stuck_key(i: int) -> str:
    return f"w{i:05d}"


FanOut(
    "stuck_slow_list",
    over=slow_list,
    key=stuck_key,
    do=noted,
    join=tally,
    max_parallel=8,
    lease_seconds=2,
)


def spawn_child(item: Item) -> Any:
    with executing(item, worker=str(os.getpid())):
        return item.spawn("stuck_slow_list", params={"n": 6, "sleep": item.params["child_sleep"]})


def undo(item: Item, result: Any) -> None:
    """Noted in the ledger as "undo:<key>"."""
    with executing(Item(f"undo:{item.key}", item.index, item.payload, 1, item.run_id)):
        pass


# A run whose items each wait on a child run of slow items, and that can be compensated.
FanOut(
    "stuck_comp_spawner",
    over=lambda p: range(int(p.get("n", 2))),
    key=stuck_key,
    do=spawn_child,
    compensate=undo,
    join=tally,
    max_parallel=4,
    lease_seconds=2,
)


def spawn_slow_list(item: Item) -> Any:
    with executing(item, worker=str(os.getpid())):
        return item.spawn("stuck_slow_list", params=item.params["child"])


# A run whose one item hands a slow work list to a child run: its worker writes the child's.
FanOut(
    "stuck_slow_spawner",
    over=lambda p: range(1),
    key=stuck_key,
    do=spawn_slow_list,
    join=tally,
    lease_seconds=2,
)
# The same, but an item whose worker dies is not run again (it fails, WorkerLost).
FanOut(
    "stuck_slow_spawner_once",
    over=lambda p: range(1),
    key=stuck_key,
    do=spawn_slow_list,
    join=tally,
    lease_seconds=2,
    crash_budget=0,
)


# Calls of ``flaky_then_broken``'s work list, per params["tag"].
_list_calls: Counter[str] = Counter()


def flaky_then_broken(params: dict[str, Any]) -> Iterator[int]:
    """A work list whose first call meets a database that went away (the run is kept for the
    next writer), whose second raises the definition's own error, and whose later calls (the
    definition fixed) give 2 elements."""
    from django.db import OperationalError

    _list_calls[params["tag"]] += 1
    if _list_calls[params["tag"]] == 1:
        raise OperationalError("the database went away mid-work-list")
    if _list_calls[params["tag"]] == 2:
        raise ValueError("the work list is broken")
    return iter(range(2))


FanOut("stuck_flaky_then_broken", over=flaky_then_broken, key=stuck_key, do=noted, join=tally)


def spawn_flaky_then_broken(item: Item) -> Any:
    return item.spawn("stuck_flaky_then_broken", params={"tag": item.params["tag"]})


# A run whose one item hands its work to a child run of ``stuck_flaky_then_broken``.
FanOut(
    "stuck_broken_child_spawner",
    over=lambda p: range(1),
    key=stuck_key,
    do=spawn_flaky_then_broken,
    join=tally,
)
