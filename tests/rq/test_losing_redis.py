"""Redis may lose everything at any moment: PostgreSQL keeps the run, and it still finishes."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.queues import default_slots
from tests.procs import other_sessions, wait_until
from tests.rq.support import (
    assert_succeeded_once_each,
    drain_jobs,
    executions,
    keys,
    pending,
    queued,
    report,
    slot_keys,
    started_call,
)

pytestmark = pytest.mark.django_db(transaction=True)


def _run_of(parent: Any) -> BatchRun:
    def created() -> BatchRun | None:
        if parent.proc.poll() is not None:
            raise AssertionError(f"the parent exited early:\n{parent.output()}")
        return BatchRun.objects.first()

    return wait_until(created, 30, "the parent to create its run")


def test_a_flush_of_redis_mid_run_is_healed_by_the_waiting_parent_and_every_item_runs_once(
    processes: Any, redis: Any, tmp_path: Path
) -> None:
    workers = processes.workers(2)
    go = tmp_path / "go"
    parent = processes.manage(
        ["run_fanout", "rq_items", "--param", "n=100", "--param", "delay=0.01"]
        + ["--param", "block_key=r00010", "--param", f"block_file={go}"]
        + ["--executor", "rq", "--json"]
    )
    run = _run_of(parent)
    started_call(run.pk, "r00010")  # an item is in flight ...
    assert pending(run.pk) > 0  # ... and others wait for their turn
    before = drain_jobs(redis, run.pk)
    assert before

    redis.flushdb()  # FLUSHALL, as far as this session's Redis database goes
    assert drain_jobs(redis, run.pk) == set()

    # The run's drain slots are taken again: by its live drain, whose heartbeat re-takes its
    # key, or by new jobs that the waiting parent (or a worker's supervisor) enqueues. A job
    # whose threads find no admissible item (the run is at max_parallel) leaves after a
    # moment, so not every slot need be taken at once.
    slots = default_slots(run, get_definition("rq_items"))
    wait_until(
        lambda: 1 <= len(slot_keys(redis, run.pk)) <= slots, 20, "the slots to be taken again"
    )
    go.touch()
    code, log = parent.finish(timeout=90)

    assert code == 0, log
    assert report(parent.stdout())["status"] == RunStatus.SUCCEEDED
    assert_succeeded_once_each(run.pk, 100)
    assert all(w.proc.poll() is None for w in workers)


def test_resume_finishes_a_run_after_redis_lost_everything_and_every_worker_died(
    processes: Any, redis: Any, tmp_path: Path
) -> None:
    first = processes.workers(2)
    parent = processes.manage(
        ["run_fanout", "rq_crash", "--param", "n=60", "--param", "delay=0.02"]
        + ["--param", "block_key=r00004", "--param", f"block_file={tmp_path / 'never'}"]
        + ["--executor", "rq", "--no-wait"]
    )
    assert parent.finish(timeout=60)[0] == 0, parent.output()
    run = BatchRun.objects.get(pk=int(parent.stdout()))
    started_call(run.pk, "r00004")
    for worker in first:
        worker.signal(signal.SIGKILL)
    for worker in first:
        worker.wait(timeout=10)
    # A COMMIT the workers sent just before they died still completes on the server: wait for
    # their sessions to end before reading what they left.
    wait_until(lambda: not other_sessions(), 10, "the dead workers' sessions to end")
    redis.flushdb()
    # Items claimed when their worker died, outcome not committed: they alone may run again.
    in_flight = set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING).values_list("key", flat=True)
    )
    assert "r00004" in in_flight
    assert pending(run.pk) > 0
    ran_before = executions(run.pk)

    processes.workers(2)
    assert drain_jobs(redis, run.pk) == set() and queued(redis) == []  # nothing will wake them
    resumed = processes.manage(["run_fanout", "--resume", str(run.pk), "--json"])
    code, log = resumed.finish(timeout=90)

    assert code == 0, log
    printed = report(resumed.stdout())
    assert printed["run_id"] == run.pk
    assert printed["status"] == RunStatus.SUCCEEDED
    assert printed["counts"]["succeeded"] == 60
    run.refresh_from_db()
    assert run.join_runs == 1
    expected = {k: 1 for k in keys(60)} | {k: ran_before[k] + 1 for k in in_flight}
    assert executions(run.pk) == Counter(expected)
    assert set(ItemClaim.objects.filter(run=run).values_list("status", "attempt")) == {
        (ItemStatus.SUCCEEDED, 1)
    }
    assert set(
        ItemClaim.objects.filter(run=run, key__in=in_flight).values_list("crashes", flat=True)
    ) == {1}


def test_a_waiting_parent_rides_out_a_redis_restart_and_reports_the_finished_run(
    processes: Any, redis_relay: Any, tmp_path: Path
) -> None:
    processes.workers(2)  # they reach Redis directly; only the parent goes through the relay
    go = tmp_path / "go"
    parent = processes.manage(
        ["run_fanout", "rq_items", "--param", "n=30", "--param", "delay=1.5"]
        + ["--param", "block_key=r00002", "--param", f"block_file={go}"]
        + ["--executor", "rq", "--json"],
        env={**processes.env, "REDIS_URL": redis_relay.url},
    )
    run = _run_of(parent)
    started_call(run.pk, "r00002")

    redis_relay.cut()  # Redis goes away for the parent
    # While items wait their turn, the parent keeps tending the run: it tries Redis again.
    wait_until(
        lambda: parent.proc.poll() is not None or redis_relay.dropped >= 2,
        30,
        "the parent to try Redis again and again (or die)",
    )
    redis_relay.restore()
    go.touch()
    code, log = parent.finish(timeout=60)

    assert code == 0, log
    assert report(parent.stdout())["status"] == RunStatus.SUCCEEDED
    assert_succeeded_once_each(run.pk, 30)
