"""The run page's and the pool page's charts match the rows they are drawn from, bucket by
bucket, and cost a named number of queries whatever the size of the run.

Database-agnostic: `make test` runs it on PostgreSQL, `make test-mariadb` on MariaDB, and
DATABASE_URL=sqlite:///... on SQLite.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from fanout.charts import (
    ATTEMPTS_SHOWN,
    DURATION_EDGES,
    MAX_BUCKETS,
    PERCENTILES,
    TimeAxis,
    cached_run_charts,
    pool_charts,
    run_axis,
    run_charts,
)
from fanout.models import (
    BatchRun,
    CapacityPool,
    ItemClaim,
    ItemStatus,
    PoolSample,
    RunSample,
    RunStatus,
    SpendAccount,
)
from fanout.prune import prune_tree
from fanout.sample import WAITS, measure, sample_pool, sample_run
from fanout.supervise import sweep, tend
from fanout.tally import ended

pytestmark = pytest.mark.django_db

# What run_charts costs for a run that no sample counts: its samples (waits), one pass over
# the items (throughput, durations, attempts), one over the durations the percentiles fall
# among, and the child runs. A sampled run: its samples, the items that ended after the last
# one, and the child runs. On PostgreSQL one statement more plans them (fanout.backends: no
# JIT, hash aggregates).
PLAN = 1 if connection.vendor == "postgresql" else 0
RUN_CHART_QUERIES = 4 + PLAN
SAMPLED_RUN_CHART_QUERIES = 3 + PLAN
# A pool's last hour: its samples, and when they do not reach back to the hour's start (no
# supervisor sampled it then), one pass over its items; when they do, the items it admitted
# after the last sample and its items running now, whatever it ran in the hour.
POOL_CHART_QUERIES = 2 + PLAN
SAMPLED_POOL_CHART_QUERIES = 3


def whole(t: datetime) -> datetime:
    """A time every database keeps exactly (microseconds included)."""
    return t.replace(microsecond=t.microsecond - t.microsecond % 1000)


def new_run(status: str = RunStatus.SUCCEEDED, minutes: float = 10, **fields: Any) -> BatchRun:
    now = whole(timezone.now())
    started = now - timedelta(minutes=minutes)
    return BatchRun.objects.create(
        definition=fields.pop("definition", "charts"),
        run_key=fields.pop("run_key", f"charts:{uuid.uuid4().hex}"),
        status=status,
        max_parallel=fields.pop("max_parallel", 8),
        failure_policy="collect",
        join_mode="all",
        created_at=started,
        started_at=started,
        finished_at=now if status != RunStatus.RUNNING else None,
        **fields,
    )


def finished_items(run: BatchRun, n: int, seed: int = 7, pool: str = "") -> list[ItemClaim]:
    """n items that ran at random times of the run's life, durations spread from 0.3 ms to
    minutes, some failed, some after several attempts."""
    rng = random.Random(seed)
    assert run.started_at and run.finished_at
    life = (run.finished_at - run.started_at).total_seconds()
    rows = []
    for i in range(n):
        took = timedelta(milliseconds=round(10 ** rng.uniform(-0.5, 5.2), 3))
        end = run.started_at + timedelta(milliseconds=round(rng.uniform(0, life) * 1000))
        failed = rng.random() < 0.15
        rows.append(
            ItemClaim(
                run=run,
                key=f"k{i}",
                index=i,
                pool=pool,
                status=ItemStatus.FAILED if failed else ItemStatus.SUCCEEDED,
                attempt=rng.choice([1, 1, 1, 1, 2, 3, 12]),
                claimed_at=end - took,
                started_at=end - took,
                finished_at=end,
            )
        )
    ItemClaim.objects.bulk_create(rows)
    return list(ItemClaim.objects.filter(run=run))


def nearest_rank(values: list[timedelta], p: int) -> timedelta:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(len(ordered) * p / 100)) - 1]


def test_a_runs_charts_match_its_rows_in_a_named_number_of_queries(
    django_assert_num_queries: Any,
) -> None:
    run = new_run()
    items = finished_items(run, 700)
    # Unfinished and unstarted items count in none of the charts.
    ItemClaim.objects.create(run=run, key="never", index=10_000, status=ItemStatus.PENDING)

    with django_assert_num_queries(RUN_CHART_QUERIES):
        charts = run_charts(run, timezone.now())

    axis = run_axis(run, timezone.now())
    assert axis.count <= MAX_BUCKETS and axis.step == timedelta(seconds=10)
    finished, failed = Counter[int](), Counter[int]()
    for item in items:
        b = min(int((item.finished_at - axis.start) / axis.step), axis.count - 1)
        finished[b] += 1
        failed[b] += item.status == ItemStatus.FAILED
    assert charts.finished == [finished[b] for b in range(axis.count)]
    assert charts.failed == [failed[b] for b in range(axis.count)]
    assert sum(charts.finished) == 700

    took = [item.finished_at - item.started_at for item in items]
    histogram = Counter(bisect.bisect_right(DURATION_EDGES, t) for t in took)
    assert charts.durations == [histogram[b] for b in range(len(DURATION_EDGES) + 1)]
    assert charts.percentiles == {p: nearest_rank(took, p) for p in PERCENTILES}

    attempts = Counter(min(item.attempt, ATTEMPTS_SHOWN) for item in items)
    assert charts.attempts == dict(sorted(attempts.items()))


@pytest.mark.parametrize("minutes", [1, 0])  # 0: a run that just started has one bucket
def test_a_run_that_nothing_finished_yet_draws_empty_charts_in_fewer_queries(
    django_assert_num_queries: Any, minutes: int
) -> None:
    run = new_run(RunStatus.RUNNING, minutes=minutes)
    ItemClaim.objects.create(run=run, key="a", index=0, status=ItemStatus.PENDING)

    with django_assert_num_queries(RUN_CHART_QUERIES - 1):
        charts = run_charts(run, timezone.now())

    assert sum(charts.finished) == 0 and charts.percentiles == {} and charts.attempts == {}
    assert all(v is None for v in charts.waits["running"])


def test_an_ended_runs_charts_are_computed_once_per_end(django_assert_num_queries: Any) -> None:
    run = new_run()
    finished_items(run, 20)
    running = new_run(RunStatus.RUNNING)
    cache.clear()

    first = cached_run_charts(run, timezone.now())
    with django_assert_num_queries(0):
        again = cached_run_charts(run, timezone.now())
    with django_assert_num_queries(RUN_CHART_QUERIES - 1):
        cached_run_charts(running, timezone.now())  # a live run's are always read anew
    run.reopened += 1  # retried and ended again: its items changed
    with django_assert_num_queries(RUN_CHART_QUERIES):
        cached_run_charts(run, timezone.now())

    assert again == first


def test_a_time_axis_has_at_most_sixty_buckets_of_a_round_step() -> None:
    start = whole(timezone.now())
    for span, step in [(5, 1), (59, 1), (61, 2), (3600, 60), (7201, 300), (86_400 * 3, 7200)]:
        axis = TimeAxis.over(start, start + timedelta(seconds=span))
        assert axis.step == timedelta(seconds=step), span
        assert axis.count <= MAX_BUCKETS
        assert axis.start + axis.step * axis.count >= start + timedelta(seconds=span)
    week = TimeAxis.over(start, start + timedelta(days=90))
    assert week.count <= MAX_BUCKETS


def test_a_sample_counts_what_each_unfinished_item_waits_on() -> None:
    now = whole(timezone.now())
    CapacityPool.objects.create(name="charts-full", max_concurrency=1)
    CapacityPool.objects.create(
        name="charts-rate",
        max_concurrency=50,
        rate_count=1,
        rate_period=60,
        tokens=0,
        tokens_at=now,
    )
    CapacityPool.objects.create(name="charts-throttled", backoff_until=now + timedelta(minutes=1))
    CapacityPool.objects.create(name="charts-paused", paused=True)
    run = new_run(RunStatus.RUNNING, max_parallel=100)
    later, due = now + timedelta(minutes=5), now - timedelta(seconds=1)
    lease = now + timedelta(seconds=30)
    shape = [
        # (pool, status, how many, next_attempt_at, lease)
        ("charts-full", ItemStatus.RUNNING, 1, due, lease),
        ("charts-full", ItemStatus.PENDING, 4, due, None),
        ("charts-rate", ItemStatus.PENDING, 3, due, None),
        ("charts-throttled", ItemStatus.PENDING, 2, due, None),
        ("charts-paused", ItemStatus.PENDING, 5, due, None),
        ("charts-missing", ItemStatus.PENDING, 1, due, None),
        ("", ItemStatus.PENDING, 6, due, None),
        ("", ItemStatus.PENDING, 7, later, None),
        ("", ItemStatus.RUNNING, 2, due, lease),
        ("", ItemStatus.RUNNING, 1, due, now - timedelta(seconds=5)),  # its owner is gone
        ("", ItemStatus.WAITING, 3, due, None),
        ("", ItemStatus.SUCCEEDED, 9, due, None),
    ]
    rows, index = [], 0
    for pool, status, n, at, lease_until in shape:
        for _ in range(n):
            rows.append(
                ItemClaim(
                    run=run,
                    key=f"k{index}",
                    index=index,
                    pool=pool,
                    status=status,
                    next_attempt_at=at,
                    lease_expires_at=lease_until,
                )
            )
            index += 1
    ItemClaim.objects.bulk_create(rows)

    sample = measure(run, now)

    assert {w: getattr(sample, w) for w in WAITS} == {
        "running": 3,
        "ready": 6 + 1,  # its own items due, and the one whose lease ran out
        "max_parallel": 0,
        "pool_full": 4,
        "rate_limited": 3,
        "throttled": 2,
        "budget": 0,
        "paused": 5 + 1,
        "retry_due": 7,
        "child_runs": 3,
    }
    run.max_parallel = 6  # 3 running and 3 in child runs hold every slot
    assert measure(run, now).max_parallel == 7 and measure(run, now).ready == 0


def test_a_sample_counts_items_a_budget_holds_as_budget_not_rate() -> None:
    """A pool whose budget is spent, and a run whose own budget is spent, hold their due items
    for the budget: neither is the pool's rate."""
    now = whole(timezone.now())
    CapacityPool.objects.create(name="charts-spent", max_concurrency=50)
    SpendAccount.objects.create(pool="charts-spent", unit="usd", budget=1.0, spent=1.0)
    CapacityPool.objects.create(
        name="charts-rate", rate_count=1, rate_period=60, tokens=0, tokens_at=now
    )
    pooled = new_run(RunStatus.RUNNING, max_parallel=100)
    capped = new_run(RunStatus.RUNNING, max_parallel=100)
    SpendAccount.objects.create(run=capped, unit="usd", budget=2.0, spent=2.0)
    due = now - timedelta(seconds=1)
    shape = [
        (pooled, "charts-spent", 4),
        (pooled, "charts-rate", 3),
        (pooled, "", 2),
        (capped, "", 5),
        (capped, "charts-rate", 1),
    ]
    rows = []
    for run, pool, n in shape:
        for _ in range(n):
            i = len(rows)
            rows.append(ItemClaim(run=run, key=f"k{i}", index=i, pool=pool, next_attempt_at=due))
    ItemClaim.objects.bulk_create(rows)

    first, second = measure(pooled, now), measure(capped, now)

    assert (first.budget, first.rate_limited, first.ready) == (4, 3, 2)
    assert (second.budget, second.rate_limited, second.ready) == (5, 1, 0)


