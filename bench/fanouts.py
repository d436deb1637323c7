"""The benchmark's definitions, autodiscovered in bench/run.py and in every RQ worker it starts.

The batch size of the throughput definitions comes from FANOUT_BENCH_BATCH (default 200); the
script passes the same value to the workers it starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from fanout import FanOut, Item, Outcome

BATCH = int(os.environ.get("FANOUT_BENCH_BATCH", "200"))
MAX_PARALLEL = 1000  # high enough never to bind: the throughput runs measure the machinery
POOL_SLEEP = 0.05  # seconds each item of the concurrency-limited pool takes


def work_list(params: dict) -> Iterable[int]:
    return range(params["n"])


def payload(n: int) -> dict:
    return {"n": n}


def count_succeeded(outcomes: Iterable[Outcome]) -> int:
    """The join: reads every outcome, as a real join would, and counts the successes."""
    return sum(1 for o in outcomes if o.succeeded)


def noop(item: Item) -> None:
    return None


def sleep_1ms(item: Item) -> None:
    time.sleep(0.001)


def sleep_pool(item: Item) -> list[float]:
    """Return when the handler ran, so the script can count handlers running at once."""
    started = time.time()
    time.sleep(POOL_SLEEP)
    return [started, time.time()]


common = dict(
    over=work_list,
    payload=payload,
    join=count_succeeded,
    params={"n": int},
    max_parallel=MAX_PARALLEL,
    failure_policy="collect",
)

FanOut("bench.noop", do=noop, batch_size=BATCH, **common)
FanOut("bench.sleep1ms", do=sleep_1ms, batch_size=BATCH, **common)
# Per-item commit: every item is claimed in its own transaction and recorded in another.
FanOut("bench.noop_each", do=noop, batch_size=1, **common)
# Materialization only (never dispatched).
FanOut("bench.materialize", do=noop, **common)
# Pool-limited (settings.FANOUT_POOLS): 4 at once with a 50 ms handler; 50 admissions/s.
FanOut(
    "bench.pool_conc4",
    do=sleep_pool,
    pool="bench-conc4",
    batch_size=1,
    **{**common, "max_parallel": 64},
)
FanOut("bench.pool_rate50", do=noop, pool="bench-rate50", batch_size=1, **common)
