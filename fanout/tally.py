"""Count the items that ended: by when, whether they failed, how long their handler took and
at which attempt. One GROUP BY over a portable bucket expression, shared by the run samples
(the items that ended in a window) and the run page's charts (those no sample holds yet).

A bucket is found by a CASE nested as a binary search over its edges (six comparisons for
sixty buckets), or the backend's own function, so the same query runs on PostgreSQL, MariaDB
and SQLite.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import (
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

from .backends import backend
from .models import TERMINAL_ITEM_STATUSES, ItemClaim, ItemStatus

# A handler's duration, on a fixed log scale so that runs compare: 1 ms to 1 day, 1-2-5.
DURATION_EDGES = tuple(
    timedelta(milliseconds=m * 10**e)
    for e in range(8)
    for m in (1, 2, 5)
    if m * 10**e <= 86_400_000
)
ATTEMPTS_SHOWN = 10  # attempts above this are counted together
ENDED_ITEM_STATUSES = tuple(s for s in TERMINAL_ITEM_STATUSES if s != ItemStatus.CANCELLED)


def bucket_of(name: str, edges: Sequence[Any]) -> Any:
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


def or_none(when: Q, then: Any) -> Case:
    """``then`` where ``when`` holds, else -1 (a row that this series does not count)."""
    return Case(When(when, then=then), default=Value(-1), output_field=IntegerField())


def took() -> ExpressionWrapper:
    return ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())


@dataclass
class Ended:
    """The items that ended, summed: per time bucket (finished, failed), per DURATION_EDGES
    bucket (len + 1 of them), and per attempt they ended at (started items only)."""

    finished: list[int]
    failed: list[int]
    durations: list[int] = field(default_factory=lambda: [0] * (len(DURATION_EDGES) + 1))
    attempts: Counter[int] = field(default_factory=Counter)

    @classmethod
    def empty(cls, buckets: int = 1) -> Ended:
        return cls([0] * buckets, [0] * buckets)

    def add(self, rows: Iterable[tuple[int, int, int, int, int]]) -> Ended:
        for b, lost, d, a, n in rows:
            self.finished[b] += n
            self.failed[b] += n * lost
            if d >= 0:
                self.durations[d] += n
            if a > 0:
                self.attempts[a] += n
        return self


def ended(
    items: QuerySet[ItemClaim], edges: Sequence[datetime] = ()
) -> list[tuple[int, int, int, int, int]]:
    """The items that ended (a terminal status other than cancelled, and an end time),
    grouped by (the bucket of their end among ``edges``, failed, their duration's bucket,
    their attempt): a few thousand groups at most, whatever the number of items."""
    started = Q(started_at__isnull=False)
    capped = Case(
        When(attempt__gt=ATTEMPTS_SHOWN, then=Value(ATTEMPTS_SHOWN)),
        default=F("attempt"),
        output_field=IntegerField(),
    )
    lost = Case(
        When(status=ItemStatus.FAILED, then=Value(1)), default=Value(0), output_field=IntegerField()
    )
    # An item cancelled before its handler ran (or between its attempts) ended no attempt: a
    # run cancelled with most of its items pending drew them as finished, in one spike.
    return list(
        items.filter(status__in=ENDED_ITEM_STATUSES)
        .filter(finished_at__isnull=False)
        .annotate(took=took())
        .annotate(
            b=bucket_of("finished_at", edges) if edges else Value(0, IntegerField()),
            lost=lost,
            d=or_none(started, bucket_of("took", DURATION_EDGES)),
            a=or_none(started, capped),
        )
        .values("b", "lost", "d", "a")
        .annotate(n=Count("pk"))
        .order_by()
        .values_list("b", "lost", "d", "a", "n")
    )
