"""The shape of a run and of a pool over time, from SQL aggregates of the rows.

Every series has at most MAX_BUCKETS buckets, and each is one GROUP BY over a portable
expression: a bucket is found by a CASE nested as a binary search over its edges (six
comparisons for sixty buckets), so the same query runs on PostgreSQL, MariaDB and SQLite, and
a page costs the same few queries for a run of a hundred items and of a million.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import accumulate
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
    Window,
)
from django.db.models.functions import RowNumber

from .backends import backend
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
    fast = backend().bucket(F(name), edges)
    if fast is not None:
        return fast

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
    """The run page's charts in four queries whatever the run's size: one pass over its
    items, one over the few durations that the percentiles fall among, its samples, and its
    child runs."""
    with backend().aggregating():
        return _run_charts(run, now)


def _run_charts(run: BatchRun, now: datetime) -> RunCharts:
    axis = run_axis(run, now)
    items = ItemClaim.objects.filter(run_id=run.pk)
    finished, failed = [0] * axis.count, [0] * axis.count
    durations = [0] * (len(DURATION_EDGES) + 1)
    attempts: Counter[int] = Counter()
    for b, lost, d, a, n in _one_pass(items, axis):
        if b >= 0:
            finished[b] += n
            failed[b] += n * lost
        if d >= 0:
            durations[d] += n
        if a > 0:
            attempts[a] += n
    return RunCharts(
        axis=axis,
        finished=finished,
        failed=failed,
        durations=durations,
        percentiles=_percentiles(items, durations),
        attempts=dict(sorted(attempts.items())),
        waits=_waits(run, axis),
        **_children(run),
    )


def _or_none(when: Q, then: Any) -> Case:
    """``then`` where ``when`` holds, else -1 (a row that this series does not count)."""
    return Case(When(when, then=then), default=Value(-1), output_field=IntegerField())


def _one_pass(items: QuerySet[ItemClaim], axis: TimeAxis) -> list[tuple[int, int, int, int, int]]:
    """Every started or finished item counted once, grouped by (its finish's bucket of the
    axis, failed, its duration's bucket, its attempts): a few thousand groups at most, which
    the caller sums into the throughput, the duration histogram and the attempts."""
    finished = Q(finished_at__isnull=False)
    started = Q(started_at__isnull=False)
    capped = Case(
        When(attempt__gt=ATTEMPTS_SHOWN, then=Value(ATTEMPTS_SHOWN)),
        default=F("attempt"),
        output_field=IntegerField(),
    )
    took = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    return list(
        items.filter(started | finished)
        .annotate(took=took)
        .annotate(
            b=_or_none(finished, bucket_of("finished_at", axis.inner_edges())),
            lost=Case(
                When(status=ItemStatus.FAILED, then=Value(1)),
                default=Value(0),
                output_field=IntegerField(),
            ),
            d=_or_none(started & finished, bucket_of("took", DURATION_EDGES)),
            a=_or_none(started, capped),
        )
        .values("b", "lost", "d", "a")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("b", "lost", "d", "a", "n")
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


def _percentiles(items: QuerySet[ItemClaim], histogram: list[int]) -> dict[int, timedelta]:
    """The nearest-rank percentiles, exact: the histogram says which bucket holds each rank,
    and one query numbers the durations of those buckets alone, in order."""
    total = sum(histogram)
    if not total:
        return {}
    wanted: dict[int, tuple[int, int]] = {}  # percentile: (bucket, rank within it, 1-based)
    for p in PERCENTILES:
        rank = max(1, math.ceil(total * p / 100))
        b, below = _bucket_of_rank(histogram, rank)
        wanted[p] = (b, rank - below)
    buckets = sorted({b for b, _ in wanted.values()})
    ranked = (
        _durations(items)
        .annotate(d=bucket_of("took", DURATION_EDGES))
        .filter(d__in=buckets)
        .annotate(r=Window(RowNumber(), partition_by=[F("d")], order_by=[F("took").asc(), F("pk")]))
        .filter(r__in=sorted({r for _, r in wanted.values()}))
        .values_list("d", "r", "took")
    )
    found = {(d, r): took for d, r, took in ranked}
    return {p: found[where] for p, where in wanted.items()}


def _bucket_of_rank(histogram: list[int], rank: int) -> tuple[int, int]:
    """The bucket that holds the ``rank``-th smallest value, and how many lie below it."""
    below = 0
    for b, n in enumerate(histogram):
        if below + n >= rank:
            return b, below
        below += n
    raise ValueError(f"rank {rank} is past the histogram's {below} values")


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
    """The pool page's last hour in one pass over the items that were claimed in it or held
    a slot in it, grouped by (the bucket of their claim, of their end, whether they held a
    slot): admissions are the claims per bucket, and the items in flight at the end of a
    bucket those claimed before it and not yet ended."""
    axis = TimeAxis.over(now - POOL_WINDOW, now)
    edges = [axis.start, *axis.inner_edges()]  # bucket 0: before the hour; i + 1: bucket i
    running = Q(finished_at__isnull=True, status=ItemStatus.RUNNING)
    with backend().aggregating():
        rows = list(
            ItemClaim.objects.filter(pool=name, claimed_at__lte=now)
            .filter(Q(claimed_at__gte=axis.start) | Q(finished_at__gte=axis.start) | running)
            .annotate(
                c=bucket_of("claimed_at", edges),
                f=_or_none(Q(finished_at__isnull=False), bucket_of("finished_at", edges)),
                held=Case(
                    When(Q(finished_at__isnull=False) | running, then=Value(1)),
                    default=Value(0),
                    output_field=IntegerField(),
                ),
            )
            .values("c", "f", "held")
            .annotate(n=Count("pk"))
            .order_by()
            .values_list("c", "f", "held", "n")
        )
    admitted = [0] * axis.count
    claimed, ended = [0] * (axis.count + 1), [0] * (axis.count + 1)
    for c, f, held, n in rows:
        if c > 0:
            admitted[c - 1] += n
        if held:  # a pending item, released or retried, holds no slot: not in flight
            claimed[c] += n
            if f >= 0:
                ended[f] += n
    # By the end of bucket i: claimed in buckets 0..i + 1, less ended in them.
    started, stopped = list(accumulate(claimed)), list(accumulate(ended))
    in_flight = [started[i + 1] - stopped[i + 1] for i in range(axis.count)]
    return PoolCharts(axis, in_flight, admitted)
