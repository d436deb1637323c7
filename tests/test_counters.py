"""The counters are the rows: no path gives up a slot that no row holds, and a counter pushed
below zero is an error the database raises, never a zero that hides the drift."""

from __future__ import annotations

import subprocess
import uuid
from typing import Any

import pytest
from django.db import IntegrityError

from fanout.claim import claim
from fanout.clock import db_now_plus
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus
from fanout.transitions import release, release_expired
from tests.procs import child_env, finish, spawn_manage, wait_until
from tests.testapp.fanouts_pools import KILL_POOL
from tests.testapp.fanouts_slots import SLOTS_POOL
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

LEASE, CRASH_BUDGET = 30, 1


def prepared(name: str, **params: Any) -> BatchRun:
    return prepare_run(get_definition(name), params, f"{name}-{uuid.uuid4().hex[:8]}")


def expire(items: Any) -> None:
    """The items' owner died: their leases ran out a minute ago, by the database's clock."""
    assert items.update(lease_expires_at=db_now_plus(-60))


def assert_counters_are_the_rows(*runs: BatchRun, pool: str = SLOTS_POOL) -> None:
    for run in runs:
        run.refresh_from_db()
        held = ItemClaim.objects.filter(run=run).holding_run_slots().count()
        assert run.in_flight == held, f"run {run.pk}: counter {run.in_flight}, rows {held}"
    counted = CapacityPool.objects.get(name=pool).in_flight
    held = ItemClaim.objects.filter(pool=pool).running().count()
    assert counted == held, f"pool {pool}: counter {counted}, rows {held}"


def test_an_item_failed_past_its_crash_budget_after_a_reaper_freed_its_slot_frees_no_other() -> (
    None
):
    # One pool of 2 slots shared by a run whose worker keeps dying and a run of good items.
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=2)
    crashing, good = prepared("slots_pool", n=1), prepared("slots_pool", n=6)
    dying = claim(crashing.pk, "dead-worker", 1, LEASE, CRASH_BUDGET, SLOTS_POOL)
    assert len(dying.items) == 1
    # Its earlier owners died as often as the budget allows: the next death is one too many.
    ItemClaim.objects.filter(run=crashing).update(crashes=CRASH_BUDGET)
    assert len(claim(good.pk, "good-worker", 1, LEASE, CRASH_BUDGET, SLOTS_POOL).items) == 1
    expire(ItemClaim.objects.filter(run=crashing))

    # The good run's claimer finds the pool full of a dead worker's lease and gives it back
    # (as claim() does); the item goes back to pending with its crash counted.
    assert release_expired(ItemClaim.objects.filter(pool=SLOTS_POOL)) == 1
    assert_counters_are_the_rows(crashing, good)
    # The crashing run's next claim finds the item past its budget and fails it.
    lost = claim(crashing.pk, "next-worker", 1, LEASE, CRASH_BUDGET, SLOTS_POOL)
    assert lost.crashed_out == 1 and lost.items == []
    assert ItemClaim.objects.get(run=crashing).status == ItemStatus.FAILED
    assert_counters_are_the_rows(crashing, good)

    # The good run may fill the pool, and no more.
    more = claim(good.pk, "good-worker-2", 6, LEASE, CRASH_BUDGET, SLOTS_POOL)
    assert len(more.items) == 1
    assert ItemClaim.objects.filter(pool=SLOTS_POOL).running().count() == 2
    assert_counters_are_the_rows(crashing, good)


def test_a_release_that_would_push_a_drifted_counter_below_zero_is_refused_by_the_database() -> (
    None
):
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=2)
    run = prepared("slots_pool", n=1)
    taken = claim(run.pk, "worker", 1, LEASE, CRASH_BUDGET, SLOTS_POOL)
    assert taken.token is not None
    # A counter that drifted low: it says nothing runs while a row holds a slot.
    CapacityPool.objects.filter(name=SLOTS_POOL).update(in_flight=0)

    with pytest.raises(IntegrityError):
        release(ItemClaim.objects.held(taken.token))

    # The release was rolled back whole: the item still holds its slot, the drift stays visible.
    assert ItemClaim.objects.filter(run=run).running().count() == 1
    assert CapacityPool.objects.get(name=SLOTS_POOL).in_flight == 0


def run_fanout(name: str, run_key: str, workers: int, **params: object) -> list[str]:
    args = ["run_fanout", name, "--run-key", run_key, "--workers", str(workers)]
    for key, value in params.items():
        args += ["--param", f"{key}={value}"]
    return args


def most_at_once(run: BatchRun) -> int:
    """The most handler calls of the run that overlapped in time (from the ledger)."""
    edges = []
    for started, ended in Execution.objects.filter(run_id=run.pk).values_list("started", "ended"):
        edges += [(started, 1), (ended if ended is not None else float("inf"), -1)]
    peak = now = 0
    for _, step in sorted(edges):
        now += step
        peak = max(peak, now)
    return peak


def test_good_items_sharing_a_pool_with_items_that_kill_their_workers_stay_within_its_limit(
    database_url: str, children: list[subprocess.Popen[str]]
) -> None:
    # A pool of 2 shared by a run of good items on 3 threads and a run whose every item kills
    # its worker process (crash budget 1, 2 s leases), whose workers are restarted as they die:
    # the good run's claimers give the dead workers' slots back, the crashing run's fail the
    # items past their budget.
    CapacityPool.objects.create(name=KILL_POOL, max_concurrency=2)
    env = child_env(database_url)
    good = spawn_manage(run_fanout("pools_kill", "good", 3, n=100, sleep=0.3), env)
    children.append(good)
    crashing = run_fanout("pools_crashing", "crashing", 1, n=8, exit=1)
    crashers: list[subprocess.Popen[str]] = []

    def crashing_run_over() -> bool:
        run = BatchRun.objects.filter(run_key="crashing").first()
        return run is not None and run.status not in ("pending", "running")

    def good_run_over_restarting_crashers() -> bool:
        if good.poll() is not None:
            return True
        alive = [p for p in crashers if p.poll() is None]
        if len(alive) < 2 and not crashing_run_over():
            crashers.append(spawn_manage(crashing, env))
            children.append(crashers[-1])
        return False

    wait_until(good_run_over_restarting_crashers, 240, "the good run to finish", every=0.1)
    code, out, err = finish(good)
    assert code == 0, (out, err)

    good_run = BatchRun.objects.get(run_key="good")
    assert good_run.status == "succeeded"
    assert len(crashers) >= 2, "no worker of the crashing run died while the good run ran"
    assert most_at_once(good_run) <= 2
    for proc in crashers:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert_counters_are_the_rows(good_run, BatchRun.objects.get(run_key="crashing"), pool=KILL_POOL)
