"""Cost per item: estimates written with the items, reserved while they run, replaced by what
the calls reported in the outcome's transaction."""

from __future__ import annotations

import pytest

from fanout import FanOut
from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.errors import FanoutError, Throttled
from fanout.models import CapacityPool, ItemClaim, RunStatus, SpendAccount
from fanout.report import final_report, snapshot
from project.demo.fanouts import FakeProvider
from tests.conftest import executions
from tests.procs import wait_until
from tests.testapp.fanouts_spend import PROMPT_USD, SPEND_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_item_carries_its_estimate_and_a_success_that_reports_nothing_costs_it() -> None:
    run = get_definition("spend_fixed").start({"n": 12}, workers=3)
    assert run.status == RunStatus.SUCCEEDED
    items = list(ItemClaim.objects.filter(run=run))
    assert [i.estimate for i in items] == [{"usd": 0.25, "requests": 1.0}] * 12
    assert [i.cost for i in items] == [{"usd": 0.25, "requests": 1.0}] * 12


def test_reported_costs_replace_the_reservations_and_the_run_budget_counts_them() -> None:
    definition = get_definition("spend_work")
    run = definition.start({"n": 30, "estimate": 0.1}, workers=4, max_spend={"usd": 100})
    assert run.status == RunStatus.SUCCEEDED
    costs = {i.key: i.cost["usd"] for i in ItemClaim.objects.filter(run=run)}
    account = SpendAccount.objects.get(run=run, unit="usd")
    assert account.reserved == pytest.approx(0.0, abs=1e-9)
    assert account.spent == pytest.approx(sum(costs.values()))
    assert all(0 <= c <= 0.1 for c in costs.values())
    assert len(set(costs.values())) > 1  # reported, not the estimate


def test_a_run_budget_stops_admission_and_the_items_left_wait_unrun() -> None:
    definition = get_definition("spend_work")
    # Estimates of $1 against a $5 budget: admission stops once another $1 would pass it.
    run = prepare_run(definition, {"n": 20, "estimate": 1.0}, max_spend={"usd": 5})
    handle = dispatch(run, definition, "inline", 4)
    assert handle is not None
    account = SpendAccount.objects.get(run=run, unit="usd")

    def settled() -> bool:
        account.refresh_from_db()
        running = ItemClaim.objects.filter(run=run, status="running").exists()
        return account.spent > 4 and not running and account.reserved < 1e-9

    try:
        wait_until(settled, 30, "the budget to be spent")
    finally:
        handle.stop.set()
        handle.join(timeout=30)
    items = list(ItemClaim.objects.filter(run=run))
    done = [i for i in items if i.status == "succeeded"]
    assert account.spent <= 5 + 1e-9
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in done))
    assert len(done) < 20
    waiting = [i for i in items if i.status == "pending"]
    assert len(waiting) == 20 - len(done)
    assert all(i.attempt == 1 and i.cost is None for i in waiting)


def test_a_run_held_by_its_budget_says_so_in_progress_and_in_the_json_report() -> None:
    definition = get_definition("spend_work")
    run = prepare_run(definition, {"n": 6, "estimate": 0.3}, max_spend={"usd": 0.5})
    handle = dispatch(run, definition, "inline", 2)
    assert handle is not None
    account = SpendAccount.objects.get(run=run, unit="usd")

    def held() -> bool:
        # Between two items nothing runs or is reserved either: held is when the next item's
        # estimate (0.3) no longer fits in what is left of the budget.
        account.refresh_from_db()
        running = ItemClaim.objects.filter(run=run, status="running").exists()
        return account.spent + 0.3 > 0.5 and not running and account.reserved < 1e-9

    try:
        wait_until(held, 30, "the budget to hold the run")
    finally:
        handle.stop.set()
        handle.join(timeout=30)
    account.refresh_from_db()
    expected = f"budget spent (${account.spent:,.2f} of $0.50, $0.00 reserved)"
    assert snapshot(run).why == expected
    report = final_report(run)
    assert report["why"] == expected
    assert report["spend"]["spent"]["usd"] == pytest.approx(account.spent)
    assert report["spend"]["budgets"][0]["budget"] == 0.5


def test_a_cost_read_from_the_handlers_answer_replaces_the_estimate() -> None:
    run = get_definition("spend_billed_key").start({"n": 10}, max_spend={"usd": 100})
    assert run.status == RunStatus.SUCCEEDED
    items = {i.payload: i for i in ItemClaim.objects.filter(run=run)}
    for n, item in items.items():
        # The answer's "billed" is what the call cost; a handler that reported wins.
        expected = 0.5 if n % 5 == 4 else 0.01 * (n % 5)
        assert item.cost == {"usd": pytest.approx(expected)}, item.key
    account = SpendAccount.objects.get(run=run, unit="usd")
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in items.values()))
    assert account.reserved == pytest.approx(0.0, abs=1e-9)


