"""Real processes racing on real rows: parents starting one run, workers sharing it, a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from django.utils import timezone

from fanout.actions import release
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests import procs
from tests.conftest import executions, items, keys
from tests.testapp.models import Execution, Observation

pytestmark = pytest.mark.django_db(transaction=True)

Children = list[subprocess.Popen[str]]


def start_together(
    children: Children, tmp_path: Path, env: dict[str, str], *commands: list[str]
) -> list[subprocess.Popen[str]]:
    """Start one child per command and release them at the same instant."""
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{n}" for n in range(len(commands))]
    started = [
        procs.spawn_manage(c, env, ready=r, go=go) for c, r in zip(commands, ready, strict=True)
    ]
    children.extend(started)
    procs.release_together(started, ready, go)
    return started


def finish_all(started: list[subprocess.Popen[str]]) -> list[dict]:
    """Wait for every child; each must exit 0 and print its --json report last."""
    reports = []
    for proc in started:
        code, out, err = procs.finish(proc, timeout=90)
        assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
        assert "database is locked" not in err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def worker_processes(run_id: int) -> set[str]:
    workers = Execution.objects.filter(run_id=run_id).values_list("worker", flat=True)
    return {w.split(":")[0] for w in workers}


def test_two_parents_starting_the_same_run_at_once_make_one_run_with_one_item_each(
    children: Children, tmp_path: Path, database_url: str
) -> None:
    command = ["run_fanout", "t_ledger", "--run-key", "same", "--param", "n=200"]
    command += ["--workers", "2", "--json"]

    reports = finish_all(
        start_together(children, tmp_path, procs.child_env(database_url), command, command)
    )

    run = BatchRun.objects.get()
    assert run.run_key == "same"
    assert {r["run_id"] for r in reports} == {run.pk}
    assert [r["status"] for r in reports] == ["succeeded", "succeeded"]
    assert run.total_items == 200
    assert sorted(ItemClaim.objects.filter(run=run).values_list("key", flat=True)) == keys(200)
    assert executions(run.pk) == dict.fromkeys(keys(200), 1)
    assert run.join_runs == 1
    assert len(Observation.objects.filter(name="join")) == 1


def racing_workers(run_key: str, sleep: float = 0.01) -> list[str]:
    return [
        "run_fanout",
        "t_ledger",
        "--run-key",
        run_key,
        "--param",
        "n=300",
        "--param",
        f"sleep={sleep}",
        "--workers",
        "4",
        "--max-parallel",
        "12",
        "--json",
    ]


def assert_every_item_ran_once(run_key: str, reports: list[dict]) -> None:
    run = BatchRun.objects.get(run_key=run_key)
    assert run.status == RunStatus.SUCCEEDED
    assert [r["status"] for r in reports] == ["succeeded"] * 3
    assert all(r["run_id"] == run.pk for r in reports)
    assert executions(run.pk) == dict.fromkeys(keys(300), 1)
    assert run.join_runs == 1
    assert list(Observation.objects.filter(name="join").values_list("value", flat=True)) == [
        {"count": 300, "statuses": ["succeeded"]}
    ]
    assert run.join_result == {"count": 300, "succeeded": 300, "sum": sum(range(300))}
    # The race was real: the work was shared between processes.
    assert len(worker_processes(run.pk)) >= 2


def test_worker_processes_started_together_execute_every_item_exactly_once(
    children: Children, tmp_path: Path, database_url: str
) -> None:
    command = racing_workers("together")

    started = start_together(
        children, tmp_path, procs.child_env(database_url), command, command, command
    )

    assert_every_item_ran_once("together", finish_all(started))


def test_worker_processes_joining_a_run_midway_execute_every_item_exactly_once(
    children: Children, database_url: str
) -> None:
    env = procs.child_env(database_url)
    # Items of 100 ms: the first process alone needs 7.5 s for the rest, longer than the
    # others take to start on a loaded machine (at 10 ms it finished before they joined).
    command = racing_workers("midway", sleep=0.1)
    first = procs.spawn_manage(command, env)
    children.append(first)
    procs.wait_until(
        lambda: Execution.objects.filter(ended__isnull=False).count() >= 20,
        30,
        "the first process to get going",
    )

    others = [procs.spawn_manage(command, env) for _ in range(2)]
    children.extend(others)

    reports = finish_all([first, *others])
    assert_every_item_ran_once("midway", reports)


def test_an_item_whose_process_was_killed_is_reclaimed_after_its_lease_and_run_once_more(
    children: Children, tmp_path: Path, database_url: str
) -> None:
    definition = get_definition("t_crash")
    assert (definition.lease_seconds, definition.max_attempts) == (2, 1)
    env = procs.child_env(database_url)
    # One worker: items run in order, and k00005 blocks on its first execution.
    parent = procs.spawn_manage(
        [
            "run_fanout",
            "t_crash",
            "--param",
            "n=10",
            "--param",
            "block_first=k00005",
            "--param",
            f"block_file={tmp_path / 'never'}",
            "--workers",
            "1",
        ],
        env,
    )
    children.append(parent)
    started = procs.wait_until(
        lambda: Execution.objects.filter(key="k00005").first(), 30, "k00005 to start"
    )
    run_id = started.run_id

    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)

    before = items(run_id)
    assert {k: r.status for k, r in before.items()} == {
        **dict.fromkeys(keys(5), ItemStatus.SUCCEEDED),
        "k00005": ItemStatus.RUNNING,
        **dict.fromkeys(keys(10)[6:], ItemStatus.PENDING),
    }
    lease = before["k00005"].lease_expires_at
    # While the lease lasts, nobody may take the item: not even a claimer with room for all.
    assert not ItemClaim.objects.claimable(timezone.now()).filter(key="k00005").exists()
    probe = claim(run_id, "probe", 10, 30, definition.crash_budget, None)
    assert timezone.now() < lease, "too slow to observe the live lease"
    assert sorted(i.key for i in probe.items) == keys(10)[6:]
    assert release([probe.token]) == 4
    assert items(run_id)["k00005"].status == ItemStatus.RUNNING

    procs.wait_until(
        lambda: ItemClaim.objects.claimable(timezone.now()).filter(key="k00005").exists(),
        10,
        "the dead owner's lease to run out",
    )
    done = procs.manage(["run_fanout", "--resume", str(run_id), "--workers", "2", "--json"], env)

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "succeeded"
    after = items(run_id)
    assert set(r.status for r in after.values()) == {ItemStatus.SUCCEEDED}
    # Reclaimed without using the single attempt; counted as a crash.
    assert (after["k00005"].attempt, after["k00005"].crashes) == (1, 1)
    assert executions(run_id) == {**dict.fromkeys(keys(10), 1), "k00005": 2}
    first_run = Execution.objects.filter(key="k00005").order_by("pk").first()
    assert first_run is not None and first_run.ended is None  # it died mid-item
    # Items that succeeded before the kill were not run again, nor touched.
    for key in keys(5):
        assert after[key].finished_at == before[key].finished_at
    run = BatchRun.objects.get(pk=run_id)
    assert (run.status, run.join_runs) == (RunStatus.SUCCEEDED, 1)
