"""The runs' pages and actions, through the Django test client on real PostgreSQL."""

from __future__ import annotations

import importlib.util
import json
import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse
from django.utils import timezone

from fanout.actions import retry_failed
from fanout.models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from fanout.report import snapshot

from .helpers import action, make_run, messages_of, page_action, statuses

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:fanout_batchrun_changelist")


def change_url(run: BatchRun) -> str:
    return reverse("admin:fanout_batchrun_change", args=[run.pk])


def progress_url(run: BatchRun) -> str:
    return reverse("admin:fanout_batchrun_progress", args=[run.pk])


# ------------------------------------------------------------------------ pages


def test_the_run_list_shows_each_runs_progress_bar_counts_and_rate(admin_client):
    run = make_run({"succeeded": 6, "failed": 2, "running": 1, "pending": 3}, waiting=1)

    response = admin_client.get(CHANGELIST)

    assert response.status_code == 200
    html = response.content.decode()
    assert run.run_key.removeprefix(f"{run.definition}:") in html  # its name has a column
    assert "fanout-seg-succeeded" in html and "fanout-seg-failed" in html
    assert "fanout-seg-waiting" in html and "fanout-seg-running" in html
    assert "2 failed" in html and "1 running" in html and "1 waiting" in html
    # 8 done of 12 in the 5 minutes since it started.
    assert "<strong>8</strong>&thinsp;/&thinsp;12" in html
    assert "0.03/s" in html


def test_the_run_list_searches_by_run_key_and_filters_by_status_and_definition(admin_client):
    wanted = make_run({"succeeded": 1}, run_key="nightly-2026-11-29")
    other = make_run({"failed": 1}, status=RunStatus.FAILED, run_key="weekly-48")

    found = admin_client.get(CHANGELIST, {"q": "nightly"}).context["cl"].result_list
    failed = admin_client.get(CHANGELIST, {"status__exact": "failed"}).context["cl"].result_list
    by_definition = admin_client.get(CHANGELIST, {"definition": "admin-console"})

    assert [r.pk for r in found] == [wanted.pk]
    assert [r.pk for r in failed] == [other.pk]
    assert {r.pk for r in by_definition.context["cl"].result_list} == {wanted.pk, other.pk}


def test_the_run_list_filters_by_the_date_a_run_was_created(admin_client):
    run = make_run({"succeeded": 1})
    cl = admin_client.get(CHANGELIST).context["cl"]
    [dates] = [s for s in cl.filter_specs if s.title == "created at"]
    links = {c["display"]: c["query_string"] for c in dates.choices(cl)}

    today = admin_client.get(CHANGELIST + links["Today"]).context["cl"].result_list

    assert [r.pk for r in today] == [run.pk]


def test_the_run_page_groups_failures_by_error_class_with_one_example_each(admin_client):
    run = make_run(
        {"succeeded": 4, "failed": 5}, error_classes=("ValueError", "ValueError", "KeyError")
    )

    response = admin_client.get(change_url(run))

    assert response.status_code == 200
    groups = [(f["group"].error_class, f["group"].count) for f in response.context["failures"]]
    assert groups == [("ValueError", 4), ("KeyError", 1)]
    example = response.context["failures"][0]["group"].example
    assert example.key == "item-000004"
    assert "ValueError: item 4 broke" in response.content.decode()
    assert f"?run={run.pk}&amp;status=failed&amp;error_class=KeyError" in response.content.decode()


def test_the_run_page_links_its_items_filtered_by_status(admin_client):
    run = make_run({"succeeded": 1, "failed": 1})

    html = admin_client.get(change_url(run)).content.decode()

    # The bar's "waiting" segment (pending items held back) links to the "held" filter.
    for status in ("succeeded", "failed", "running", "held", "pending", "cancelled"):
        assert f"?run={run.pk}&amp;status={status}" in html


def test_the_run_page_shows_the_join_result_and_the_pools_with_their_state(admin_client):
    CapacityPool.objects.create(name="provider-a", max_concurrency=2, paused=True)
    run = make_run(
        {"succeeded": 3, "pending": 2},
        pool="provider-a",
        join_result={"thumbnails": 3},
        join_runs=1,
    )

    response = admin_client.get(change_url(run))

    html = response.content.decode()
    assert "&quot;thumbnails&quot;: 3" in html
    [pool] = response.context["pools"]
    assert pool["state"].name == "provider-a" and pool["items"] == 5
    assert pool["state"].reason == "pool paused"
    # Its pending items wait for the paused pool.
    assert response.context["counts"]["waiting"] == 2
    assert response.context["progress"].held_back == {"provider-a: pool paused": 2}


