"""A worker process's threads serve every open run of their queue, not one run at a time."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.models import ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.rq.support import executions, finished_run, item, keys, started_call
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def test_many_small_runs_are_served_at_once_by_one_worker_process_threads(
    processes: Any, tmp_path: Path
) -> None:
    processes.workers(1, FANOUT_WORKER_THREADS=6)
    go = tmp_path / "go"
    params = {"n": 3, "block_key": "r00000", "block_file": str(go)}
    definition = get_definition("rq_single")
    runs = [definition.start(params, f"single-{i}", executor="rq", wait=False) for i in range(6)]
    ids = [run.pk for run in runs]
    assert len(set(ids)) == 6

    def running_at_once() -> set[int]:
        # Each run's first item blocks until `go` exists: a run counts once its handler runs.
        busy = set(
            Execution.objects.filter(run_id__in=ids, ended__isnull=True).values_list(
                "run_id", flat=True
            )
        )
        return busy if busy == set(ids) else set()

    try:
        wait_until(running_at_once, 60, "all 6 runs to have an item running at once")
        # max_parallel=1 still holds in each run, while the process serves all of them.
        assert all(
            ItemClaim.objects.filter(run_id=i, status=ItemStatus.RUNNING).count() == 1 for i in ids
        )
    finally:
        go.touch()
    for run_id in ids:
        run = finished_run(run_id)
        assert run.status == RunStatus.SUCCEEDED, run.error
        assert executions(run_id) == Counter({k: 1 for k in keys(3)})
    assert len(set(Execution.objects.filter(run_id__in=ids).values_list("worker", flat=True))) == 1


def test_a_worker_stopped_with_sigterm_records_the_finished_items_of_its_batch_before_releasing(
    processes: Any, tmp_path: Path
) -> None:
    grace = 1.0
    [victim] = processes.workers(1, FANOUT_STOP_GRACE_SECONDS=grace)
    go = tmp_path / "go"
    params = {"n": 6, "delay": 0.05, "block_key": "r00002", "block_file": str(go)}
    run = get_definition("rq_batched").start(params, executor="rq", wait=False)
    started_call(run.pk, "r00002")
    wait_until(
        lambda: (
            Execution.objects.filter(
                run_id=run.pk, key__in=["r00000", "r00001"], ended__isnull=False
            ).count()
            == 2
        ),
        30,
        "the batch's first two items to finish",
    )
    # The three were claimed together: the first two wait to be recorded with the third.
    batch = {item(run.pk, k).claim_token for k in keys(3)}
    assert len(batch) == 1 and None not in batch
    assert {item(run.pk, k).status for k in keys(3)} == {ItemStatus.RUNNING}

    victim.signal(signal.SIGTERM)  # r00002 outlasts the grace period
    assert victim.wait(timeout=grace + 30) == 0

    assert [item(run.pk, k).status for k in keys(3)] == [
        ItemStatus.SUCCEEDED,
        ItemStatus.SUCCEEDED,
        ItemStatus.PENDING,
    ]
    processes.workers(1)
    go.touch()
    run = finished_run(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    # What finished before the stop never ran again; only what never finished did.
    assert executions(run.pk) == Counter({k: 1 for k in keys(6)} | {"r00002": 2})


def test_a_thread_whose_run_ended_serves_the_next_run_while_the_run_is_joined(
    processes: Any, tmp_path: Path
) -> None:
    # One thread: it must not sit in a run's join while another run has an admissible item.
    processes.workers(1, FANOUT_WORKER_THREADS=1)
    go = tmp_path / "go"
    params = {"n": 1, "block_key": "r00000", "block_file": str(go)}
    slow = get_definition("rq_slow_join").start(params, "slow-join", executor="rq", wait=False)
    started_call(slow.pk, "r00000")
    other = get_definition("rq_single").start({"n": 1}, "next", executor="rq", wait=False)
    go.touch()

    other = finished_run(other.pk)
    slow = finished_run(slow.pk, timeout=60)
    assert slow.status == RunStatus.SUCCEEDED, slow.error
    assert other.status == RunStatus.SUCCEEDED, other.error
    assert slow.join_runs == 1
    # The other run's item started while the slow run was being joined, not after.
    assert item(other.pk, "r00000").started_at < slow.finished_at
    assert other.finished_at < slow.finished_at
