"""A database error that no retry mends stops the drain, and the run says why.

A worker rides out a database that restarts (connection lost, deadlock, lock wait timeout);
but a missing procedure or an illegal mix of collations fails the same way for ever, and a
worker that retried it would hold its items and show nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction

from fanout.definition import get_definition
from fanout.dispatch import dispatch
from fanout.errors import is_transient
from fanout.report import snapshot
from tests.conftest import prepare
from tests.procs import wait_until

pytestmark = [
    pytest.mark.skipif(
        "connection.vendor not in ('postgresql', 'mysql')", reason="a hand-over in SQL"
    ),
    pytest.mark.django_db(transaction=True),
]

# Where the hand-over (MariaDB/MySQL's procedure, PostgreSQL's function) is last created.
_HAND_OVER = "fanout.migrations.0015_hand_over_live_waiters"


@pytest.fixture
def without_hand_over() -> Iterator[None]:
    """The test database without its hand-over; created again at the end."""
    migration = importlib.import_module(_HAND_OVER)
    with connection.cursor() as cursor:
        cursor.execute(migration.DROP[connection.vendor])
    yield
    with connection.schema_editor(atomic=False) as editor:
        migration.create(None, editor)


def test_a_missing_hand_over_stops_the_drain_and_the_run_says_why(without_hand_over: None) -> None:
    run = prepare("t_lease", {"n": 10})
    handle = dispatch(run, get_definition("t_lease"), "inline", workers=2)
    assert handle is not None
    try:
        # Each worker's first success is handed over, which fails: it stops instead of
        # retrying for ever.
        wait_until(lambda: not handle.alive, 60, "the workers to stop")
    finally:
        handle.shutdown()

    assert all(o.startswith("stopped: a database error") for o in handle.outcomes), handle.outcomes
    run.refresh_from_db()
    assert "fanout_hand_over" in run.stalled
    # Once the stopped workers' leases run out, the run's progress says it stalled, and why.
    why = wait_until(
        lambda: (w := snapshot(run).why).startswith("stalled:") and w, 30, "the run stalled"
    )
    assert "fanout_hand_over" in why, why


def raised(statement: str, params: list[Any] | None = None) -> DatabaseError:
    """The error the database answers ``statement`` with, on this test's connection."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, params or [])
    except DatabaseError as exc:
        return exc
    raise AssertionError(f"{statement!r} did not fail")


def test_errors_that_go_away_are_told_from_those_that_never_do() -> None:
    run = prepare("t_ledger", {"n": 1})
    mysql = connection.vendor == "mysql"
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        # A lock wait that runs out: the holder may let go by the next try.
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("SELECT id FROM fanout_batchrun WHERE id = %s FOR UPDATE", [run.pk])
        timeout = "SET innodb_lock_wait_timeout = 1" if mysql else "SET lock_timeout = '200ms'"
        with connection.cursor() as cursor:
            cursor.execute(timeout)
        lock_wait = raised("SELECT id FROM fanout_batchrun WHERE id = %s FOR UPDATE", [run.pk])
        other.rollback()
        other.set_autocommit(True)

        # A session killed under the worker (a restart, an administrator).
        with connection.cursor() as cursor:
            cursor.execute("SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()")
            session = cursor.fetchone()[0]
        with other.cursor() as cursor:
            if mysql:
                cursor.execute(f"KILL {int(session)}")
            else:
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
        killed = raised("SELECT 1")
    finally:
        other.close()
        connection.close()

    assert is_transient(lock_wait), lock_wait
    assert is_transient(killed), killed
    for permanent in (
        raised("SELECT no_such_column FROM fanout_batchrun"),
        raised("CALL no_such_procedure()" if mysql else "SELECT no_such_function()"),
        raised("SELEC 1"),
    ):
        assert not is_transient(permanent), permanent
    if mysql:
        mix = "SELECT _utf8mb4'a' COLLATE utf8mb4_unicode_ci = _utf8mb4'a' COLLATE utf8mb4_bin"
        assert not is_transient(raised(mix))
