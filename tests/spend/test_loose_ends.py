"""Spend's smaller promises: an item that counted nothing has no cost whichever path recorded
it, and a claim at a period's boundary keeps what its own transaction settled."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection

from fanout.claim import claim
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.join import outcomes
from fanout.models import CapacityPool, ItemClaim, SpendAccount
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.transitions import hand_over_spending
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def said(pk: int, key: str, cost: dict[str, float]) -> ExecutionOutcome:
    """A success whose call said what it cost (its answer read by ``cost_from=``)."""
    outcome = ExecutionOutcome(pk, key, SUCCEEDED, "", {"answer": key})
    outcome.cost, outcome.accounted = cost, True
    return outcome


@pytest.mark.parametrize("path", ["record", "hand_over"])
def test_a_call_that_says_it_cost_nothing_leaves_its_item_without_a_cost_on_every_path(
    path: str,
) -> None:
    # An answer that reads {} (cost_from= finding an empty dict of units) spent nothing: the
    # item counted nothing, and its cost is None as on the record path, not {}.
    if path == "hand_over" and connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("no hand-over on this database")
    definition = get_definition("spend_work")
    run = prepare_run(definition, {"n": 3, "estimate": 0.1}, max_spend={"usd": 10})
    taken = claim(run.pk, "worker", 1, 30.0, 3, None, spend=True)
    (item,) = taken.items
    outcome = said(item.pk, item.key, {})
    if path == "record":
        record(run.pk, taken.token, [outcome], definition.failure_policy, definition)
    else:
        done = hand_over_spending(run.pk, taken.token, outcome, "worker", uuid.uuid4(), 30.0)
        assert done.written and done.next is not None
    assert ItemClaim.objects.get(pk=item.pk).cost is None
    (seen,) = [o for o in outcomes(run.pk) if o.key == item.key]
    assert seen.cost is None


def test_a_claim_that_finds_a_period_ended_keeps_what_it_recorded_first_in_the_new_one() -> None:
    # A claim records its worker's last batch, then locks the pool's budget and rolls its
    # period over if it has ended. The record read the clock first: when the period ended in
    # between, the roll set spent to zero and wiped what the batch had just settled, though
    # the transaction that holds both commits in the new period.
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=10)
    account = SpendAccount.objects.create(
        pool=SPEND_POOL,
        unit="usd",
        budget=10.0,
        spent=5.0,
        period=60.0,
        period_started_at=db_now() - timedelta(seconds=30),
    )
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 3, "estimate": 0.1})
    taken = claim(run.pk, "worker", 1, 30.0, 3, SPEND_POOL, spend=True)
    (item,) = taken.items
    outcome = said(item.pk, item.key, {"usd": 3.0})
    outcome.pool = SPEND_POOL

    def before() -> Any:
        recorded = record(run.pk, taken.token, [outcome], definition.failure_policy, definition)
        # The period ends now, after the record read the clock and before the claim reads it.
        SpendAccount.objects.filter(pk=account.pk).update(
            period_started_at=db_now() - timedelta(seconds=61)
        )
        return recorded

    again = claim(run.pk, "worker", 1, 30.0, 3, SPEND_POOL, before=before, spend=True)
    assert len(again.items) == 1
    account.refresh_from_db()
    assert account.period_started_at > db_now() - timedelta(seconds=60)  # rolled over
    # The old period's $5 went; the batch's $3 stays, beside the next item's reservation.
    assert (account.spent, account.reserved) == (pytest.approx(3.0), pytest.approx(0.1))
