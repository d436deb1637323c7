"""A run that no worker can run backs off its re-dispatch and says so once, not every round."""

from __future__ import annotations

import time
from typing import Any

import pytest
from rq.registry import FailedJobRegistry

from fanout.definition import get_definition
from fanout.models import BatchRun
from fanout.queues import default_slots
from fanout.supervise import STALL_BACKOFF
from tests.procs import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {"FANOUT_SUPERVISE_SECONDS": 1}


def test_a_stalled_runs_redispatch_backs_off_exponentially_and_is_logged_once(
    processes: Any, redis: Any
) -> None:
    # A worker started with RQ's defaults (pickle) fails every JSON drain job it takes.
    pickle = ["--serializer", "rq.serializers.DefaultSerializer"]
    processes.worker("fanout", args=["--worker-class", "rq.SimpleWorker", *pickle])
    run = get_definition("rq_items").start({"n": 5}, executor="rq", wait=False)
    # A healthy worker on another queue supervises every run, once a second.
    (supervisor,) = processes.workers(1, "fanout-gpu", **FAST)
    failed = FailedJobRegistry("fanout", connection=redis)

    slots = default_slots(run, get_definition("rq_items"))  # drain jobs per dispatch

    wait_until(lambda: BatchRun.objects.get(pk=run.pk).stalled, 30, "the run to stall")
    wait_until(lambda: failed.count >= 2 * slots, 30, "the first re-dispatch after the stall")
    first = time.monotonic()
    wait_until(lambda: failed.count >= 4 * slots, 90, "two more re-dispatches")

    # Without backoff the supervisor re-dispatched every round (1 s): the 3rd re-dispatch came
    # about 2 s after the 1st. Held for 1 and 2 backoffs (2 s, then 4 s), it comes >= 6 s after
    # (less the time the bad worker took to fail the 1st's jobs: a second or so).
    assert time.monotonic() - first >= 3 * STALL_BACKOFF - 1.5
    lines = [line for line in supervisor.output().splitlines() if f"run {run.pk} stalls" in line]
    assert len(lines) == 1, supervisor.output()
    assert "re-dispatched with backoff" in lines[0]
