"""A worker's threads outlive a database that drops their sessions mid-compensation."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.rq.support import describe_runs
from tests.testapp.models import Execution

pytestmark = [
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="pg_terminate_backend"),
    pytest.mark.django_db(transaction=True),
]


def terminate_sessions_of(application: str) -> int:
    """End the database sessions of one application name, as a restart would; how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s"
            " AND pid <> pg_backend_pid()",
            [application],
        )
        return len(cursor.fetchall())


def test_a_worker_whose_sessions_are_terminated_mid_compensation_keeps_serving_the_run(
    processes: Any,
) -> None:
    application = f"fanout-worker-{uuid.uuid4().hex[:8]}"
    processes.env["PGAPPNAME"] = application  # libpq names the worker's sessions with it
    worker = processes.worker()
    run = get_definition("comp_reverse").start(
        {"n": 4, "failing": ["s00003"], "refund_sleep": 1.0}, executor="rq", wait=False
    )
    undoing = Execution.objects.filter(run_id=run.pk, key__startswith="undo:", ended=None)
    wait_until(undoing.exists, 60, "a compensation to be under way")

    assert terminate_sessions_of(application) > 0

    try:
        run = wait_until(
            lambda: BatchRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATED).first(),
            60,
            "the run to end compensated",
            every=0.1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe_runs()}\n{worker.output()}") from None
    assert worker.proc.poll() is None, worker.output()
    # No thread of the worker died of it: each rode the lost session out and went on.
    log = worker.output().splitlines()
    died = [line for line in log if "drain failed" in line]
    assert died == [], died
    statuses = set(ItemClaim.objects.filter(run=run).values_list("status", flat=True))
    assert ItemStatus.COMPENSATING not in statuses
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.COMPENSATED).exists()
    assert (run.in_flight, run.compensating) == (0, 0)
