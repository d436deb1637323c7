"""Definitions for the slot, clock and lease tests (imported by fanouts.py).

Their handler writes every call to the Execution ledger when it starts and ends, with the
process id, so a test counts executions per key, knows which process ran each, and measures
how many ran at once.

Params understood by ``timed`` (all optional):
  n      items in the work list (keys s00000, s00001, ...), default 10
  sleep  seconds every handler call takes
  slow   {key: seconds}: the key's first execution takes that long instead
"""

from __future__ import annotations

import os
import time
from typing import Any

from fanout import FanOut, Item

from .ledger import executing

__all__: list[str] = []  # nothing to import: constructing the definitions registers them

SLOTS_POOL = "slots-pool"


def timed(item: Item) -> dict[str, Any]:
    p = item.params
    with executing(item, worker=str(os.getpid())) as first:
        seconds = float(p.get("sleep", 0))
        if first and item.key in p.get("slow", {}):
            seconds = float(p["slow"][item.key])
        if seconds:
            time.sleep(seconds)
        return {"i": item.payload, "pid": os.getpid()}


common: dict[str, Any] = dict(
    over=lambda p: range(int(p.get("n", 10))),
    key=lambda i: f"s{i:05d}",
    do=timed,
    retry_backoff=0.02,
)

FanOut("slots_run", max_parallel=6, lease_seconds=3, **common)
FanOut("slots_pool", pool=SLOTS_POOL, max_parallel=16, lease_seconds=3, **common)
# Workers whose clocks disagree by minutes: a lease far shorter than the skew.
FanOut("slots_skew", max_parallel=6, lease_seconds=4, max_attempts=1, **common)
# A batch whose last item outlives its timeout: only that item may be reclaimed.
FanOut("slots_batch", batch_size=4, max_parallel=4, timeout=1, lease_seconds=1.5, **common)
# Items that outlive a drain job's time budget many times over.
FanOut("slots_long", max_parallel=2, lease_seconds=2, max_attempts=1, **common)


def join_once_blocked(outcomes: Any) -> dict[str, Any]:
    """A join whose first run blocks until ``join_file`` exists; every run is noted with its pid."""
    from pathlib import Path

    from .models import Observation

    seen = list(outcomes)
    first = not Observation.objects.filter(name="join-started").exists()
    Observation.objects.create(name="join-started", value=os.getpid())
    if first:
        release = Path(seen[0].result["params"]["join_file"])
        deadline = time.monotonic() + 60
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"items": len(seen), "succeeded": sum(o.succeeded for o in seen)}


def with_params(item: Item) -> dict[str, Any]:
    return {**timed(item), "params": dict(item.params)}


# A join that a test kills mid-way, on RQ workers.
FanOut(
    "slots_join",
    over=common["over"],
    key=common["key"],
    do=with_params,
    max_parallel=2,
    lease_seconds=2,
    join=join_once_blocked,
)


def fail_some(item: Item) -> dict[str, Any]:
    """Items whose number is in ``failing`` fail for good; the others succeed."""
    from fanout import PermanentError

    result = timed(item)
    if item.payload in item.params.get("failing", ()):
        raise PermanentError(f"item {item.payload} fails")
    return result


thresholds: dict[str, Any] = dict(
    over=common["over"], key=common["key"], do=fail_some, max_parallel=4, max_attempts=1
)
FanOut("slots_max_failures", max_failures=5, failure_policy="collect", **thresholds)
FanOut("slots_failure_rate", max_failure_rate=0.1, failure_policy="tolerate", **thresholds)


# Nested runs, three levels: orgs -> repos -> files. Each handler notes its execution.
def sync_file(item: Item) -> dict[str, Any]:
    """A leaf; ``broken``: [[org, repo, file], ...] fail on their first execution only."""
    from fanout import PermanentError

    from .models import Execution

    timed(item)
    where = [item.params.get("org"), item.params.get("repo"), item.payload]
    first = Execution.objects.filter(run_id=item.run_id, key=item.key).count() == 1
    if first and where in item.params.get("broken", []):
        raise PermanentError(f"file {where} is broken this time")
    return {"file": item.payload}


def sync_repo(item: Item) -> Any:
    timed(item)
    return item.spawn(
        "nest_files",
        params={**item.params, "repo": item.payload, "n": int(item.params.get("files", 3))},
    )


def sync_org(item: Item) -> Any:
    timed(item)
    return item.spawn("nest_repos", params={**item.params, "org": item.payload})


def count_children(outcomes: Any) -> dict[str, Any]:
    seen = list(outcomes)
    return {"items": len(seen), "succeeded": sum(o.succeeded for o in seen)}


