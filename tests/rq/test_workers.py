"""Items run on real `rqworker` processes: exactly once, across workers, parents and crashes."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fanout.conf import conf
from fanout.definition import get_definition
from fanout.models import BatchRun, ItemStatus, RunStatus
from tests.procs import other_sessions, wait_until
from tests.rq.support import (
    assert_succeeded_once_each,
    calls,
    drain_jobs,
    executions,
    finished_run,
    item,
    keys,
    pending,
    queued,
    report,
    started_call,
    workers_that_ran,
)
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

JSON = ["--serializer", "rq.serializers.JSONSerializer"]


def test_every_item_runs_exactly_once_across_two_rqworker_processes_and_the_run_joins_once(
    processes: Any,
) -> None:
    workers = processes.workers(2)
    parent = processes.manage(
        ["run_fanout", "rq_items", "--param", "n=400", "--param", "spread=2"]
        + ["--max-parallel", "16", "--executor", "rq", "--json"]
    )

    code, log = parent.finish(timeout=120)

    assert code == 0, log
    printed = report(parent.stdout())
    assert printed["status"] == RunStatus.SUCCEEDED
    assert printed["definition"] == "rq_items"
    assert printed["counts"] == {
        "pending": 0,
        "running": 0,
        "succeeded": 400,
        "failed": 0,
        "cancelled": 0,
    }
    assert printed["failed"] == []
    assert printed["join_result"] == {"items": 400, "succeeded": 400}
    assert printed["error"] == ""
    run = assert_succeeded_once_each(printed["run_id"], 400)
    assert run.executor == "rq"
    # Both workers took part: the items were spread over processes, not run by one. (Every
    # call waits until two processes have started one, so a worker that is slow to start is
    # waited for; a dispatch that gave the whole run to one process fails the run instead.
    # The run's 16 slots are more than one process's 8 threads can hold while they wait.)
    assert workers_that_ran(run.pk) == {w.pid for w in workers}


def test_two_parents_of_the_same_run_at_once_make_one_run_and_run_no_item_twice(
    processes: Any,
) -> None:
    processes.workers(2)
    args = ["run_fanout", "rq_items", "--param", "n=80", "--param", "delay=0.005"]
    args += ["--run-key", "rq-two-parents", "--executor", "rq", "--json"]

    parents = processes.racing([args, args])

    results = [p.finish(timeout=120) for p in parents]
    for code, log in results:
        assert code == 0, log
    reports = [report(p.stdout()) for p in parents]
    assert {r["run_id"] for r in reports} == {BatchRun.objects.get(run_key="rq-two-parents").pk}
    assert BatchRun.objects.count() == 1
    assert all(r["status"] == RunStatus.SUCCEEDED for r in reports)
    assert_succeeded_once_each(reports[0]["run_id"], 80)


def test_a_worker_killed_mid_item_has_its_item_reclaimed_by_another_worker_after_its_lease(
    processes: Any, tmp_path: Path
) -> None:
    workers = processes.workers(2)
    lease = get_definition("rq_crash").lease_seconds
    params = {"n": 40, "delay": 0.02, "block_key": "r00005", "block_file": str(tmp_path / "no")}
    run = get_definition("rq_crash").start(params, executor="rq", wait=False)

    first = started_call(run.pk, "r00005")
    victim = next(w for w in workers if w.pid == int(first.worker))
    survivor = next(w for w in workers if w is not victim)
    assert pending(run.pk) > 0  # the run is mid-way: there is still work to hand out
    lease_live_until = item(run.pk, "r00005").lease_expires_at
    victim.signal(signal.SIGKILL)  # the worker's whole process group, no goodbye
    killed_at = time.time()
    victim.wait(timeout=10)

    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_runs == 1
    counts = executions(run.pk)
    # Every item the killed worker ran (on any of its threads) but had not yet recorded ran
    # again: those it was running, and any whose handler had just returned; no other.
    mine = Execution.objects.filter(run_id=run.pk, worker=str(victim.pid))
    died = {c.key for c in mine if ended_elsewhere(run.pk, c.key, victim.pid)}
    assert "r00005" in died
    assert counts == Counter({k: 1 for k in keys(40)} | dict.fromkeys(died, 2))
    dead, again = calls(run.pk, "r00005")
    assert dead.ended is None  # the killed call never ended
    assert int(again.worker) == survivor.pid
    # Reclaimed only once the dead owner's lease had run out, not at once.
    assert again.started > killed_at
    assert again.started >= lease_live_until.timestamp() >= first.started + lease - 1
    reclaimed = item(run.pk, "r00005")
    assert (reclaimed.status, reclaimed.attempt, reclaimed.crashes) == (
        ItemStatus.SUCCEEDED,
        1,  # a crash is not the handler's fault: the single attempt was not used up
        1,
    )


def test_a_worker_killed_mid_batch_loses_nothing_and_reruns_only_its_unrecorded_items(
    processes: Any, tmp_path: Path
) -> None:
    [victim] = processes.workers(1)
    params = {"n": 9, "delay": 0.05, "block_key": "r00004", "block_file": str(tmp_path / "no")}
    run = get_definition("rq_batched_crash").start(params, executor="rq", wait=False)
    # Batches of 3: r00000-r00002 were recorded by the claim that took r00003-r00005; r00003
    # finished but waits to be recorded with its batch, r00004 is running.
    started_call(run.pk, "r00004")
    second = {item(run.pk, k).claim_token for k in keys(6)[3:]}
    assert len(second) == 1 and None not in second
    victim.signal(signal.SIGKILL)  # mid-batch, no goodbye
    victim.wait(timeout=10)

    assert [item(run.pk, k).status for k in keys(9)] == [
        *[ItemStatus.SUCCEEDED] * 3,
        *[ItemStatus.RUNNING] * 3,
        *[ItemStatus.PENDING] * 3,
    ]
    processes.workers(1)
    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_result == {"items": 9, "succeeded": 9}
    # What was committed never ran again; the batch in hand ran again, once.
    assert executions(run.pk) == Counter({k: 1 for k in keys(9)} | {"r00003": 2, "r00004": 2})
    again = [item(run.pk, k) for k in keys(6)[3:]]
    assert [(i.status, i.attempt, i.crashes) for i in again] == [(ItemStatus.SUCCEEDED, 1, 1)] * 3
    assert BatchRun.objects.get(pk=run.pk).in_flight == 0


# The project's worker class, and RQ's forking Worker, where the drain runs in a work horse in a
# process group of its own. A stop reaches the drain thread when the job's main thread next
# polls for it: every 0.1 s in FanoutWorker, every second (through Redis) in a work horse.
WORKER_CLASSES = {"FanoutWorker": [], "forking rq.Worker": ["--worker-class", "rq.Worker", *JSON]}
# (0.05 s: a handler whose thread passed its stop check as the request came in.)
STOP_LATENCY = {"FanoutWorker": 0.05, "forking rq.Worker": 2.0}


def ended_elsewhere(run_id: int, key: str, pid: int) -> bool:
    """Whether the item's recorded outcome is another process's than ``pid``'s."""
    return item(run_id, key).result.get("pid") != pid