def test_the_run_page_polls_while_the_run_is_active_and_not_after(admin_client):
    active = make_run({"running": 1})
    finished = make_run({"succeeded": 1}, status=RunStatus.SUCCEEDED)

    assert 'data-active="true"' in admin_client.get(change_url(active)).content.decode()
    assert 'data-active="false"' in admin_client.get(change_url(finished)).content.decode()


def test_the_progress_endpoint_returns_counts_segments_and_whether_the_run_is_active(
    admin_client,
):
    run = make_run({"succeeded": 2, "failed": 1, "pending": 1})

    response = admin_client.get(progress_url(run))

    assert response.status_code == 200
    data = json.loads(response.content)
    assert data["active"] is True and data["status"] == "running"
    assert data["counts"] == {
        "succeeded": 2,
        "failed": 1,
        "running": 0,
        "waiting": 0,
        "pending": 1,
        "cancelled": 0,
    }
    assert data["total"] == 4 and data["done"] == 3 and data["percent_done"] == 75.0
    assert [s["status"] for s in data["segments"]] == ["succeeded", "failed", "pending"]
    assert sum(s["width"] for s in data["segments"]) == pytest.approx(1000)


def test_the_progress_endpoint_needs_a_staff_user_who_may_view_runs(client, operator):
    run = make_run({"pending": 1})

    assert client.get(progress_url(run)).status_code == 302  # to the login page
    assert operator().get(progress_url(run)).status_code == 200


def test_only_max_parallel_is_editable_and_saving_it_writes_nothing_else(admin_client):
    run = make_run({"running": 1})
    # A worker moves the run on after the operator opened the page.
    form = admin_client.get(change_url(run)).context["adminform"].form
    assert list(form.fields) == ["max_parallel"]
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.JOINING, join_runs=1)

    response = admin_client.post(change_url(run), {"max_parallel": 9})

    assert response.status_code == 302
    run.refresh_from_db()
    assert run.max_parallel == 9
    assert run.status == RunStatus.JOINING and run.join_runs == 1


def test_runs_cannot_be_added_or_deleted_in_the_admin(admin_client):
    run = make_run({"pending": 1})

    assert admin_client.get(reverse("admin:fanout_batchrun_add")).status_code == 403
    assert (
        admin_client.get(reverse("admin:fanout_batchrun_delete", args=[run.pk])).status_code == 403
    )


# ---------------------------------------------------------------------- actions


def test_retry_failed_items_puts_only_the_failed_items_back_and_reopens_the_run(admin_client):
    run = make_run({"succeeded": 3, "failed": 2, "cancelled": 1}, status=RunStatus.FAILED)

    response = action(admin_client, CHANGELIST, "retry_failed_items", run.pk)

    assert response.status_code == 302
    assert statuses(run) == {"succeeded": 3, "pending": 2, "cancelled": 1}
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.finished_at is None
    retried = ItemClaim.objects.filter(run=run, status=ItemStatus.PENDING)
    assert {(i.attempt, i.owner, i.finished_at) for i in retried} == {(1, "", None)}
    notes = messages_of(response)
    assert "2 failed items of 1 run back to pending." in notes
    # The admin never runs items in the web process: RQ's workers take the inline run over.
    assert f"run {run.pk} was carried by inline workers" in " ".join(notes)
    assert run.executor == "rq"
    assert LogEntry.objects.filter(object_id=str(run.pk)).exists()


def test_retry_failed_on_ten_thousand_items_touches_only_the_three_thousand_failed_in_one_request(
    admin_client, django_assert_max_num_queries
):
    run = make_run({"succeeded": 7000, "failed": 3000}, status=RunStatus.FAILED)
    before = {
        pk: (status, finished_at, attempt)
        for pk, status, finished_at, attempt in ItemClaim.objects.filter(
            run=run, status=ItemStatus.SUCCEEDED
        ).values_list("pk", "status", "finished_at", "attempt")
    }

    with django_assert_max_num_queries(25):
        response = action(admin_client, CHANGELIST, "retry_failed_items", run.pk)

    assert response.status_code == 302
    assert statuses(run) == {"succeeded": 7000, "pending": 3000}
    after = {
        pk: (status, finished_at, attempt)
        for pk, status, finished_at, attempt in ItemClaim.objects.filter(
            run=run, status=ItemStatus.SUCCEEDED
        ).values_list("pk", "status", "finished_at", "attempt")
    }
    assert after == before
    assert "3,000 failed items of 1 run back to pending." in messages_of(response)


