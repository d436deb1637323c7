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
from fanout.materialize import create_run
from fanout.models import CapacityPool, ItemClaim, SpendAccount
from fanout.nest import child_run_key
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.spend import Gate
from fanout.transitions import SPAWNED
from tests.procs import wait_until
from tests.test_retry_race import LOCK_POLL, session_id, waits_for_a_lock
from tests.testapp.fanouts_spend import SPEND_POOL

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
    # The batch's spend settled once the claim held the run: its calls' cost is spent, and
    # the claim's two new items hold their estimates.
    (account,) = SpendAccount.objects.filter(run_id=run.pk)
    assert account.spent == pytest.approx(0.1)
    assert account.reserved == pytest.approx(0.2)
    costs = ItemClaim.objects.filter(pk__in=[i.pk for i in taken.items]).values_list(
        "cost", flat=True
    )
    assert list(costs) == [{"usd": 0.05}, {"usd": 0.05}]


def test_a_spawned_item_of_a_pool_records_its_spend_after_the_runs_row() -> None:
    # An item that spawned a child run keeps its run slot and gives its pool slot up: its
    # record locked the pool, then the run's budget, while a claimer of the run holds the
    # run's row and its budget and waits for the pool.
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 2, "estimate": 0.1}, max_spend={"usd": 100.0})
    taken = claim(run.pk, "a", 1, 30.0, 3, definition.static_pool, spend=True)
    assert taken.token is not None and len(taken.items) == 1
    item = taken.items[0]
    child, _ = create_run(
        get_definition("t_collect"),
        {"n": 1},
        child_run_key(run.pk, item.key),
        parent_item_id=item.pk,
    )
    spawned = ExecutionOutcome(item.pk, item.key, SPAWNED, SPEND_POOL, {"child_run": child.pk})
    spawned.accounted = True  # as every outcome of a definition that counts cost
    sessions: list[int] = []
    errors: list[BaseException] = []

    def record_spawned() -> None:
        try:
            sessions.append(session_id())
            record(run.pk, taken.token, [spawned], definition.failure_policy, definition)
        except DatabaseError as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    recorder = threading.Thread(target=record_spawned)
    try:
        # A claim of the run: the run's row, its budget, then the run's pools.
        with transaction.atomic():
            lock_run(run.pk)
            Gate.open(run.pk, db_now())
            recorder.start()
            wait_until(lambda: sessions, 30, "the record to start")
            wait_until(
                lambda: waits_for_a_lock(sessions[0]),
                30,
                "the record to wait",
                every=LOCK_POLL,
            )
            pools = CapacityPool.objects.filter(name=SPEND_POOL).select_for_update()
            assert list(pools.values_list("name", flat=True)) == [SPEND_POOL]
    finally:
        if recorder.ident is not None:
            recorder.join(60)
    assert not errors, errors
