"""The shape of a run and of a pool over time, from SQL aggregates of the rows.

Every series has at most MAX_BUCKETS buckets, and each is one GROUP BY over a portable
expression: a bucket is found by a CASE nested as a binary search over its edges (six
comparisons for sixty buckets), so the same query runs on PostgreSQL, MariaDB and SQLite, and
a page costs the same few queries for a run of a hundred items and of a million.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import cache
from django.db.models import (
    Avg,
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    Q,
    QuerySet,
    Value,
    When,
)

from .models import BatchRun, ItemClaim, ItemStatus, RunSample
from .sample import WAITS

MAX_BUCKETS = 60
# Steps a time axis is cut into, seconds: the smallest that gives at most MAX_BUCKETS buckets.
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
# A handler's duration, on a fixed log scale so that runs compare: 1 ms to 1 day, 1-2-5.
DURATION_EDGES = tuple(
    timedelta(milliseconds=m * 10**e)
    for e in range(8)
    for m in (1, 2, 5)
    if m * 10**e <= 86_400_000
)
PERCENTILES = (50, 95, 99)
CHILDREN_SHOWN = 60
CACHE_SECONDS = 3600
ATTEMPTS_SHOWN = 10  # attempts above this are counted together


def bucket_of(name: str, edges: list[Any] | tuple[Any, ...]) -> Any:
    """An expression giving the index i of the bucket [edges[i-1], edges[i]) that ``name``
    falls in: 0 below edges[0], len(edges) at or above the last edge."""

    def search(lo: int, hi: int) -> Any:
        if lo == hi:
            return Value(lo)
        mid = (lo + hi) // 2
        return Case(
            When(Q(**{f"{name}__lt": edges[mid]}), then=search(lo, mid)),
            default=search(mid + 1, hi),
            output_field=IntegerField(),
        )

    return search(0, len(edges))


@dataclass
class TimeAxis:
    """[start, start + step * count): a run's life or the last hour, cut into buckets."""

    start: datetime
    step: timedelta
    count: int

    @classmethod
    def over(cls, start: datetime, end: datetime) -> TimeAxis:
        span = max((end - start).total_seconds(), 1.0)
        step = next((s for s in STEPS if span / s <= MAX_BUCKETS), None)
        if step is None:
            step = math.ceil(span / MAX_BUCKETS)
        return cls(start, timedelta(seconds=step), max(1, math.ceil(span / step)))

    def inner_edges(self) -> list[datetime]:
        """The edges between buckets: a time before the first lands in bucket 0, after the
        last in the last bucket."""
        return [self.start + self.step * i for i in range(1, self.count)]

    def times(self) -> list[datetime]:
        return [self.start + self.step * i for i in range(self.count)]


def _durations(items: QuerySet[ItemClaim]) -> QuerySet[ItemClaim]:
    return items.filter(started_at__isnull=False, finished_at__isnull=False).annotate(
        took=ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    )


# ------------------------------------------------------------------------------------ runs


@dataclass
class RunCharts:
    axis: TimeAxis
    # Items finished per bucket of the axis, and how many of them failed.
    finished: list[int]
    failed: list[int]
    # Handler durations (the last attempt of each finished item): counts per DURATION_EDGES
    # bucket (len(DURATION_EDGES) + 1 of them), and the exact percentiles.
    durations: list[int]
    percentiles: dict[int, timedelta]
    # Items by the attempt they ended at (started items only); the last key counts the rest.
    attempts: dict[int, int]
    # Mean items per bucket of the axis by what they waited on (fanout.sample.WAITS).
    waits: dict[str, list[float | None]]
    # Child runs (Item.spawn), first started first: at most CHILDREN_SHOWN, and how many.
    children: list[dict[str, Any]] = field(default_factory=list)
    more_children: bool = False

    @property
    def seconds(self) -> float:
        return self.axis.step.total_seconds()


def run_axis(run: BatchRun, now: datetime) -> TimeAxis:
    start = run.started_at or run.created_at
    end = run.finished_at or now
    return TimeAxis.over(start, max(end, start))


def run_charts(run: BatchRun, now: datetime) -> RunCharts:
    """The run page's charts, in eight queries whatever the run's size."""
    axis = run_axis(run, now)
    items = ItemClaim.objects.filter(run_id=run.pk)
    finished, failed = _throughput(items, axis)
    durations = _duration_histogram(items)
    return RunCharts(
        axis=axis,
        finished=finished,
        failed=failed,
        durations=durations,
        percentiles=_percentiles(items, durations),
        attempts=_attempts(items),
        waits=_waits(run, axis),
        **_children(run),
    )


def cached_run_charts(run: BatchRun, now: datetime) -> RunCharts:
    """A run's charts; an ended run's are computed once per end and kept CACHE_SECONDS in
    Django's default cache (a retry reopens the run and ends it again: a new key)."""
    if not run.is_terminal or run.finished_at is None:
        return run_charts(run, now)
    ended = run.finished_at.timestamp()
    key = (
        f"fanout:run-charts:{run.pk}:{run.status}:{ended}:{run.reopened}:{run.item_counts is None}"
    )
    charts = cache.get(key)
    if charts is None:
        charts = run_charts(run, now)
        cache.set(key, charts, CACHE_SECONDS)
    return charts