def test_a_run_is_sampled_at_most_once_per_period_and_only_while_it_runs(settings: Any) -> None:
    settings.FANOUT_SAMPLE_SECONDS = 10
    now = whole(timezone.now())
    run = new_run(RunStatus.RUNNING)
    ItemClaim.objects.create(run=run, key="a", index=0)

    assert sample_run(run, now) is not None
    assert sample_run(run, now + timedelta(seconds=9)) is None
    assert sample_run(run, now + timedelta(seconds=11)) is not None
    run.status = RunStatus.SUCCEEDED
    assert sample_run(run, now + timedelta(seconds=30)) is None
    assert RunSample.objects.filter(run=run).count() == 2


def test_the_supervisor_that_tends_a_running_run_samples_it() -> None:
    run = new_run(RunStatus.RUNNING)
    ItemClaim.objects.create(run=run, key="a", index=0)
    done = new_run(RunStatus.SUCCEEDED)

    tend(run.pk)
    tend(run.pk)  # within FANOUT_SAMPLE_SECONDS: no second sample
    tend(done.pk)

    assert list(RunSample.objects.values_list("run_id", "ready")) == [(run.pk, 1)]


def test_the_wait_chart_averages_the_samples_of_each_bucket() -> None:
    run = new_run(minutes=10)
    assert run.started_at
    axis = run_axis(run, timezone.now())
    rows = []
    for second in range(0, 600, 5):  # a sample every 5 s: two per 10 s bucket
        rows.append(
            RunSample(
                run=run,
                at=run.started_at + timedelta(seconds=second),
                running=second % 7,
                pool_full=second,
            )
        )
    RunSample.objects.bulk_create(rows)

    waits = run_charts(run, timezone.now()).waits

    for b in range(axis.count):
        inside = [r for r in rows if min(int((r.at - axis.start) / axis.step), axis.count - 1) == b]
        want = sum(r.pool_full for r in inside) / len(inside) if inside else None
        assert waits["pool_full"][b] == pytest.approx(want), b
        running = sum(r.running for r in inside) / len(inside) if inside else None
        assert waits["running"][b] == pytest.approx(running), b


