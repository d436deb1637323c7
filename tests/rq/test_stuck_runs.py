"""No run waits forever: runs whose writer, workers or database connection went away move on.

A compensating run whose running items lost their workers, a run whose writer was killed
mid-work-list, and one whose writer lost its database connection all finish with nobody
watching, every item run (and undone) once.
"""

from __future__ import annotations

import signal
import uuid
from collections import Counter
from typing import Any

import pytest
from django.db import DatabaseError, connection

from fanout.actions import cancel_run
from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from tests.procs import other_sessions, wait_until
from tests.rq.support import describe_runs, executions, finished_run
from tests.testapp.fanouts_stuck import stuck_key
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"FANOUT_SUPERVISE_SECONDS": 1, "FANOUT_JOIN_LEASE_SECONDS": 2}
# A work list of 600 elements, written 100 per commit, that pauses 0.3 s every 50.
SLOW_LIST = {"n": 600, "page": 50, "pause": 0.3}


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


def small_chunks(processes: Any) -> dict[str, str]:
    """The environment of a process that writes work lists 100 items per commit."""
    return {
        **processes.env,
        "DJANGO_SETTINGS_MODULE": "tests.rq.writer_settings",
        "FANOUT_MATERIALIZE_CHUNK": "100",
        **{name: str(value) for name, value in FAST.items()},
    }


def write_slowly(processes: Any, run_key: str) -> Any:
    """Start `run_fanout --executor rq --no-wait` on a slow work list: the writer."""
    args = ["run_fanout", "stuck_slow_list", "--executor", "rq", "--no-wait"]
    args += ["--run-key", run_key] + [f"--param={k}={v}" for k, v in SLOW_LIST.items()]
    return processes.manage(args, "writer", env=small_chunks(processes))


def written_in_part(runs: Any) -> BatchRun:
    """Wait until the writer has committed 200 items of the (one) run of ``runs``."""
    return wait_until(
        lambda: runs.filter(materialized_upto__gte=200).first(),
        60,
        "the writer to commit part of the work list",
    )


def terminate_other_sessions() -> None:
    """End every database session but this test's own, as a restart or a proxy would."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(
                "SELECT id FROM information_schema.processlist"
                " WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
            for (session,) in cursor.fetchall():
                try:
                    cursor.execute(f"KILL CONNECTION {int(session)}")
                except DatabaseError:
                    pass  # it ended meanwhile
            return
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def assert_every_item_ran_once(run_id: int) -> None:
    run = finished_run(run_id, timeout=120)
    n = SLOW_LIST["n"]
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_result == {"items": n, "succeeded": n}
    assert executions(run_id) == Counter({stuck_key(i): 1 for i in range(n)})
    assert_no_slot_held(run_id)


def test_a_run_whose_writer_was_killed_mid_work_list_is_written_and_run_by_the_workers(
    processes: Any,
) -> None:
    processes.workers(2, **FAST)
    run_key = uuid.uuid4().hex
    writer = write_slowly(processes, run_key)
    run = written_in_part(BatchRun.objects.filter(run_key=run_key))
    writer.signal(signal.SIGKILL)
    writer.wait(timeout=10)
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert run.materialized_upto < SLOW_LIST["n"], "the writer finished before it was killed"

    assert_every_item_ran_once(run.pk)


def test_a_run_whose_writer_lost_its_database_connection_is_kept_and_finished(
    processes: Any,
) -> None:
    run_key = uuid.uuid4().hex
    writer = write_slowly(processes, run_key)
    run = written_in_part(BatchRun.objects.filter(run_key=run_key))
    terminate_other_sessions()  # the writer's: no worker is up yet
    code = writer.wait(timeout=60)

    assert code != 0, writer.output()
    assert BatchRun.objects.filter(pk=run.pk, status=RunStatus.PENDING).exists(), (
        f"the run was deleted:\n{writer.output()[-2000:]}"
    )
    processes.workers(2, **FAST)
    assert_every_item_ran_once(run.pk)


def spawn_slow_child(
    processes: Any, name: str = "stuck_slow_spawner"
) -> tuple[Any, BatchRun, BatchRun]:
    """Start a worker that writes in small chunks and a run whose item spawns a slow child
    run; return the worker, the run and the child once 200 of its items are written."""
    worker = f"writer-{uuid.uuid4().hex[:8]}"
    args = ["rqworker", "fanout", "--name", worker]
    writer = processes.manage(args, worker, small_chunks(processes))
    wait_until(lambda: processes.redis.exists(f"rq:worker:{worker}"), 60, "the worker to register")
    parent = get_definition(name).start({"child": SLOW_LIST}, executor="rq", wait=False)
    return writer, parent, written_in_part(BatchRun.objects.filter(parent_item__run=parent))


def test_a_child_run_whose_writer_was_killed_mid_work_list_is_written_and_run(
    processes: Any,
) -> None:
    writer, parent, child = spawn_slow_child(processes)
    kill([writer])
    child.refresh_from_db()
    assert child.status == RunStatus.PENDING
    assert child.materialized_upto < SLOW_LIST["n"], "the writer finished before it was killed"

    processes.workers(2, **FAST)
    parent = finished_run(parent.pk, timeout=120)

    assert parent.status == RunStatus.SUCCEEDED, parent.error
    assert BatchRun.objects.filter(parent_item__run=parent).count() == 1
    assert_every_item_ran_once(child.pk)


def test_a_child_run_whose_writer_died_runs_though_its_parent_item_is_not_run_again(
    processes: Any,
) -> None:
    # Nothing runs the parent item again (crash_budget=0) to write the child on its way.
    writer, parent, child = spawn_slow_child(processes, "stuck_slow_spawner_once")
    kill([writer])

    processes.workers(2, **FAST)

    assert_every_item_ran_once(child.pk)
    parent = finished_run(parent.pk, timeout=60)
    assert parent.status == RunStatus.FAILED
    assert parent.items.get().error_class == "WorkerLost"
    assert executions(parent.pk) == Counter({stuck_key(0): 1})


def test_a_child_run_whose_writer_lost_its_database_connection_is_kept_and_its_item_waits(
    processes: Any,
) -> None:
    _, parent, child = spawn_slow_child(processes)
    terminate_other_sessions()  # the worker's, which is writing the child's work list

    processes.workers(1, **FAST)
    parent = finished_run(parent.pk, timeout=120)

    assert parent.status == RunStatus.SUCCEEDED, parent.error
    assert not ItemClaim.objects.filter(run=parent, error_class="SpawnFailed").exists()
    assert list(BatchRun.objects.filter(parent_item__run=parent).values_list("pk", flat=True)) == [
        child.pk
    ]
    assert_every_item_ran_once(child.pk)
