"""Truthful stop and cancel: --cancel, retry rules shared with the admin, Ctrl-C on an RQ run."""

from __future__ import annotations

import signal
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from fanout.actions import cancel_run
from fanout.claim import claim
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from tests.conftest import prepare
from tests.procs import wait_until
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def run_fanout(*args: str) -> tuple[int, str, str]:
    out, err = StringIO(), StringIO()
    try:
        call_command("run_fanout", *args, stdout=out, stderr=err)
        code = 0
    except CommandError as exc:
        code, err = exc.returncode, StringIO(err.getvalue() + str(exc))
    return code, out.getvalue(), err.getvalue()


def test_cancel_stops_claiming_cancels_pending_items_and_lets_running_ones_be_recorded() -> None:
    run = prepare("t_ledger", {"n": 6})
    held = claim(run.pk, "a worker", 2, 30, 3, None)
    assert held.token is not None and len(held.items) == 2

    code, out, err = run_fanout("--cancel", str(run.pk))

    assert code == 0, err
    assert f"run {run.pk} cancelled: 4 pending items cancelled; 2 running items finish" in out
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert claim(run.pk, "another worker", 6, 30, 3, None).items == []
    outcomes = [ExecutionOutcome(i.pk, i.key, SUCCEEDED, result={"i": 0}) for i in held.items]
    assert record(run.pk, held.token, outcomes, "collect").written == 2
    statuses = sorted(run.items.values_list("status", flat=True))
    assert statuses == ["cancelled"] * 4 + ["succeeded"] * 2
    assert BatchRun.objects.get(pk=run.pk).in_flight == 0


def test_cancel_refuses_an_unknown_or_finished_run_with_exit_2() -> None:
    assert run_fanout("--cancel", "999999")[0] == 2
    run = prepare("t_ledger", {"n": 1})
    cancel_run(run)
    code, _, err = run_fanout("--cancel", str(run.pk))
    assert code == 2 and "already cancelled" in err


def test_retry_failed_refuses_a_cancelled_run_as_the_admin_does() -> None:
    run = prepare("t_ledger", {"n": 3})
    ItemClaim.objects.filter(run=run, key="k00000").update(status=ItemStatus.FAILED)
    cancel_run(run)

    code, _, err = run_fanout("--retry-failed", str(run.pk))

    assert code == 2
    assert "cannot be retried: it was cancelled" in err
    assert ItemClaim.objects.get(run=run, key="k00000").status == ItemStatus.FAILED


def test_ctrl_c_on_a_waiting_parent_of_an_rq_run_detaches_and_the_workers_finish_it(
    processes: Any,
) -> None:
    processes.workers(1)
    parent = processes.manage(
        ["run_fanout", "rq_items", "--param", "n=200", "--param", "delay=0.02"]
        + ["--executor", "rq", "--run-key", "detach"]
    )
    run = wait_until(lambda: BatchRun.objects.filter(run_key="detach").first(), 30, "the run")
    wait_until(lambda: Execution.objects.filter(run_id=run.pk).count() >= 10, 30, "10 items")

    parent.signal(signal.SIGINT)
    code, log = parent.finish(timeout=30)

    assert code == 1, log
    assert f"detached: the workers go on with run {run.pk}" in log
    assert f"run_fanout --cancel {run.pk}" in log
    run = wait_until(
        lambda: BatchRun.objects.filter(pk=run.pk, status=RunStatus.SUCCEEDED).first(),
        60,
        "the workers to finish the run",
    )
    assert Execution.objects.filter(run_id=run.pk).count() == 200
