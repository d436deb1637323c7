"""Why a run's ready items are not running: the reason names what limits it, not a guess."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fanout.models import CapacityPool
from fanout.report import snapshot
from fanout.waiting import why_items_wait
from tests.admin.helpers import make_run

pytestmark = pytest.mark.django_db


def test_a_run_through_a_rated_pool_is_said_to_run_at_the_pools_rate_not_short_of_threads():
    drawn_down(
        CapacityPool.objects.create(name="payments", rate_count=600, rate_period=60.0, burst=20)
    )
    run = make_run({"running": 1, "pending": 100}, max_parallel=8, executor="rq", pool="payments")

    why = snapshot(run).why

    assert why == "1 running, up to 8 allowed: pool payments admits 600/60s (burst 20)"


def drawn_down(pool: CapacityPool) -> None:
    """The pool's bucket as a run that takes each token as it comes leaves it: near empty."""
    CapacityPool.objects.filter(pk=pool.pk).update(tokens=1.5, tokens_at=timezone.now())


def test_a_run_through_a_rated_pool_with_a_full_bucket_is_short_of_worker_threads():
    CapacityPool.objects.create(name="payments", rate_count=600, rate_period=60.0, burst=20)
    run = make_run({"running": 2, "pending": 100}, max_parallel=8, executor="rq", pool="payments")

    assert snapshot(run).why.endswith(
        "no other worker thread is free (another rqworker adds threads)"
    )


def test_a_run_through_an_unrated_pool_is_short_of_worker_threads():
    CapacityPool.objects.create(name="bulk", max_concurrency=50)
    run = make_run({"running": 2, "pending": 100}, max_parallel=8, executor="rq", pool="bulk")

    assert snapshot(run).why == (
        "2 running, up to 8 allowed: no other worker thread is free (another rqworker adds threads)"
    )


def test_a_ready_item_of_a_rated_pool_says_the_pool_paces_its_run():
    drawn_down(
        CapacityPool.objects.create(name="payments", rate_count=600, rate_period=60.0, burst=20)
    )
    run = make_run({"running": 1, "pending": 3}, max_parallel=8, executor="rq", pool="payments")
    item = run.items.filter(status="pending").select_related("run").first()

    [(why, held)] = why_items_wait([item], timezone.now()).values()

    assert (why, held) == (
        "1 running, up to 8 allowed: pool payments admits 600/60s (burst 20)",
        False,
    )