def test_retry_failed_skips_runs_without_failures_and_cancelled_runs(admin_client):
    clean = make_run({"succeeded": 2}, status=RunStatus.SUCCEEDED)
    cancelled = make_run({"failed": 2, "cancelled": 1}, status=RunStatus.CANCELLED)

    response = action(admin_client, CHANGELIST, "retry_failed_items", clean.pk, cancelled.pk)

    assert statuses(clean) == {"succeeded": 2}
    assert statuses(cancelled) == {"failed": 2, "cancelled": 1}
    assert BatchRun.objects.get(pk=cancelled.pk).status == RunStatus.CANCELLED
    assert "0 failed items of 0 runs back to pending." in messages_of(response)


def test_retry_failed_items_from_the_run_page_is_one_button(admin_client):
    run = make_run({"succeeded": 1, "failed": 2}, status=RunStatus.FAILED)
    page = admin_client.get(change_url(run))
    assert [b[0] for b in page.context["buttons"]] == ["retry_failed_items"]
    assert "Retry 2 failed items" in page.content.decode()

    response = page_action(admin_client, change_url(run), "retry_failed_items", run.pk)

    assert response.status_code == 302 and response.url == change_url(run)
    assert statuses(run) == {"succeeded": 1, "pending": 2}


def test_retry_on_a_run_that_cannot_be_dispatched_reopens_it_and_says_why(admin_client):
    run = make_run({"failed": 1}, status=RunStatus.FAILED, executor="rq")
    BatchRun.objects.filter(pk=run.pk).update(definition="no-longer-defined")

    response = action(admin_client, CHANGELIST, "retry_failed_items", run.pk)

    assert statuses(run) == {"pending": 1}
    [note] = [m for m in messages_of(response) if "could not be dispatched" in m]
    assert "unknown fan-out 'no-longer-defined'" in note


def test_cancel_run_cancels_pending_items_and_lets_running_ones_finish(admin_client):
    run = make_run({"succeeded": 1, "running": 2, "pending": 3})
    done = make_run({"succeeded": 1}, status=RunStatus.SUCCEEDED)

    response = action(admin_client, CHANGELIST, "cancel_runs", run.pk, done.pk, confirm=True)

    assert statuses(run) == {"succeeded": 1, "running": 2, "cancelled": 3}
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    assert BatchRun.objects.get(pk=done.pk).status == RunStatus.SUCCEEDED
    assert (
        "Cancelled 1 run: 3 pending items cancelled; 2 running items are stopping: each "
        "finishes its current attempt." in messages_of(response)
    )
    page = admin_client.get(change_url(run)).content.decode()
    assert "2 running items are stopping" in re.sub(r"\s+", " ", page)


def test_cancel_asks_to_confirm_on_a_page_of_its_own_before_anything_changes(admin_client):
    run = make_run({"succeeded": 1, "running": 2, "pending": 3})

    asked = action(admin_client, CHANGELIST, "cancel_runs", run.pk)

    assert asked.status_code == 200
    assert asked.templates[0].name == "fanout/admin/confirm_cancel.html"
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", asked.content.decode()))
    assert (
        f"run #{run.pk} (admin-console): 3 pending items cancelled; 2 running items finish "
        "their current attempts and stop." in text
    ), text
    assert statuses(run) == {"succeeded": 1, "running": 2, "pending": 3}
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.RUNNING
    # Its form posts the same action again, confirmed.
    form = asked.content.decode().split('<form method="post">')[1]
    assert 'name="action" value="cancel_runs"' in form and 'name="post" value="yes"' in form


def test_the_run_pages_cancel_button_asks_first_and_comes_back_to_the_run(admin_client):
    run = make_run({"pending": 2})

    asked = page_action(admin_client, change_url(run), "cancel_runs", run.pk)
    assert asked.status_code == 200 and statuses(run) == {"pending": 2}
    repost = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', asked.content.decode()))
    repost.pop("csrfmiddlewaretoken", None)
    target = admin_client.get(change_url(run)).context.get("action_url") or change_url(run)
    done = admin_client.post(target, repost)

    assert done.status_code == 302 and done.url == change_url(run)
    assert statuses(run) == {"cancelled": 2}


