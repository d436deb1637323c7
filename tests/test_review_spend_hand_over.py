"""A hand-over that moves spend refuses the next item as a claim would: on every database, a
budget already reached refuses an item that reserves nothing, even when the finished item
moved nothing either (it reported no cost and had no estimate)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection, transaction

from fanout import spend
from fanout.clock import db_now
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus, SpendAccount
from fanout.spend import Gate
from fanout.transitions import SUCCEEDED, ExecutionOutcome, hand_over_spending

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_hand_over_refuses_the_next_item_once_the_runs_budget_is_reached_as_a_claim_does() -> (
    None
):
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("no hand-over on this database: the claim decides alone")
    spend._run_budgets.clear()  # ids come back after a flush on MariaDB: nothing is known yet
    now = db_now()
    run = BatchRun.objects.create(
        definition="budgeted",
        run_key="budgeted-run",
        status=RunStatus.RUNNING,
        max_parallel=5,
        in_flight=1,
        failure_policy="collect",
        join_mode="none",
    )
    # max_spend={"usd": 1}, spent to the cent by the items that reported what they cost.
    SpendAccount.objects.create(run=run, unit="usd", budget=1.0, spent=1.0)
    token = uuid.uuid4()
    finished = ItemClaim.objects.create(
        run=run,
        key="finished",
        index=0,
        status=ItemStatus.RUNNING,
        owner="worker",
        claim_token=token,
        lease_expires_at=now,
        started_at=now,
        next_attempt_at=now,
    )
    ItemClaim.objects.create(run=run, key="next", index=1, next_attempt_at=now)
    # The claim's rule: a reached budget admits no item, not even one that reserves nothing.
    with transaction.atomic():
        assert Gate.open(run.pk, now).admit(None, "", reclaim=False)

    # The finished call reported no cost (a cache hit, say) and the items have no estimate.
    outcome = ExecutionOutcome(finished.pk, "finished", SUCCEEDED, "", {"ok": True})
    done = hand_over_spending(run.pk, token, outcome, "worker-next", uuid.uuid4(), 30.0)

    assert done.written
    assert done.next is None or done.refused, (
        f"on {connection.vendor} the hand-over gave the slot to item {done.next.key!r} "
        "past the run's spent budget"
    )
