"""The benchmark's definitions, autodiscovered in bench/run.py and in every RQ worker it starts.

The batched definitions take their batch size from FANOUT_BENCH_BATCH (default 200); the script
passes the same value to the workers it starts. The per-item definitions leave ``batch_size``
unset, so they run with the library's default (FANOUT_BATCH_SIZE, 1: every item committed on
its own), as users run them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from fanout import FanOut, Item, Outcome

BATCH = int(os.environ.get("FANOUT_BENCH_BATCH", "200"))
MAX_PARALLEL = 1000  # high enough never to bind: the throughput runs measure the machinery
SLOW_SLEEP = 0.02  # seconds each item of the max_parallel-bound run takes
SLOW_MAX_PARALLEL = 16  # so that run's limit is 16 / 0.02 s = 800 items/s
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


def _sleep(seconds: float) -> list[float]:
    """Sleep; return when the handler ran, so the script can count handlers running at once."""
    started = time.time()
    time.sleep(seconds)
    return [started, time.time()]


def sleep_20ms(item: Item) -> list[float]:
    return _sleep(SLOW_SLEEP)


def sleep_pool(item: Item) -> list[float]:
    return _sleep(POOL_SLEEP)


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
# Per-item commit, the default: each item is claimed durably before it runs and its outcome
# committed after (on PostgreSQL with the next item's claim, in one statement).
FanOut("bench.noop_each", do=noop, **common)
# The same, counting cost (spend phase): an estimate per item, without and with a run budget
# that never binds, so what is measured is the accounting alone.
FanOut("bench.noop_each_cost", do=noop, cost={"usd": 0.001}, **common)
FanOut("bench.noop_each_budget", do=noop, cost={"usd": 0.001}, max_spend={"usd": 1e12}, **common)
# 20 ms items bound by max_parallel=16: the limit is 800 items/s, reached only if the workers
# keep 16 items in flight (2 processes x FANOUT_WORKER_THREADS threads).
FanOut(
    "bench.sleep20ms",
    do=sleep_20ms,
    **{**common, "max_parallel": SLOW_MAX_PARALLEL},
)
# Materialization only (never dispatched).
FanOut("bench.materialize", do=noop, **common)
# Pool-limited (settings.FANOUT_POOLS): 4 at once with a 50 ms handler; 50 admissions/s.
FanOut("bench.pool_conc4", do=sleep_pool, pool="bench-conc4", **{**common, "max_parallel": 64})
FanOut("bench.pool_rate50", do=noop, pool="bench-rate50", **common)

# Scheduling (issue 21): many small runs, a tree, and a per-host limit, all through RQ.
SMALL_SLEEP = 0.1  # seconds each item of the many-runs phase takes
HOST_SLEEP = 0.05  # seconds each item of the per-host phase takes


def sleep_small(item: Item) -> list[float]:
    return _sleep(SMALL_SLEEP)


def sleep_host(item: Item) -> list:
    from fanout.conf import host_name

    return [*_sleep(HOST_SLEEP), host_name()]


def spawn_child(item: Item) -> object:
    return item.spawn("bench.tree_child", params={"n": item.params["child_items"]})


# A per-customer limit: many such runs open at once must share every worker thread.
FanOut("bench.small_runs", do=sleep_small, **{**common, "max_parallel": 2})
FanOut("bench.tree_child", do=sleep_small, **{**common, "max_parallel": 2})
FanOut(
    "bench.tree_parent",
    do=spawn_child,
    **{**common, "params": {"n": int, "child_items": int}, "max_parallel": 4},
)
FanOut(
    "bench.host_limit",
    do=sleep_host,
    host_max_parallel=2,
    **{**common, "max_parallel": 64},
)
