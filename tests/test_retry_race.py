"""Retry-failed and cancel racing on one run: a cancel that committed first is never undone."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction

from fanout.actions import cancel_run, check_retryable, retry_failed
from fanout.claim import claim, lock_run
from fanout.definition import get_definition
from fanout.errors import FanoutError
from fanout.join import maybe_join
from fanout.materialize import create_run, materialize
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.nest import child_run_key
from fanout.record import FAILED, ExecutionOutcome, record
from fanout.transitions import CHILD_FAILED, SPAWNED
from tests.conftest import items, prepare
from tests.procs import wait_until

pytestmark = [
    pytest.mark.skipif(
        "connection.vendor not in ('postgresql', 'mysql')", reason="row locks to race on"
    ),
    pytest.mark.django_db(transaction=True),
]


def session_id() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()"
        )
        return cursor.fetchone()[0]


# MariaDB refreshes information_schema.innodb_trx only when it was last read over 100 ms ago:
# polled faster, a lock wait that began after the first read is never seen.
LOCK_POLL = 0.2


def waits_for_a_lock(session: int) -> bool:
    """Whether the database session ``session`` is waiting for a row lock now."""
    if connection.vendor == "mysql":
        query = (
            "SELECT count(*) FROM information_schema.innodb_trx"
            " WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'"
        )
    else:
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
    with connection.cursor() as cursor:
        cursor.execute(query, [session])
        return cursor.fetchone()[0] > 0


def running_run_with_a_failed_item() -> BatchRun:
    run = prepare("t_collect", {"n": 4})
    taken = claim(run.pk, "owner", 1, 30, 3, None)
    assert taken.token is not None
    item = taken.items[0]
    outcome = ExecutionOutcome(item.pk, item.key, FAILED, error="boom", error_class="Boom")
    record(run.pk, taken.token, [outcome], "collect")
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    assert items(run.pk)[item.key].status == ItemStatus.FAILED
    return run


def test_a_cancel_that_commits_while_retry_failed_waits_for_the_run_is_not_undone() -> None:
    run = running_run_with_a_failed_item()
    check_retryable(run)  # what the operator's retry saw: a running run, retryable
    locked, go = threading.Event(), threading.Event()
    retried: list[object] = []
    sessions: list[int] = []

    def cancel() -> None:
        # Holds the run's row until told, then cancels and commits: the cancel lands while
        # retry_failed waits for that row, after its caller read the run as retryable.
        try:
            with transaction.atomic():
                lock_run(run.pk)
                locked.set()
                go.wait(30)
                cancel_run(BatchRun.objects.get(pk=run.pk), "cancelled meanwhile")
        finally:
            connections["default"].close()

    def retry() -> None:
        try:
            sessions.append(session_id())
            retried.append(retry_failed(BatchRun.objects.get(pk=run.pk)))
        except FanoutError as exc:
            retried.append(exc)
        finally:
            connections["default"].close()

    canceller = threading.Thread(target=cancel)
    retrier = threading.Thread(target=retry)
    canceller.start()
    try:
        assert locked.wait(30)
        retrier.start()
        wait_until(lambda: sessions, 30, "retry_failed to start")
        wait_until(lambda: waits_for_a_lock(sessions[0]), 30, "retry_failed to wait for the row")
    finally:
        go.set()
        canceller.join(60)
        if retrier.ident is not None:
            retrier.join(60)

    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.error == "cancelled meanwhile"
    assert ItemStatus.PENDING not in set(s.status for s in items(run.pk).values())
    assert len(retried) == 1 and isinstance(retried[0], FanoutError), retried
    assert "cancelled" in str(retried[0])


def running_parent_with_an_item_failed_by_its_child() -> tuple[BatchRun, BatchRun]:
    """A running run whose first item spawned a child run that failed: the item failed too."""
    parent = prepare("t_collect", {"n": 2})
    taken = claim(parent.pk, "owner", 1, 30, 3, None)
    assert taken.token is not None
    item = taken.items[0]
    definition = get_definition("t_collect")
    child, _ = create_run(
        definition, {"n": 1}, child_run_key(parent.pk, item.key), parent_item_id=item.pk
    )
    child = materialize(child, definition)
    spawned = ExecutionOutcome(item.pk, item.key, SPAWNED, result={"child_run": child.pk})
    record(parent.pk, taken.token, [spawned], "collect")
    leaf = claim(child.pk, "owner", 1, 30, 3, None)
    assert leaf.token is not None
    broken = leaf.items[0]
    failed = ExecutionOutcome(broken.pk, broken.key, FAILED, error="boom", error_class="Boom")
    record(child.pk, leaf.token, [failed], "collect")
    assert maybe_join(child.pk)  # the child fails and hands its failure to the parent item
    parent.refresh_from_db()
    child.refresh_from_db()
    assert (parent.status, child.status) == (RunStatus.RUNNING, RunStatus.FAILED)
    waited = ItemClaim.objects.get(pk=item.pk)
    assert (waited.status, waited.error_class) == (ItemStatus.FAILED, CHILD_FAILED)
    return parent, child


def test_a_cancel_of_the_parent_while_retry_failed_reopens_its_child_leaves_no_child_running() -> (
    None
):
    parent, child = running_parent_with_an_item_failed_by_its_child()
    held, release = threading.Event(), threading.Event()
    retried: list[object] = []
    cancelled: list[int] = []
    sessions: dict[str, int] = {}

    def hold_the_child() -> None:
        # Holds the child's row: a retry that reopens the child waits here, after it read the
        # parent's children and (unless it locked the parent first) before the parent's lock.
        try:
            with transaction.atomic():
                lock_run(child.pk)
                held.set()
                release.wait(30)
        finally:
            connections["default"].close()

    def retry() -> None:
        try:
            sessions["retry"] = session_id()
            retried.append(retry_failed(BatchRun.objects.get(pk=parent.pk)))
        except FanoutError as exc:
            retried.append(exc)
        finally:
            connections["default"].close()

    def cancel() -> None:
        try:
            sessions["cancel"] = session_id()
            cancelled.append(cancel_run(BatchRun.objects.get(pk=parent.pk), "cancelled meanwhile"))
        finally:
            connections["default"].close()

    holder = threading.Thread(target=hold_the_child)
    retrier = threading.Thread(target=retry)
    canceller = threading.Thread(target=cancel)
    holder.start()
    try:
        assert held.wait(30)
        retrier.start()
        wait_until(lambda: "retry" in sessions, 30, "retry_failed to start")
        wait_until(
            lambda: waits_for_a_lock(sessions["retry"]), 30, "retry_failed to wait", LOCK_POLL
        )
        # The cancel either commits now (the retry has not locked the parent) or waits for the
        # parent's row until the retry has decided.
        canceller.start()
        wait_until(lambda: "cancel" in sessions, 30, "the cancel to start")
        wait_until(
            lambda: bool(cancelled) or waits_for_a_lock(sessions["cancel"]),
            30,
            "the cancel to commit or to wait for the parent",
            LOCK_POLL,
        )
    finally:
        release.set()
        holder.join(60)
        for thread in (retrier, canceller):
            if thread.ident is not None:
                thread.join(60)

    parent.refresh_from_db()
    child.refresh_from_db()
    assert len(retried) == 1 and len(cancelled) == 1, (retried, cancelled)
    assert parent.status == RunStatus.CANCELLED
    assert child.status in (RunStatus.FAILED, RunStatus.CANCELLED), retried
    assert ItemStatus.PENDING not in {i.status for i in items(child.pk).values()}
    assert (parent.in_flight, child.in_flight) == (0, 0)


def test_a_join_elected_while_retry_failed_reopens_an_item_steps_down() -> None:
    # The joiner saw every item finished, then waited for the run's row while retry_failed
    # put the failed item back: it is elected after the retry commits, sees the item pending
    # and leaves the join (leave_join), so the run runs on and the join is not called.
    run = prepare("t_collect", {"n": 1})
    taken = claim(run.pk, "owner", 1, 30, 3, None)
    assert taken.token is not None
    item = taken.items[0]
    outcome = ExecutionOutcome(item.pk, item.key, FAILED, error="boom", error_class="Boom")
    record(run.pk, taken.token, [outcome], "collect")
    sessions: list[int] = []
    joined: list[bool] = []

    def join() -> None:
        try:
            sessions.append(session_id())
            joined.append(maybe_join(run.pk))
        finally:
            connections["default"].close()

    joiner = threading.Thread(target=join)
    try:
        with transaction.atomic():
            lock_run(run.pk)
            joiner.start()
            wait_until(lambda: sessions, 30, "the joiner to start")
            wait_until(
                lambda: waits_for_a_lock(sessions[0]),
                30,
                "the joiner to wait for the run",
                every=LOCK_POLL,
            )
            assert retry_failed(BatchRun.objects.get(pk=run.pk)) == 1
    finally:
        if joiner.ident is not None:
            joiner.join(60)

    assert joined == [False]
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    assert run.join_token is None and run.join_lease_expires_at is None
    assert run.join_runs == 0
    assert items(run.pk)[item.key].status == ItemStatus.PENDING
