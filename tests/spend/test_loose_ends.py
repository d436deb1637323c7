"""Spend's smaller promises: an item that counted nothing has no cost whichever path recorded
it, and a claim at a period's boundary keeps what its own transaction settled."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.join import outcomes
from fanout.models import ItemClaim
from fanout.record import SUCCEEDED, ExecutionOutcome, record
from fanout.transitions import hand_over_spending

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
