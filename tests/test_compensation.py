"""Compensation: a failed run undoes what succeeded, durably, in order, within its budget."""

from __future__ import annotations

import threading
import time
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from fanout import compensate, supervise, transitions
from fanout.claim import claim
from fanout.compensate import retry_failed_compensations
from fanout.definition import get_definition
from fanout.dispatch import prepare_run, resume
from fanout.models import BatchRun, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from tests.pools.ledger import max_in_flight
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def start(name: str, **params: Any) -> BatchRun:
    return get_definition(name).start(params, run_key=uuid.uuid4().hex, workers=4)


def undone(run: BatchRun) -> list[str]:
    """Keys whose compensation ran, in the order they started."""
    rows = Execution.objects.filter(run_id=run.pk, key__startswith="undo:").order_by("started")
    return [r.key.removeprefix("undo:") for r in rows]


def test_a_failed_run_compensates_every_succeeded_item_once_latest_finished_first() -> None:
    run = start("comp_reverse", n=40, sleep=0.02, failing=["s00010"])

    assert run.status == RunStatus.COMPENSATED, run.error
    items = {i.key: i for i in ItemClaim.objects.filter(run=run)}
    compensated = [k for k, i in items.items() if i.status == ItemStatus.COMPENSATED]
    assert compensated, "nothing had succeeded before the failure"
    # Exactly the items that succeeded, each once, and nothing else.
    assert sorted(undone(run)) == sorted(compensated)
    assert items["s00010"].status == ItemStatus.FAILED
    assert all(
        i.status in (ItemStatus.COMPENSATED, ItemStatus.FAILED, ItemStatus.CANCELLED)
        for i in items.values()
    )
    # Strictly one after another, the latest finished first.
    by_finish = sorted(compensated, key=lambda k: (items[k].finished_at, items[k].index))
    assert undone(run) == list(reversed(by_finish))
    spans = Execution.objects.filter(run_id=run.pk, key__startswith="undo:").order_by("started")
    ends = [s.ended for s in spans]
    assert all(e is not None for e in ends)
    assert all(nxt.started >= prev for prev, nxt in zip(ends, spans[1:], strict=False))


def test_parallel_compensation_keeps_to_its_own_budget() -> None:
    run = start("comp_parallel", n=12, failing=["s00011"], refund_sleep=0.1)

    assert run.status == RunStatus.COMPENSATED, run.error
    rows = Execution.objects.filter(run_id=run.pk, key__startswith="undo:")
    assert rows.count() == 11
    assert max_in_flight(list(rows)) == 2  # compensate_max_parallel


def test_a_compensation_that_keeps_failing_stays_visible_and_can_be_retried() -> None:
    # Its refund bounces 3 times: max_attempts=3 is used up.
    run = start("comp_reverse", n=3, failing=["s00002"], refund_fail={"s00001": 3})

    assert run.status == RunStatus.COMPENSATION_FAILED
    stuck = ItemClaim.objects.get(run=run, key="s00001")
    assert stuck.status == ItemStatus.COMPENSATION_FAILED
    assert "bounced" in stuck.error
    assert stuck.attempts.filter(error_class__startswith="compensation").count() == 3
    assert ItemClaim.objects.get(run=run, key="s00000").status == ItemStatus.COMPENSATED

    assert retry_failed_compensations(run) == 1
    run, handle = resume(run.pk)
    assert handle is not None
    handle.join(30)
    run.refresh_from_db()

    assert run.status == RunStatus.COMPENSATED
    assert ItemClaim.objects.get(run=run, key="s00001").status == ItemStatus.COMPENSATED
    assert undone(run).count("s00001") == 4


def test_an_operator_cancels_a_run_and_compensates_what_it_did() -> None:
    definition = get_definition("comp_reverse")
    run = prepare_run(definition, {"n": 6}, uuid.uuid4().hex)
    handle = resume(run.pk)[1]
    assert handle is not None
    handle.join(30)  # it succeeded: nothing to compensate yet
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED

    run = prepare_run(definition, {"n": 6, "sleep": 0.2}, uuid.uuid4().hex)
    out = StringIO()
    call_command("run_fanout", "--cancel", str(run.pk), "--compensate", stdout=out)
    assert f"run {run.pk} compensating" in out.getvalue()
    handle = resume(run.pk)[1]
    assert handle is not None
    handle.join(30)
    run.refresh_from_db()

    # Nothing had run: every item was cancelled, nothing needed undoing.
    assert run.status == RunStatus.COMPENSATED
    assert set(run.items.values_list("status", flat=True)) == {ItemStatus.CANCELLED}
    assert undone(run) == []


def test_an_item_that_succeeds_after_a_cancel_to_compensate_is_undone_before_the_run_ends() -> None:
    # cancel --compensate while an item runs and none has succeeded yet; the item then
    # succeeds, and the supervisor tends the run before any compensation claim swept it up.
    definition = get_definition("phase_reverse")
    run = prepare_run(definition, {"n": 1}, uuid.uuid4().hex)
    taken = claim(run.pk, "host:1:w1", 1, 60.0, definition.crash_budget, None)
    (item,) = taken.items
    assert compensate.begin(run.pk, "cancelled by an operator")
    done = transitions.ExecutionOutcome(
        item.pk, item.key, transitions.SUCCEEDED, item.pool, result={"charged": 1}
    )
    assert transitions.settle(run.pk, taken.token, [done]) == [item.pk]

    supervise.tend(run.pk)

    assert ItemClaim.objects.get(pk=item.pk).status == ItemStatus.COMPENSATING
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.COMPENSATING
    assert compensate.finish(run.pk) is None  # not until it is undone


