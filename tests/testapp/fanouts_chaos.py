"""Definitions the chaos harness (``python -m chaos``) runs in real worker processes.

They share one handler, ``chaos_work``, steered by the run's params. Every call writes an
``Execution`` ledger row when it starts and sets ``ended`` when it ends; a call that does not
simply return also writes an ``Observation`` named "chaos" with how it ended, so that the
harness can tell a retry from a duplicate. Ledger writes ride out a database restart, so the
ledger never makes a handler fail.

Params understood by ``chaos_work`` (all optional):
  n               items in the work list (keys c00000, c00001, ...)
  sleep           [low, high]: every call sleeps a random time in that range, in seconds
  throttle_every  k: items whose index is a multiple of k raise Throttled on their first call
  throttle_after  the retry_after of those Throttled, in seconds (default 0.5)
  bad             {key: behaviour}: "raise" (always), "permanent", "nonjson", "hang" (the first
                  call sleeps ``hang_seconds``, past the definition's timeout), "exit" (every
                  call kills its process with os._exit), "exit_once" (the first call does)
  hang_seconds    how long "hang" sleeps (default 8)
  admissions      also record when the item was claimed (ItemClaim.claimed_at), for rate checks

A tree of runs (``chaos_nest_orgs`` -> ``chaos_nest_repos`` -> ``chaos_nest_files``) takes
``orgs``, ``repos`` and ``files`` (items per level) and ``sleep`` (every call, at every level);
``crash_spawn``: ["o1", "o0/r2", ...] are the parent items whose child run, once written, kills
the process that wrote it (a crash between spawning a child run and recording its parent item
waiting). Joins of the tree, and compensations (``chaos_comp_*``, ``undo_sleep``: [low, high]),
also write ``Execution`` rows, keyed ``join:`` and ``undo:<key>``, so that a join or a
compensation run twice is counted, and one cut off by a kill is told from a duplicate.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from django.db import InterfaceError, OperationalError, connection

from fanout import FanOut, Item, Outcome, PermanentError, Throttled
from fanout.models import BatchRun, ItemClaim
from fanout.signals import run_started

from .models import Execution, Observation

__all__: list[str] = []  # `from .fanouts_chaos import *` only registers the definitions

HOST = socket.gethostname()
POOL = "chaos-pool"


def _durable[T](op: Callable[[], T], seconds: float = 90.0) -> T:
    """Run a ledger write or read; wait out a database that is restarting."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return op()
        except (OperationalError, InterfaceError):
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def chaos_key(i: int) -> str:
    return f"c{i:05d}"


def chaos_over(params: dict[str, Any]) -> Iterator[int]:
    fail_at = int(params.get("fail_at", -1))
    for i in range(int(params.get("n", 10))):
        if i == fail_at:
            raise RuntimeError(f"chaos: the work list broke at element {i}")
        yield i


def _start(item: Item, started: float, key: str | None = None) -> Execution:
    return _ledger_row(item.run_id, key or item.key, item.attempt, item.pool, started)


def _ledger_row(run_id: int, key: str, attempt: int, pool: str, started: float) -> Execution:
    worker = f"{HOST}:{os.getpid()}"

    def create() -> Execution:
        # A create whose reply was lost in a restart may have committed: look before inserting.
        row = Execution.objects.filter(
            run_id=run_id, key=key, worker=worker, started=started
        ).first()
        return row or Execution.objects.create(
            run_id=run_id, key=key, attempt=attempt, pool=pool, worker=worker, started=started
        )

    return _durable(create)


def _ended(row: Execution) -> None:
    _durable(lambda: Execution.objects.filter(pk=row.pk).update(ended=time.time()))


def _sleep(span: Any) -> None:
    low, high = span or (0.0, 0.0)
    if high:
        time.sleep(random.uniform(low, high))


def _observe(item: Item, value: dict[str, Any]) -> None:
    def create() -> None:
        seen = Observation.objects.filter(run_id=item.run_id, key=item.key, name="chaos")
        if not any(o.value == value for o in seen):
            Observation.objects.create(run_id=item.run_id, key=item.key, name="chaos", value=value)

    _durable(create)