@pytest.fixture
def no_rq(settings):
    """RQ_QUEUES without fanout's queue: the inline executor is all there is."""
    settings.RQ_QUEUES = {"default": {"URL": settings.REDIS_URL}}


def test_redispatch_of_an_inline_run_without_rq_says_how_to_start_its_workers(admin_client, no_rq):
    run = make_run({"pending": 2})
    finished = make_run({"succeeded": 1}, status=RunStatus.SUCCEEDED)

    response = action(admin_client, CHANGELIST, "redispatch_runs", run.pk, finished.pk)

    assert messages_of(response) == [
        f"run {run.pk} uses the inline executor: start its workers with "
        f"`manage.py run_fanout --resume {run.pk}` (RQ cannot take over here: RQ_QUEUES has "
        "no queue 'fanout' for fan-out 'admin-console': add \"fanout\": {\"URL\": REDIS_URL} "
        "to RQ_QUEUES)"
    ]
    assert statuses(run) == {"pending": 2}
    assert BatchRun.objects.get(pk=run.pk).executor == "inline"


def test_retrying_an_inline_run_where_rq_is_configured_hands_it_to_rq_after_commit(
    admin_client, django_capture_on_commit_callbacks
):
    run = make_run({"succeeded": 1, "failed": 2}, status=RunStatus.FAILED)

    # Not executed: the jobs would go to the shared Redis, to workers of another database.
    with django_capture_on_commit_callbacks() as enqueues:
        response = action(admin_client, CHANGELIST, "retry_failed_items", run.pk)

    assert response.status_code == 302
    assert statuses(run) == {"succeeded": 1, "pending": 2}
    assert BatchRun.objects.get(pk=run.pk).executor == "rq"
    assert len(enqueues) >= 1
    assert (
        f"run {run.pk} was carried by inline workers: its items now run on RQ workers "
        "(queue 'fanout')."
    ) in messages_of(response)


def test_retrying_an_inline_run_without_rq_asks_first_and_says_how_its_items_will_run(
    admin_client, no_rq
):
    run = make_run({"succeeded": 1, "failed": 2}, status=RunStatus.FAILED)

    asked = action(admin_client, CHANGELIST, "retry_failed_items", run.pk)

    # Nothing changed yet: the page says what the retry would leave behind.
    assert asked.status_code == 200
    assert statuses(run) == {"succeeded": 1, "failed": 2}
    text = asked.content.decode()
    assert "RQ cannot take it over here" in text
    assert f"manage.py run_fanout --resume {run.pk}" in text

    response = admin_client.post(
        CHANGELIST,
        {
            "action": "retry_failed_items",
            "index": 0,
            "_selected_action": [str(run.pk)],
            "fanout_confirmed": "yes",
        },
    )

    assert response.status_code == 302
    assert statuses(run) == {"succeeded": 1, "pending": 2}
    assert BatchRun.objects.get(pk=run.pk).executor == "inline"
    assert any(
        f"start its workers with `manage.py run_fanout --resume {run.pk}`" in m
        for m in messages_of(response)
    )


def test_the_run_page_says_before_the_retry_what_will_run_an_inline_runs_items(
    admin_client, settings
):
    run = make_run({"succeeded": 1, "failed": 2}, status=RunStatus.FAILED)
    page = admin_client.get(change_url(run))
    assert "retried items run on RQ workers ('fanout')" in page.context["retry_note"]
    assert 'data-field="retry_note"' in page.content.decode()

    settings.RQ_QUEUES = {"default": {"URL": settings.REDIS_URL}}
    note = admin_client.get(change_url(run)).context["retry_note"]
    assert "RQ cannot take it over here" in note
    assert f"until someone runs `manage.py run_fanout --resume {run.pk}`" in note


@pytest.mark.skipif(importlib.util.find_spec("fanout.rq") is None, reason="no fanout.rq")
def test_redispatch_of_an_rq_run_enqueues_its_drain_jobs_when_the_request_commits(
    admin_client, django_capture_on_commit_callbacks
):
    run = make_run({"pending": 2}, executor="rq")

    # Not executed: the jobs would go to the shared Redis, to workers of another database.
    with django_capture_on_commit_callbacks() as enqueues:
        response = action(admin_client, CHANGELIST, "redispatch_runs", run.pk)

    assert messages_of(response) == [f"Workers woken for run {run.pk}."]
    assert len(enqueues) >= 1


