"""The budgets' page: spend against each budget, the runs and pools that spent most first, and
the budget the one field an operator raises."""

from __future__ import annotations

import pytest
from django.urls import reverse

from fanout.models import CapacityPool, SpendAccount

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
