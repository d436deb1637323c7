"""The shape of a run and of a pool over time, from SQL aggregates of the rows.

Every series has at most MAX_BUCKETS buckets. A run's throughput, durations and attempts are
summed from its samples (fanout.sample: the items that ended in each window) and one GROUP BY
over the items no sample holds yet, so a page costs the same few queries, each reading a few
hundred rows, for a run of a hundred items and of a million. A run without samples (run
inline, or ended before its supervisor sampled it), or retried since some were taken, is
counted from its items instead, exactly.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import accumulate
from typing import Any, NamedTuple

from django.core.cache import cache
from django.db.models import Case, Count, F, IntegerField, Q, QuerySet, Value, When, Window
from django.db.models.functions import RowNumber

from .backends import backend
from .models import (
    BatchRun,
    ItemClaim,
    ItemStatus,
    PoolSample,
    RunSample,
)
from .sample import WAITS
from .tally import (
    ATTEMPTS_SHOWN,
    DURATION_EDGES,
    ENDED_ITEM_STATUSES,
    Ended,
    bucket_of,
    ended,
    or_none,
    took,
)

__all__ = [
    "ATTEMPTS_SHOWN",
    "DURATION_EDGES",
    "MAX_BUCKETS",
    "PERCENTILES",
    "PoolCharts",
    "RunCharts",
    "TimeAxis",
    "cached_run_charts",
    "pool_charts",
    "run_axis",
    "run_charts",
]

MAX_BUCKETS = 60
# Steps a time axis is cut into, seconds: the smallest that gives at most MAX_BUCKETS buckets.
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
PERCENTILES = (50, 95, 99)
CHILDREN_SHOWN = 60
CACHE_SECONDS = 3600


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

    def bucket(self, at: datetime) -> int:
        """The bucket ``at`` falls in, as bucket_of() finds it in SQL."""
        return bisect.bisect_right(self.inner_edges(), at)


# ------------------------------------------------------------------------------------ runs


@dataclass
class RunCharts:
    axis: TimeAxis
    # Items ended per bucket of the axis, and how many of them failed.
    finished: list[int]
    failed: list[int]
    # Handler durations (the last attempt of each ended item): counts per DURATION_EDGES
    # bucket (len(DURATION_EDGES) + 1 of them), and the nearest-rank percentiles.
    durations: list[int]
    percentiles: dict[int, timedelta]
    # Items by the attempt they ended at (started items only); the last key counts the rest.
    attempts: dict[int, int]
    # Mean items per bucket of the axis by what they waited on (fanout.sample.WAITS).
    waits: dict[str, list[float | None]]
    # Child runs (Item.spawn), first started first: at most CHILDREN_SHOWN, and how many.
    children: list[dict[str, Any]] = field(default_factory=list)
    more_children: bool = False
    # False when the percentiles are read off the histogram (a sampled run): each is then
    # only known to lie in its bucket, ``bounds[p]`` = (its lower edge, its upper edge; None
    # past the last edge), and ``percentiles[p]`` is that lower edge, a true lower bound.
    exact: bool = True
    bounds: dict[int, tuple[timedelta, timedelta | None]] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.axis.step.total_seconds()


class Sample(NamedTuple):
    at: datetime
    waits: tuple[int, ...]
    upto: datetime | None
    finished: int
    failed: int
    durations: list[int]
    attempts: dict[str, int]
    reopened: int


def run_axis(run: BatchRun, now: datetime) -> TimeAxis:
    start = run.started_at or run.created_at
    end = run.finished_at or now
    return TimeAxis.over(start, max(end, start))


def run_charts(run: BatchRun, now: datetime) -> RunCharts:
    """The run page's charts in three queries whatever the run's size: its samples, the
    items that ended since the last of them, and its child runs. A run that no sample
    counts yet reads its items instead, and one more query for the exact percentiles."""
    with backend().aggregating():
        return _run_charts(run, now)


def _run_charts(run: BatchRun, now: datetime) -> RunCharts:
    axis = run_axis(run, now)
    samples = _samples(run)
    windows = [s for s in samples if s.upto is not None]
    items = ItemClaim.objects.filter(run_id=run.pk)
    # Every sample must have its window, all of this end: a retry voids the windows before it.
    if windows and all(s.upto is not None and s.reopened == run.reopened for s in samples):
        counts = _from_windows(axis, windows, items)
        bounds, exact = _percentile_bounds(counts.durations), False
        percentiles = {p: lo for p, (lo, _) in bounds.items()}
    else:
        counts = Ended.empty(axis.count).add(ended(items, axis.inner_edges()))
        percentiles, exact, bounds = _percentiles(items, counts.durations), True, {}
    return RunCharts(
        axis=axis,
        finished=counts.finished,
        failed=counts.failed,
        durations=counts.durations,
        percentiles=percentiles,
        attempts=dict(sorted(counts.attempts.items())),
        waits=_waits(axis, samples),
        exact=exact,
        bounds=bounds,
        **_children(run),
    )


def _samples(run: BatchRun) -> list[Sample]:
    rows = RunSample.objects.filter(run_id=run.pk).order_by("at")
    columns = ("upto", "finished", "failed", "durations", "attempts", "reopened")
    return [
        Sample(r[0], r[1 : len(WAITS) + 1], *r[len(WAITS) + 1 :])
        for r in rows.values_list("at", *WAITS, *columns)
    ]


def _from_windows(axis: TimeAxis, windows: list[Sample], items: QuerySet[ItemClaim]) -> Ended:
    """The windows' counts, each spread over the buckets its window covers, and the items
    that ended after the last window, each in its own bucket. A window is as long as the
    supervisor's period: one longer than a bucket, drawn in one, would draw a rate its pool
    never allowed."""
    counts = Ended.empty(axis.count)
    since = axis.start
    for w in windows:
        assert w.upto is not None
        for totals, n in ((counts.finished, w.finished), (counts.failed, w.failed)):
            for b, share in _spread(axis, since, w.upto, n):
                totals[b] += share
        counts.durations = [x + y for x, y in zip(counts.durations, w.durations, strict=False)]
        counts.attempts.update({int(a): n for a, n in w.attempts.items()})
        since = max(since, w.upto)
    return counts.add(ended(items.filter(finished_at__gt=since), axis.inner_edges()))


def _spread(axis: TimeAxis, start: datetime, end: datetime, n: int) -> list[tuple[int, int]]:
    """``n`` items that ended within (start, end], shared among the buckets of the axis in
    proportion to the time each covers of it, in whole items that sum to ``n``."""
    if n == 0:
        return []
    first, last = axis.bucket(start), axis.bucket(end)
    if end <= start or first == last:
        return [(last, n)]
    span = (end - start).total_seconds()
    shares, given = [], 0
    for b in range(first, last + 1):
        right = end if b == last else min(end, axis.start + axis.step * (b + 1))
        upto = round(n * (right - start).total_seconds() / span)
        shares.append((b, upto - given))
        given = upto
    return shares


def cached_run_charts(run: BatchRun, now: datetime) -> RunCharts:
    """A run's charts; an ended run's are computed once per end and kept CACHE_SECONDS in
    Django's default cache (a retry reopens the run and ends it again: a new key)."""
    if not run.is_terminal or run.finished_at is None:
        return run_charts(run, now)
    ended_at = run.finished_at.timestamp()
    key = (
        f"fanout:run-charts:{run.pk}:{run.status}:{ended_at}:{run.reopened}:"
        f"{run.item_counts is None}"
    )
    charts = cache.get(key)
    if charts is None:
        charts = run_charts(run, now)
        cache.set(key, charts, CACHE_SECONDS)
    return charts


