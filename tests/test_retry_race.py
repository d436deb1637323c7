"""Retry-failed and cancel racing on one run: a cancel that committed first is never undone."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction

from fanout.claim import claim, lock_run
from fanout.errors import FanoutError
from fanout.models import BatchRun, ItemStatus, RunStatus
from fanout.record import FAILED, ExecutionOutcome, record
from fanout.recover import cancel_run, check_retryable, retry_failed
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
