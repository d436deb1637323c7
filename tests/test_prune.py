"""Retention: fanout_prune and FANOUT_RETENTION delete what they should, and nothing else."""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from fanout.actions import cancel_run, retry_failed
from fanout.audit import measure_pool
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, RunStatus
from fanout.prune import prune_by_retention, prune_tree, take
from fanout.record import record
from fanout.supervise import Supervisor
from fanout.transitions import SUCCEEDED, ExecutionOutcome
from tests.conftest import prepare, start
from tests.procs import child_env, spawn_manage, wait_until
from tests.test_nesting import wait_tree

pytestmark = pytest.mark.django_db(transaction=True)


def age(runs: list[BatchRun], days: float) -> None:
    """Say the runs finished ``days`` ago, by the database's clock (supervision's hold of
    them, when they were open, long over too)."""
    interval = (
        "clock_timestamp() - make_interval(secs => %s)"
        if connection.vendor == "postgresql"
        else "UTC_TIMESTAMP(6) - INTERVAL %s SECOND"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE fanout_batchrun SET finished_at = {interval}, tended_until = NULL WHERE id IN "
            f"({', '.join(['%s'] * len(runs))})",
            [days * 86400, *[r.pk for r in runs]],
        )


def finished_tree(days: float, **params: Any) -> list[BatchRun]:
    root = get_definition("nest_orgs").start(
        {"orgs": 2, "repos": 2, "files": 2, **params}, run_key=uuid.uuid4().hex
    )
    runs = wait_tree(root)
    age(runs, days)
    return runs


def finished_run(name: str, days: float, **params: Any) -> BatchRun:
    run = start(name, params, run_key=uuid.uuid4().hex)
    assert run.is_terminal, run.status
    age([run], days)
    return run


