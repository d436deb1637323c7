"""Runs that heal themselves: workers take up what nobody carries, with no parent and no command."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.rq.support import executions, finished_run, keys
from tests.testapp.models import Execution, Observation

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"FANOUT_SUPERVISE_SECONDS": 1, "FANOUT_JOIN_LEASE_SECONDS": 2}


def ran(run_id: int) -> int:
    return Execution.objects.filter(run_id=run_id).count()


def assert_recorded_items_ran_once(run_id: int, n: int, recorded: set[str]) -> None:
    """Every item ran; an item whose outcome was recorded before the kill ran exactly once, and
    the others at most twice (a killed worker may have run them, recorded or not)."""
    counts = executions(run_id)
    assert set(counts) == set(keys(n))
    assert {k: counts[k] for k in recorded} == dict.fromkeys(recorded, 1)
    assert max(counts.values()) <= 2


def test_a_deploy_that_kills_every_worker_mid_run_loses_nothing_and_needs_nobody(
    processes: Any,
) -> None:
    old = processes.workers(2, **FAST)
    # What a web view does: start on RQ and return; no parent waits on the run.
    run = get_definition("rq_crash").start({"n": 300, "delay": 0.02}, executor="rq", wait=False)
    wait_until(lambda: ran(run.pk) >= 60, 60, "60 items to run")
    for worker in old:
        worker.signal(signal.SIGKILL)
        worker.wait(timeout=10)
    recorded = set(
        BatchRun.objects.get(pk=run.pk)
        .items.filter(status=ItemStatus.SUCCEEDED)
        .values_list("key", flat=True)
    )
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.RUNNING
    assert recorded, "nothing was recorded before the deploy"

    processes.workers(2, **FAST)
    run = finished_run(run.pk, timeout=90)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_runs == 1
    assert_recorded_items_ran_once(run.pk, 300, recorded)


def test_workers_stopped_for_longer_than_their_leases_finish_the_run_when_they_return(
    processes: Any,
) -> None:
    workers = processes.workers(2, **FAST)
    run = get_definition("rq_crash").start({"n": 200, "delay": 0.02}, executor="rq", wait=False)
    wait_until(lambda: ran(run.pk) >= 40, 60, "40 items to run")
    for worker in workers:
        worker.signal(signal.SIGSTOP)
    lease = get_definition("rq_crash").lease_seconds
    wait_until(
        lambda: not BatchRun.objects.get(pk=run.pk).items.in_flight().exists(),
        lease + 10,
        "every lease to run out",
    )
    for worker in workers:
        worker.signal(signal.SIGCONT)

    run = finished_run(run.pk, timeout=90)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_runs == 1
    counts = executions(run.pk)
    assert set(counts) == set(keys(200))
    assert max(counts.values()) <= 2


def test_a_join_whose_worker_dies_is_taken_over_after_its_lease_and_recorded_once(
    processes: Any, tmp_path: Path
) -> None:
    workers = processes.workers(2, **FAST)
    release = tmp_path / "join-go"
    run = get_definition("slots_join").start(
        {"n": 6, "join_file": str(release)}, executor="rq", wait=False
    )
    first = wait_until(
        lambda: Observation.objects.filter(name="join-started").first(), 60, "the join to start"
    )
    joiner = next(w for w in workers if w.pid == first.value)
    joiner.signal(signal.SIGKILL)
    joiner.wait(timeout=10)

    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_result == {"items": 6, "succeeded": 6}
    starts = list(Observation.objects.filter(name="join-started").values_list("value", flat=True))
    # The join function ran again on the other worker; the run recorded one result.
    assert len(starts) == 2 and starts[1] != joiner.pid
    assert run.join_runs == 2


def test_a_supervisor_that_does_not_know_a_runs_definition_says_its_workers_may_predate_it(
    redis: Any,
) -> None:
    from fanout.supervise import redispatch

    run = get_definition("rq_items").start({"n": 2}, executor="rq", wait=False)
    BatchRun.objects.filter(pk=run.pk).update(definition="sync_not_deployed_yet")
    run.refresh_from_db()

    redispatch(run)

    stalled = BatchRun.objects.get(pk=run.pk).stalled
    # Not only "unknown fan-out; registered definitions: ...", which `run_fanout --list` in the
    # new deploy contradicts: what makes a worker not know it, and what mends it.
    assert "unknown fan-out on host" in stalled
    assert "workers started before it was deployed? restart them" in stalled


def test_a_worker_that_does_not_know_the_definition_says_why_and_the_run_heals_when_fixed(
    processes: Any,
) -> None:
    run = get_definition("rq_items").start({"n": 20}, executor="rq", wait=False)
    # The worker was started from an older deploy: it has never heard of this definition.
    BatchRun.objects.filter(pk=run.pk).update(definition="sync_not_deployed_yet")
    processes.workers(1, **FAST)

    stalled = wait_until(
        lambda: BatchRun.objects.get(pk=run.pk).stalled, 30, "the run to say why it stalls"
    )
    assert "no worker could run 'sync_not_deployed_yet': unknown fan-out on host" in stalled
    assert "workers started before it was deployed?" in stalled
    assert ran(run.pk) == 0

    # The fixed deploy: now the workers know it. The supervisor takes the run up again.
    BatchRun.objects.filter(pk=run.pk).update(definition="rq_items")
    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.stalled == ""
    assert executions(run.pk) == Counter(dict.fromkeys(keys(20), 1))


def test_a_drain_job_that_a_pickle_worker_cannot_read_frees_its_slot_and_says_why(
    processes: Any,
) -> None:
    # A worker started with RQ's defaults (pickle) takes the JSON drain jobs and fails them.
    pickle = ["--serializer", "rq.serializers.DefaultSerializer"]
    bad = processes.worker("fanout", args=["--worker-class", "rq.SimpleWorker", *pickle])
    run = get_definition("rq_items").start({"n": 20}, executor="rq", wait=False)
    # A healthy worker elsewhere (another queue) supervises every run.
    processes.workers(1, "fanout-gpu", **FAST)

    stalled = wait_until(
        lambda: BatchRun.objects.get(pk=run.pk).stalled, 30, "the run to say why it stalls"
    )
    assert "no worker could run 'rq_items': drain job" in stalled
    assert f"failed on worker {bad.name}" in stalled
    assert "FanoutWorker" in stalled

    bad.signal(signal.SIGKILL)
    bad.wait(timeout=10)
    processes.workers(1, **FAST)
    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.stalled == ""
    assert executions(run.pk) == Counter(dict.fromkeys(keys(20), 1))


def test_a_worker_killed_between_dequeue_and_its_first_beat_does_not_hold_the_slot(
    processes: Any, redis: Any
) -> None:
    # One drain slot; the worker that takes its job dies before the job's code runs, so the
    # slot key still carries the minutes a queued job is allowed.
    dying = processes.worker(
        "fanout", args=["--worker-class", "tests.rq.dying_worker.DiesOnDequeue"]
    )
    run = get_definition("rq_items").start(
        {"n": 6}, executor="rq", workers=1, max_parallel=1, wait=False
    )
    dying.wait(timeout=30)
    [job_id] = [redis.get(k) for k in redis.scan_iter(match=f"fanout:drain:{run.pk}:*")]
    assert redis.hget(b"rq:job:" + job_id, "status") == b"started"

    processes.workers(1, **FAST)
    run = finished_run(run.pk, timeout=60)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert executions(run.pk) == Counter(dict.fromkeys(keys(6), 1))


def test_a_drain_job_that_rqs_own_cleanup_failed_is_refilled_without_a_stall(
    transactional_db: Any, redis: Any
) -> None:
    # A worker stopped right after dequeuing leaves its job in RQ's intermediate queue; another
    # worker's maintenance later fails it with this text. Nothing is misconfigured.
    import django_rq
    from rq.serializers import JSONSerializer

    from fanout.rq import FanoutWorker, slot_key
    from fanout.supervise import redispatch

    run = get_definition("rq_items").start({"n": 4}, executor="rq", workers=1, wait=False)
    old = redis.get(slot_key(run.pk, 0)).decode()
    queue = django_rq.get_queue("fanout", serializer=JSONSerializer)
    job = queue.fetch_job(old)
    worker = FanoutWorker([queue], connection=queue.connection)
    worker.handle_job_failure(job, queue, exc_string="Job was stuck in intermediate queue.")
    assert redis.hget(f"rq:job:{old}", "status") == b"failed"

    redispatch(BatchRun.objects.get(pk=run.pk))

    assert BatchRun.objects.get(pk=run.pk).stalled == ""
    new = redis.get(slot_key(run.pk, 0)).decode()
    assert new != old
    assert new in queue.job_ids