nested: dict[str, Any] = dict(
    over=lambda p: range(int(p.get("n", 3))), join=count_children, lease_seconds=3
)
FanOut("nest_files", key=lambda i: f"f{i}", do=sync_file, max_parallel=4, **nested)
FanOut(
    "nest_repos",
    over=lambda p: range(int(p.get("repos", 3))),
    key=lambda i: f"r{i}",
    do=sync_repo,
    max_parallel=2,
    join=count_children,
    lease_seconds=3,
)
FanOut(
    "nest_orgs",
    over=lambda p: range(int(p.get("orgs", 3))),
    key=lambda i: f"o{i}",
    do=sync_org,
    max_parallel=2,
    join=count_children,
    lease_seconds=3,
)


# A group of three different members: a Step with its own attempts, a plain callable, and a
# FanOut that runs as a child run with the group's params.
def send_welcome(item: Item) -> dict[str, Any]:
    timed(item)
    if item.attempt <= int(item.payload.get("email_flaky", 0)):
        raise RuntimeError(f"smtp hiccup on attempt {item.attempt}")
    return {"sent_to": item.payload.get("customer")}


def sync_crm(item: Item) -> dict[str, Any]:
    timed(item)
    if item.payload.get("crm_broken"):
        from fanout import PermanentError

        raise PermanentError("the CRM refused the customer")
    return {"crm": "synced"}


def by_member(outcomes: Any) -> dict[str, Any]:
    return {o.key: o.result for o in outcomes}


def _group(name: str, policy: str) -> None:
    from fanout import Group, Step

    Group(
        name,
        steps={
            "email": Step(send_welcome, max_attempts=5),
            "crm": sync_crm,
            "repos": get_definition("nest_files"),
        },
        failure_policy=policy,
        join=by_member,
        retry_backoff=0.02,
    )


from fanout.definition import get_definition  # noqa: E402

_group("group_onboard", "collect")
_group("group_fail_fast", "fail_fast")
_group("group_tolerate", "tolerate")


# Compensation: charge items, refund the charged ones when the run fails.
def charge(item: Item) -> dict[str, Any]:
    from fanout import PermanentError

    timed(item)
    if item.key in item.params.get("failing", []):
        raise PermanentError(f"{item.key} declined")
    return {"charged": item.key}


def refund(item: Item, result: Any) -> None:
    """Noted in the ledger as "undo:<key>"; ``refund_fail``: {key: n}: its first n calls fail."""
    from .models import Execution

    undone = Execution.objects.create(
        run_id=item.run_id,
        key=f"undo:{item.key}",
        attempt=item.attempt,
        pool=item.pool,
        worker=str(os.getpid()),
        started=time.time(),
    )
    try:
        time.sleep(float(item.params.get("refund_sleep", 0)))
        assert result == {"charged": item.key}, result
        calls = Execution.objects.filter(run_id=item.run_id, key=f"undo:{item.key}").count()
        if calls <= int(item.params.get("refund_fail", {}).get(item.key, 0)):
            raise RuntimeError(f"the refund of {item.key} bounced")
    finally:
        Execution.objects.filter(pk=undone.pk).update(ended=time.time())


charges: dict[str, Any] = dict(
    over=common["over"],
    key=common["key"],
    do=charge,
    compensate=refund,
    retry_backoff=0.02,
    max_attempts=3,
    lease_seconds=3,
)
FanOut("comp_reverse", failure_policy="fail_fast", max_parallel=4, **charges)
FanOut(
    "comp_parallel",
    failure_policy="collect",
    max_parallel=6,
    compensate_order="parallel",
    compensate_max_parallel=2,
    **charges,
)


# At most 2 items per host, however many threads and processes a host has.
FanOut("slots_per_host", max_parallel=12, host_max_parallel=2, lease_seconds=3, **common)
# One item and, counted apart, one compensation per host at a time, out of a budget of 8.
FanOut(
    "comp_per_host",
    failure_policy="collect",
    max_parallel=8,
    host_max_parallel=1,
    compensate_order="parallel",
    compensate_max_parallel=8,
    **charges,
)


def _compensating_group() -> None:
    from fanout import Group, Step

    # Two members that are undone when the group fails, and one that fails it (late).
    Group(
        "group_compensating",
        steps={
            "reserve": Step(charge, compensate=refund),
            "pay": Step(charge, compensate=refund, max_attempts=1),
            "ship": Step(charge),
        },
        failure_policy="fail_fast",
        retry_backoff=0.02,
    )


_compensating_group()


def _cancelled_mid_write(params: dict[str, Any]) -> Any:
    """Yields ``n`` items; at ``cancel_at`` its run is cancelled, as its parent's cancel would."""
    from fanout.actions import cancel_run
    from fanout.models import BatchRun

    for i in range(int(params["n"])):
        if i == int(params["cancel_at"]):
            run = BatchRun.objects.filter(definition="slots_cancelled_mid_write").latest("pk")
            cancel_run(run, "cancelled while its items were written")
        yield i


FanOut("slots_cancelled_mid_write", over=_cancelled_mid_write, do=timed, key=lambda i: f"s{i:05d}")