def prune(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("fanout_prune", *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def left(runs: list[BatchRun]) -> set[int]:
    return set(BatchRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("pk", flat=True))


def test_a_prune_deletes_old_finished_trees_whole_and_leaves_open_and_young_runs_alone() -> None:
    old_tree = finished_tree(days=40)
    old_failed = finished_run("t_collect", 40, n=6, flaky={"k00001": 1}, permanent=["k00002"])
    young = finished_run("t_ledger", 10, n=4)
    still_open = prepare("t_ledger", {"n": 3}, run_key=uuid.uuid4().hex)
    age([still_open], 40)  # an open run is never touched, whatever its dates say
    assert ItemAttempt.objects.filter(item__run=old_failed).exists()

    report = prune("--older-than", "30d")

    gone = [*old_tree, old_failed]
    assert left(gone) == set()
    assert not ItemClaim.objects.filter(run_id__in=[r.pk for r in gone]).exists()
    assert not ItemAttempt.objects.filter(item__run_id__in=[r.pk for r in gone]).exists()
    assert left([young, still_open]) == {young.pk, still_open.pk}
    assert ItemClaim.objects.filter(run=young).count() == 4
    assert sorted(report["roots"]) == sorted([old_tree[0].pk, old_failed.pk])
    assert report["runs"] == len(old_tree) + 1
    assert report["items"] == sum(r.total_items for r in gone)


def test_a_tree_with_an_open_descendant_is_not_touched() -> None:
    runs = finished_tree(days=40)
    child = runs[1]
    BatchRun.objects.filter(pk=child.pk).update(status=RunStatus.RUNNING)  # reopened, say

    report = prune("--older-than", "30d")

    assert report["roots"] == []
    assert left(runs) == {r.pk for r in runs}


def test_a_child_run_is_never_pruned_apart_from_its_root() -> None:
    runs = finished_tree(days=40)
    age(runs[:1], 5)  # the root is young; its children are old

    assert prune("--older-than", "30d")["roots"] == []
    assert left(runs) == {r.pk for r in runs}


def test_dry_run_says_what_would_go_and_deletes_nothing() -> None:
    runs = finished_tree(days=40)
    items = ItemClaim.objects.filter(run_id__in=[r.pk for r in runs]).count()

    report = prune("--older-than", "30d", "--dry-run")

    assert report["dry_run"] is True
    assert report["runs"] == len(runs) and report["items"] == items
    assert left(runs) == {r.pk for r in runs}
    assert ItemClaim.objects.filter(run_id__in=[r.pk for r in runs]).count() == items


def test_status_and_definition_narrow_what_goes() -> None:
    failed = finished_run("t_collect", 40, n=3, permanent=["k00000"])
    succeeded = finished_run("t_ledger", 40, n=3)
    other = finished_run("t_quiet", 40, n=3)

    assert prune("--older-than", "30d", "--status", "failed")["roots"] == [failed.pk]
    assert prune("--older-than", "30d", "--definition", "t_quiet")["roots"] == [other.pk]
    assert left([succeeded]) == {succeeded.pk}


def test_keep_runs_keeps_each_runs_row_and_counts_and_deletes_only_items() -> None:
    run = finished_run("t_collect", 40, n=5, permanent=["k00003"])
    result = run.join_result

    report = prune("--older-than", "30d", "--keep-runs")

    run.refresh_from_db()
    assert report["items"] == 5 and report["runs"] == 1
    assert not ItemClaim.objects.filter(run=run).exists()
    assert run.item_counts == {"succeeded": 4, "failed": 1}
    assert run.join_result == result and run.status == RunStatus.FAILED
    # Nothing is left to prune of it: a second prune finds nothing, the row stays.
    assert prune("--older-than", "30d", "--keep-runs")["roots"] == []
    assert prune("--older-than", "30d")["roots"] == [run.pk]
    assert left([run]) == set()


@pytest.mark.parametrize(
    "bad", [["--older-than", "soon"], ["--older-than", "3d", "--status", "running"]]
)
def test_a_bad_age_or_an_open_status_is_refused_with_a_clear_error(bad: list[str]) -> None:
    finished_run("t_ledger", 40, n=2)
    with pytest.raises(CommandError) as refused:
        call_command("fanout_prune", *bad)
    assert "30d" in str(refused.value) or "finished run" in str(refused.value)
    assert BatchRun.objects.count() == 1


def test_a_prune_killed_midway_leaves_its_root_and_the_next_prune_finishes_the_tree(
    database_url: str, children: list[subprocess.Popen[str]]
) -> None:
    runs = finished_tree(days=40, orgs=3, repos=3, files=6)
    assert len(runs) > 10
    proc = spawn_manage(
        ["fanout_prune", "--older-than", "30d", "--batch", "1"], child_env(database_url)
    )
    children.append(proc)
    ids = [r.pk for r in runs]
    # Killed once some leaves are gone but the root is still there.
    wait_until(lambda: len(left(runs)) < len(runs) - 2, 60, "a part of the tree to go")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert runs[0].pk in left(runs)
    # Every item left belongs to a run that is left: leaves went first, whole.
    assert set(ItemClaim.objects.filter(run_id__in=ids).values_list("run_id", flat=True)) <= left(
        runs
    )
    # Its pruner is dead: another one skips the tree until its hold runs out.
    assert prune("--older-than", "30d")["held"] == [runs[0].pk]
    BatchRun.objects.filter(pk=runs[0].pk).update(tended_until=None)

    report = prune("--older-than", "30d")

    assert report["roots"] == [runs[0].pk]
    assert left(runs) == set()
    assert not ItemClaim.objects.filter(run_id__in=ids).exists()


def test_the_supervisor_prunes_by_fanout_retention_and_only_when_it_is_set(settings: Any) -> None:
    old = finished_run("t_ledger", 40, n=3)
    old_failed = finished_run("t_collect", 40, n=3, permanent=["k00000"])

    settings.FANOUT_RETENTION = {}
    assert prune_by_retention().roots == []
    settings.FANOUT_RETENTION = {"succeeded": "30d", "failed": "90d"}
    settings.FANOUT_SUPERVISE_SECONDS = 0.2
    supervisor = Supervisor().start()
    try:
        wait_until(lambda: not left([old]), 30, "the supervisor to prune the old success")
    finally:
        supervisor.stop()
    assert left([old_failed]) == {old_failed.pk}  # failures are kept 90 days


def test_a_cancelled_run_whose_items_still_run_is_not_pruned_until_they_are_recorded() -> None:
    CapacityPool.objects.create(name="prune-pool", max_concurrency=2)
    run = prepare("t_ledger", {"n": 4}, run_key=uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(pool="prune-pool")
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    taken = claim(run.pk, "worker-1", 2, 60.0, 3, None)
    assert len(taken.items) == 2 and taken.token is not None
    cancel_run(run, "stopped by the test")  # its two running items go on
    age([run], 40)

    assert prune("--older-than", "30d")["roots"] == []
    with transaction.atomic():
        assert measure_pool("prune-pool") == (2, 2)
    # Once their outcomes are recorded the slots are given back, and the run may go.
    outcomes = [ExecutionOutcome(i.pk, i.key, SUCCEEDED, pool=i.pool) for i in taken.items]
    record(run.pk, taken.token, outcomes, run.failure_policy)
    with transaction.atomic():
        assert measure_pool("prune-pool") == (0, 0)
    assert prune("--older-than", "30d")["roots"] == [run.pk]


def test_a_prune_stops_at_a_run_reopened_under_it() -> None:
    run = finished_run("t_collect", 40, n=6, permanent=["k00001"])
    assert take(run.pk)
    retry_failed(run)  # an operator reopens it after the pruner took it

    pruned = prune_tree(run.pk, batch=2)

    assert pruned.items == 0
    assert ItemClaim.objects.filter(run=run).count() == 6
