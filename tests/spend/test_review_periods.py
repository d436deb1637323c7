"""A pool's budget over a period counts what a call spent in the period its outcome settles in."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection

from fanout.claim import claim
from fanout.clock import calendar_start, db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import CapacityPool, SpendAccount
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.transitions import hand_over_spending
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("calendar", ["", "day", "week", "month", "year"])
@pytest.mark.parametrize("path", ["record", "hand_over"])
def test_spend_settled_after_the_pools_period_ended_counts_in_the_new_period(
    path: str, calendar: str
) -> None:
    if path == "hand_over" and connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("no hand-over on this database")
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    now = db_now()
    this_period = calendar_start(now, calendar) if calendar else now - timedelta(seconds=30)
    account = SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=10.0,
        spent=5.0,
        period=None if calendar else 60.0,
        calendar=calendar,
        period_started_at=this_period,
    )
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 2, "estimate": 0.1})
    taken = claim(run.pk, "worker", 1, 30.0, 3, definition.static_pool, spend=True)
    assert taken.token is not None and len(taken.items) == 1
    # The call runs past the period's end: when it returns, the period it was admitted in
    # began 70 s ago (a rolling minute), or is the calendar period before this one.
    if calendar:
        ended = calendar_start(this_period - timedelta(seconds=1), calendar)
    else:
        ended = db_now() - timedelta(seconds=70)
    SpendAccount.objects.filter(pk=account.pk).update(period_started_at=ended)
    item = taken.items[0]
    outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, SPEND_POOL, {"usd": 3.0})
    outcome.cost, outcome.accounted = {"usd": 3.0}, True
    if path == "record":
        record(run.pk, taken.token, [outcome], definition.failure_policy, definition)
    else:
        done = hand_over_spending(run.pk, taken.token, outcome, "worker", uuid.uuid4(), 30.0)
        assert done.written
    # The next claim rolls the period over.
    claim(run.pk, "worker", 1, 30.0, 3, definition.static_pool, spend=True)

    account.refresh_from_db()
    assert account.spent == pytest.approx(3.0)  # spent in this period; the old one's 5 went
    if calendar:
        assert account.period_started_at == calendar_start(db_now(), calendar)
    else:
        assert account.period_started_at > db_now() - timedelta(seconds=60)
