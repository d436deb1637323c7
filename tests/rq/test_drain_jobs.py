"""Drain jobs on Redis: what they carry, when and how many are enqueued, and on which queue."""

from __future__ import annotations

import json
import socket
import zlib
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from rq.job import Job
from rq.serializers import JSONSerializer

from fanout.checks import check_rq
from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.errors import FanoutError
from fanout.models import BatchRun, ItemClaim, ItemStatus
from fanout.queues import default_slots, slot_key
from tests.rq.support import (
    assert_succeeded_once_each,
    drain_jobs,
    finished_run,
    queued,
    slot_keys,
    workers_that_ran,
)
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_drain_job_carries_only_the_run_id_and_its_slot_as_json(redis: Any) -> None:
    definition = get_definition("rq_items")
    run = definition.start({"n": 10}, executor="rq", wait=False)

    jobs = queued(redis)
    assert len(jobs) == default_slots(run, definition) == 2
    slots = set()
    for job_id in jobs:
        raw = redis.hgetall(f"rq:job:{job_id}")
        data = zlib.decompress(raw[b"data"])  # RQ stores the call zlib-compressed
        assert not data.startswith(b"\x80"), "a pickle"
        func, instance, args, kwargs = json.loads(data)
        assert (func, instance, kwargs) == ("fanout.rq.drain_job", None, {})
        assert len(args) == 2 and args[0] == run.pk and isinstance(args[1], int)
        slots.add(args[1])
        # Nothing else in the job's hash is a pickle either.
        assert not any(v.startswith(b"\x80") for v in raw.values())
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
        assert job.func_name == "fanout.rq.drain_job"
        assert list(job.args) == [run.pk, args[1]] and job.kwargs == {}
        assert job.origin == "fanout"
    assert slots == {0, 1}
    assert slot_keys(redis, run.pk) == {slot_key(run.pk, s) for s in slots}


def test_drain_jobs_are_enqueued_only_once_the_dispatching_transaction_commits(
    redis: Any,
) -> None:
    definition = get_definition("rq_items")
    run = prepare_run(definition, {"n": 10}, "rq-after-commit", executor="rq")

    with transaction.atomic():
        dispatch(run, definition, "rq")
        assert queued(redis) == []  # a worker must not look for rows it cannot see yet

    assert len(queued(redis)) == 2


def test_a_dispatch_that_is_rolled_back_leaves_the_slots_free_for_the_next_one(
    redis: Any,
) -> None:
    definition = get_definition("rq_items")
    run = prepare_run(definition, {"n": 10}, "rq-rolled-back", executor="rq")

    with pytest.raises(RuntimeError), transaction.atomic():
        dispatch(run, definition, "rq")
        raise RuntimeError("the request failed after dispatching")
    assert queued(redis) == []

    dispatch(run, definition, "rq")  # e.g. the waiting parent's next re-dispatch
    assert len(queued(redis)) == 2


def test_two_parents_dispatching_the_same_run_at_once_enqueue_no_more_jobs_than_its_slots(
    processes: Any, redis: Any
) -> None:
    args = ["run_fanout", "rq_items", "--param", "n=50", "--run-key", "rq-bounded"]
    args += ["--executor", "rq", "--no-wait", "--json"]

    parents = processes.racing([args, args, args])

    for parent in parents:
        code, log = parent.finish(timeout=60)
        assert code == 0, log
    run = BatchRun.objects.get(run_key="rq-bounded")
    assert [json.loads(p.stdout()) for p in parents] == [{"run_id": run.pk}] * 3
    assert len(queued(redis)) == 2
    assert len(drain_jobs(redis, run.pk)) == 2
    assert len(slot_keys(redis, run.pk)) == 2
    # Dispatching again while the slots are held adds nothing.
    for _ in range(3):
        dispatch(run, get_definition("rq_items"), "rq")
    assert len(queued(redis)) == 2


def test_a_definition_that_requires_a_gpu_runs_only_on_workers_of_the_gpu_queue(
    processes: Any, redis: Any, settings: Any
) -> None:
    if "fanout-gpu" not in settings.RQ_QUEUES:
        pytest.skip("RQ_QUEUES has no fanout-gpu queue")
    run = get_definition("rq_gpu").start({"n": 20, "delay": 0.01}, executor="rq", wait=False)
    assert len(queued(redis, "fanout-gpu")) == 2
    assert queued(redis, "fanout") == []

    plain = processes.worker("fanout")
    gpu = processes.worker("fanout-gpu")

    finished_run(run.pk)
    assert_succeeded_once_each(run.pk, 20)
    assert workers_that_ran(run.pk) == {gpu.pid}
    assert plain.proc.poll() is None


def test_a_definition_whose_capability_queue_is_not_configured_is_refused_naming_the_queue(
    settings: Any,
) -> None:
    settings.RQ_QUEUES = {k: v for k, v in settings.RQ_QUEUES.items() if k != "fanout-gpu"}

    with pytest.raises(FanoutError, match=r"RQ_QUEUES has no queue 'fanout-gpu'"):
        get_definition("rq_gpu").start({"n": 3}, executor="rq", wait=False)
    with pytest.raises(CommandError, match="fanout-gpu") as refused:
        call_command("run_fanout", "rq_gpu", "--executor", "rq", "--no-wait")
    assert refused.value.returncode == 2


def test_run_fanout_no_wait_prints_the_run_id_at_once_and_resume_attaches_and_finishes_it(
    processes: Any, redis: Any
) -> None:
    parent = processes.manage(
        ["run_fanout", "rq_items", "--param", "n=50", "--executor", "rq", "--no-wait"]
    )
    code, log = parent.finish(timeout=60)

    assert code == 0, log
    run = BatchRun.objects.get()
    assert parent.stdout().strip() == str(run.pk)
    # It did not wait: no worker exists yet, and nothing has run.
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.PENDING).count() == 50
    assert not Execution.objects.exists()
    assert len(queued(redis)) == 2

    processes.workers(2)
    attached = processes.manage(["run_fanout", "--resume", str(run.pk)])
    code, log = attached.finish(timeout=60)

    assert code == 0, log
    out = attached.stdout()
    assert f"run {run.pk} succeeded: 50/50 (100%)" in out  # the progress display
    assert f"run {run.pk} (rq_items, key {run.run_key}): SUCCEEDED" in out
    assert_succeeded_once_each(run.pk, 50)


def test_manage_py_check_warns_without_failing_when_redis_is_unreachable(processes: Any) -> None:
    # A port that is bound but not listening: connecting to it is refused at once.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        env = {**processes.env, "REDIS_URL": f"redis://127.0.0.1:{port}/0"}
        check = processes.manage(["check"], env=env)
        code, log = check.finish(timeout=60)

    assert code == 0, log
    assert "fanout.W002" in log + check.stdout()
    assert f"127.0.0.1:{port}" in log + check.stdout()


def test_the_system_check_warns_when_rq_queues_has_no_fanout_queue(settings: Any) -> None:
    settings.RQ_QUEUES = {k: v for k, v in settings.RQ_QUEUES.items() if k != "fanout"}

    assert [w.id for w in check_rq()] == ["fanout.W001"]

    settings.RQ_QUEUES = {**settings.RQ_QUEUES, "fanout": {"URL": settings.REDIS_URL}}
    assert check_rq() == []
