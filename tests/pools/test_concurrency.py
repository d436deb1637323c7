"""A pool's max_concurrency holds across processes and runs, counted from live leases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from fanout.claim import ClaimResult, claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run, resume
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from tests.procs import finish, other_sessions, wait_until
from tests.testapp.fanouts_pools import BUSY_POOL, KILL_POOL
from tests.testapp.models import Execution

from .ledger import max_in_flight, processes, spans
from .workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)

# The handler's sleep where throughput is measured; long enough that the per-item cost of
# claiming and recording (a few queries) does not dominate it on a loaded machine.
HANDLER_SECONDS = 0.3
# The handler's sleep where only limits and fairness are measured.
SHORT_SECONDS = 0.1


def run_fanout(name: str, run_key: str, workers: int, **params: object) -> list[str]:
    args = ["run_fanout", name, "--run-key", run_key, "--workers", str(workers)]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    return args


def all_succeed(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        code, out, err = finish(proc, timeout=60)
        assert code == 0, f"worker process exited {code}:\n{out}\n{err}"


def test_a_pool_of_three_never_has_more_than_three_in_flight_and_stays_busy_across_processes(
    workers: Workers,
) -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    n = 36
    # Two threads a process: no process can hold all three slots, so processes must share them.
    command = run_fanout("pools_busy", "busy", 2, n=n, sleep=HANDLER_SECONDS)

    all_succeed(workers([command] * 4))

    run = BatchRun.objects.get(run_key="busy")
    assert run.status == RunStatus.SUCCEEDED
    calls = spans(run_id=run.pk)
    assert Counter(c.key for c in calls) == {f"k{i:05d}": 1 for i in range(n)}
    assert len(processes(calls)) >= 2
    assert max_in_flight(calls) <= 3
    # Kept busy: items per second against what three slots of HANDLER_SECONDS allow.
    elapsed = max(c.ended for c in calls) - min(c.started for c in calls)
    throughput_ratio = (n / elapsed) / (3 / HANDLER_SECONDS)
    print(f"max in flight {max_in_flight(calls)}, throughput ratio {throughput_ratio:.2f}")
    assert throughput_ratio >= 0.6


def test_two_runs_sharing_a_pool_never_exceed_it_together_and_both_progress(
    workers: Workers,
) -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    n = 30

    all_succeed(
        workers(
            [
                run_fanout("pools_busy", "shared-a", 5, n=n, sleep=SHORT_SECONDS),
                run_fanout("pools_busy", "shared-b", 5, n=n, sleep=SHORT_SECONDS),
            ]
        )
    )

    a, b = (BatchRun.objects.get(run_key=k) for k in ("shared-a", "shared-b"))
    assert a.status == b.status == RunStatus.SUCCEEDED
    calls_a, calls_b = spans(run_id=a.pk), spans(run_id=b.pk)
    assert len(calls_a) == len(calls_b) == n
    assert max_in_flight(calls_a + calls_b) <= 3
    # Neither run finishes before the other starts ...
    assert max(c.ended for c in calls_a) > min(c.started for c in calls_b)
    assert max(c.ended for c in calls_b) > min(c.started for c in calls_a)
    # ... and while both are active, each gets a fair part of the pool, not the leftovers.
    overlap_start = max(min(c.started for c in calls_a), min(c.started for c in calls_b))
    overlap_end = min(max(c.ended for c in calls_a), max(c.ended for c in calls_b))
    during = [
        sum(overlap_start <= c.started < overlap_end for c in calls) for calls in (calls_a, calls_b)
    ]
    print(f"items started while both runs were active: {during}")
    assert min(during) >= n // 3


def test_a_run_that_arrives_at_a_pool_another_run_fills_gets_its_share_at_once(
    workers: Workers,
) -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    n = 40
    (first,), go_first = workers.ready(
        [run_fanout("pools_busy", "early", 5, n=n, sleep=SHORT_SECONDS)]
    )
    (late,), go_late = workers.ready(
        [run_fanout("pools_busy", "late", 5, n=n, sleep=SHORT_SECONDS)]
    )
    go_first()
    wait_until(
        lambda: (
            ItemClaim.objects.filter(run__run_key="early", status=ItemStatus.RUNNING).count() == 3
        ),
        30,
        "the early run to fill the pool",
    )
    go_late()
    all_succeed([first, late])

    early, later = (BatchRun.objects.get(run_key=k) for k in ("early", "late"))
    calls_early, calls_late = spans(run_id=early.pk), spans(run_id=later.pk)
    assert max_in_flight(calls_early + calls_late) <= 3
    # The late run is not left the early run's leftovers: it runs while the early one still has
    # most of its items to go, and keeps running beside it.
    late_start = min(c.started for c in calls_late)
    early_to_go = sum(c.started > late_start for c in calls_early)
    early_end = max(c.ended for c in calls_early)
    late_beside = sum(c.started < early_end for c in calls_late)
    print(
        f"early items still to start when the late run began: {early_to_go}/{n}; "
        f"late items run beside the early run: {late_beside}"
    )
    assert early_to_go >= n // 4
    assert late_beside >= n // 4


def race_to_claim(runs: list[int], pool: str, owner: str) -> dict[int, ClaimResult]:
    """One claimer per run, each on its own connection, all let go at the same instant."""
    barrier = threading.Barrier(len(runs))
    results: dict[int, ClaimResult] = {}

    def race(run_id: int) -> None:
        try:
            ItemClaim.objects.exists()  # connect first: the race is the claim itself
            barrier.wait(10)
            results[run_id] = claim(run_id, owner, 1, 30, 3, pool)
        finally:
            connection.close()

    threads = [threading.Thread(target=race, args=(run_id,)) for run_id in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == len(runs), "a claimer failed"
    return results


def test_claimers_of_many_runs_racing_for_one_pool_admit_no_more_than_its_limit() -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    definition = get_definition("pools_busy")
    runs = [prepare_run(definition, {"n": 3}, f"race-{i}").pk for i in range(8)]

    for round_no in range(3):
        results = race_to_claim(runs, BUSY_POOL, f"racer-{round_no}")

        admitted = {run_id: r for run_id, r in results.items() if r.items}
        assert len(admitted) == 3, f"round {round_no}: {len(admitted)} claims admitted"
        assert ItemClaim.objects.filter(pool=BUSY_POOL, status=ItemStatus.RUNNING).count() == 3
        # Free the pool for the next round, as the owners would by recording their outcomes.
        for run_id, result in admitted.items():
            outcomes = [ExecutionOutcome(i.pk, i.key, SUCCEEDED) for i in result.items]
            record(run_id, result.token, outcomes, "collect")


def test_a_killed_worker_holds_its_slot_until_its_lease_expires_then_the_pool_admits_again(
    workers: Workers, tmp_path: Path
) -> None:
    CapacityPool.objects.create(name=KILL_POOL, max_concurrency=1)
    release = tmp_path / "release"
    (proc,) = workers([run_fanout("pools_kill", "killed", 1, n=3, block_file=str(release))])
    # Another run waits on the same pool; the test claims its items by hand.
    other = prepare_run(get_definition("pools_kill"), {"n": 2}, "waiting")
    first = wait_until(
        lambda: Execution.objects.filter(pool=KILL_POOL).first(), 30, "the first item to start"
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    # Once its sessions are gone, no renewal of the dead worker's can still be landing.
    wait_until(lambda: other_sessions() == 0, 10, "the dead worker's sessions to end")
    held = ItemClaim.objects.get(run__run_key="killed", key=first.key)
    assert held.status == ItemStatus.RUNNING

    # Claim the other run's items in the same pool until it admits one; note the refusals.
    refused_while_live = 0
    while True:
        result = claim(other.pk, "probe", 1, 30, 3, KILL_POOL)
        checked = timezone.now()
        if result.items:
            break
        assert result.reason == f"{KILL_POOL}: pool full (1/1)"
        refused_while_live += checked < held.lease_expires_at
        assert checked < held.lease_expires_at + timedelta(seconds=10), "the slot never freed"

    assert refused_while_live > 0, "no claim was tried while the dead worker's lease was live"
    (taken,) = result.items
    admitted_at = ItemClaim.objects.get(pk=taken.pk).claimed_at
    # The dead worker's lease was not renewed, and its slot was given away only once it ended:
    # its item went back to pending with the crash counted.
    given_back = ItemClaim.objects.get(pk=held.pk)
    assert (given_back.status, given_back.crashes) == (ItemStatus.PENDING, 1)
    assert admitted_at >= held.lease_expires_at
    assert taken.pool == KILL_POOL
    record(other.pk, result.token, [ExecutionOutcome(taken.pk, taken.key, SUCCEEDED)], "collect")

    # Any worker then finishes the killed run: the crash used no attempt.
    release.touch()
    killed, handle = resume(held.run_id, executor="inline", workers=2)
    assert handle is not None
    try:
        handle.join(timeout=30)
        assert not handle.alive, "the resumed run did not finish"
    finally:
        handle.stop.set()
        handle.join(timeout=10)
    killed.refresh_from_db()
    assert killed.status == RunStatus.SUCCEEDED
    item = ItemClaim.objects.get(pk=held.pk)
    assert (item.status, item.attempt, item.crashes) == (ItemStatus.SUCCEEDED, 1, 1)
    assert Counter(Execution.objects.filter(run_id=killed.pk).values_list("key", flat=True)) == {
        "k00000": 2,
        "k00001": 1,
        "k00002": 1,
    }
