"""A claim's budgets are judged on the clock it read after the pools' locks, as its rates are."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections  # noqa: F401 - the skipif reads connection

from fanout.claim import claim
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import CapacityPool, SpendAccount
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
