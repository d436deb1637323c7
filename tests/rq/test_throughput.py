"""What the worker class costs: RQ's forking Worker against FanoutWorker, on the same runs.

Printed, not asserted: timings depend on the machine. Only correctness is asserted.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.queues import get_queue
from tests.procs import wait_until
from tests.rq.support import finished_run

pytestmark = pytest.mark.django_db(transaction=True)

ITEMS = 2000
EMPTY_JOBS = 100

JSON = ["--serializer", "rq.serializers.JSONSerializer"]
WORKER_CLASSES = {
    "rq.Worker (fork per job)": ["--worker-class", "rq.Worker", *JSON],
    "fanout.rq.FanoutWorker": ["--worker-class", "fanout.rq.FanoutWorker", *JSON],
}


def _timed_run(run_key: str) -> tuple[float, BatchRun]:
    """Seconds from dispatch to join of a no-op run of ITEMS items in batches of 50."""
    definition = get_definition("rq_noop")
    run = prepare_run(definition, {"n": ITEMS}, run_key, executor="rq")
    started = time.monotonic()
    dispatch(run, definition, "rq")
    run = finished_run(run.pk, timeout=120, every=0.01)
    return time.monotonic() - started, run


def _timed_empty_jobs(redis: Any, run: BatchRun) -> float:
    """Seconds to run EMPTY_JOBS drain jobs of a finished run: the cost of a job, nothing else."""
    queue = get_queue(get_definition(run.definition))
    ids = [f"fanout-drain-{run.pk}-0-{uuid.uuid4().hex[:12]}" for _ in range(EMPTY_JOBS)]
    started = time.monotonic()
    for job_id in ids:
        queue.enqueue_call("fanout.rq.drain_job", args=(run.pk, 0), job_id=job_id)

    def all_finished() -> bool:
        with redis.pipeline() as pipe:
            for job_id in ids:
                pipe.hget(f"rq:job:{job_id}", "status")
            return all(status == b"finished" for status in pipe.execute())

    wait_until(all_finished, 120, "the empty drain jobs to finish", every=0.01)
    return time.monotonic() - started


def test_the_fork_cost_of_rq_worker_against_fanout_worker_is_measured_on_correct_runs(
    processes: Any, redis: Any, capsys: Any
) -> None:
    figures = []
    for label, args in WORKER_CLASSES.items():
        workers = processes.workers(2, args=args)
        elapsed, run = _timed_run(f"rq-throughput-{label}")

        assert run.status == RunStatus.SUCCEEDED, run.error
        assert run.join_runs == 1
        assert run.join_result == {"items": ITEMS, "succeeded": ITEMS}
        claims = ItemClaim.objects.filter(run=run)
        assert set(claims.values_list("status", "attempt", "crashes")) == {
            (ItemStatus.SUCCEEDED, 1, 0)
        }
        assert all(c.result == c.index for c in claims.only("result", "index"))
        # Where the items ran: in a forked work horse, or in the worker process itself.
        owners = {int(owner.split(":")[1]) for owner in claims.values_list("owner", flat=True)}
        pids = {w.pid for w in workers}
        if "fork" in label:
            assert owners.isdisjoint(pids)
        else:
            assert owners <= pids

        per_job = _timed_empty_jobs(redis, run) / EMPTY_JOBS
        figures.append((label, ITEMS / elapsed, elapsed, per_job))
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(timeout=30) == 0

    with capsys.disabled():
        print(f"\nRQ worker classes, 2 workers, a no-op run of {ITEMS} items in batches of 50:")
        for label, rate, elapsed, per_job in figures:
            print(
                f"  {label:28} {rate:8.0f} items/s ({elapsed:.2f} s); "
                f"{per_job * 1000:6.1f} ms per empty drain job (2 workers, {EMPTY_JOBS} jobs)"
            )
