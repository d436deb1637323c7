"""Trees of runs and compensations survive workers killed mid-way, with no command."""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.rq.support import finished_run
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"FANOUT_SUPERVISE_SECONDS": 1, "FANOUT_JOIN_LEASE_SECONDS": 2}


def kill(workers: list[Any]) -> None:
    for worker in workers:
        worker.signal(signal.SIGKILL)
        worker.wait(timeout=10)


def test_a_tree_of_runs_finishes_after_every_worker_is_killed_mid_way(processes: Any) -> None:
    old = processes.workers(2, **FAST)
    root = get_definition("nest_orgs").start(
        {"orgs": 2, "repos": 2, "files": 4, "sleep": 0.2}, executor="rq", wait=False
    )
    leaves = Execution.objects.filter(key__startswith="f")
    wait_until(lambda: leaves.count() >= 4, 60, "leaves to run")
    kill(old)
    recorded = set(
        ItemClaim.objects.filter(
            run__definition="nest_files", status=ItemStatus.SUCCEEDED
        ).values_list("run_id", "key")
    )

    processes.workers(2, **FAST)
    root = finished_run(root.pk, timeout=120)

    assert root.status == RunStatus.SUCCEEDED, root.error
    assert root.join_result == {"items": 2, "succeeded": 2}
    # One child per item, at every level: a crash between spawn and record made no second one.
    assert Counter(BatchRun.objects.values_list("definition", flat=True)) == {
        "nest_orgs": 1,
        "nest_repos": 2,
        "nest_files": 4,
    }
    calls = Counter(leaves.values_list("run_id", "key"))
    assert len(calls) == 16
    assert all(calls[leaf] == 1 for leaf in recorded), "a recorded leaf ran again"
    assert max(calls.values()) <= 2


def test_compensations_cut_off_by_killed_workers_are_taken_over_and_done_once(
    processes: Any,
) -> None:
    old = processes.workers(2, **FAST)
    run = get_definition("comp_reverse").start(
        {"n": 12, "failing": ["s00008"], "refund_sleep": 0.4}, executor="rq", wait=False
    )
    undo = Execution.objects.filter(run_id=run.pk, key__startswith="undo:")
    wait_until(lambda: undo.count() >= 2, 60, "compensations to run")
    kill(old)
    done_before = set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.COMPENSATED).values_list(
            "key", flat=True
        )
    )

    processes.workers(2, **FAST)
    run = wait_until(
        lambda: BatchRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATED).first(),
        90,
        "the compensation to finish",
    )

    compensated = set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.COMPENSATED).values_list(
            "key", flat=True
        )
    )
    succeeded_first = set(
        Execution.objects.filter(run_id=run.pk, key__startswith="s", ended__isnull=False)
        .exclude(key="s00008")
        .values_list("key", flat=True)
    )
    assert compensated == succeeded_first
    calls = Counter(k.removeprefix("undo:") for k in undo.values_list("key", flat=True))
    assert set(calls) == compensated
    assert all(calls[k] == 1 for k in done_before), "a recorded compensation ran again"
    # Only a compensation cut off mid-call ran twice.
    for key, n in calls.items():
        if n > 1:
            first = undo.filter(key=f"undo:{key}").order_by("started").first()
            assert first is not None and first.ended is None
