"""The pools' page: usage against limits, editable limits, pause and resume."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from fanout.admin.pools import PoolRow
from fanout.models import CapacityPool, ItemClaim, ItemStatus

from .helpers import action, make_run, messages_of

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:fanout_capacitypool_changelist")


def change_url(pool: CapacityPool) -> str:
    return reverse("admin:fanout_capacitypool_change", args=[pool.pk])


def row(response, name: str) -> PoolRow:
    """What the pool list shows on the line of the pool ``name``."""
    cl = response.context["cl"]
    [pool] = [p for p in cl.result_list if p.name == name]
    return cl.facts[pool.pk]


def test_the_pool_list_shows_in_flight_against_the_limit_and_a_full_pool_as_blocked(
    admin_client,
):
    CapacityPool.objects.create(name="provider-a", max_concurrency=3)
    make_run({"running": 3, "pending": 4}, pool="provider-a")

    response = admin_client.get(CHANGELIST)

    assert row(response, "provider-a") == PoolRow(
        in_flight=3, admitted=3, pending=4, reason="pool full (3/3)"
    )
    html = response.content.decode()
    assert '<meter min="0" max="3"' in html and "3 / 3" in html
    assert "pool full (3/3)" in html
    assert "?pool=provider-a&amp;status=pending" in html


def test_admissions_count_claims_within_each_pools_own_rate_period(admin_client):
    CapacityPool.objects.create(name="per-second", max_concurrency=10, rate_count=5)
    CapacityPool.objects.create(
        name="per-minute", max_concurrency=10, rate_count=100, rate_period=60
    )
    fast = make_run({"succeeded": 4}, pool="per-second")
    slow = make_run({"succeeded": 4}, pool="per-minute")
    now = timezone.now()
    for run in (fast, slow):
        items = ItemClaim.objects.filter(run=run)
        items.filter(index__lt=2).update(claimed_at=now - timedelta(seconds=0.2))
        items.filter(index__gte=2).update(claimed_at=now - timedelta(seconds=30))

    response = admin_client.get(CHANGELIST)

    assert row(response, "per-second").admitted == 2
    assert row(response, "per-minute").admitted == 4
    assert "2 / 5 per 1s" in response.content.decode()


def test_limits_are_editable_but_the_name_and_the_workers_state_are_not(admin_client):
    pool = CapacityPool.objects.create(name="provider-a", max_concurrency=3, rate_count=10)
    form = admin_client.get(change_url(pool)).context["adminform"].form
    assert set(form.fields) == {"max_concurrency", "rate_count", "rate_period", "burst"}
    # A worker spends tokens and backs off after the operator opened the page.
    until = timezone.now() + timedelta(seconds=30)
    CapacityPool.objects.filter(pk=pool.pk).update(tokens=1.5, backoff_until=until)

    response = admin_client.post(
        change_url(pool),
        {
            "name": "renamed",
            "max_concurrency": 7,
            "rate_count": 10,
            "rate_period": 1.0,
            "burst": "",
        },
    )

    assert response.status_code == 302
    pool.refresh_from_db()
    assert pool.name == "provider-a" and pool.max_concurrency == 7
    assert pool.tokens == 1.5 and pool.backoff_until == until


def test_a_pool_can_be_created_in_the_admin(admin_client):
    response = admin_client.post(
        reverse("admin:fanout_capacitypool_add"),
        {"name": "new-provider", "max_concurrency": 2, "rate_count": "", "rate_period": 1.0},
    )

    assert response.status_code == 302
    assert CapacityPool.objects.get(name="new-provider").max_concurrency == 2


def test_pause_and_resume_flip_the_selected_pools(admin_client):
    a = CapacityPool.objects.create(name="a")
    b = CapacityPool.objects.create(name="b", paused=True)

    paused = action(admin_client, CHANGELIST, "pause_pools", a.pk, b.pk)
    assert set(CapacityPool.objects.filter(paused=True).values_list("name", flat=True)) >= {
        "a",
        "b",
    }
    resumed = action(admin_client, CHANGELIST, "resume_pools", a.pk)

    assert messages_of(paused) == ["Paused 1 pool: they admit no new items."]
    assert messages_of(resumed) == ["Resumed 1 pool."]
    assert not CapacityPool.objects.get(pk=a.pk).paused
    assert CapacityPool.objects.get(pk=b.pk).paused


def test_a_paused_pool_holds_its_runs_items_as_waiting(admin_client):
    pool = CapacityPool.objects.create(name="provider-a")
    run = make_run({"pending": 3}, pool="provider-a")
    action(admin_client, CHANGELIST, "pause_pools", pool.pk)

    response = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))

    assert response.context["counts"]["waiting"] == 3
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.PENDING).count() == 3


def test_pausing_needs_the_pause_permission(operator):
    pool = CapacityPool.objects.create(name="provider-a")
    without, holder = operator(), operator("pause_pool")

    assert without.get(CHANGELIST).context["action_form"] is None
    action(without, CHANGELIST, "pause_pools", pool.pk)
    assert not CapacityPool.objects.get(pk=pool.pk).paused

    action(holder, CHANGELIST, "pause_pools", pool.pk)
    assert CapacityPool.objects.get(pk=pool.pk).paused


def test_a_pool_that_unfinished_items_use_cannot_be_deleted(admin_client):
    busy = CapacityPool.objects.create(name="busy")
    idle = CapacityPool.objects.create(name="idle")
    make_run({"pending": 1}, pool="busy")
    make_run({"succeeded": 1}, pool="idle")

    refused = admin_client.post(reverse("admin:fanout_capacitypool_delete", args=[busy.pk]))
    deleted = admin_client.post(
        reverse("admin:fanout_capacitypool_delete", args=[idle.pk]), {"post": "yes"}
    )

    assert refused.status_code == 403 and CapacityPool.objects.filter(pk=busy.pk).exists()
    assert deleted.status_code == 302 and not CapacityPool.objects.filter(pk=idle.pk).exists()
    form = admin_client.get(CHANGELIST).context["action_form"]
    assert "delete_selected" not in dict(form.fields["action"].choices)


# ------------------------------------------------------------------ the pool's own page


def test_the_pool_page_shows_the_burst_it_applies_and_says_whether_it_is_paused(admin_client):
    pool = CapacityPool.objects.create(name="smtp", max_concurrency=5, rate_count=50)

    page = admin_client.get(change_url(pool)).content.decode()

    assert "50 (the rate count)" in page
    assert "no: admitting" in page
    assert "defaults to the rate count" not in page


def test_the_pool_page_pauses_and_resumes_its_pool_for_holders_of_the_pause_permission(
    operator,
):
    pool = CapacityPool.objects.create(name="smtp", max_concurrency=5)
    switch = reverse("admin:fanout_capacitypool_pause", args=[pool.pk])
    viewer = operator()
    assert "Pause pool" not in viewer.get(change_url(pool)).content.decode()
    assert viewer.post(switch, {"paused": "1"}).status_code == 403
    assert not CapacityPool.objects.get(pk=pool.pk).paused

    pauser = operator("pause_pool")
    assert "Pause pool" in pauser.get(change_url(pool)).content.decode()
    assert pauser.get(switch).status_code == 405
    response = pauser.post(switch, {"paused": "1"})
    assert response.status_code == 302 and response.url == change_url(pool)
    assert CapacityPool.objects.get(pk=pool.pk).paused
    assert "Resume pool" in pauser.get(change_url(pool)).content.decode()
    pauser.post(switch, {"paused": "0"})
    assert not CapacityPool.objects.get(pk=pool.pk).paused


def test_the_pool_page_lists_the_runs_using_or_waiting_on_it(admin_client):
    pool = CapacityPool.objects.create(name="smtp", max_concurrency=5)
    busy = make_run({"running": 2, "pending": 3, "succeeded": 1}, pool="smtp")
    waiting = make_run({"pending": 4}, pool="smtp")
    make_run({"succeeded": 2}, pool="smtp", status="succeeded")
    make_run({"pending": 2}, pool="other")

    runs = admin_client.get(change_url(pool)).context["pool_runs"]

    assert [(r["run_id"], r["running"], r["pending"]) for r in runs] == [
        (busy.pk, 2, 3),
        (waiting.pk, 0, 4),
    ]
