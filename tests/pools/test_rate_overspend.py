"""A reclaimed item is a new call to the provider: it spends a token of its pool's bucket, and
that token is gone for every other item of the same claim."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fanout import claim as claiming
from fanout.claim import claim
from fanout.clock import db_now, db_now_plus
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import CapacityPool, ItemClaim, ItemStatus
from tests.testapp.fanouts_pools import RATE_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_claim_that_reclaims_an_item_with_the_last_token_admits_no_fresh_item() -> None:
    # One call an hour: the bucket never refills within the test.
    CapacityPool.objects.create(name=RATE_POOL, max_concurrency=10, rate_count=1, rate_period=3600)
    run = prepare_run(get_definition("pools_rate"), {"n": 2}, "overspend")
    first = claim(run.pk, "dead-worker", 1, 30, 3, RATE_POOL)
    assert len(first.items) == 1
    # The bucket holds exactly one token again, and the first item's owner died.
    CapacityPool.objects.filter(name=RATE_POOL).update(tokens=1.0, tokens_at=db_now())
    ItemClaim.objects.filter(pk=first.items[0].pk).update(lease_expires_at=db_now_plus(-60))
    # This process looked for expired leases a moment ago; make its next claim look first, as
    # one does at most twice a second (the order in which the spending went wrong).
    claiming._expired_checked.pop(run.pk, None)

    second = claim(run.pk, "next-worker", 2, 30, 3, RATE_POOL)

    assert [i.pk for i in second.items] == [first.items[0].pk]
    pool = CapacityPool.objects.get(name=RATE_POOL)
    assert pool.tokens is not None and pool.tokens >= 0, pool.tokens
    fresh = ItemClaim.objects.filter(run=run).exclude(pk=first.items[0].pk).get()
    assert fresh.status == ItemStatus.PENDING
    # The fresh item waits for the next token, an hour after the last one was spent.
    assert second.retry_at is not None and second.retry_at > db_now() + timedelta(minutes=50)
    assert second.reason.startswith(f"{RATE_POOL}: rate limited until"), second.reason
