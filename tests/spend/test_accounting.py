"""Cost per item: estimates written with the items, reserved while they run, replaced by what
the calls reported in the outcome's transaction."""

from __future__ import annotations

import pytest

from fanout.definition import get_definition
from fanout.dispatch import dispatch, prepare_run
from fanout.models import ItemClaim, RunStatus, SpendAccount
from fanout.report import final_report, snapshot
from tests.procs import wait_until

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