# ------------------------------------------------------------------ permissions


@pytest.mark.parametrize(
    ("name", "codename"),
    [
        ("retry_failed_items", "retry_run"),
        ("cancel_runs", "cancel_run"),
        ("redispatch_runs", "dispatch_run"),
    ],
)
def test_each_run_action_is_offered_only_to_holders_of_its_permission(operator, name, codename):
    without, holder = operator(), operator(codename)

    def offered(client):
        form = client.get(CHANGELIST).context["action_form"]
        return form is not None and name in dict(form.fields["action"].choices)

    assert not offered(without)
    assert offered(holder)


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("retry_failed_items", "cancel_run"),
        ("cancel_runs", "retry_run"),
        ("redispatch_runs", "cancel_run"),
    ],
)
def test_a_run_action_posted_without_its_permission_changes_nothing(operator, name, other):
    run = make_run({"failed": 2, "pending": 2})
    # Once with no action at all, once holding a different one.
    for client in (operator(), operator(other)):
        response = action(client, CHANGELIST, name, run.pk)
        assert response.status_code in (200, 302, 403)
        assert b'name="post" value="yes"' not in response.content  # no confirmation page
        response = action(client, CHANGELIST, name, run.pk, confirm=True)
        assert response.status_code in (200, 302, 403)
        page = page_action(client, change_url(run), name, run.pk)
        assert page.status_code in (200, 302, 403)

    assert statuses(run) == {"failed": 2, "pending": 2}
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.RUNNING


def test_the_run_page_shows_only_the_buttons_its_viewer_may_press(operator):
    run = make_run({"failed": 1, "pending": 1})

    assert operator().get(change_url(run)).context["buttons"] == []
    buttons = operator("cancel_run").get(change_url(run)).context["buttons"]
    assert [b[0] for b in buttons] == ["cancel_runs"]


def test_retrying_several_inline_runs_tells_the_operator_once_how_to_resume_them(
    admin_client, no_rq
):
    a = make_run({"failed": 1}, status=RunStatus.FAILED)
    b = make_run({"failed": 2}, status=RunStatus.FAILED)

    response = admin_client.post(
        CHANGELIST,
        {
            "action": "retry_failed_items",
            "index": 0,
            "_selected_action": [str(a.pk), str(b.pk)],
            "fanout_confirmed": "yes",
        },
    )

    notes = messages_of(response)
    assert notes[0] == "3 failed items of 2 runs back to pending."
    assert notes[1].startswith(
        f"runs {a.pk}, {b.pk} use the inline executor: start their workers with "
        "`manage.py run_fanout --resume ID` (RQ cannot take over here: "
    )


# ------------------------------------------------------------------ why it waits


def test_a_run_with_claimable_items_and_nothing_claimed_for_a_while_says_it_stalled(
    admin_client,
):
    run = make_run({"succeeded": 2, "pending": 3}, executor="rq")
    # Its last item was claimed a minute ago; nothing runs now.
    ItemClaim.objects.filter(run=run, status=ItemStatus.SUCCEEDED).update(
        claimed_at=timezone.now() - timedelta(seconds=61)
    )

    page = admin_client.get(change_url(run))
    poll = json.loads(admin_client.get(progress_url(run)).content)
    cli = snapshot(run)

    why = page.context["progress"].why
    assert why.startswith("stalled: nothing running, no item claimed for 1m 0")
    assert "start `manage.py rqworker fanout`" in why
    # Read a moment apart: on a loaded machine the three may be a second apart.
    assert same_but_seconds(poll["why"], why) and poll["stalled"] is True
    assert same_but_seconds(cli.why, why)
    assert "Why pending items wait: stalled: nothing running" in page.content.decode()


def same_but_seconds(a: str, b: str) -> bool:
    return re.sub(r"\d+s\b", "Ns", a) == re.sub(r"\d+s\b", "Ns", b)


def test_a_run_whose_failed_items_were_just_retried_is_not_said_to_have_stalled(admin_client):
    run = make_run({"succeeded": 2, "failed": 3}, status=RunStatus.FAILED, executor="rq")
    # Its items were last claimed minutes ago, before they failed and the run ended.
    ItemClaim.objects.filter(run=run).update(claimed_at=timezone.now() - timedelta(minutes=5))
    retry_failed(run)

    progress = admin_client.get(change_url(run)).context["progress"]

    # Claimable for a moment only: live workers take them within seconds.
    assert progress.activity.ready == 3 and progress.activity.live == 0
    assert not progress.why.startswith("stalled"), progress.why


