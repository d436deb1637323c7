"""A writer's errors move the run on: a child run whose work list fails decides its parent item,
and a database error that no retry mends is said on the run instead of retried in silence."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from django.db import connection

from fanout import supervise
from fanout.actions import retry_failed
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.lease import LeaseKeeper
from fanout.materialize import WritingInterrupted
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.worker import Drain
from tests.rq.support import executions, finished_run
from tests.testapp.fanouts_stuck import stuck_key

pytestmark = pytest.mark.django_db(transaction=True)


def drain_once(run: BatchRun) -> str:
    """Run the run's claimable items in this thread; return once nothing is left to claim."""
    definition = get_definition(run.definition)
    keeper = LeaseKeeper(definition.lease_seconds)
    return Drain(run.pk, definition, keeper, run.params, idle_exit=0.1)()


def test_a_child_run_whose_takeover_writer_meets_a_broken_work_list_fails_its_parent_item() -> None:
    # The child's first writer (the parent item's worker) loses the database mid-work-list:
    # the child is kept for the next writer and the parent item waits for it, holding its slot.
    parent = prepare_run(get_definition("stuck_broken_child_spawner"), {"tag": uuid.uuid4().hex})
    drain_once(parent)
    item = ItemClaim.objects.get(run=parent)
    assert item.status == ItemStatus.WAITING
    child = BatchRun.objects.get(parent_item=item)
    assert child.status == RunStatus.PENDING

    # The supervisor takes the writing over, and the work list now raises its own error.
    supervise.tend(child.pk)
    supervise.tend(parent.pk)

    item.refresh_from_db()
    assert item.status == ItemStatus.FAILED, f"the parent item is still {item.status}"
    assert item.error_class == "ChildRunFailed"
    assert "the work list is broken" in item.error
    parent.refresh_from_db()
    assert parent.status == RunStatus.FAILED
    assert parent.in_flight == 0
    # The child is kept, failed, saying why; its parent's retry writes it afresh.
    child.refresh_from_db()
    assert child.status == RunStatus.FAILED
    assert "the work list is broken" in child.error


def test_a_child_whose_work_list_failed_is_written_afresh_when_its_parent_item_is_retried() -> None:
    parent = prepare_run(get_definition("stuck_broken_child_spawner"), {"tag": uuid.uuid4().hex})
    drain_once(parent)
    (child,) = BatchRun.objects.filter(parent_item__run=parent)
    supervise.tend(child.pk)  # the work list fails: the child, its parent item and run too
    parent.refresh_from_db()
    assert parent.status == RunStatus.FAILED

    # The definition is fixed (its work list gives 2 elements now): a retry runs the item again.
    retry_failed(parent)
    drain_once(parent)
    parent = finished_run(parent.pk, timeout=30)

    assert parent.status == RunStatus.SUCCEEDED, parent.error
    (child,) = BatchRun.objects.filter(parent_item__run=parent)
    assert child.status == RunStatus.SUCCEEDED
    assert executions(child.pk) == Counter({stuck_key(0): 1, stuck_key(1): 1})
    assert parent.in_flight == 0


@pytest.fixture
def items_refused() -> Iterator[None]:
    """The database refuses every new item with an error that no retry mends (program limit
    exceeded: a class of SQLSTATE that is not transient)."""
    if connection.vendor != "postgresql":
        pytest.skip("the refusing trigger is written for PostgreSQL")
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION fanout_test_refuse_items() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN RAISE EXCEPTION 'no more items here' USING ERRCODE = '54000'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER fanout_test_refuse_items BEFORE INSERT ON fanout_itemclaim"
            " FOR EACH ROW EXECUTE FUNCTION fanout_test_refuse_items()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER fanout_test_refuse_items ON fanout_itemclaim")
            cursor.execute("DROP FUNCTION fanout_test_refuse_items()")


def test_a_database_error_that_no_retry_mends_is_said_on_the_run_and_its_writing_backs_off(
    items_refused: None,
) -> None:
    definition = get_definition("stuck_slow_list")
    with pytest.raises(WritingInterrupted):
        prepare_run(definition, {"n": 5}, uuid.uuid4().hex)
    run = BatchRun.objects.get(definition="stuck_slow_list")
    assert run.status == RunStatus.PENDING  # kept: the definition is not at fault

    said = supervise.tend(run.pk)

    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert "no more items here" in run.stalled, said
    # The supervisor's next rounds do not write it again at once, every round.
    tries = [supervise.tend(run.pk) for _ in range(3)]
    assert sum("held back" in t for t in tries) >= 2, tries
