"""The hand-over of an item that counts cost is one round trip where the database has a routine
for it (PostgreSQL's function, MariaDB's procedure): the finished item's reservation becomes
what it cost, the next item reserves its estimate, and a budget refuses it as a claim would."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from fanout import spend
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import CapacityPool, ItemClaim, ItemStatus, SpendAccount
from fanout.transitions import SUCCEEDED, ExecutionOutcome, hand_over, hand_over_spending
from tests.testapp.fanouts_spend import SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = 30.0


def one_running(budget: float, pool_budget: float) -> tuple[int, ItemClaim, uuid.UUID]:
    """A run of three items estimated at $0.10 in a pool with a budget; one of them running."""
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the one-round-trip hand-over is PostgreSQL's and MariaDB/MySQL's")
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=5)
    SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=pool_budget)
    definition = get_definition("spend_pooled")
    run = prepare_run(definition, {"n": 3, "estimate": 0.1}, f"handed-{uuid.uuid4().hex[:8]}")
    spend.open_run_budget(run.pk, {"usd": budget})
    taken = claim(run.pk, "w:1", 1, LEASE, 3, SPEND_POOL, spend=True)
    assert taken.token is not None and len(taken.items) == 1
    item = ItemClaim.objects.get(pk=taken.items[0].pk)
    return run.pk, item, taken.token


def hand(run_id: int, item: ItemClaim, token: uuid.UUID, cost: dict | None) -> object:
    outcome = ExecutionOutcome(
        item.pk, item.key, SUCCEEDED, SPEND_POOL, {"ok": 1}, cost=cost, accounted=True
    )
    return hand_over_spending(run_id, token, outcome, "w:1", uuid.uuid4(), LEASE)


def accounts(run_id: int) -> dict[str, tuple[float, float]]:
    rows = SpendAccount.objects.filter(run_id=run_id) | SpendAccount.objects.filter(pool=SPEND_POOL)
    return {
        ("run" if a.run_id else "pool"): (round(a.spent, 9), round(a.reserved, 9)) for a in rows
    }


@pytest.mark.parametrize("cost", [{"usd": 0.04, "tokens": 7.0}, None])
def test_a_spending_hand_over_is_one_round_trip_that_settles_and_reserves(
    cost: dict | None,
) -> None:
    run_id, item, token = one_running(budget=10, pool_budget=10)
    spend.run_has_budget(run_id)  # known to this process, as to a worker, after its claim
    with CaptureQueriesContext(connection) as queries:
        done = hand(run_id, item, token, cost)
    assert len(queries) == 1, [q["sql"][:80] for q in queries.captured_queries]
    assert done.written and done.next is not None and not done.refused
    item.refresh_from_db()
    assert item.status == ItemStatus.SUCCEEDED
    assert item.cost == (cost or {"usd": 0.1})  # a success that reported nothing: its estimate
    spent = (cost or {"usd": 0.1})["usd"]
    # The finished item's $0.10 reservation is spent, and the next item reserves its own.
    assert accounts(run_id) == {"run": (spent, 0.1), "pool": (spent, 0.1)}


def test_a_budget_that_the_next_items_estimate_would_pass_refuses_it() -> None:
    run_id, item, token = one_running(budget=10, pool_budget=0.15)
    done = hand(run_id, item, token, {"usd": 0.08})
    # $0.08 spent + $0.10 reserved passes the pool's $0.15: the worker records it released.
    assert done.written and done.next is not None and done.refused
    assert accounts(run_id)["pool"] == (0.08, 0.1)


def state(pool_spent: float, next_estimate: bool) -> tuple[int, ItemClaim, uuid.UUID]:
    """A run of items without estimates in a pool whose $1 budget has ``pool_spent``; one
    running, the next with an estimate or not (written as cost= would have)."""
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=5)
    account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=1.0)
    definition = get_definition("spend_billed_pooled")
    run = prepare_run(definition, {"n": 2}, f"agree-{uuid.uuid4().hex[:8]}")
    if next_estimate:
        ItemClaim.objects.filter(run=run, index=1).update(estimate={"usd": 0.1})
    taken = claim(run.pk, "w:1", 1, LEASE, 3, SPEND_POOL, spend=True)
    assert taken.token is not None and len(taken.items) == 1
    SpendAccount.objects.filter(pk=account.pk).update(spent=pool_spent)  # others spent since
    return run.pk, ItemClaim.objects.get(pk=taken.items[0].pk), taken.token


def python_rule(run_id: int, token: uuid.UUID, outcome: ExecutionOutcome) -> bool:
    """The hand-over, then the spend it moves by fanout.spend: where no routine does both."""
    with transaction.atomic():
        done = hand_over(run_id, token, outcome, "w:1", uuid.uuid4(), LEASE)
        assert done.written and done.next is not None
        return not spend.after_hand_over(outcome, run_id, done.next.pk, False)


@pytest.mark.parametrize(
    ("pool_spent", "next_estimate", "cost"),
    [(1.0, False, None), (1.0, True, None), (0.5, False, None), (0.95, True, {"usd": 0.01})],
)
def test_the_spending_routine_and_the_python_rule_agree_on_what_moves_and_what_is_refused(
    pool_spent: float, next_estimate: bool, cost: dict | None
) -> None:
    seen = []
    for routine in ("database", "python"):
        run_id, item, token = state(pool_spent, next_estimate)
        outcome = ExecutionOutcome(
            item.pk, item.key, SUCCEEDED, SPEND_POOL, {"ok": 1}, cost=cost, accounted=True
        )
        if routine == "database":
            refused = hand_over_spending(run_id, token, outcome, "w:1", uuid.uuid4(), LEASE).refused
        else:
            refused = python_rule(run_id, token, outcome)
        item.refresh_from_db()
        pool = SpendAccount.objects.get(pool=SPEND_POOL)
        seen.append((refused, item.cost, round(pool.spent, 9), round(pool.reserved, 9)))
        for model in (ItemClaim, SpendAccount, CapacityPool):
            model.objects.all().delete()
    assert seen[0] == seen[1]