def test_a_trees_child_runs_are_listed_first_started_first() -> None:
    parent = new_run(minutes=30)
    items = finished_items(parent, 3)
    assert parent.started_at
    for i, item in enumerate(reversed(items)):
        BatchRun.objects.create(
            definition="charts-child",
            run_key=f"child:{uuid.uuid4().hex}",
            status=RunStatus.SUCCEEDED,
            max_parallel=1,
            failure_policy="collect",
            join_mode="all",
            parent_item=item,
            started_at=parent.started_at + timedelta(minutes=i),
            finished_at=parent.started_at + timedelta(minutes=i + 5),
        )
    new_run()  # another run's tree is not this one's

    children = run_charts(parent, timezone.now()).children

    assert [c["started_at"] - parent.started_at for c in children] == [
        timedelta(minutes=i) for i in range(3)
    ]
    assert {c["definition"] for c in children} == {"charts-child"}


def pool_items(now: datetime, pool: str = "charts-pool") -> list[ItemClaim]:
    """400 items of the pool claimed over the last 90 minutes, most ended, some running."""
    run = new_run(minutes=90)
    rng = random.Random(3)
    rows = []
    for i in range(400):
        claimed = now - timedelta(seconds=rng.uniform(0, 5400))
        done = rng.random() < 0.9
        finished = claimed + timedelta(seconds=rng.uniform(1, 600)) if done else None
        if finished and finished > now:
            finished = None
        rows.append(
            ItemClaim(
                run=run,
                key=f"p{i}",
                index=i,
                pool=pool,
                status=ItemStatus.SUCCEEDED if finished else ItemStatus.RUNNING,
                claimed_at=whole(claimed),
                started_at=whole(claimed),
                finished_at=whole(finished) if finished else None,
            )
        )
    ItemClaim.objects.bulk_create(rows)
    # Another pool's items are not this pool's.
    ItemClaim.objects.create(
        run=run, key="other", index=999, pool="x", claimed_at=now, status=ItemStatus.RUNNING
    )
    return rows