def stop_requested_at(redis: Any, worker_name: str) -> float:
    """When the worker took its stop request, by its own record (the signal reaches it later
    than it was sent, and later still on a busy machine)."""
    from datetime import UTC

    from rq.utils import utcparse

    raw = wait_until(
        lambda: redis.hget(f"rq:worker:{worker_name}", "shutdown_requested_date"),
        10,
        "the worker to take the stop request",
    )
    return utcparse(raw.decode()).replace(tzinfo=UTC).timestamp()


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _sigterm_mid_item(
    processes: Any, tmp_path: Path, worker_args: list[str], n: int = 30, **settings: float
) -> tuple[Any, Any, BatchRun, Path, int]:
    """Two workers, a run whose item r00003 blocks on a file; SIGTERM the worker running it.

    Return the stopped worker, the other one, the run, the file that lets r00003 go and the
    pid of the process that runs r00003 (the worker, or its work horse).
    """
    workers = processes.workers(2, args=worker_args, **settings)
    go = tmp_path / "go"
    params = {"n": n, "delay": 0.05, "block_key": "r00003", "block_file": str(go)}
    run = get_definition("rq_items").start(params, executor="rq", wait=False)
    runner = int(started_call(run.pk, "r00003").worker)
    owner = runner if any(w.pid == runner for w in workers) else _parent_pid(runner)
    victim = next(w for w in workers if w.pid == owner)
    survivor = next(w for w in workers if w is not victim)
    victim.signal(signal.SIGTERM)  # its process group: a forked work horse is not in it
    return victim, survivor, run, go, runner


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_worker_stopped_with_sigterm_lets_its_item_finish_within_the_grace_period(
    processes: Any, redis: Any, tmp_path: Path, worker_class: str
) -> None:
    victim, survivor, run, go, runner = _sigterm_mid_item(
        processes, tmp_path, WORKER_CLASSES[worker_class], n=400
    )
    stopped_at = stop_requested_at(redis, victim.name)
    held = item(run.pk, "r00003")
    assert held.status == ItemStatus.RUNNING  # not released: it may still finish

    go.touch()  # the handler finishes well within the grace period
    assert victim.wait(timeout=conf.STOP_GRACE_SECONDS + 5) == 0
    assert pending(run.pk) > 0  # it left the rest of the run to the other worker

    finished = item(run.pk, "r00003")
    assert (finished.status, finished.attempt, finished.crashes) == (ItemStatus.SUCCEEDED, 1, 0)
    assert finished.claim_token is None and finished.lease_expires_at is None
    assert finished.owner == held.owner
    # A stopping worker claims nothing more: nothing started there after SIGTERM.
    assert not Execution.objects.filter(
        run_id=run.pk,
        worker__in=[str(victim.pid), str(runner)],
        started__gt=stopped_at + STOP_LATENCY[worker_class],
    ).exists()
    finished_run(run.pk)
    assert_succeeded_once_each(run.pk, 400)
    assert survivor.proc.poll() is None