def _percentiles(items: QuerySet[ItemClaim], histogram: list[int]) -> dict[int, timedelta]:
    """The nearest-rank percentiles, exact: the histogram says which bucket holds each rank,
    and one query numbers the durations of those buckets alone, in order."""
    if not sum(histogram):
        return {}
    wanted = {p: _rank_in_bucket(histogram, p) for p in PERCENTILES}  # p: (bucket, rank in it)
    buckets = sorted({b for b, _ in wanted.values()})
    ranked = (
        items.filter(status__in=ENDED_ITEM_STATUSES)
        .filter(started_at__isnull=False, finished_at__isnull=False)
        .annotate(took=took())
        .annotate(d=bucket_of("took", DURATION_EDGES))
        .filter(d__in=buckets)
        .annotate(r=Window(RowNumber(), partition_by=[F("d")], order_by=[F("took").asc(), F("pk")]))
        .filter(r__in=sorted({r for _, r in wanted.values()}))
        .values_list("d", "r", "took")
    )
    found = {(d, r): duration for d, r, duration in ranked}
    return {p: found[where] for p, where in wanted.items()}


def _percentile_bounds(histogram: list[int]) -> dict[int, tuple[timedelta, timedelta | None]]:
    """Where the nearest-rank percentiles lie, read off the histogram: the bucket that holds
    each rank, as (its lower edge, its upper edge or None above the last). A place within the
    bucket would be a guess: durations bunch, and a 1-2-5 bucket is wide (a p95 of 3.1 s
    placed on the log scale read 4.8 s)."""
    if not sum(histogram):
        return {}
    found = {}
    for p in PERCENTILES:
        b, _ = _rank_in_bucket(histogram, p)
        lo = DURATION_EDGES[b - 1] if b else timedelta(0)
        found[p] = (lo, DURATION_EDGES[b] if b < len(DURATION_EDGES) else None)
    return found


def _rank_in_bucket(histogram: list[int], p: int) -> tuple[int, int]:
    """The bucket that holds the nearest-rank ``p``th percentile, and its rank there (1-based)."""
    rank = max(1, math.ceil(sum(histogram) * p / 100))
    below = 0
    for b, n in enumerate(histogram):
        if below + n >= rank:
            return b, rank - below
        below += n
    raise ValueError(f"rank {rank} is past the histogram's {below} values")


