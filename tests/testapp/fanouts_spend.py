"""Definitions the spend tests run, in this process or in worker processes.

Imported at the end of ``fanouts.py``. ``spend_work`` bills each call a random amount of
dollars, drawn from the item's key and attempt so that every process draws the same:

  n         items (keys k00000, ...), default 20
  estimate  dollars reserved per item (default 0.10)
  factor    actual = estimate × uniform(0, factor): 1 keeps estimates upper bounds (default 1)
  sleep     seconds each call sleeps
  block_file  a call blocks until this file exists (60 s at most)
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from fanout import FanOut, Item, Throttled

from .ledger import executing
from .models import Execution

__all__: list[str] = []

SPEND_POOL = "spend-pool"


def numbered(params: dict[str, Any]) -> range:
    return range(int(params.get("n", 20)))


def estimate(item: Item) -> dict[str, float]:
    return {"usd": float(item.params.get("estimate", 0.10))}


def billed(item: Item) -> float:
    """What the call costs: the same for the same key and attempt in every process."""
    draw = random.Random(f"{item.key}:{item.attempt}").random()
    return round(
        float(item.params.get("estimate", 0.10)) * float(item.params.get("factor", 1)) * draw, 6
    )


def spend_work(item: Item) -> dict[str, Any]:
    block = item.params.get("block_file")
    if block:
        deadline = time.monotonic() + 60
        while not Path(block).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    if item.params.get("sleep"):
        time.sleep(float(item.params["sleep"]))
    usd = billed(item)
    item.report_cost(usd=usd)
    return {"pid": os.getpid(), "usd": usd}


FanOut(
    "spend_work",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=spend_work,
    cost=estimate,
    max_parallel=16,
    params={
        "n": (int, 20),
        "estimate": (float, 0.10),
        "factor": (float, 1.0),
        "sleep": (float, 0.0),
        "block_file": (str, ""),
    },
)

FanOut(
    "spend_pooled",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=spend_work,
    cost=estimate,
    pool=SPEND_POOL,
    max_parallel=16,
    lease_seconds=2.0,
    params={
        "n": (int, 20),
        "estimate": (float, 0.10),
        "factor": (float, 1.0),
        "sleep": (float, 0.0),
        "block_file": (str, ""),
    },
)

FanOut(
    "spend_fixed",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=lambda item: item.key,
    cost={"usd": 0.25, "requests": 1},
    params={"n": (int, 20)},
)

TOKEN_POOL = "spend-tokens"


def tokens_work(item: Item) -> int:
    if item.params.get("sleep"):
        time.sleep(float(item.params["sleep"]))
    item.report_cost(tokens=item.payload["tokens"])  # what it was estimated at, exactly
    return item.payload["tokens"]


FanOut(
    "spend_tokens",
    over=lambda params: [
        {"n": i, "tokens": int(params["tokens"]) + 50 * (i % 3)} for i in range(int(params["n"]))
    ],
    key=lambda cell: f"k{cell['n']:05d}",
    do=tokens_work,
    cost=lambda item: {"tokens": item.payload["tokens"]},
    pool=TOKEN_POOL,
    max_parallel=16,
    params={"n": (int, 20), "tokens": (int, 100), "sleep": (float, 0.0)},
)


def answered(item: Item) -> dict[str, Any]:
    """A provider's answer that says what it billed, as many APIs do; no report_cost."""
    if item.payload % 5 == 4:
        item.report_cost(usd=0.5)  # what the handler reports wins over the answer's
    return {"answer": item.key, "billed": {"usd": round(0.01 * (item.payload % 5), 6)}}


FanOut(
    "spend_billed_key",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=answered,
    cost={"usd": 0.1},
    cost_from="billed",
    params={"n": (int, 10)},
)

FanOut(
    "spend_billed_function",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=answered,
    cost_from=lambda answer: {"usd": answer["billed"]["usd"] * 2} if answer["answer"] else None,
    max_spend={"usd": 100},
    params={"n": (int, 10)},
)

FanOut(
    "spend_billed_badly",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=lambda item: {"billed": "a lot"},
    cost={"usd": 0.1},
    cost_from="billed",
    params={"n": (int, 3)},
)


def spend_seen(outcomes: Any) -> dict[str, Any]:
    """The join's view of what the run spent: each outcome's cost, by unit."""
    costs = {o.key: o.cost for o in outcomes}
    return {"costs": costs, "usd": sum((c or {}).get("usd", 0.0) for c in costs.values())}


FanOut(
    "spend_joined",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=spend_work,
    cost=estimate,
    join=spend_seen,
    params={"n": (int, 8), "estimate": (float, 0.10), "factor": (float, 1.0)},
)


PROMPT_USD = 0.01  # what a provider bills for reading the prompt, answered or throttled


def throttling_provider(item: Item) -> dict[str, Any]:
    """A provider that answers 429 to a key's first ``throttles`` calls, billing the prompt it
    read each time (the handler reports it before raising), then answers and bills the rest."""
    calls = Execution.objects.filter(run_id=item.run_id, key=item.key).count()
    with executing(item):
        if calls < int(item.params.get("throttles", 2)):
            item.report_cost(usd=PROMPT_USD)
            raise Throttled(0.05, "429 Too Many Requests")
        usd = billed(item)
        item.report_cost(usd=PROMPT_USD + usd)
        return {"usd": usd}


FanOut(
    "spend_throttled",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=throttling_provider,
    cost=estimate,
    pool=SPEND_POOL,
    max_attempts=1,  # a throttled call that used an attempt would fail its item
    params={"n": (int, 6), "estimate": (float, 0.10), "throttles": (int, 2)},
)

FanOut(
    # Neither cost= nor max_spend: what each call cost is only in its answer.
    "spend_billed_pooled",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=answered,
    cost_from="billed",
    pool=SPEND_POOL,
    params={"n": (int, 10)},
)

FanOut(
    # An answer whose cost is an integer too large for a float (JSON allows any length).
    "spend_billed_hugely",
    over=numbered,
    key=lambda i: f"k{i:05d}",
    do=lambda item: {"billed": {"usd": 10**400}},
    cost={"usd": 0.1},
    cost_from="billed",
    params={"n": (int, 2)},
)
