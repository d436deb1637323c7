"""The runs a roaming worker thread looks at: runs held up for long never hide newer ones."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fanout import worker
from fanout.models import BatchRun, CapacityPool, ItemClaim, RunStatus
from tests.conftest import prepare

pytestmark = pytest.mark.django_db(transaction=True)


def open_run(pool: str) -> BatchRun:
    run = prepare("t_ledger", {"n": 2}, run_key=uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(pool=pool)
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, executor="rq")
    return run


def test_a_run_started_after_more_held_up_runs_than_a_thread_looks_at_is_still_seen(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(worker, "CANDIDATES", 3)
    CapacityPool.objects.create(name="paused-pool", paused=True)
    CapacityPool.objects.create(name="free-pool")
    for _ in range(6):
        open_run("paused-pool")  # open, with pending items, admitting nothing for hours
    newest = open_run("free-pool")

    seen = {r["pk"] for _ in range(40) for r in worker.open_runs(["t_ledger"], "rq")}

    assert newest.pk in seen