def _waits(axis: TimeAxis, samples: list[Sample]) -> dict[str, list[float | None]]:
    """The mean of each wait over the samples taken in each bucket of the axis."""
    sums: dict[int, list[int]] = {}
    seen: Counter[int] = Counter()
    for s in samples:
        b = axis.bucket(s.at)
        seen[b] += 1
        sums[b] = [x + y for x, y in zip(sums.get(b, [0] * len(WAITS)), s.waits, strict=True)]
    waits: dict[str, list[float | None]] = {w: [None] * axis.count for w in WAITS}
    for b, total in sums.items():
        for w, value in zip(WAITS, total, strict=True):
            waits[w][b] = value / seen[b]
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
    # Items of the pool running at the end of each bucket; from samples, at the last sample
    # taken in it (None where none was) and now for the last bucket.
    in_flight: list[int | None]
    admitted: list[int]  # items claimed in each bucket
    sampled: bool = False  # drawn from the pool's samples, not its items

    @property
    def seconds(self) -> float:
        return self.axis.step.total_seconds()


class PoolWindow(NamedTuple):
    at: datetime
    in_flight: int
    since: datetime
    upto: datetime
    admitted: int


def pool_charts(name: str, now: datetime) -> PoolCharts:
    """The pool page's last hour. From the pool's samples when their windows reach back to the
    hour's start, in three queries whatever the pool ran: its samples, the items it admitted
    after the last one, and its items running now. Else in one pass over the items that were
    claimed in the hour or held a slot in it: admissions are the claims per bucket, and the
    items in flight at the end of a bucket those claimed before it and not yet ended."""
    axis = TimeAxis.over(now - POOL_WINDOW, now)
    samples = [
        PoolWindow(*row)
        for row in PoolSample.objects.filter(pool__name=name, upto__gt=axis.start, at__lte=now)
        .order_by("at", "pk")
        .values_list("at", "in_flight", "since", "upto", "admitted")
    ]
    if samples and samples[0].since <= axis.start:
        return _sampled_pool(name, axis, samples, now)
    admitted = [0] * axis.count
    claimed, ended_in = [0] * (axis.count + 1), [0] * (axis.count + 1)
    for c, f, held, n in _pool_rows(name, axis, now):
        if c > 0:
            admitted[c - 1] += n
        if held:  # a pending item, released or retried, holds no slot: not in flight
            claimed[c] += n
            if f >= 0:
                ended_in[f] += n
    # By the end of bucket i: claimed in buckets 0..i + 1, less ended in them.
    started, stopped = list(accumulate(claimed)), list(accumulate(ended_in))
    in_flight: list[int | None] = [started[i + 1] - stopped[i + 1] for i in range(axis.count)]
    return PoolCharts(axis, in_flight, admitted)


def _sampled_pool(
    name: str, axis: TimeAxis, samples: list[PoolWindow], now: datetime
) -> PoolCharts:
    """Each window's admissions shared among the buckets it covers (the part before the hour
    left out), the claims after the last window each in its own bucket, and each bucket's
    last sample of what ran (now's, for the last bucket)."""
    admitted = [0] * axis.count
    in_flight: list[int | None] = [None] * axis.count
    for w in samples:
        start, n = w.since, w.admitted
        if start < axis.start:  # the window's share of the hour, in proportion to its time
            inside = (w.upto - axis.start) / (w.upto - start)
            start, n = axis.start, round(n * inside)
        for b, share in _spread(axis, start, w.upto, n):
            admitted[b] += share
        in_flight[axis.bucket(w.at)] = w.in_flight
    items = ItemClaim.objects.filter(pool=name)
    tail = (
        items.filter(claimed_at__gt=samples[-1].upto, claimed_at__lte=now)
        .annotate(c=bucket_of("claimed_at", axis.inner_edges()))
        .values("c")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("c", "n")
    )
    for b, n in tail:
        admitted[b] += n
    in_flight[-1] = items.running().count()
    return PoolCharts(axis, in_flight, admitted, sampled=True)


def _pool_rows(name: str, axis: TimeAxis, now: datetime) -> list[tuple[int, int, int, int]]:
    """The pool's items grouped by (the bucket of their claim, of their end, whether they held
    a slot); bucket 0 is before the hour, i + 1 the axis's bucket i."""
    edges = [axis.start, *axis.inner_edges()]
    running = Q(finished_at__isnull=True, status=ItemStatus.RUNNING)
    with backend().aggregating():
        return list(
            ItemClaim.objects.filter(pool=name, claimed_at__lte=now)
            .filter(Q(claimed_at__gte=axis.start) | Q(finished_at__gte=axis.start) | running)
            .annotate(
                c=bucket_of("claimed_at", edges),
                f=or_none(Q(finished_at__isnull=False), bucket_of("finished_at", edges)),
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