def test_a_cost_function_of_the_answer_counts_without_an_estimate() -> None:
    run = get_definition("spend_billed_function").start({"n": 10})
    assert run.status == RunStatus.SUCCEEDED
    items = {i.payload: i for i in ItemClaim.objects.filter(run=run)}
    assert all(i.estimate is None for i in items.values())
    for n, item in items.items():
        expected = 0.5 if n % 5 == 4 else 0.02 * (n % 5)
        assert item.cost == {"usd": pytest.approx(expected)}, item.key
    account = SpendAccount.objects.get(run=run, unit="usd")
    assert account.spent == pytest.approx(sum(i.cost["usd"] for i in items.values()))


def test_an_answer_whose_cost_cannot_be_read_fails_its_item_saying_why() -> None:
    run = get_definition("spend_billed_badly").start({"n": 3}, max_spend={"usd": 10})
    items = list(ItemClaim.objects.filter(run=run))
    assert [i.status for i in items] == ["failed"] * 3
    assert all(i.attempt == 1 and i.error_class == "CostNotReadable" for i in items)
    assert "cost_from='billed'" in items[0].error
    # The call was made and billed an amount nobody can read: it costs its estimate, as a
    # call cut off by a crash does, so the budget's bound still holds.
    assert [i.cost for i in items] == [{"usd": pytest.approx(0.1)}] * 3
    account = SpendAccount.objects.get(run=run, unit="usd")
    assert (account.spent, account.reserved) == (pytest.approx(0.3), pytest.approx(0.0))


@pytest.mark.parametrize("cost_from", [3, "", ["usd"]])
def test_cost_from_must_be_a_key_or_a_function(cost_from: object) -> None:
    with pytest.raises(FanoutError, match="cost_from must be a key of the handler's answer"):
        FanOut("spend_bad_option", over=list, do=str, cost_from=cost_from)


def test_the_join_sees_what_each_outcome_cost_by_unit() -> None:
    run = get_definition("spend_joined").start({"n": 8}, max_spend={"usd": 100})
    assert run.status == RunStatus.SUCCEEDED, run.error
    costs = {i.key: i.cost for i in ItemClaim.objects.filter(run=run)}
    assert len({c["usd"] for c in costs.values()}) > 1  # reported, not the estimate
    assert run.join_result["costs"] == costs
    account = SpendAccount.objects.get(run=run, unit="usd")
    assert run.join_result["usd"] == pytest.approx(account.spent)


def test_a_throttled_calls_reported_cost_is_kept_and_its_retry_uses_no_attempt() -> None:
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=4)
    pool_account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=100)
    run = get_definition("spend_throttled").start({"n": 6, "throttles": 2}, workers=3)
    items = list(ItemClaim.objects.filter(run=run))
    assert run.status == RunStatus.SUCCEEDED, [(i.key, i.status, i.error[-300:]) for i in items]
    calls = executions(run.pk)
    assert len(items) == 6 and all(calls[i.key] == 3 for i in items)  # two 429s, then an answer
    for item in items:
        assert (item.status, item.attempt) == ("succeeded", 1)  # max_attempts=1: none used
        # Both throttled calls' prompts, then the answer's: nothing lost, nothing doubled.
        expected = 2 * PROMPT_USD + PROMPT_USD + item.result["usd"]
        assert item.cost == {"usd": pytest.approx(expected)}, item.key
    pool_account.refresh_from_db()
    assert pool_account.spent == pytest.approx(sum(i.cost["usd"] for i in items))
    assert pool_account.reserved == pytest.approx(0.0, abs=1e-9)


def test_the_demo_providers_429_is_a_throttle_not_a_handler_error() -> None:
    provider = FakeProvider(tokens_per_second=300)
    assert 75 <= provider.complete("swift-small", "p", 300, "seed") <= 300
    with pytest.raises(Throttled) as answered:  # its bucket is empty: 429
        provider.complete("swift-small", "p", 300, "seed")
    assert answered.value.retry_after == 0.5 and "429" in str(answered.value)


def test_a_cost_read_from_the_answer_without_an_estimate_or_budget_reaches_item_and_pool() -> None:
    # The docs' promise: without cost= or a run budget, the answer's cost is kept on the item
    # and counted by its pool's budget, on every path an outcome takes (a claim that records
    # it, or the hand-over of its slot to the next item).
    CapacityPool.objects.create(name=SPEND_POOL, max_concurrency=1)
    pool_account = SpendAccount.objects.create(pool=SPEND_POOL, unit="usd", budget=100)
    run = get_definition("spend_billed_pooled").start({"n": 10}, workers=1)
    assert run.status == RunStatus.SUCCEEDED, run.error
    items = {i.payload: i for i in ItemClaim.objects.filter(run=run)}
    for n, item in items.items():
        expected = 0.5 if n % 5 == 4 else 0.01 * (n % 5)
        assert (item.cost or {}).get("usd", 0.0) == pytest.approx(expected), item.key
    pool_account.refresh_from_db()
    assert pool_account.spent == pytest.approx(sum(i.cost["usd"] for i in items.values()))


def test_an_answers_cost_too_large_for_a_float_fails_its_item_saying_why() -> None:
    run = get_definition("spend_billed_hugely").start({"n": 2}, workers=1)
    items = list(ItemClaim.objects.filter(run=run))
    assert [(i.status, i.error_class) for i in items] == [("failed", "CostNotReadable")] * 2
    assert "usd must be a finite number" in items[0].error
