"""Definitions the tests run, in this process or in worker processes (autodiscovered).

Most of them share one handler, ``work``, steered by the run's params so that one definition
serves many scenarios; every call is written to the Execution ledger when it starts and ends.

Params understood by ``work`` (all optional):
  n               items in the work list (keys k00000, k00001, ...), default 10
  sleep           seconds every handler call sleeps
  permanent       keys that raise PermanentError
  permanent_once  keys that raise PermanentError on their first execution only
  flaky           {key: k}: the key raises RuntimeError on attempts 1..k
  nonjson         keys whose handler returns a value that is not JSON
  unstorable      {key: "nan" | "nul" | "surrogate" | "nul_lookalike"}: the key returns
                  {"v": NaN}, {"s": "a\\x00b"} or {"s": "a\\ud800b"}, which PostgreSQL's jsonb
                  refuses, or {"s": "a\\\\u0000b"} (a backslash, then "u0000"), which it stores
  unstorable_error keys that raise PermanentError with a NUL and a lone surrogate in its message
  block_first     a key whose first execution blocks until ``block_file`` exists (60 s at most)
  await_failed    {key: other}: the key waits until item ``other`` is failed (30 s at most)
  probe           record in an Observation whether the handler runs inside a transaction
  file_ledger     append one line per call ("key attempt worker") to this file instead of
                  writing Execution rows: the handler then never writes to the database
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from django.db import connection

from fanout import FanOut, Item, Outcome, PermanentError
from fanout.models import ItemClaim, ItemStatus

from .ledger import executing
from .models import Observation, Widget


def numbered(params: dict[str, Any]) -> range:
    return range(int(params.get("n", 10)))


def item_key(i: int) -> str:
    return f"k{i:05d}"


def item_payload(i: int) -> dict[str, int]:
    return {"i": i}


def _wait(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.02)


def work(item: Item) -> Any:
    p = item.params
    if p.get("file_ledger"):
        with open(p["file_ledger"], "a") as ledger:  # one short append per line: never torn
            ledger.write(
                f"{item.key} {item.attempt} {os.getpid()}:{threading.current_thread().name}\n"
            )
        if p.get("sleep"):
            time.sleep(float(p["sleep"]))
        i = item.payload["i"]
        return {"i": i, "square": i * i}
    in_atomic = connection.in_atomic_block
    if p.get("probe"):
        Observation.objects.create(
            run_id=item.run_id, key=item.key, name="in_atomic_block", value=in_atomic
        )
    with executing(item) as first:
        if p.get("sleep"):
            time.sleep(float(p["sleep"]))
        if item.key == p.get("block_first") and first:
            block_file = Path(p["block_file"])
            _wait(block_file.exists, 60, f"{block_file} to appear")
        other = p.get("await_failed", {}).get(item.key)
        if other:
            _wait(
                ItemClaim.objects.filter(
                    run_id=item.run_id, key=other, status=ItemStatus.FAILED
                ).exists,
                30,
                f"item {other} to fail",
            )
        if item.key in p.get("permanent", ()):
            raise PermanentError(f"{item.key} is broken for good")
        if item.key in p.get("unstorable_error", ()):
            raise PermanentError(f"{item.key} read a\x00b and c\udc80d")
        if item.key in p.get("permanent_once", ()) and first:
            raise PermanentError(f"{item.key} is broken this time")
        if item.attempt <= p.get("flaky", {}).get(item.key, 0):
            raise RuntimeError(f"{item.key} flaked on attempt {item.attempt}")
        if item.key in p.get("nonjson", ()):
            return {item.key, "a set is not JSON"}
        unstorable = p.get("unstorable", {}).get(item.key)
        if unstorable == "nan":
            return {"v": float("nan")}
        if unstorable == "nul":
            return {"s": "a\x00b"}
        if unstorable == "surrogate":
            return {"s": "a\ud800b"}
        if unstorable == "nul_lookalike":
            return {"s": "a\\u0000b"}
        i = item.payload["i"]
        return {"i": i, "square": i * i}


def summarize(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    seen = list(outcomes)
    Observation.objects.create(
        name="join",
        value={"count": len(seen), "statuses": sorted({o.status for o in seen})},
    )
    succeeded = [o for o in seen if o.succeeded]
    return {
        "count": len(seen),
        "succeeded": len(succeeded),
        "sum": sum(o.result["i"] for o in succeeded),
    }


def tally(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """The join of ``summarize`` without its database write."""
    seen = list(outcomes)
    succeeded = [o for o in seen if o.succeeded]
    return {
        "count": len(seen),
        "succeeded": len(succeeded),
        "sum": sum(o.result["i"] for o in succeeded),
    }


def broken_join(outcomes: Iterable[Outcome]) -> Any:
    list(outcomes)
    raise ValueError("the join broke on purpose")


common: dict[str, Any] = dict(
    over=numbered, key=item_key, payload=item_payload, do=work, retry_backoff=0.02
)

FanOut("t_ledger", max_parallel=8, join=summarize, **common)
FanOut("t_collect", failure_policy="collect", join=summarize, **common)
FanOut("t_fail_fast", failure_policy="fail_fast", join=summarize, max_parallel=2, **common)
FanOut("t_tolerate", failure_policy="tolerate", join=summarize, **common)
FanOut("t_any", failure_policy="collect", join_mode="any", join=summarize, **common)
FanOut("t_batched", batch_size=5, max_parallel=2, join=summarize, **common)
FanOut("t_join_raises", join=broken_join, **common)
FanOut("t_no_join", **common)
FanOut("t_quiet", max_parallel=8, join=tally, **common)
# Short leases, for renewal and crash recovery; a crash must not use up the single attempt.
FanOut("t_lease", lease_seconds=2, max_parallel=2, join=summarize, **common)
FanOut("t_crash", lease_seconds=2, max_attempts=1, max_parallel=10, join=summarize, **common)
FanOut("t_budget", lease_seconds=5, crash_budget=2, **common)
FanOut("t_fail_fast_budget", failure_policy="fail_fast", crash_budget=0, **common)
FanOut("t_strict", params={"n": int, "label": (str, "none")}, join=summarize, **common)
# A work list that comes out empty is a mistake here (a mistyped param), not a finished run.
FanOut("t_refuse_empty", allow_empty=False, join=summarize, **common)


def spawn_refused(item: Item) -> Any:
    """Hand the item to a child run whose params its definition refuses: the spawn fails."""
    return item.spawn("t_strict", params={"n": "not a number"})


FanOut("t_spawn_refused", over=numbered, key=item_key, do=spawn_refused, max_attempts=1)


# Work lists that are not ranges: a queryset, a plain list, a generator.

last_querysets: list[Any] = []


def widgets(params: dict[str, Any]) -> Any:
    qs = Widget.objects.filter(batch=params["batch"]).order_by("-rank", "pk")
    last_querysets.append(qs)
    return qs


FanOut(
    "t_widgets",
    over=widgets,
    key=lambda w: f"widget-{w.pk}",
    payload=lambda w: {"name": w.name, "rank": w.rank},
    do=lambda item: item.payload["rank"],
)

FanOut(
    "t_list",
    over=lambda params: list(params["items"]),
    payload=lambda e: {"v": e},
    do=lambda item: item.payload["v"],
)


def generated(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """n elements made on the fly; ``keys`` overrides some keys, ``fail_at`` breaks the source."""
    keys = params.get("keys", {})
    for i in range(int(params["n"])):
        if i == params.get("fail_at"):
            raise RuntimeError(f"the source broke at element {i}")
        payload: Any = {"i": i}
        if i in params.get("bad_payload", ()):
            payload = {"i": i, "when": datetime.datetime(2026, 1, 1)}
        yield {"key": keys.get(str(i), f"g{i:06d}"), "payload": payload}


FanOut(
    "t_generated",
    over=generated,
    key=lambda e: e["key"],
    payload=lambda e: e["payload"],
    do=lambda item: item.payload["i"],
)


# The definitions of the other test areas register themselves when imported.
from .fanouts_chaos import *  # noqa: E402, F401, F403
from .fanouts_group import *  # noqa: E402, F401, F403
from .fanouts_phase import *  # noqa: E402, F401, F403
from .fanouts_pools import *  # noqa: E402, F401, F403
from .fanouts_rq import *  # noqa: E402, F401, F403
from .fanouts_slots import *  # noqa: E402, F401, F403
from .fanouts_spend import *  # noqa: E402, F401, F403
from .fanouts_stuck import *  # noqa: E402, F401, F403