def _first_call(item: Item, row: Execution) -> bool:
    return not _durable(
        lambda: Execution.objects.filter(run_id=item.run_id, key=item.key, pk__lt=row.pk).exists()
    )


def chaos_work(item: Item) -> Any:
    p = item.params
    started = time.time()
    claimed = None
    if p.get("admissions"):
        at = _durable(
            lambda: (
                ItemClaim.objects.filter(run_id=item.run_id, key=item.key)
                .values_list("claimed_at", flat=True)
                .first()
            )
        )
        claimed = at.timestamp() if at else None
    row = _start(item, started)
    behaviour = p.get("bad", {}).get(item.key, "")
    ending = "raised"
    try:
        _sleep(p.get("sleep"))
        if behaviour in ("exit", "exit_once"):
            if behaviour == "exit" or _first_call(item, row):
                _observe(item, {"exec": row.pk, "ending": "exit", "at": time.time()})
                os._exit(3)
        if behaviour == "hang" and _first_call(item, row):
            time.sleep(float(p.get("hang_seconds", 8)))
        if behaviour == "raise":
            raise RuntimeError(
                f"chaos: {item.key} raised on attempt {item.attempt} (exec {row.pk})"
            )
        if behaviour == "permanent":
            raise PermanentError(f"chaos: {item.key} is broken for good (exec {row.pk})")
        every = int(p.get("throttle_every", 0))
        if every and item.index % every == 0 and _first_call(item, row):
            ending = "throttled"
            raise Throttled(float(p.get("throttle_after", 0.5)))
        ending = "returned"
        if behaviour == "nonjson":
            return {item.key, "a set is not JSON"}
        return {"i": item.index, "exec": row.pk}
    except PermanentError:
        ending = "permanent"
        raise
    finally:
        if ending != "returned" or claimed is not None:
            _observe(item, {"exec": row.pk, "ending": ending, "claimed": claimed})
        _ended(row)