def admissions(rows: list[ItemClaim], axis: TimeAxis, now: datetime) -> list[int]:
    """The items claimed in each bucket of the axis, counted from the rows."""
    admitted = Counter(
        min(int((r.claimed_at - axis.start) / axis.step), axis.count - 1)
        for r in rows
        if r.claimed_at and axis.start <= r.claimed_at <= now
    )
    return [admitted[b] for b in range(axis.count)]


def test_an_unsampled_pools_last_hour_matches_its_rows_in_a_named_number_of_queries(
    django_assert_num_queries: Any,
) -> None:
    now = whole(timezone.now())
    CapacityPool.objects.create(name="charts-pool", max_concurrency=20)
    rows = pool_items(now)

    with django_assert_num_queries(POOL_CHART_QUERIES):
        charts = pool_charts("charts-pool", now)

    axis = charts.axis
    assert axis.count == 60 and axis.step == timedelta(minutes=1)
    assert not charts.sampled
    assert charts.admitted == admissions(rows, axis, now)
    ends = [t + axis.step for t in axis.times()]
    ends[-1] = now
    assert charts.in_flight == [
        sum(1 for r in rows if r.claimed_at < t and (r.finished_at is None or r.finished_at >= t))
        for t in ends
    ]


def test_a_sampled_pools_last_hour_matches_its_rows_in_a_named_number_of_queries(
    settings: Any, django_assert_num_queries: Any
) -> None:
    """Sampled every 10 s over the hour as the supervisor samples it, the pool's admissions
    are its rows', bucket by bucket, without reading the items its samples counted."""
    settings.FANOUT_SAMPLE_SECONDS = 10
    now = whole(timezone.now())
    pool = CapacityPool.objects.create(name="charts-pool", max_concurrency=20)
    rows = pool_items(now)
    for back in range(3600, -1, -10):
        assert sample_pool(pool, now - timedelta(seconds=back)) is not None
    samples = list(PoolSample.objects.filter(pool=pool).order_by("at"))
    assert all(a.upto == b.since for a, b in zip(samples, samples[1:], strict=False))
    running = sum(1 for r in rows if r.status == ItemStatus.RUNNING)
    assert {s.in_flight for s in samples} == {running}  # this pool's, not pool x's

    with django_assert_num_queries(SAMPLED_POOL_CHART_QUERIES):
        charts = pool_charts("charts-pool", now)

    assert charts.sampled
    assert charts.admitted == admissions(rows, charts.axis, now)
    assert charts.in_flight == [running] * charts.axis.count
    PoolSample.objects.all().delete()
    assert pool_charts("charts-pool", now).admitted == charts.admitted  # read from the items