def _throughput(items: QuerySet[ItemClaim], axis: TimeAxis) -> tuple[list[int], list[int]]:
    finished, failed = [0] * axis.count, [0] * axis.count
    rows = (
        items.filter(finished_at__isnull=False)
        .annotate(b=bucket_of("finished_at", axis.inner_edges()))
        .values("b")
        .annotate(n=Count("pk"), f=Count("pk", filter=Q(status=ItemStatus.FAILED)))
        .order_by()
        .values_list("b", "n", "f")
    )
    for b, n, f in rows:
        finished[b], failed[b] = n, f
    return finished, failed


def _duration_histogram(items: QuerySet[ItemClaim]) -> list[int]:
    counts = [0] * (len(DURATION_EDGES) + 1)
    rows = (
        _durations(items)
        .annotate(b=bucket_of("took", DURATION_EDGES))
        .values("b")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("b", "n")
    )
    for b, n in rows:
        counts[b] = n
    return counts


def _percentiles(items: QuerySet[ItemClaim], histogram: list[int]) -> dict[int, timedelta]:
    """The nearest-rank percentiles, exact: the histogram says which bucket holds each rank,
    and one query per percentile sorts only that bucket's durations."""
    total = sum(histogram)
    found: dict[int, timedelta] = {}
    if not total:
        return found
    for p in PERCENTILES:
        rank = max(1, math.ceil(total * p / 100))  # 1-based
        b, below = _bucket_of_rank(histogram, rank)
        bucket = _durations(items)
        if b > 0:
            bucket = bucket.filter(took__gte=DURATION_EDGES[b - 1])
        if b < len(DURATION_EDGES):
            bucket = bucket.filter(took__lt=DURATION_EDGES[b])
        took = bucket.order_by("took").values_list("took", flat=True)[rank - below - 1]
        found[p] = took
    return found


def _bucket_of_rank(histogram: list[int], rank: int) -> tuple[int, int]:
    """The bucket that holds the ``rank``-th smallest value, and how many lie below it."""
    below = 0
    for b, n in enumerate(histogram):
        if below + n >= rank:
            return b, below
        below += n
    raise ValueError(f"rank {rank} is past the histogram's {below} values")


def _attempts(items: QuerySet[ItemClaim]) -> dict[int, int]:
    capped = Case(
        When(attempt__gt=ATTEMPTS_SHOWN, then=Value(ATTEMPTS_SHOWN)),
        default=F("attempt"),
        output_field=IntegerField(),
    )
    rows = (
        items.filter(started_at__isnull=False)
        .annotate(a=capped)
        .values("a")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("a", "n")
    )
    return dict(sorted(rows))


def _waits(run: BatchRun, axis: TimeAxis) -> dict[str, list[float | None]]:
    waits: dict[str, list[float | None]] = {w: [None] * axis.count for w in WAITS}
    rows = (
        RunSample.objects.filter(run_id=run.pk)
        .annotate(b=bucket_of("at", axis.inner_edges()))
        .values("b")
        .annotate(**{f"mean_{w}": Avg(w) for w in WAITS})
        .order_by()
    )
    for row in rows:
        for w in WAITS:
            mean = row[f"mean_{w}"]
            waits[w][row["b"]] = None if mean is None else float(mean)
    return waits


def _children(run: BatchRun) -> dict[str, Any]:
    rows = list(
        BatchRun.objects.filter(parent_item__run_id=run.pk)
        .order_by("started_at", "pk")
        .values("pk", "definition", "status", "created_at", "started_at", "finished_at")[
            : CHILDREN_SHOWN + 1
        ]
    )
    return {"children": rows[:CHILDREN_SHOWN], "more_children": len(rows) > CHILDREN_SHOWN}


# ----------------------------------------------------------------------------------- pools

POOL_WINDOW = timedelta(hours=1)


@dataclass
class PoolCharts:
    axis: TimeAxis
    in_flight: list[int]  # items of the pool running at the end of each bucket
    admitted: list[int]  # items claimed in each bucket

    @property
    def seconds(self) -> float:
        return self.axis.step.total_seconds()


def pool_charts(name: str, now: datetime) -> PoolCharts:
    """The pool page's last hour, in two queries whatever the pool's size."""
    axis = TimeAxis.over(now - POOL_WINDOW, now)
    items = ItemClaim.objects.filter(pool=name)
    admitted = [0] * axis.count
    rows = (
        items.filter(claimed_at__gte=axis.start, claimed_at__lte=now)
        .annotate(b=bucket_of("claimed_at", axis.inner_edges()))
        .values("b")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("b", "n")
    )
    for b, n in rows:
        admitted[b] = n
    # In flight at the end of each bucket: claimed by then and not finished by then.
    ends = [t + axis.step for t in axis.times()]
    ends[-1] = now
    unfinished = Q(finished_at__isnull=True, status=ItemStatus.RUNNING)
    live = items.filter(claimed_at__lte=now).filter(unfinished | Q(finished_at__gte=axis.start))
    held = live.aggregate(
        **{
            f"t{i}": Count(
                "pk",
                filter=Q(claimed_at__lte=t) & (unfinished | Q(finished_at__gt=t)),
            )
            for i, t in enumerate(ends)
        }
    )
    in_flight = [held[f"t{i}"] for i in range(len(ends))]
    return PoolCharts(axis, in_flight, admitted)