def test_a_run_whose_workers_died_holding_leases_says_it_stalled(admin_client):
    run = make_run({"running": 2, "pending": 1}, lease_seconds=-60)
    ItemClaim.objects.filter(run=run).update(claimed_at=timezone.now() - timedelta(minutes=2))

    progress = admin_client.get(change_url(run)).context["progress"]

    assert progress.activity.expired == 2 and progress.activity.live == 0
    assert progress.why.startswith("stalled: nothing running, no item claimed for 2m")
    assert progress.why.endswith(f"resume it with `manage.py run_fanout --resume {run.pk}`")


def test_the_run_page_says_how_many_attempts_lost_workers_cut_off(admin_client):
    run = make_run({"succeeded": 3, "running": 1})
    first, second = ItemClaim.objects.filter(run=run).order_by("index")[:2]
    for item, attempt in ((first, 1), (first, 2), (second, 1)):
        ItemAttempt.objects.create(item=item, attempt=attempt, error_class="WorkerLost")
    ItemAttempt.objects.create(item=second, attempt=2, error_class="ValueError")
    other = make_run({"succeeded": 1})
    ItemAttempt.objects.create(item=other.items.get(), attempt=1, error_class="WorkerLost")

    page = admin_client.get(change_url(run)).content.decode()

    assert (
        "Workers lost: 3 attempts of 2 items were cut off by a worker that stopped renewing "
        "its lease (each item ran again, or failed past its crash budget)"
    ) in page
    assert (
        "Workers lost"
        not in admin_client.get(change_url(make_run({"succeeded": 2}))).content.decode()
    )


def test_a_stalled_run_of_a_definition_nobody_registered_says_so(admin_client):
    run = make_run({"pending": 1})
    BatchRun.objects.filter(pk=run.pk).update(definition="gone-away")

    why = admin_client.get(change_url(run)).context["progress"].why

    assert why.endswith("definition 'gone-away' is not registered, so no worker can run it")


def test_a_run_that_just_started_is_not_called_stalled(admin_client):
    run = make_run({"pending": 3})
    BatchRun.objects.filter(pk=run.pk).update(started_at=timezone.now())

    assert admin_client.get(change_url(run)).context["progress"].why == ""


@pytest.mark.parametrize(
    ("running", "max_parallel", "executor", "why"),
    [
        (4, 4, "inline", "run at max_parallel (4/4)"),
        (
            2,
            8,
            "inline",
            "2 running, up to 8 allowed: every thread of its run_fanout is busy "
            "(--workers sets how many)",
        ),
        (
            2,
            8,
            "rq",
            "2 running, up to 8 allowed: no other worker thread is free "
            "(another rqworker adds threads)",
        ),
    ],
)
def test_a_run_with_items_ready_says_why_no_more_of_them_run(
    admin_client, running, max_parallel, executor, why
):
    run = make_run(
        {"running": running, "pending": 1050}, max_parallel=max_parallel, executor=executor
    )

    response = admin_client.get(CHANGELIST)

    assert response.context["cl"].facts[run.pk].why == why
    assert why in response.content.decode()
    assert why in response.content.decode()


def test_held_items_are_explained_by_their_reasons_not_by_a_stall(admin_client):
    CapacityPool.objects.create(name="provider-a", paused=True)
    run = make_run({"pending": 4}, pool="provider-a", waiting=1)

    progress = admin_client.get(change_url(run)).context["progress"]

    assert progress.held_back == {"retry not yet due": 1, "provider-a: pool paused": 3}
    assert progress.why == ""


def test_the_run_list_shows_each_runs_id_and_when_it_started_to_the_second(admin_client):
    run = make_run({"succeeded": 1})
    started = timezone.localtime(run.started_at)

    html = admin_client.get(CHANGELIST).content.decode()

    assert f">#{run.pk}</a>" in html
    assert f"{started:%Y-%m-%d}</span> {started:%H:%M:%S}</time>" in html


def test_the_run_list_says_why_a_run_with_nothing_running_waits_for_its_held_items(admin_client):
    CapacityPool.objects.create(name="provider-a", paused=True)
    make_run({"succeeded": 3, "pending": 9}, pool="provider-a")

    html = admin_client.get(CHANGELIST).content.decode()

    assert ">provider-a: pool paused (9)</span>" in html