def test_a_pools_in_flight_is_its_last_sample_in_each_bucket_and_its_running_items_now() -> None:
    now = whole(timezone.now())
    pool = CapacityPool.objects.create(name="charts-pool", max_concurrency=20)
    run = new_run(RunStatus.RUNNING)
    ItemClaim.objects.create(run=run, key="a", index=0, pool="charts-pool", status="running")
    start = now - timedelta(hours=1)
    # A sample every 20 s for the first half hour, then none: nobody sampled the pool.
    PoolSample.objects.bulk_create(
        PoolSample(
            pool=pool,
            at=start + timedelta(seconds=s),
            in_flight=s // 20,
            since=start + timedelta(seconds=s - 30),
            upto=start + timedelta(seconds=s - 10),
        )
        for s in range(0, 1800, 20)
    )

    charts = pool_charts("charts-pool", now)

    assert charts.in_flight[:30] == [(60 * b + 40) // 20 for b in range(30)]
    assert charts.in_flight[30:-1] == [None] * 29
    assert charts.in_flight[-1] == 1


def test_a_pool_is_sampled_at_most_once_per_period_and_keeps_two_hours(settings: Any) -> None:
    settings.FANOUT_SAMPLE_SECONDS = 10
    now = whole(timezone.now())
    pool = CapacityPool.objects.create(name="charts-pool")
    old = PoolSample.objects.create(
        pool=pool, at=now - timedelta(hours=3), since=now - timedelta(hours=4), upto=now
    )
    PoolSample.objects.filter(pk=old.pk).update(upto=now - timedelta(hours=3, seconds=10))

    first = sample_pool(pool, now)
    assert first is not None and first.since == now - timedelta(hours=1, seconds=10)
    assert sample_pool(pool, now + timedelta(seconds=9)) is None
    second = sample_pool(pool, now + timedelta(seconds=11))
    assert second is not None and second.since == first.upto
    assert list(PoolSample.objects.order_by("at")) == [first, second]


def test_the_supervisor_elected_to_audit_a_pool_samples_it() -> None:
    pool = CapacityPool.objects.create(name="charts-pool")

    sweep()
    sweep()  # the pool is audited by one supervisor per period: not taken again

    assert PoolSample.objects.filter(pool=pool).count() == 1


def test_a_pruned_run_takes_its_samples_with_it() -> None:
    run = new_run()
    finished_items(run, 5)
    RunSample.objects.create(run=run, at=run.created_at, running=1)
    kept = new_run()
    RunSample.objects.create(run=kept, at=kept.created_at, running=1)

    prune_tree(run.pk)

    assert not BatchRun.objects.filter(pk=run.pk).exists()
    assert list(RunSample.objects.values_list("run_id", flat=True)) == [kept.pk]


def test_the_run_page_and_the_pool_page_draw_their_charts(admin_client: Any) -> None:
    CapacityPool.objects.create(name="charts-page", max_concurrency=4, rate_count=10)
    run = new_run()
    finished_items(run, 50, pool="charts-page")
    RunSample.objects.create(run=run, at=run.created_at, running=2, pool_full=3)
    pool = CapacityPool.objects.get(name="charts-page")

    page = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))
    pool_page = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))

    html = page.content.decode()
    for name in ("throughput", "durations", "attempts", "waits"):
        assert f'data-chart="{name}"' in html
    assert html.count('<svg class="fanout-chart"') == 4
    assert "<script" not in html.split('data-chart="throughput"')[1].split("</svg>")[0]
    durations = next(c for c in page.context["charts"] if c["name"] == "durations")
    assert set(durations["percentiles"]) == set(PERCENTILES)
    assert "pool full" in html  # the wait chart's legend
    pool_html = pool_page.content.decode()
    assert 'data-chart="pool-in-flight"' in pool_html and 'data-chart="pool-admitted"' in pool_html
    assert "fanout-chart-limit" in pool_html  # max_concurrency drawn as a line


