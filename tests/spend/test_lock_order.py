"""Budgets are locked after their run's row, on every path: no claimer waits for another in a
circle."""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection, connections, transaction  # noqa: F401 - skipif

from fanout.claim import claim, lock_run
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.spend import Gate
from tests.procs import wait_until
from tests.test_retry_race import LOCK_POLL, session_id, waits_for_a_lock

pytestmark = [
    pytest.mark.skipif(
        "connection.vendor not in ('postgresql', 'mysql')", reason="row locks to wait on"
    ),
    pytest.mark.django_db(transaction=True),
]


def test_a_claim_recording_spent_successes_first_locks_the_run_before_its_budget() -> None:
    definition = get_definition("spend_work")
    run = prepare_run(definition, {"n": 4, "estimate": 0.1}, max_spend={"usd": 100.0})
    taken = claim(run.pk, "a", 2, 30.0, 3, None, spend=True)
    assert taken.token is not None and len(taken.items) == 2
    outcomes = []
    for item in taken.items:
        outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"usd": 0.05})
        outcome.cost, outcome.accounted = {"usd": 0.05}, True
        outcomes.append(outcome)
    sessions: list[int] = []
    errors: list[BaseException] = []

    def record_then_claim() -> None:
        # Worker a records its batch in its next claim's transaction, as a drain does.
        try:
            sessions.append(session_id())
            claim(
                run.pk,
                "a",
                2,
                30.0,
                3,
                None,
                before=lambda: record(
                    run.pk, taken.token, outcomes, definition.failure_policy, definition
                ),
                spend=True,
            )
        except DatabaseError as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    recorder = threading.Thread(target=record_then_claim)
    try:
        # Worker b's claim: the run's row, then the run's budget.
        with transaction.atomic():
            lock_run(run.pk)
            recorder.start()
            wait_until(lambda: sessions, 30, "worker a to start")
            wait_until(
                lambda: waits_for_a_lock(sessions[0]),
                30,
                "worker a to wait for the run",
                every=LOCK_POLL,
            )
            Gate.open(run.pk, db_now())
    finally:
        if recorder.ident is not None:
            recorder.join(60)
    assert not errors, errors