# ------------------------------------------------------------------ reading a run at a glance


def test_the_run_list_shows_the_part_of_the_run_key_that_tells_runs_apart(admin_client):
    make_run({"succeeded": 1}, run_key='admin-console:{"month":"2026-11"}')

    page = admin_client.get(CHANGELIST).content.decode()

    # The definition has its own column: the cell shows the params, whole, wrapping.
    assert (
        '<span class="fanout-wrap fanout-sub" title="{&quot;month&quot;:&quot;2026-11&quot;}">'
        in page
    )
    assert "admin-console:{" not in page


def test_a_run_that_failed_under_collect_says_how_many_items_failed_and_the_first_error(
    admin_client,
):
    run = make_run({"succeeded": 17, "failed": 3}, status=RunStatus.FAILED)
    assert run.error == ""

    page = admin_client.get(change_url(run))

    why = "3 of 20 items failed: ValueError: item 17 broke (first)"
    assert page.context["failed_why"] == why
    assert f"Why it failed: {why}" in page.content.decode()


def test_a_finished_run_has_no_editable_field_and_no_save_button(admin_client):
    run = make_run({"succeeded": 2}, status=RunStatus.SUCCEEDED, max_parallel=4)
    running = make_run({"pending": 2})

    page = admin_client.get(change_url(run)).content.decode()
    assert 'name="max_parallel"' not in page
    assert 'name="_save"' not in page and 'name="_continue"' not in page
    admin_client.post(change_url(run), {"max_parallel": 99, "_save": "Save"})
    assert BatchRun.objects.get(pk=run.pk).max_parallel == 4
    # A running run keeps its one editable limit.
    assert 'name="max_parallel"' in admin_client.get(change_url(running)).content.decode()


def test_the_run_pages_retry_of_an_inline_run_without_rq_asks_first_then_comes_back(
    admin_client, no_rq
):
    run = make_run({"succeeded": 1, "failed": 2}, status=RunStatus.FAILED)

    asked = page_action(admin_client, change_url(run), "retry_failed_items", run.pk)

    assert asked.status_code == 200 and statuses(run) == {"succeeded": 1, "failed": 2}
    repost = dict(asked.context["repost"])
    repost["fanout_confirmed"] = "yes"
    target = asked.wsgi_request.path
    response = admin_client.post(target, repost)

    assert response.status_code == 302 and response.url == change_url(run)
    assert statuses(run) == {"succeeded": 1, "pending": 2}


def test_a_cancelled_runs_page_counts_what_ran_apart_from_what_was_cancelled(admin_client):
    run = make_run({"succeeded": 72, "pending": 78})
    action(admin_client, CHANGELIST, "cancel_runs", run.pk, confirm=True)
    assert statuses(run) == {"succeeded": 72, "cancelled": 78}

    page = admin_client.get(change_url(run))
    html = page.content.decode()

    throughput = next(c for c in page.context["charts"] if c["name"] == "throughput")
    assert throughput["note"].startswith("72 finished, 0 failed"), throughput["note"]
    headline = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html.split('class="fanout-headline"')[1]))
    assert "48.0% 72 of 150 items done, 78 cancelled" in headline, headline[:200]
    join = html.split("<h2>Join</h2>")[1].split("</section>")[0]
    assert "The join returned nothing" not in join and "Join runs" not in join
    assert "Not joined: the run was cancelled" in join
    data = json.loads(admin_client.get(progress_url(run)).content)
    assert (data["done"], data["cancelled"], data["percent_done"]) == (72, 78, 48.0)


def test_a_rate_limited_pool_on_the_run_page_says_until_when_to_the_second(admin_client):
    CapacityPool.objects.create(
        name="limited",
        max_concurrency=10,
        rate_count=1,
        rate_period=60,
        tokens=0.0,
        tokens_at=timezone.now(),
    )
    run = make_run({"pending": 2}, pool="limited")

    html = admin_client.get(change_url(run)).content.decode()

    pools = html.split("<h2>Pools</h2>")[1].split("</section>")[0]
    badge = re.search(r'class="fanout-badge fanout-pool-blocked[^"]*">([^<]*)<', pools)
    assert badge and re.fullmatch(r"rate limited until \d\d:\d\d:\d\d", badge.group(1)), pools
