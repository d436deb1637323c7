"""An admin retry of an inline run's failed items, finished by real `rqworker` processes."""

from __future__ import annotations

import os
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from fanout.definition import get_definition
from fanout.models import BatchRun, ItemStatus, RunStatus
from tests.rq.conftest import processes, redis, redis_url  # noqa: F401  (real workers, own Redis)
from tests.rq.support import finished_run
from tests.testapp.models import Execution

from .helpers import action, messages_of

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = reverse("admin:fanout_batchrun_changelist")
BROKEN_ONCE = ["k00001", "k00004"]


def failed_inline_run() -> BatchRun:
    """A run started with the plain inline executor whose two items failed on their first try."""
    run = get_definition("t_collect").start(
        {"n": 6, "permanent_once": BROKEN_ONCE}, run_key="admin-retry-inline"
    )
    assert run.status == RunStatus.FAILED and run.executor == "inline", run.error
    return run


def test_an_admin_retry_of_an_inline_runs_failed_items_finishes_the_run_on_rq_workers(
    processes: Any,  # noqa: F811
    django_user_model: Any,
) -> None:
    run = failed_inline_run()
    worker = processes.worker("fanout")
    operator = django_user_model.objects.create_superuser("operator", "op@example.com", "pw")
    client = Client()
    client.force_login(operator)

    response = action(client, CHANGELIST, "retry_failed_items", run.pk)

    assert response.status_code == 302
    notes = messages_of(response)
    assert "2 failed items of 1 run back to pending." in notes
    assert any("now run on RQ workers (queue 'fanout')" in n for n in notes), notes
    run = finished_run(run.pk, timeout=120)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.executor == "rq"
    assert not run.items.exclude(status=ItemStatus.SUCCEEDED).exists()
    # The two retried items ran once more, in the worker; the others never ran again.
    ran = Execution.objects.filter(run_id=run.pk)
    here = ran.filter(worker__startswith=f"{os.getpid()}:").values_list("key", flat=True)
    there = ran.filter(worker__startswith=f"{worker.pid}:").values_list("key", flat=True)
    assert sorted(here) == [f"k{i:05d}" for i in range(6)]
    assert sorted(there) == BROKEN_ONCE