def chaos_join(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return {"count": sum(counts.values()), "statuses": counts}


common: dict[str, Any] = dict(
    over=chaos_over, key=chaos_key, payload=lambda i: {"i": i}, do=chaos_work, join=chaos_join
)

# Three parents race to start the same run while workers drain it.
FanOut("chaos_compete", max_parallel=8, lease_seconds=10, **common)
# Workers and parents are killed: a crash must not use the single attempt.
FanOut("chaos_crash", max_parallel=6, lease_seconds=3, max_attempts=1, **common)
# A pool of concurrency 2 and rate 10/s (the harness creates the row) under 8 workers.
FanOut("chaos_pool", pool=POOL, max_parallel=8, lease_seconds=10, **common)
# Redis flushed or stopped, PostgreSQL restarted: leases outlive the outage.
FanOut("chaos_infra", max_parallel=6, lease_seconds=20, max_attempts=1, **common)
# Bad handlers: a short lease and timeout for the hang, a crash budget of 1 for the exits.
FanOut(
    "chaos_bad",
    max_parallel=4,
    lease_seconds=2,
    timeout=1,
    max_attempts=2,
    crash_budget=1,
    retry_backoff=0.1,
    params={
        "n": int,
        "sleep": (list, [0.0, 0.0]),
        "bad": (dict, {}),
        "hang_seconds": (float, 8.0),
    },
    **common,
)
# A work list that breaks part-way through being written.
FanOut("chaos_over", params={"n": int, "fail_at": (int, -1)}, **common)


# A tree of runs: orgs -> repos -> files. A parent item spawns its child run; every call, and
# every run's join, is in the ledger.
def _spawner(child: str, level: str) -> Callable[[Item], Any]:
    def spawn(item: Item) -> Any:
        row = _start(item, time.time())
        try:
            _sleep(item.params.get("sleep"))
            return item.spawn(child, params={**item.params, level: item.key})
        finally:
            _ended(row)

    spawn.__name__ = f"spawn_{child}"
    return spawn


def _run_of(outcomes: list[Outcome]) -> int | None:
    """The run being joined, from its items' results: a leaf's execution, or a child run."""
    for o in outcomes:
        if not isinstance(o.result, dict):
            continue
        if "exec" in o.result:
            rows = Execution.objects.filter(pk=o.result["exec"])
            found = rows.values_list("run_id", flat=True).first()
        else:
            rows = BatchRun.objects.filter(pk=o.result.get("run"))
            found = rows.values_list("parent_item__run_id", flat=True).first()
        if found is not None:
            return int(found)
    return None


def chaos_tree_join(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """Count the outcomes; the call is in the ledger (key ``join:``) under the joined run."""
    seen = list(outcomes)
    run_id = _durable(lambda: _run_of(seen))
    row = _ledger_row(run_id, "join:", 1, "", time.time()) if run_id is not None else None
    try:
        return {**chaos_join(seen), "run": run_id}
    finally:
        if row is not None:
            _ended(row)


def _crash_after_spawn(sender: Any, run: BatchRun, **kwargs: Any) -> None:
    """A child run listed in ``crash_spawn`` kills the process that has just written it.

    ``run_started`` is sent right after the child's items are written: its parent item is not
    yet recorded waiting, so the parent item is reclaimed and spawns again. Only once a run.
    """
    if not run.definition.startswith("chaos_nest_") or run.parent_item_id is None:
        return
    path = "/".join(str(run.params[p]) for p in ("org", "repo") if p in run.params)
    if path not in run.params.get("crash_spawn", ()):
        return
    if Observation.objects.filter(run_id=run.pk, name="chaos-spawn-exit").exists():
        return
    Observation.objects.create(
        run_id=run.pk, name="chaos-spawn-exit", value={"pid": os.getpid(), "at": time.time()}
    )
    os._exit(3)


run_started.connect(_crash_after_spawn, dispatch_uid="chaos-crash-after-spawn")

tree: dict[str, Any] = dict(join=chaos_tree_join, lease_seconds=3, max_attempts=1)
FanOut(
    "chaos_nest_orgs",
    over=lambda p: range(int(p.get("orgs", 3))),
    key=lambda i: f"o{i}",
    do=_spawner("chaos_nest_repos", "org"),
    max_parallel=2,
    **tree,
)
FanOut(
    "chaos_nest_repos",
    over=lambda p: range(int(p.get("repos", 3))),
    key=lambda i: f"r{i}",
    do=_spawner("chaos_nest_files", "repo"),
    max_parallel=2,
    **tree,
)
FanOut(
    "chaos_nest_files",
    over=lambda p: range(int(p.get("files", 6))),
    key=chaos_key,
    payload=lambda i: {"i": i},
    do=chaos_work,
    max_parallel=3,
    **tree,
)


# Compensation: item ``bad`` fails for good (fail_fast), then every item that succeeded is
# undone; each compensation is in the ledger as "undo:<key>". While the file ``undo_hold``
# names exists, a compensation that starts waits for it to go (then it runs as usual).
def chaos_undo(item: Item, result: Any) -> None:
    row = _start(item, time.time(), key=f"undo:{item.key}")
    try:
        # ``undo_hold``: a file; while it exists, a compensation that started stays under way,
        # so that the harness kills it in the state it observed instead of racing its end.
        hold = item.params.get("undo_hold")
        while hold and os.path.exists(hold):
            time.sleep(0.05)
        _sleep(item.params.get("undo_sleep"))
        if not isinstance(result, dict) or result.get("i") != item.index:
            raise RuntimeError(f"chaos: {item.key} was handed the result {result!r}")
    finally:
        _ended(row)


compensated: dict[str, Any] = dict(
    failure_policy="fail_fast",
    max_parallel=4,
    lease_seconds=3,
    max_attempts=2,
    retry_backoff=0.1,
    compensate=chaos_undo,
    **common,
)
FanOut("chaos_comp_reverse", compensate_order="reverse", **compensated)
FanOut("chaos_comp_parallel", compensate_order="parallel", compensate_max_parallel=2, **compensated)
