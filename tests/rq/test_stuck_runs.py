"""No run waits forever: runs whose workers went away move on.

A compensating run whose running items lost their workers finishes with nobody watching,
every succeeded item undone once.
"""

from __future__ import annotations

import signal
import uuid
from collections import Counter
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.recover import cancel_run
from tests.procs import other_sessions, wait_until
from tests.rq.support import describe_runs
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"FANOUT_SUPERVISE_SECONDS": 1, "FANOUT_JOIN_LEASE_SECONDS": 2}


def kill(workers: list[Any]) -> None:
    for worker in workers:
        worker.signal(signal.SIGKILL)
        worker.wait(timeout=10)


def until_status(run_id: int, status: str, timeout: float) -> BatchRun:
    try:
        return wait_until(
            lambda: BatchRun.objects.filter(pk=run_id, status=status).first(),
            timeout,
            f"run {run_id} to be {status}",
            every=0.1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe_runs()}") from None


def assert_no_slot_held(run_id: int) -> None:
    run = BatchRun.objects.get(pk=run_id)
    assert (run.in_flight, run.compensating) == (0, 0)
    assert not CapacityPool.objects.exclude(in_flight=0).exists()


def test_a_compensation_whose_running_items_lost_their_workers_ends_compensated(
    processes: Any,
) -> None:
    old = processes.workers(2, **FAST)
    run = get_definition("comp_reverse").start({"n": 40, "sleep": 2}, executor="rq", wait=False)
    items = ItemClaim.objects.filter(run=run)
    wait_until(
        lambda: (
            items.filter(status=ItemStatus.SUCCEEDED).count() >= 8
            and items.filter(status=ItemStatus.RUNNING).exists()
        ),
        90,
        "8 items done and some running",
    )
    kill(old)
    done = set(items.filter(status=ItemStatus.SUCCEEDED).values_list("key", flat=True))
    cut_off = set(items.filter(status=ItemStatus.RUNNING).values_list("key", flat=True))
    assert cut_off
    cancel_run(run, "undo it all", compensate=True)

    processes.workers(2, **FAST)
    run = until_status(run.pk, RunStatus.COMPENSATED, 90)

    assert set(items.filter(status=ItemStatus.COMPENSATED).values_list("key", flat=True)) == done
    undone = Counter(
        Execution.objects.filter(run_id=run.pk, key__startswith="undo:").values_list(
            "key", flat=True
        )
    )
    assert undone == Counter({f"undo:{k}": 1 for k in done})
    # The items whose workers died mid-call are not run forward again: they are cancelled,
    # their crash counted, their slots given back.
    lost = {i.key: i for i in items.filter(key__in=cut_off)}
    assert {(i.status, i.crashes) for i in lost.values()} == {(ItemStatus.CANCELLED, 1)}
    assert_no_slot_held(run.pk)


def test_cancelling_a_run_with_compensation_cancels_its_child_runs() -> None:
    definition = get_definition("stuck_comp_spawner")
    run = prepare_run(definition, {"n": 2, "child_sleep": 5}, uuid.uuid4().hex)
    handle = dispatch(run, definition, "inline", workers=2)
    assert handle is not None
    children = BatchRun.objects.filter(parent_item__run=run)
    wait_until(
        lambda: Execution.objects.filter(run_id__in=children.values("pk")).count() >= 2,
        30,
        "the child runs' items to start",
    )

    cancel_run(run, "undo it all", compensate=True)
    handle.join(60)
    run = until_status(run.pk, RunStatus.COMPENSATED, 60)

    assert sorted(children.values_list("status", flat=True)) == [RunStatus.CANCELLED] * 2
    assert set(run.items.values_list("status", "error_class")) == {
        (ItemStatus.FAILED, "ChildRunFailed")
    }
    assert_no_slot_held(run.pk)
    wait_until(lambda: other_sessions() == 0, 30, "the child runs' threads to end")