@pytest.mark.parametrize("worker_class", WORKER_CLASSES)
def test_a_worker_stopped_with_sigterm_releases_an_item_that_outlasts_the_grace_period(
    processes: Any, tmp_path: Path, worker_class: str
) -> None:
    grace = 3.0  # shorter than the default 10 s, to keep the test short
    victim, survivor, run, go, runner = _sigterm_mid_item(
        processes, tmp_path, WORKER_CLASSES[worker_class], FANOUT_STOP_GRACE_SECONDS=grace
    )
    stopped_at = time.monotonic()
    lease = get_definition("rq_items").lease_seconds
    assert lease > grace + 5, "the lease must outlive the grace period for this test to tell"

    def let_go() -> float | None:
        current = item(run.pk, "r00003")
        if current.status == ItemStatus.SUCCEEDED or current.claim_token is None:
            return time.monotonic() - stopped_at
        return None

    # Released at the end of the grace period, never left leased until its lease runs out.
    after = wait_until(let_go, grace + 5, "the stopping worker to release its item", every=0.02)
    assert after >= grace - 0.5, f"released after {after:.1f}s, before the grace period ended"
    assert victim.wait(timeout=5) == 0

    # The survivor runs it again: wait for the run to finish before reading the ledger.
    run = finished_run(run.pk)
    dead, again = calls(run.pk, "r00003")
    assert dead.ended is None  # it never finished on the stopped worker
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_runs == 1
    assert executions(run.pk) == Counter({k: 1 for k in keys(30)} | {"r00003": 2})
    assert int(again.worker) not in (victim.pid, runner)
    released = item(run.pk, "r00003")
    # A release is not an attempt, nor a crash.
    assert (released.status, released.attempt, released.crashes) == (ItemStatus.SUCCEEDED, 1, 0)
    assert again.attempt == 1
    go.touch()


def test_idle_workers_keep_no_database_connection_open_between_drain_jobs(
    processes: Any, redis: Any
) -> None:
    processes.workers(2)
    run = get_definition("rq_items").start({"n": 40}, executor="rq", wait=False)
    finished_run(run.pk)

    def drained() -> bool:
        statuses = [redis.hget(f"rq:job:{job}", "status") for job in drain_jobs(redis, run.pk)]
        return not queued(redis) and all(s == b"finished" for s in statuses)

    wait_until(drained, 30, "every drain job of the run to finish")

    # Connections are closed around every job, in every thread that used one.
    wait_until(lambda: other_sessions() == 0, 10, "the idle workers' connections to close")


def test_a_drain_job_that_spends_its_time_budget_re_enqueues_itself_until_the_run_is_done(
    processes: Any, redis: Any
) -> None:
    processes.workers(2, FANOUT_DRAIN_SECONDS=0.5)
    run = get_definition("rq_items").start({"n": 60, "delay": 0.03}, executor="rq", wait=False)
    first_jobs = drain_jobs(redis, run.pk)
    assert len(first_jobs) == 2

    # No parent waits on this run: only drain jobs coming back after their budget finish it.
    run = finished_run(run.pk, timeout=60)

    assert_succeeded_once_each(run.pk, 60)
    assert len(drain_jobs(redis, run.pk) - first_jobs) >= 2


def test_a_workers_log_names_the_queue_once_before_each_drain_job(processes: Any) -> None:
    (worker,) = processes.workers(1)
    parent = processes.manage(["run_fanout", "rq_items", "--param", "n=2", "--executor", "rq"])

    code, log = parent.finish(timeout=120)

    assert code == 0, log
    lines = [line for line in worker.output().splitlines() if " drain run " in line]
    assert lines, worker.output()
    # RQ puts the queue's name ("fanout:") before the job's description itself.
    assert all("fanout: fanout:" not in line for line in lines), lines
    assert any(": fanout: drain run " in line for line in lines), lines
