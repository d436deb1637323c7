"""A claim's budgets are judged on the clock it read after the pools' locks, as its rates are."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, connections  # noqa: F401 - the skipif reads connection

from fanout.claim import claim
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import CapacityPool, SpendAccount
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.transitions import hand_over_spending
from tests.procs import wait_until
from tests.test_retry_race import LOCK_POLL, session_id, waits_for_a_lock
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = [
    pytest.mark.skipif(
        "connection.vendor not in ('postgresql', 'mysql')", reason="row locks to wait on"
    ),
    pytest.mark.django_db(transaction=True),
]


def test_a_period_that_ends_while_the_claim_waits_for_its_pool_rolls_over() -> None:
    pool = CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 2, "estimate": 0.1})
    # The pool's rolling minute is spent to its budget and ends a moment from now.
    ends = db_now() + timedelta(seconds=1)
    SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=1.0,
        spent=1.0,
        period=60.0,
        period_started_at=ends - timedelta(seconds=60),
    )
    sessions: list[int] = []
    taken: list[object] = []

    def claimer() -> None:
        try:
            sessions.append(session_id())
            taken.append(claim(run.pk, "worker", 1, 30.0, 3, definition.static_pool, spend=True))
        finally:
            connections["default"].close()

    # Another run's claim holds the pool's row while the period ends.
    holder = connections.create_connection("default")
    thread = threading.Thread(target=claimer)
    try:
        with holder.cursor() as cursor:
            holder.set_autocommit(False)
            table = CapacityPool._meta.db_table
            cursor.execute(f"SELECT name FROM {table} WHERE id = %s FOR UPDATE", [pool.pk])
            thread.start()
            wait_until(lambda: sessions, 30, "the claim to start")
            wait_until(
                lambda: waits_for_a_lock(sessions[0]),
                30,
                "the claim to wait for the pool",
                every=LOCK_POLL,
            )
            wait_until(lambda: db_now() >= ends, 30, "the period to end")
            holder.commit()
    finally:
        holder.close()
        thread.join(60)

    (result,) = taken
    # The period it waited into admits the item: what the last one spent is gone.
    assert len(result.items) == 1, result.reason
    account = SpendAccount.objects.get(pool=SPEND_POOL)
    assert account.spent == pytest.approx(0.0)
    assert account.reserved == pytest.approx(0.1)
    assert account.period_started_at == ends


@pytest.mark.parametrize("path", ["record", "hand_over"])
def test_spend_that_waits_for_its_pools_budget_rolls_a_period_that_ended_meanwhile(
    path: str,
) -> None:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 2, "estimate": 0.1})
    ends = db_now() + timedelta(seconds=1)
    account = SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=100.0,
        spent=5.0,
        period=60.0,
        period_started_at=ends - timedelta(seconds=60),
    )
    taken = claim(run.pk, "worker", 1, 30.0, 3, definition.static_pool, spend=True)
    assert taken.token is not None and len(taken.items) == 1
    item = taken.items[0]
    outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, SPEND_POOL, {"usd": 3.0})
    outcome.cost, outcome.accounted = {"usd": 3.0}, True
    sessions: list[int] = []
    done: list[object] = []

    def settle() -> None:
        try:
            sessions.append(session_id())
            if path == "record":
                policy = definition.failure_policy
                done.append(record(run.pk, taken.token, [outcome], policy, definition))
            else:
                token = uuid.uuid4()
                done.append(hand_over_spending(run.pk, taken.token, outcome, "w", token, 30.0))
        finally:
            connections["default"].close()

    # A claim of another run holds the pool's budget while the period ends.
    holder = connections.create_connection("default")
    thread = threading.Thread(target=settle)
    try:
        holder.set_autocommit(False)
        with holder.cursor() as cursor:
            table = SpendAccount._meta.db_table
            cursor.execute(f"SELECT id FROM {table} WHERE id = %s FOR UPDATE", [account.pk])
        thread.start()
        wait_until(lambda: sessions, 30, f"the {path} to start")
        wait_until(
            lambda: waits_for_a_lock(sessions[0]),
            30,
            f"the {path} to wait for the budget",
            every=LOCK_POLL,
        )
        wait_until(lambda: db_now() >= ends, 30, "the period to end")
        holder.commit()
    finally:
        holder.close()
        thread.join(60)

    assert len(done) == 1
    account.refresh_from_db()
    # The call settled in the period it waited into: the last period's 5 are gone.
    assert account.spent == pytest.approx(3.0)
    assert account.period_started_at == ends
