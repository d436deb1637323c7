"""Definitions the RQ executor tests run in `rqworker` processes (imported by fanouts.py).

Their handler writes every call to the Execution ledger when it starts and when it ends, with
the worker's pid, so a test counts executions per key and knows which process ran each one.

Params understood by ``ledger`` (all optional):
  n           items in the work list (keys r00000, r00001, ...), default 10
  delay       seconds every handler call takes
  block_key   a key whose first execution blocks until ``block_file`` exists (60 s at most)
  block_file  the file that lets it go
  spread      hold every call until this many processes have started items of the run (60 s
              at most), so a test sees work spread over workers without racing their start-up
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fanout import FanOut, Item, Outcome

from .ledger import executing
from .models import Execution

__all__: list[str] = []  # nothing to import: constructing the definitions registers them

BLOCK_LIMIT = 60.0  # seconds a blocked handler waits for its file before giving up


def rq_key(i: int) -> str:
    return f"r{i:05d}"


def numbered(params: dict[str, Any]) -> range:
    return range(int(params.get("n", 10)))


def ledger(item: Item) -> dict[str, int]:
    p = item.params
    with executing(item, worker=str(os.getpid())) as first:
        if first and item.key == p.get("block_key"):
            release = Path(p["block_file"])
            deadline = time.monotonic() + BLOCK_LIMIT
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        elif p.get("delay"):
            time.sleep(float(p["delay"]))
        if p.get("spread"):
            deadline = time.monotonic() + BLOCK_LIMIT
            while len(processes_in(item.run_id)) < int(p["spread"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {p['spread']} processes took items within 60 s")
                time.sleep(0.02)
        return {"i": item.payload, "pid": os.getpid()}


def processes_in(run_id: int) -> set[str]:
    return set(Execution.objects.filter(run_id=run_id).values_list("worker", flat=True))


def noop(item: Item) -> int:
    return int(item.payload)


def tally(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counts = Counter(o.status for o in outcomes)
    return {"items": sum(counts.values()), "succeeded": counts["succeeded"]}


# Seconds the join of rq_slow_join takes: a join that reads a large run's outcomes.
SLOW_JOIN_SECONDS = 3.0


def slow_tally(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counted = tally(outcomes)
    time.sleep(SLOW_JOIN_SECONDS)
    return counted


common: dict[str, Any] = dict(over=numbered, key=rq_key, join=tally)

FanOut("rq_items", do=ledger, max_parallel=4, **common)
# A short lease, so that a killed worker's item is reclaimed in seconds; a crash must not use
# up the single attempt.
FanOut("rq_crash", do=ledger, lease_seconds=2, max_attempts=1, max_parallel=4, **common)
# A no-op in batches of 50, to time what the worker class costs per drain job.
FanOut("rq_noop", do=noop, batch_size=50, max_parallel=100, **common)
# One item at a time per run: many such runs share one worker process's threads.
FanOut("rq_single", do=ledger, max_parallel=1, **common)
# One item at a time, and a join that takes seconds.
FanOut("rq_slow_join", do=ledger, max_parallel=1, **{**common, "join": slow_tally})
# Batches of 3: a thread runs a batch's items one after another and records them together.
FanOut("rq_batched", do=ledger, batch_size=3, max_parallel=3, **common)
# The same with a short lease and one attempt: a worker killed mid-batch has its unrecorded
# items reclaimed in seconds, and a crash must not use up the attempt.
FanOut(
    "rq_batched_crash",
    do=ledger,
    batch_size=3,
    max_parallel=3,
    lease_seconds=2,
    max_attempts=1,
    **common,
)
# Drain jobs go to the queue `fanout-gpu`: only workers started on it run them.
FanOut("rq_gpu", do=ledger, requires="gpu", max_parallel=2, **common)
