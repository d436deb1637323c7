"""The item list: django-filter filters, why an item waits, and the per-item actions."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import django
import pytest
from django.urls import reverse
from django.utils import timezone

from fanout.admin import ItemClaimAdmin
from fanout.admin.common import worker_name
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.record import SUCCEEDED, ExecutionOutcome, record

from .helpers import action, make_run, messages_of, page_action, statuses

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:fanout_itemclaim_changelist")


# Actions offered on an object's own page came with Django 6.1.
BEFORE_PAGE_ACTIONS = pytest.mark.skipif(
    django.VERSION < (6, 1), reason="actions on an object's page came in Django 6.1"
)


def keys(response) -> list[str]:
    return [i.key for i in response.context["cl"].result_list]


def item_url(item: ItemClaim) -> str:
    return reverse("admin:fanout_itemclaim_change", args=[item.pk])


# ---------------------------------------------------------------------- filters


def test_items_filter_by_run_and_status(admin_client):
    run = make_run({"succeeded": 2, "failed": 1})
    make_run({"failed": 1})

    response = admin_client.get(CHANGELIST, {"run": run.pk, "status": "failed"})

    assert response.status_code == 200
    assert keys(response) == ["item-000002"]


def test_the_held_filter_lists_pending_items_held_by_a_retry_or_a_pool(admin_client):
    CapacityPool.objects.create(name="slow-api", max_concurrency=1, paused=True)
    held_by_retry = make_run({"pending": 3}, waiting=1)
    held_by_pool = make_run({"pending": 2}, pool="slow-api")
    on_a_child = make_run({"waiting": 1, "pending": 1})

    response = admin_client.get(CHANGELIST, {"status": "held"})

    got = {(i.run_id, i.key) for i in response.context["cl"].result_list}
    assert got == {
        (held_by_retry.pk, "item-000000"),
        (held_by_pool.pk, "item-000000"),
        (held_by_pool.pk, "item-000001"),
    }
    # The status "waiting" is an item whose work a child run does: a filter of its own.
    response = admin_client.get(CHANGELIST, {"status": "waiting"})
    assert {(i.run_id, i.key) for i in response.context["cl"].result_list} == {
        (on_a_child.pk, "item-000000")
    }


def test_items_filter_by_pool_error_class_attempts_and_lease_holder(admin_client):
    CapacityPool.objects.create(name="provider-a", max_concurrency=3)
    run = make_run({"failed": 4, "running": 1}, pool="provider-a")
    make_run({"failed": 1})
    ItemClaim.objects.filter(run=run, index=1).update(attempt=1)

    def get(**params):
        return keys(admin_client.get(CHANGELIST, params))

    assert len(get(pool="provider-a")) == 5
    assert get(run=run.pk, error_class="TimeoutError") == ["item-000001", "item-000003"]
    assert get(run=run.pk, attempt_max=1) == ["item-000001", "item-000004"]
    assert get(run=run.pk, attempt_min=2, attempt_max=3) == [
        "item-000000",
        "item-000002",
        "item-000003",
    ]
    assert get(owner="worker-2") == ["item-000004"]


def test_items_filter_by_when_they_finished(admin_client):
    run = make_run({"succeeded": 3})
    now = timezone.now()
    ItemClaim.objects.filter(run=run, index=0).update(finished_at=now - timedelta(days=2))
    ItemClaim.objects.filter(run=run, index=2).update(finished_at=now + timedelta(days=2))
    after = (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    before = (now + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")

    response = admin_client.get(
        CHANGELIST, {"run": run.pk, "finished_after": after, "finished_before": before}
    )

    assert keys(response) == ["item-000001"]


def test_an_invalid_filter_value_is_reported_not_crashed_on(admin_client):
    response = admin_client.get(CHANGELIST, {"attempt_min": "many"})

    assert response.status_code == 302
    assert response.url.endswith("?e=1")


def test_items_are_searched_by_key_and_error_text(admin_client):
    run = make_run({"succeeded": 2, "failed": 2})

    by_key = keys(admin_client.get(CHANGELIST, {"run": run.pk, "q": "item-000001"}))
    by_error = keys(admin_client.get(CHANGELIST, {"run": run.pk, "q": "item 3 broke"}))

    assert by_key == ["item-000001"]
    assert by_error == ["item-000003"]


def test_the_filter_sidebar_keeps_the_other_filters_when_one_is_changed(admin_client):
    run = make_run({"failed": 1})

    html = admin_client.get(CHANGELIST, {"run": run.pk, "status": "failed"}).content.decode()

    # The status links keep the run; the value form carries the status along.
    assert f'href="?run={run.pk}&amp;status=pending"' in html
    assert '<input type="hidden" name="status" value="failed">' in html
    assert f'name="run" value="{run.pk}"' in html


# ---------------------------------------------------------------------- columns


def test_each_item_says_why_it_waits(admin_client):
    CapacityPool.objects.create(name="paused-api", max_concurrency=5, paused=True)
    CapacityPool.objects.create(name="open-api", max_concurrency=5)
    by_retry = make_run({"pending": 1}, waiting=1)
    by_pool = make_run({"pending": 1}, pool="paused-api")
    ready = make_run({"pending": 1}, pool="open-api")
    BatchRun.objects.filter(pk=ready.pk).update(started_at=timezone.now())
    full = make_run({"running": 4, "pending": 1})
    short_of_workers = make_run({"running": 1, "pending": 1})
    stalled = make_run({"pending": 1}, executor="rq")
    writing = make_run({"pending": 1}, status=RunStatus.PENDING)

    response = admin_client.get(CHANGELIST, {"status": "pending"})

    cl = response.context["cl"]
    why = {i.run_id: cl.facts[i.pk].why for i in cl.result_list}
    assert why[by_retry.pk].startswith("retry due in 1m")
    assert why[by_pool.pk] == "paused-api: pool paused"
    assert why[ready.pk] == "ready: the next free worker claims it"
    assert why[full.pk] == "run at max_parallel (4/4)"
    assert why[short_of_workers.pk] == (
        "1 running, up to 4 allowed: every thread of its run_fanout is busy "
        "(--workers sets how many)"
    )
    # Started five minutes ago, nothing claimed since, nothing running: nobody works on it.
    assert why[stalled.pk] == (
        "stalled: nothing running, no item claimed for 5m 00s; no live worker takes its drain "
        "jobs: start `manage.py rqworker fanout`, or re-dispatch it"
    )
    assert why[writing.pk] == "its run is still writing items"
    html = response.content.decode()
    assert "paused-api: pool paused" in html


def test_an_items_own_page_says_why_it_waits(admin_client):
    CapacityPool.objects.create(name="paused-api", paused=True)
    run = make_run({"pending": 1}, pool="paused-api")

    html = admin_client.get(item_url(ItemClaim.objects.get(run=run))).content.decode()

    assert "paused-api: pool paused" in html


def test_the_item_list_shows_attempts_lease_last_error_and_duration(admin_client):
    run = make_run({"failed": 1, "running": 1})

    html = admin_client.get(CHANGELIST, {"run": run.pk}).content.decode()

    assert "3/3" in html  # attempt / the definition's max_attempts
    assert "ValueError: item 0 broke" in html
    assert "Traceback" not in html  # only the last line of the error
    assert "in 9m 5" in html  # the running item's 10-minute lease
    assert "10s" in html  # started 30 s ago, finished 20 s ago


def test_a_lease_that_ran_out_shows_how_long_ago(admin_client):
    run = make_run({"running": 1}, lease_seconds=-90)

    html = admin_client.get(CHANGELIST, {"run": run.pk}).content.decode()

    assert "expired 1m 3" in html


def test_nobody_edits_adds_or_deletes_an_item_by_hand(admin_client):
    run = make_run({"failed": 1})
    item = ItemClaim.objects.get(run=run)

    page = admin_client.get(item_url(item))
    posted = admin_client.post(item_url(item), {"status": "succeeded"})

    assert page.status_code == 200 and page.context["adminform"].form.fields == {}
    assert posted.status_code == 403
    assert ItemClaim.objects.get(pk=item.pk).status == ItemStatus.FAILED
    assert admin_client.get(reverse("admin:fanout_itemclaim_add")).status_code == 403
    assert (
        admin_client.get(reverse("admin:fanout_itemclaim_delete", args=[item.pk])).status_code
        == 403
    )


# ---------------------------------------------------------------------- actions


def test_retry_selected_retries_only_the_failed_ones_among_them(admin_client):
    run = make_run({"succeeded": 2, "failed": 3}, status=RunStatus.FAILED)
    pks = list(ItemClaim.objects.filter(run=run).order_by("index").values_list("pk", flat=True))

    response = action(admin_client, CHANGELIST, "retry_items", pks[1], pks[2], pks[3])

    assert statuses(run) == {"succeeded": 2, "pending": 2, "failed": 1}
    assert ItemClaim.objects.get(pk=pks[4]).status == ItemStatus.FAILED
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.RUNNING
    assert "2 failed items back to pending. 1 item skipped" in messages_of(response)[0]


def test_retry_across_a_filtered_list_retries_every_failed_item_of_the_run(admin_client):
    run = make_run({"succeeded": 5, "failed": 250}, status=RunStatus.FAILED)
    other = make_run({"failed": 3}, status=RunStatus.FAILED)

    # The browser sends the page's checked rows along with "select all".
    first = ItemClaim.objects.filter(run=run, status=ItemStatus.FAILED).first()
    response = action(
        admin_client,
        f"{CHANGELIST}?run={run.pk}&status=failed",
        "retry_items",
        first.pk,
        across=True,
    )

    assert response.status_code == 302
    assert statuses(run) == {"succeeded": 5, "pending": 250}
    assert statuses(other) == {"failed": 3}


def test_cancel_selected_cancels_pending_items_only(admin_client):
    run = make_run({"running": 1, "pending": 2, "failed": 1})
    pks = list(ItemClaim.objects.filter(run=run).order_by("index").values_list("pk", flat=True))

    response = action(admin_client, CHANGELIST, "cancel_items", *pks)

    assert statuses(run) == {"running": 1, "cancelled": 2, "failed": 1}
    assert messages_of(response) == ["Cancelled 2 pending items."]


def test_cancelling_a_runs_last_pending_items_says_who_joins_it(admin_client):
    run = make_run({"succeeded": 1, "pending": 1})
    pending = ItemClaim.objects.get(run=run, status=ItemStatus.PENDING)

    response = action(admin_client, CHANGELIST, "cancel_items", pending.pk)

    assert f"run {run.pk} has no unfinished items left" in messages_of(response)[1]
    # The join runs in a worker, not in the request.
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.RUNNING


def test_force_release_gives_running_items_back_and_the_old_holder_cannot_record(admin_client):
    run = make_run({"running": 2, "pending": 1})
    held = list(ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING).order_by("index"))
    old_token = held[0].claim_token

    response = action(
        admin_client,
        CHANGELIST,
        "force_release_leases",
        *ItemClaim.objects.filter(run=run).values_list("pk", flat=True),
    )
    late = record(
        run.pk,
        old_token,
        [ExecutionOutcome(i.pk, i.key, SUCCEEDED, result={"late": True}) for i in held],
        run.failure_policy,
    )

    assert "Released 2 leases" in messages_of(response)[0]
    assert late.written == 0 and late.dropped == 2
    for item in ItemClaim.objects.filter(pk__in=[i.pk for i in held]):
        assert item.status == ItemStatus.PENDING
        assert item.claim_token is None and item.result is None


@BEFORE_PAGE_ACTIONS
def test_the_item_page_offers_its_actions_as_buttons_of_the_page(admin_client):
    run = make_run({"failed": 1})
    item = ItemClaim.objects.get(run=run)

    response = page_action(admin_client, item_url(item), "retry_items", item.pk)

    assert response.status_code == 302
    assert ItemClaim.objects.get(pk=item.pk).status == ItemStatus.PENDING


# ------------------------------------------------------------------ permissions


@BEFORE_PAGE_ACTIONS
@pytest.mark.parametrize(
    ("name", "codename", "counts", "expected"),
    [
        ("retry_items", "retry_item", {"failed": 2}, {"pending": 2}),
        ("cancel_items", "cancel_item", {"pending": 2}, {"cancelled": 2}),
        ("force_release_leases", "force_release_item", {"running": 2}, {"pending": 2}),
    ],
)
def test_each_item_action_needs_its_own_permission(operator, name, codename, counts, expected):
    run = make_run(counts)
    pks = list(ItemClaim.objects.filter(run=run).values_list("pk", flat=True))
    others = {"retry_item", "cancel_item", "force_release_item"} - {codename}

    def offered(client):
        form = client.get(CHANGELIST).context["action_form"]
        return form is not None and name in dict(form.fields["action"].choices)

    for client in (operator(), operator(*others)):
        assert not offered(client)
        assert action(client, CHANGELIST, name, *pks).status_code in (200, 302, 403)
        assert page_action(client, item_url(ItemClaim.objects.get(pk=pks[0])), name, pks[0])
        assert statuses(run) == counts

    holder = operator(codename)
    assert offered(holder)
    action(holder, CHANGELIST, name, *pks)
    assert statuses(run) == expected


def test_retrying_items_does_not_let_one_force_release_leases(operator):
    client = operator("retry_item", "cancel_item")
    run = make_run({"running": 1})
    item = ItemClaim.objects.get(run=run)
    token = item.claim_token

    action(client, CHANGELIST, "force_release_leases", item.pk)

    item.refresh_from_db()
    assert item.status == ItemStatus.RUNNING and item.claim_token == token
    assert isinstance(token, uuid.UUID)


@pytest.mark.parametrize(
    ("status", "left_out"),
    [
        ("failed", {"why_it_waits"}),
        ("pending", {"lease", "duration_display"}),
        ("running", {"why_it_waits", "duration_display"}),
        ("", set()),
    ],
)
def test_a_status_filter_leaves_out_the_columns_it_would_leave_empty(
    admin_client, status, left_out
):
    make_run({"failed": 1, "pending": 1, "running": 1})

    cl = admin_client.get(CHANGELIST, {"status": status} if status else {}).context["cl"]

    assert set(ItemClaimAdmin.list_display) - set(cl.list_display) == left_out
    assert "last_error" in cl.list_display


# ------------------------------------------------------------------ reading items at a glance


def test_the_failed_item_list_shows_each_errors_short_class_and_its_message(admin_client):
    run = make_run({"failed": 1}, status=RunStatus.FAILED)
    ItemClaim.objects.filter(run=run).update(
        error="Traceback (most recent call last):\n  ...\n"
        "fanout.errors.PermanentError: card declined by the issuer",
        owner="worker-host-7.eu-west-1.internal:48211:fanout-drain-3",
    )

    page = admin_client.get(CHANGELIST, {"run": run.pk, "status": "failed"}).content.decode()

    assert ">PermanentError: card declined by the issuer</span>" in page
    assert "fanout.errors.PermanentError" not in page.split('title="')[-1]
    # The worker: its host's first label and process over its thread, the whole in the tooltip.
    assert '<span class="fanout-host">worker-host-7 · 48211</span>' in page
    assert 'title="worker-host-7.eu-west-1.internal:48211:fanout-drain-3"' in page


def test_only_a_pending_item_shows_when_its_next_attempt_may_start(admin_client):
    run = make_run({"succeeded": 1, "pending": 1})
    done, pending = ItemClaim.objects.filter(run=run).order_by("index")

    assert (
        "next attempt not before" not in admin_client.get(item_url(done)).content.decode().lower()
    )
    assert "next attempt not before" in admin_client.get(item_url(pending)).content.decode().lower()


def test_a_lost_workers_attempt_shows_how_long_it_may_have_run_not_its_lease(admin_client):
    from fanout.models import ItemAttempt

    run = make_run({"pending": 2})
    early, late = ItemClaim.objects.filter(run=run).order_by("index")
    started = timezone.now() - timedelta(minutes=10)
    # Its lease ran out 30 s (the lease) after it started: it may have died at once.
    ItemAttempt.objects.create(
        item=early,
        attempt=1,
        owner="h:1:t",
        started_at=started,
        finished_at=started + timedelta(seconds=30),
        error_class="WorkerLost",
        error="lost",
    )
    # It renewed for a while: it ran at least until its last renewal, 90 s in.
    ItemAttempt.objects.create(
        item=late,
        attempt=1,
        owner="h:1:t",
        started_at=started,
        finished_at=started + timedelta(seconds=120),
        error_class="WorkerLost",
        error="lost",
    )

    assert "lost after at most 30s" in admin_client.get(item_url(early)).content.decode()
    assert "lost after 1m 30s to 2m 00s" in admin_client.get(item_url(late)).content.decode()


def test_retrying_items_of_an_inline_run_without_rq_asks_first(admin_client, settings):
    settings.RQ_QUEUES = {"default": {"URL": settings.REDIS_URL}}
    run = make_run({"failed": 2}, status=RunStatus.FAILED)
    pks = list(ItemClaim.objects.filter(run=run).values_list("pk", flat=True))

    asked = action(admin_client, CHANGELIST, "retry_items", *pks)

    assert asked.status_code == 200
    assert f"manage.py run_fanout --resume {run.pk}" in asked.content.decode()
    assert statuses(run) == {"failed": 2}
    confirmed = admin_client.post(
        CHANGELIST,
        {
            **dict(asked.context["repost"]),
            "_selected_action": [str(p) for p in pks],
            "fanout_confirmed": "yes",
        },
    )
    assert confirmed.status_code == 302
    assert statuses(run) == {"pending": 2}


@pytest.mark.parametrize(
    ("owner", "host", "thread"),
    [
        ("worker-7.eu-west-1.internal:48211:fanout-drain-3", "worker-7 · 48211", "fanout-drain-3"),
        ("10.0.0.5:311:fanout-drain-1", "10.0.0.5 · 311", "fanout-drain-1"),
        # An inline worker's thread is named for its place among the run's threads.
        ("vm:3957:MainThread:inline-4", "vm · 3957", "inline-4"),
    ],
)
def test_a_worker_in_a_list_is_its_hosts_first_label_process_and_thread_on_one_line(
    owner, host, thread
):
    """ "vm · 11010 / MainThread / · inline-2" took four lines of a list's row."""
    shown = worker_name(owner, short=True)

    assert f'title="{owner}"' in shown
    assert (
        f'<span class="fanout-host">{host}</span> · <span class="fanout-thread">{thread}</span>'
        in shown
    )
    assert "fanout-sub" not in shown


def test_an_item_cancelled_before_it_ran_shows_no_attempt(admin_client):
    run = make_run({"succeeded": 1, "pending": 2})
    ItemClaim.objects.filter(run=run, status="pending").update(
        status="cancelled", finished_at=timezone.now(), error_class="Cancelled"
    )

    response = admin_client.get(reverse("admin:fanout_itemclaim_changelist") + f"?run={run.pk}")

    cells = re.findall(r'<td class="field-attempts">(.*?)</td>', response.content.decode())
    assert sorted(re.sub(r"<[^>]+>", "", c) for c in cells) == ["-", "-", "1/3"], cells


def test_an_items_page_marks_every_empty_field_alike(admin_client):
    """Its empty result read "—" beside "-" in the fields around it."""
    run = make_run({"failed": 1}, status=RunStatus.FAILED)
    item = ItemClaim.objects.get(run=run)

    page = admin_client.get(reverse("admin:fanout_itemclaim_change", args=[item.pk]))

    fields = page.content.decode().split('id="content-main"')[1]
    assert "—" not in fields
    assert re.search(r'<div class="readonly">-</div>', fields)
