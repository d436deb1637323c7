"""Definitions of the compensation-phase tests: items that charge, compensations that refund.

Every forward call is in the Execution ledger under its key, every compensation call under
"undo:<key>", each with its start and end time. Params (all optional):
  n               items (keys p00000, p00001, ...), default 10
  failing         keys whose charge raises PermanentError: the run fails (fast) and compensates
  fail_file       a failing charge raises only once this file exists (60 s at most)
  sleep           seconds each charge sleeps
  undo_sleep      seconds each refund sleeps
  undo_first      {key: seconds}: the key's first refund sleeps that long (past a timeout, or
                  long enough to kill its worker under it)
  undo_throttle   {key: seconds}: the key's first refund raises Throttled(retry_after=seconds)
  undo_permanent  keys whose refund raises PermanentError every time
  undo_fail       {key: n}: the key's first n refunds raise RuntimeError
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from fanout import FanOut, Item, PermanentError, Throttled

from .models import Execution, Observation

__all__: list[str] = []

RATE_POOL = "phase-rate"  # 20/s, burst 5 (made by the tests)
SHARED_POOL = "phase-shared"  # two slots, shared by a compensating run and a forward one


def _call(item: Item, key: str) -> tuple[Execution, bool]:
    first = not Execution.objects.filter(run_id=item.run_id, key=key).exists()
    row = Execution.objects.create(
        run_id=item.run_id,
        key=key,
        attempt=item.attempt,
        pool=item.pool,
        worker=f"{os.getpid()}:{threading.current_thread().name}",
        started=time.time(),
    )
    return row, first


def charge(item: Item) -> dict[str, Any]:
    row, _ = _call(item, item.key)
    try:
        Observation.objects.create(
            run_id=item.run_id, key=item.key, name="charge_key", value=item.idempotency_key
        )
        time.sleep(float(item.params.get("sleep", 0)))
        if item.key in item.params.get("failing", []):
            if item.params.get("fail_file"):
                deadline = time.monotonic() + 60
                while not Path(item.params["fail_file"]).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            raise PermanentError(f"{item.key} declined")
        return {"charged": item.key}
    finally:
        Execution.objects.filter(pk=row.pk).update(ended=time.time())


def refund(item: Item, result: Any) -> None:
    p = item.params
    row, first = _call(item, f"undo:{item.key}")
    try:
        Observation.objects.create(
            run_id=item.run_id, key=item.key, name="refund_key", value=item.idempotency_key
        )
        assert result == {"charged": item.key}, result
        seconds = float(p.get("undo_sleep", 0))
        if first and item.key in p.get("undo_first", {}):
            seconds = float(p["undo_first"][item.key])
        time.sleep(seconds)
        if first and item.key in p.get("undo_throttle", {}):
            raise Throttled(retry_after=float(p["undo_throttle"][item.key]))
        if item.key in p.get("undo_permanent", []):
            raise PermanentError(f"the refund of {item.key} was refused")
        calls = Execution.objects.filter(run_id=item.run_id, key=f"undo:{item.key}").count()
        if calls <= int(p.get("undo_fail", {}).get(item.key, 0)):
            raise RuntimeError(f"the refund of {item.key} bounced")
    finally:
        Execution.objects.filter(pk=row.pk).update(ended=time.time())


phase: dict[str, Any] = dict(
    over=lambda p: range(int(p.get("n", 10))),
    key=lambda i: f"p{i:05d}",
    do=charge,
    compensate=refund,
    failure_policy="fail_fast",
    retry_backoff=0.02,
    max_attempts=3,
)
# Charges and refunds through one rate-limited pool; refunds 8 at once.
FanOut(
    "phase_rate",
    pool=RATE_POOL,
    max_parallel=8,
    compensate_order="parallel",
    compensate_max_parallel=8,
    lease_seconds=5,
    **phase,
)
# Refunds one after another, latest first; a refund may outlive its 1 s timeout.
FanOut("phase_reverse", max_parallel=4, timeout=1, lease_seconds=1, **phase)
# Refunds 4 at once in a pool of two slots that a forward run shares.
FanOut(
    "phase_shared",
    pool=SHARED_POOL,
    max_parallel=4,
    compensate_order="parallel",
    compensate_max_parallel=4,
    lease_seconds=5,
    **phase,
)
# The forward run that competes for the shared pool: long items, many of them.
FanOut(
    "phase_forward",
    pool=SHARED_POOL,
    max_parallel=4,
    over=lambda p: range(int(p.get("n", 10))),
    key=lambda i: f"f{i:05d}",
    do=charge,
    lease_seconds=5,
)
# Refunds one after another with a short lease, for workers killed under them.
FanOut("phase_killed", max_parallel=4, lease_seconds=2, **phase)