def test_a_sampled_pools_page_draws_its_hour_with_the_minutes_nobody_sampled_left_blank(
    admin_client: Any,
) -> None:
    pool = CapacityPool.objects.create(name="charts-page", max_concurrency=4, rate_count=10)
    now = whole(timezone.now())
    start = now - timedelta(hours=1, seconds=30)
    PoolSample.objects.bulk_create(  # the first half hour sampled, then nobody sampled it
        PoolSample(
            pool=pool,
            at=start + timedelta(seconds=s + 10),
            in_flight=s % 5,
            since=start + timedelta(seconds=s - 10),
            upto=start + timedelta(seconds=s),
            admitted=s % 7,
        )
        for s in range(0, 1800, 20)
    )

    page = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))

    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-chart="pool-in-flight"' in html and 'data-chart="pool-admitted"' in html
    assert "last sample in each minute" in html


def ended_at_odd_times(run: BatchRun, n: int, seed: int = 5) -> list[ItemClaim]:
    """finished_items, none of them ending on a whole 10 s (the axis's and windows' edges)."""
    items = finished_items(run, n, seed)
    for item in items:
        assert item.finished_at
        if item.finished_at.microsecond == 0 and item.finished_at.second % 10 == 0:
            item.finished_at += timedelta(milliseconds=3)
            item.save(update_fields=["finished_at"])
    return items


def sample_every_10s(run: BatchRun, settings: Any, until: datetime) -> list[RunSample]:
    """The supervisor's samples of a run, every 10 s of its life from 10 s after its start."""
    settings.FANOUT_SAMPLE_SECONDS = 10
    assert run.started_at
    status, run.status = run.status, RunStatus.RUNNING
    taken, at = [], run.started_at + timedelta(seconds=10)
    while at <= until:
        taken.append(sample_run(run, at))
        at += timedelta(seconds=10)
    run.status = status
    assert all(taken)
    return [t for t in taken if t is not None]


def test_a_sample_counts_each_item_that_ended_in_its_window_once(settings: Any) -> None:
    run = new_run(minutes=3)
    assert run.started_at
    items = ended_at_odd_times(run, 300)
    now = run.started_at + timedelta(minutes=3)
    # Not ended: running, and waiting for a retry (its last attempt's end is written).
    ItemClaim.objects.create(run=run, key="r", index=900, status=ItemStatus.RUNNING)
    ItemClaim.objects.create(
        run=run, key="p", index=901, status=ItemStatus.PENDING, attempt=2, finished_at=now
    )

    samples = sample_every_10s(run, settings, now)

    since = None
    for sample in samples:
        assert sample.upto == sample.at - timedelta(seconds=10)
        inside = [
            i
            for i in items
            if (since is None or i.finished_at > since) and i.finished_at <= sample.upto
        ]
        assert sample.finished == len(inside)
        assert sample.failed == sum(i.status == ItemStatus.FAILED for i in inside)
        took = Counter(
            bisect.bisect_right(DURATION_EDGES, i.finished_at - i.started_at) for i in inside
        )
        assert sample.durations == [took[b] for b in range(len(DURATION_EDGES) + 1)]
        attempts = Counter(str(min(i.attempt, ATTEMPTS_SHOWN)) for i in inside)
        assert sample.attempts == dict(sorted(attempts.items()))
        since = sample.upto
    assert sum(s.finished for s in samples) == len([i for i in items if i.finished_at <= since])


def test_a_sampled_runs_charts_match_its_rows_without_reading_the_items_its_samples_hold(
    settings: Any, django_assert_num_queries: Any
) -> None:
    run = new_run(minutes=10)
    items = ended_at_odd_times(run, 900)
    assert run.finished_at
    # The supervisor samples it to 30 s before its end: its last items are no sample's.
    samples = sample_every_10s(run, settings, run.finished_at - timedelta(seconds=20))
    now = timezone.now()
    # The same run, counted from its items: as if no sample had a window.
    RunSample.objects.filter(run=run).update(upto=None)
    scanned = run_charts(run, now)
    RunSample.objects.bulk_update(samples, ["upto"])
    assert scanned.exact
    # What the samples hold is no longer read from the items: take those items away.
    last = samples[-1].upto
    assert last is not None
    late = [i for i in items if i.finished_at > last]
    assert 0 < len(late) < len(items) // 10
    ItemClaim.objects.filter(run=run, finished_at__lte=last).delete()

    with django_assert_num_queries(SAMPLED_RUN_CHART_QUERIES):
        charts = run_charts(run, now)

    assert not charts.exact
    assert charts.finished == scanned.finished and sum(charts.finished) == len(items)
    assert charts.failed == scanned.failed
    assert charts.durations == scanned.durations
    assert charts.attempts == scanned.attempts
    assert charts.waits == scanned.waits
    # Each percentile read off the histogram lies in the bucket of the exact one.
    for p in PERCENTILES:
        assert bisect.bisect_right(DURATION_EDGES, charts.percentiles[p]) == bisect.bisect_right(
            DURATION_EDGES, scanned.percentiles[p]
        ), p


