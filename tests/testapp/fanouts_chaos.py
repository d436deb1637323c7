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
from fanout.models import ItemClaim

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


def _start(item: Item, started: float) -> Execution:
    worker = f"{HOST}:{os.getpid()}"

    def create() -> Execution:
        # A create whose reply was lost in a restart may have committed: look before inserting.
        row = Execution.objects.filter(
            run_id=item.run_id, key=item.key, worker=worker, started=started
        ).first()
        return row or Execution.objects.create(
            run_id=item.run_id,
            key=item.key,
            attempt=item.attempt,
            pool=item.pool,
            worker=worker,
            started=started,
        )

    return _durable(create)


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
        low, high = p.get("sleep", (0.0, 0.0))
        if high:
            time.sleep(random.uniform(low, high))
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
        _durable(lambda: Execution.objects.filter(pk=row.pk).update(ended=time.time()))


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
