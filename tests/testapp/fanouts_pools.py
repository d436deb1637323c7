"""Definitions the capacity-pool tests run, in this process or in worker processes.

Imported at the end of ``fanouts.py``, so every process that sets Django up with the test
settings registers them. Every handler call is written to the Execution ledger when it starts
and when it ends: in-flight counts are reconstructed from those times.

Params understood by ``pool_work`` (all optional):
  n             items in the work list (keys k00000, k00001, ...), default 10
  sleep         seconds every handler call sleeps
  throttle      {key: seconds}: the key's first execution raises Throttled(retry_after=seconds)
  block_file    every first execution of a key blocks until this file exists (60 s at most)
  exit          every execution kills its process (os._exit), as a handler that crashes it
  accounts      for ``pools_accounts``: the accounts; ``per_account`` items each (default 4)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fanout import FanOut, Item, Throttled

from .ledger import executing

# Nothing is re-exported: ``from .fanouts_pools import *`` only registers the definitions.
__all__: list[str] = []

BUSY_POOL = "pools-busy"
RATE_POOL = "pools-rate"
KILL_POOL = "pools-kill"
THROTTLE_POOL = "pools-throttle"
HOLD_POOL = "pools-hold"
MISSING_POOL = "pools-nowhere"


def numbered(params: dict[str, Any]) -> range:
    return range(int(params.get("n", 10)))


def item_key(i: int) -> str:
    return f"k{i:05d}"


def pool_work(item: Item) -> Any:
    p = item.params
    with executing(item) as first:
        if p.get("exit"):
            os._exit(3)
        if p.get("sleep"):
            time.sleep(float(p["sleep"]))
        if p.get("block_file") and first:
            block_file = Path(p["block_file"])
            deadline = time.monotonic() + 60
            while not block_file.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        retry_after = p.get("throttle", {}).get(item.key)
        if retry_after is not None and first:
            raise Throttled(retry_after=float(retry_after))
        return item.key


def accounts(params: dict[str, Any]) -> list[dict[str, Any]]:
    per_account = int(params.get("per_account", 4))
    return [{"account": a, "i": i} for a in params["accounts"] for i in range(per_account)]


numbered_items: dict[str, Any] = dict(over=numbered, key=item_key, do=pool_work)

# Room under max_parallel for every worker, so that only the pool limits what runs at once.
FanOut("pools_busy", pool=BUSY_POOL, max_parallel=16, **numbered_items)
# Claims of several items at once, so that demand outruns the rate even on a loaded machine.
FanOut("pools_rate", pool=RATE_POOL, max_parallel=32, batch_size=4, **numbered_items)
# A short lease, and one attempt: a crash must not use it up.
FanOut("pools_kill", pool=KILL_POOL, lease_seconds=2, max_attempts=1, **numbered_items)
# Items that kill their worker every time, sharing pools_kill's pool: failed at the 2nd crash.
FanOut("pools_crashing", pool=KILL_POOL, lease_seconds=2, crash_budget=1, **numbered_items)
# One attempt: a Throttled that charged one would leave the item failed.
FanOut("pools_throttle", pool=THROTTLE_POOL, max_attempts=1, max_parallel=4, **numbered_items)
FanOut("pools_hold", pool=HOLD_POOL, max_parallel=4, **numbered_items)
FanOut("pools_nowhere", pool=MISSING_POOL, **numbered_items)
# The pool a run's params name: a test gives it the (long) name it needs.
FanOut("pools_named", pool=lambda item: item.params["pool"], max_parallel=4, **numbered_items)
FanOut(
    "pools_accounts",
    over=accounts,
    key=lambda e: f"{e['account']}-{e['i']:03d}",
    pool=lambda item: f"account-{item.payload['account']}",
    do=pool_work,
    max_parallel=8,
)
FanOut(
    "pools_ghosts",
    over=accounts,
    key=lambda e: f"{e['account']}-{e['i']:03d}",
    pool=lambda item: f"ghost-{item.payload['account']}",
    do=pool_work,
)