def test_a_compensation_taken_over_after_its_worker_died_keeps_its_attempt() -> None:
    from django.utils import timezone

    from fanout import compensate

    definition = get_definition("comp_reverse")  # max_attempts=3
    run = prepare_run(definition, {"n": 1}, uuid.uuid4().hex)
    item = ItemClaim.objects.get(run=run)
    ItemClaim.objects.filter(pk=item.pk).update(
        status=ItemStatus.SUCCEEDED, result={"charged": item.key}
    )
    assert compensate.begin(run.pk, "the run failed")
    first = compensate.claim(run.pk, definition, "host:1:dead")
    assert [i.attempt for i, _ in first.items] == [1]
    # Its worker dies mid-compensation, twice: each time the lease runs out and another
    # worker takes it over.
    for owner in ("host:2:dead", "host:3:alive"):
        ItemClaim.objects.filter(pk=item.pk).update(lease_expires_at=timezone.now())
        taken = compensate.claim(run.pk, definition, owner)

    # A crash is not the compensation's fault: like an item's, it uses no attempt.
    assert [i.attempt for i, _ in taken.items] == [1]
    assert ItemClaim.objects.get(pk=item.pk).compensation_attempt == 1
    # So a compensation that then fails once has attempts left: it is retried, not failed.
    assert taken.token is not None
    error = (False, "RuntimeError", "bounced")
    assert compensate.record(run.pk, definition, taken.token, taken.items[0][0], error)
    assert ItemClaim.objects.get(pk=item.pk).status == ItemStatus.COMPENSATING


def test_a_compensation_that_kills_every_worker_fails_after_its_crash_budget() -> None:
    from django.utils import timezone

    from fanout import compensate

    definition = get_definition("comp_reverse")
    run = prepare_run(definition, {"n": 1}, uuid.uuid4().hex)
    item = ItemClaim.objects.get(run=run)
    ItemClaim.objects.filter(pk=item.pk).update(
        status=ItemStatus.SUCCEEDED, result={"charged": item.key}
    )
    assert compensate.begin(run.pk, "the run failed")
    assert compensate.claim(run.pk, definition, "host:0:dead").items
    # Each worker that takes it over dies too, as if the compensation killed it.
    for n in range(1, definition.crash_budget + 1):
        ItemClaim.objects.filter(pk=item.pk).update(lease_expires_at=timezone.now())
        assert compensate.claim(run.pk, definition, f"host:{n}:dead").items

    ItemClaim.objects.filter(pk=item.pk).update(lease_expires_at=timezone.now())
    last = compensate.claim(run.pk, definition, "host:9:alive")

    assert last.items == []
    item.refresh_from_db()
    assert item.status == ItemStatus.COMPENSATION_FAILED
    assert f"{definition.crash_budget + 1} workers died" in item.error
    lost = ItemAttempt.objects.filter(item=item, error_class="compensation: WorkerLost")
    assert lost.count() == definition.crash_budget + 1
    assert compensate.finish(run.pk) == RunStatus.COMPENSATION_FAILED
    assert BatchRun.objects.get(pk=run.pk).compensating == 0


@pytest.mark.parametrize(("name", "failing"), [("comp_reverse", []), ("comp_reverse", ["s00001"])])
def test_a_run_cancelled_while_it_is_being_joined_stays_cancelled(name: str, failing: list) -> None:
    # Every item ended, a joiner was elected, and then an operator (or a failing-fast parent)
    # cancels the run before the joiner records its verdict: the cancel stands.
    from fanout import join
    from fanout.actions import cancel_run

    run = prepare_run(get_definition(name), {"n": 2}, uuid.uuid4().hex)
    for item in ItemClaim.objects.filter(run=run):
        failed = item.key in failing
        ItemClaim.objects.filter(pk=item.pk).update(
            status=ItemStatus.FAILED if failed else ItemStatus.SUCCEEDED,
            result=None if failed else {"charged": item.key},
        )
    token = join._elect(run.pk)
    assert token is not None

    cancel_run(BatchRun.objects.get(pk=run.pk), "stopped while joining")
    assert join.conclude(run.pk, token) is False

    run.refresh_from_db()
    assert (run.status, run.error) == (RunStatus.CANCELLED, "stopped while joining")
    assert not ItemClaim.objects.filter(run=run, status=ItemStatus.COMPENSATING).exists()


def test_a_thread_serving_every_run_leaves_a_compensating_run_with_nothing_to_claim() -> None:
    definition = get_definition("comp_reverse")
    run = prepare_run(definition, {"n": 3}, uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(status=ItemStatus.SUCCEEDED)
    assert compensate.begin(run.pk, "failed on purpose")
    held = compensate.claim(run.pk, definition, "another-worker")
    assert len(held.items) == 1  # reverse order: one at a time, and this one is under way
    ran: list[int] = []

    # A roaming thread goes to runs with work instead of waiting here for its turn to end...
    left = compensate.drain(
        definition,
        run.pk,
        "roamer",
        threading.Event(),
        time.monotonic() + 60,
        ran=ran.append,
        leave_when_idle=True,
    )
    # ...while a run's own drain waits in it (here until its short deadline).
    stayed = compensate.drain(
        definition, run.pk, "own-drain", threading.Event(), time.monotonic() + 0.5
    )

    assert left == "nothing to compensate now" and ran == []
    assert stayed == "stopped"
    assert ItemClaim.objects.filter(run=run, owner="another-worker").exists()