def test_a_reopened_runs_samples_are_not_summed_its_items_are(settings: Any) -> None:
    run = new_run(minutes=5)
    items = ended_at_odd_times(run, 200)
    assert run.finished_at
    sample_every_10s(run, settings, run.finished_at)
    failed = [i for i in items if i.status == ItemStatus.FAILED]
    # A retry of the failed items: they run again and succeed, the run ends once more.
    ItemClaim.objects.filter(pk__in=[i.pk for i in failed]).update(status=ItemStatus.SUCCEEDED)
    run.reopened += 1

    charts = run_charts(run, timezone.now())

    assert charts.exact and sum(charts.failed) == 0 and sum(charts.finished) == len(items)


def test_ended_counts_only_items_with_an_outcome() -> None:
    run = new_run(minutes=1)
    ItemClaim.objects.bulk_create(
        [
            ItemClaim(
                run=run, key="ok", index=0, status=ItemStatus.SUCCEEDED, finished_at=run.finished_at
            ),
            ItemClaim(
                run=run,
                key="retry",
                index=1,
                status=ItemStatus.PENDING,
                finished_at=run.finished_at,
            ),
            ItemClaim(run=run, key="run", index=2, status=ItemStatus.RUNNING),
        ]
    )

    assert ended(ItemClaim.objects.filter(run=run)) == [(0, 0, -1, -1, 1)]


def test_a_window_longer_than_a_bucket_is_spread_over_the_buckets_it_covers(
    settings: Any,
) -> None:
    """A 40 s run has 1 s bars and 10 s windows: ten items a second are drawn as ten a
    second, not as a hundred in one bar out of ten."""
    run = new_run(minutes=40 / 60)
    assert run.started_at and run.finished_at
    items = [
        ItemClaim(
            run=run,
            key=f"k{i}",
            index=i,
            status=ItemStatus.SUCCEEDED,
            attempt=1,
            started_at=run.started_at + timedelta(milliseconds=100 * i + 1),
            finished_at=run.started_at + timedelta(milliseconds=100 * i + 51),
        )
        for i in range(400)
    ]
    ItemClaim.objects.bulk_create(items)
    sample_every_10s(run, settings, run.finished_at)
    RunSample.objects.filter(run=run).update(upto=None)
    scanned = run_charts(run, timezone.now())
    RunSample.objects.filter(run=run).delete()
    sample_every_10s(run, settings, run.finished_at)

    charts = run_charts(run, timezone.now())

    assert not charts.exact and scanned.exact
    assert charts.seconds == 1.0 and len(charts.finished) == 40
    assert sum(charts.finished) == 400
    assert max(abs(a - b) for a, b in zip(charts.finished, scanned.finished, strict=True)) <= 1


def items_taking(run: BatchRun, seconds: list[float]) -> None:
    """Items that ended spread over the run's life, each taking the given seconds."""
    assert run.started_at and run.finished_at
    life = (run.finished_at - run.started_at) / (len(seconds) + 1)
    rows = []
    for i, s in enumerate(seconds):
        end = run.started_at + life * (i + 1) + timedelta(milliseconds=3)
        took = timedelta(seconds=s)
        rows.append(
            ItemClaim(
                run=run,
                key=f"t{i}",
                index=i,
                status=ItemStatus.SUCCEEDED,
                attempt=1,
                claimed_at=end - took,
                started_at=end - took,
                finished_at=end,
            )
        )
    ItemClaim.objects.bulk_create(rows)


def durations_panel(client: Any, run: BatchRun) -> tuple[str, str]:
    page = client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))
    panel = next(c for c in page.context["charts"] if c["name"] == "durations")
    return str(panel["svg"]), panel["note"]


