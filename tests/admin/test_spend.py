"""The budgets' page: spend against each budget, the runs and pools that spent most first, and
the budget the one field an operator raises."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from fanout.models import CapacityPool, ItemClaim, ItemStatus, SpendAccount

from .helpers import make_run

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:fanout_spendaccount_changelist")


def test_the_budgets_page_shows_spend_against_each_budget_most_spent_first(admin_client):
    run = make_run()
    CapacityPool.objects.create(name="llm")
    SpendAccount.objects.create(run=run, unit="usd", budget=50, spent=49.8, reserved=0.6)
    SpendAccount.objects.create(pool="llm", unit="tokens", budget=90000, spent=1200)
    response = admin_client.get(CHANGELIST)
    assert response.status_code == 200
    rows = list(response.context["cl"].result_list)
    assert [r.unit for r in rows] == ["tokens", "usd"]  # 1,200 tokens spent, then $49.80
    html = response.content.decode()
    assert "$50.40 of $50.00" in html
    assert "$49.80" in html and "$0.60" in html
    assert f"run {run.pk}" in html and "pool llm" in html


def test_an_operator_raises_a_budget_but_cannot_write_what_was_spent(admin_client):
    run = make_run()
    account = SpendAccount.objects.create(run=run, unit="usd", budget=5, spent=4.9)
    url = reverse("admin:fanout_spendaccount_change", args=[account.pk])
    form = admin_client.get(url).context["adminform"].form
    assert list(form.fields) == ["budget"]
    response = admin_client.post(url, {"budget": "20"})
    assert response.status_code == 302
    account.refresh_from_db()
    assert (account.budget, account.spent) == (20, 4.9)


BAR = 'class="fanout-budget" data-unit="usd"'


def spending_run() -> tuple[Any, ItemClaim, ItemClaim]:
    """A run with a $50 budget: two items that cost $20 each, one running on a $0.60 estimate."""
    run = make_run({"succeeded": 2, "running": 1})
    SpendAccount.objects.create(run=run, unit="usd", budget=50, spent=40, reserved=0.6)
    done = list(ItemClaim.objects.filter(run=run, status=ItemStatus.SUCCEEDED))
    ItemClaim.objects.filter(pk__in=[i.pk for i in done]).update(cost={"usd": 20, "tokens": 900})
    running = ItemClaim.objects.get(run=run, status=ItemStatus.RUNNING)
    ItemClaim.objects.filter(pk=running.pk).update(estimate={"usd": 0.6})
    return run, done[0], running


def test_the_run_page_shows_spend_by_unit_beside_the_runs_budget_bar(admin_client):
    run, _, _ = spending_run()

    response = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))

    spend = response.context["spend"]
    assert {r["unit"]: (r["spent"], r["reserved"]) for r in spend["rows"]} == {
        "tokens": ("1,800 tokens", "0 tokens"),
        "usd": ("$40.00", "$0.60"),
    }
    html = response.content.decode()
    panel = html.split('data-field="spend"')[1].split("</section>")[0]
    assert "$40.00" in panel and "$0.60" in panel
    assert BAR in panel and "$40.60 of $50.00" in panel  # the bar: spent + reserved of budget
    assert 'data-unit="tokens"' in panel and "1,800 tokens" in panel


def test_a_run_that_counts_no_cost_shows_no_spend(admin_client):
    run = make_run({"succeeded": 2})

    response = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))

    assert response.context["spend"] is None
    assert 'data-field="spend"' not in response.content.decode()


def test_the_item_page_shows_what_the_item_spent_and_what_it_holds_while_it_runs(admin_client):
    _, done, running = spending_run()

    done_html = admin_client.get(reverse("admin:fanout_itemclaim_change", args=[done.pk]))
    running_html = admin_client.get(reverse("admin:fanout_itemclaim_change", args=[running.pk]))

    panel = done_html.content.decode().split('data-field="spend"')[1].split("</section>")[0]
    assert "$20.00" in panel and "900 tokens" in panel
    held = running_html.content.decode().split('data-field="spend"')[1].split("</section>")[0]
    assert '<td class="fanout-num" data-field="reserved">$0.60</td>' in held


def test_the_pool_page_shows_its_budget_bar_drawn_as_on_the_run_page_and_the_budgets_page(
    admin_client,
):
    pool = CapacityPool.objects.create(name="llm")
    SpendAccount.objects.create(pool="llm", unit="usd", budget=10, spent=2.5, reserved=0.5)
    run, _, _ = spending_run()

    pool_html = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))
    run_html = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))
    list_html = admin_client.get(CHANGELIST)

    headline = pool_html.content.decode().split('class="fanout-headline"')[1].split("</div>")[0]
    assert BAR in headline and "$3.00 of $10.00" in headline
    # One include draws every budget bar: the same markup on all three pages.
    bars = [
        re.search(
            r'<span class="fanout-budget".*?</span>\s*</span>\s*</span>',
            page.content.decode(),
            re.S,
        )
        for page in (pool_html, run_html, list_html)
    ]
    assert all(bars)
    shapes = {re.sub(r">[^<]*<|(value|title)=\"[^\"]*\"", "", b.group(0)) for b in bars if b}
    assert len(shapes) == 1, shapes