def test_a_sampled_runs_percentiles_are_the_buckets_they_lie_in_not_a_guess_within_them(
    admin_client: Any, settings: Any
) -> None:
    """Durations bunched at 3.0-3.1 s: a place within the 2-5 s bucket on the log scale read
    p95 4.8 s. The page says the bucket, which holds the exact value."""
    cache.clear()
    run = new_run(minutes=2)
    assert run.finished_at
    items_taking(run, [3.0 + i / 1000 for i in range(100)])
    sample_every_10s(run, settings, run.finished_at)

    charts = run_charts(run, timezone.now())
    _, note = durations_panel(admin_client, run)

    assert not charts.exact
    exact = sorted(timedelta(seconds=3.0 + i / 1000) for i in range(100))
    for p in PERCENTILES:
        lo, hi = charts.bounds[p]
        assert hi is not None and lo <= nearest_rank(exact, p) < hi
    assert "p50, p95 and p99 between 2.0s and 5.0s" in note
    assert "4.8" not in note and "≈" not in note


def test_a_runs_durations_in_a_single_bucket_are_labelled_with_its_edges(
    admin_client: Any,
) -> None:
    cache.clear()
    run = new_run(minutes=1)
    items_taking(run, [3.0 + i / 100 for i in range(20)])

    svg, note = durations_panel(admin_client, run)

    labels = re.findall(r'class="fanout-chart-label"[^>]*>([^<]*)<', svg)
    assert "2.0s" in labels and "5.0s" in labels, labels
    assert note == "p50 3.1s, p95 3.2s, p99 3.2s"


def test_a_pools_admissions_chart_draws_what_its_burst_allows_above_its_rate(
    admin_client: Any,
) -> None:
    """A full bucket admits its burst at once: a minute's bar may rise above the rate's line
    by burst / 60 s, which read as a broken limit."""
    pool = CapacityPool.objects.create(
        name="bursty", max_concurrency=10, rate_count=100, rate_period=60, burst=20
    )

    page = admin_client.get(reverse("admin:fanout_capacitypool_change", args=[pool.pk]))

    panel = next(c for c in page.context["charts"] if c["name"] == "pool-admitted")
    svg = str(panel["svg"])
    assert "<title>rate: 1.7/s</title>" in svg
    assert "<title>most a 1m 00s bar can admit, with a full burst of 20: 2/s</title>" in svg
    assert "burst" in panel["note"] and "dotted" in panel["note"]


def test_a_reopened_runs_charts_mark_the_time_it_lay_ended(admin_client: Any) -> None:
    """Retried twelve minutes after it ended: its axis spans both periods, and the empty
    stretch between them is marked as the time it lay ended, not left as a mystery."""
    cache.clear()
    run = new_run(minutes=13, reopened=1)
    assert run.started_at and run.finished_at
    rows = [
        ItemClaim(
            run=run,
            key=f"k{i}",
            index=i,
            status=ItemStatus.SUCCEEDED,
            attempt=1,
            started_at=run.started_at + timedelta(seconds=i),
            finished_at=run.started_at + timedelta(seconds=i, milliseconds=300),
        )
        for i in range(40)
    ] + [
        ItemClaim(
            run=run,
            key="again",
            index=40,
            status=ItemStatus.FAILED,
            attempt=2,
            started_at=run.finished_at - timedelta(seconds=3),
            finished_at=run.finished_at,
        )
    ]
    ItemClaim.objects.bulk_create(rows)

    page = admin_client.get(reverse("admin:fanout_batchrun_change", args=[run.pk]))

    throughput = next(c for c in page.context["charts"] if c["name"] == "throughput")
    idle = re.findall(
        r'<rect class="fanout-chart-idle"[^>]*><title>([^<]*)</title>', str(throughput["svg"])
    )
    assert len(idle) == 1 and idle[0].startswith("ended, until reopened: "), idle
    assert "Reopened once" in throughput["note"], throughput["note"]
    headline = page.content.decode().split('class="fanout-headline"')[1].split("</div>")[0]
    assert "reopened once" in headline


def test_the_duration_axis_puts_no_two_labels_closer_than_three_bars_when_it_has_room() -> None:
    from fanout.admin.charts import _duration_ticks
    from fanout.tally import DURATION_EDGES

    buckets = len(DURATION_EDGES) + 1
    for lo in range(buckets):
        for hi in range(lo + 1, buckets + 1):
            at = [position for position, _ in _duration_ticks(lo, hi)]
            assert at[0] == 0 and at == sorted(at), (lo, hi, at)
            gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
            if hi - lo >= 3 and gaps:  # room for labels three bars apart: none closer
                assert min(gaps) >= 3, (lo, hi, at)
