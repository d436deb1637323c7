"""The run page's and the pool page's charts: fanout.charts's aggregates, drawn (svg)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.urls import reverse

from ..charts import (
    ATTEMPTS_SHOWN,
    DURATION_EDGES,
    PERCENTILES,
    PoolCharts,
    RunCharts,
    TimeAxis,
    cached_run_charts,
    pool_charts,
)
from ..models import BatchRun, CapacityPool
from ..sample import WAITS
from ..text import human_duration, precise_duration
from . import svg

Idle = tuple[int, int, str]  # a stretch of bars (first, end) and what it was

WAIT_NAMES = {
    "running": "running",
    "ready": "ready, not yet claimed",
    "max_parallel": "run at max_parallel",
    "pool_full": "pool full",
    "rate_limited": "rate limited",
    "throttled": "throttled",
    "budget": "budget spent",
    "paused": "pool paused or missing",
    "retry_due": "retry not yet due",
    "child_runs": "in a child run",
}


def time_ticks(axis: TimeAxis, origin: str = "") -> list[tuple[int, str]]:
    """Labels under the start, the middle and the end of a time axis."""
    ends = (0, axis.count // 2, axis.count) if axis.count > 2 else (0, axis.count)
    return [(i, origin if i == 0 and origin else human_duration(axis.step * i)) for i in ends]


def _slot_names(axis: TimeAxis) -> list[str]:
    return [f"at {human_duration(axis.step * i)}" for i in range(axis.count)]


def run_panels(run: BatchRun, now: datetime) -> list[dict[str, Any]]:
    """The run page's charts, each a panel: title, svg, legend, a line of figures."""
    charts = cached_run_charts(run, now)
    idle = _idle(charts) if run.reopened else []
    panels = [
        _throughput(charts, idle, run.reopened),
        _durations(charts),
        _attempts(charts),
        _waits(charts, idle),
    ]
    if charts.children:
        panels.append(_children(run, charts))
    return panels


def _per_second(values: list[int], seconds: float) -> list[float | None]:
    return [v / seconds for v in values]


def _idle(c: RunCharts) -> list[Idle]:
    """A reopened run's axis runs from its first start: the longest stretch of three bars or
    more with nothing ended and no sample, between bars that have some, is the time it lay
    ended before a retry reopened it."""
    waits = list(c.waits.values())
    active = [bool(c.finished[b]) or any(w[b] for w in waits) for b in range(c.axis.count)]
    held = [b for b, a in enumerate(active) if a]
    best: tuple[int, int] = (0, 0)
    start = None
    for b in range(held[0], held[-1] + 1) if held else ():
        if not active[b] and start is None:
            start = b
        elif active[b] and start is not None:
            best = max(best, (start, b), key=lambda g: g[1] - g[0])
            start = None
    first, end = best
    if end - first < 3:
        return []
    return [
        (first, end, f"ended, until reopened: about {human_duration(c.axis.step * (end - first))}")
    ]


def _throughput(
    c: RunCharts,
    idle: Sequence[Idle] = (),
    reopened: int = 0,
) -> dict[str, Any]:
    series = [
        svg.Series(
            "finished",
            "finished",
            _per_second([n - f for n, f in zip(c.finished, c.failed, strict=True)], c.seconds),
        ),
        svg.Series("failed", "failed", _per_second(c.failed, c.seconds)),
    ]
    done, failed = sum(c.finished), sum(c.failed)
    return {
        "name": "throughput",
        "title": "Items finished per second",
        "svg": svg.bars(
            series,
            "Items finished per second",
            time_ticks(c.axis, "start"),
            "/s",
            _slot_names(c.axis),
            marks=idle,
        ),
        "legend": svg.legend(series),
        "note": f"{done:,} finished, {failed:,} failed; one bar per {human_duration(c.axis.step)}"
        + _reopened_note(reopened, idle),
    }


def _reopened_note(reopened: int, idle: Sequence[Idle]) -> str:
    if not reopened:
        return ""
    times = "once" if reopened == 1 else f"{reopened} times"
    shaded = " The shaded stretch is the time it lay ended." if idle else ""
    return (
        f". Reopened {times} by a retry: the axis, the duration and the rate run from its "
        f"first start.{shaded}"
    )


def _durations(c: RunCharts) -> dict[str, Any]:
    edges = [precise_duration(e) for e in DURATION_EDGES]
    names = (
        [f"under {edges[0]}"]
        + [f"{edges[i - 1]} to {edges[i]}" for i in range(1, len(edges))]
        + [f"over {edges[-1]}"]
    )
    # Show the buckets from the first to the last that holds a duration.
    held = [i for i, n in enumerate(c.durations) if n]
    lo, hi = (held[0], held[-1] + 1) if held else (0, len(c.durations))
    counts = c.durations[lo:hi]
    series = [svg.Series("items", "duration", counts)]
    return {
        "name": "durations",
        "title": "Handler duration",
        "svg": svg.bars(series, "Handler durations", _duration_ticks(lo, hi), "", names[lo:hi]),
        "legend": "",
        "note": _percentile_note(c) or "No item has finished yet.",
        "percentiles": {p: precise_duration(d) for p, d in c.percentiles.items()},
    }


def _duration_ticks(lo: int, hi: int) -> list[tuple[int, str]]:
    """The bucket edges under the duration chart's bars lo..hi: both ends (the first bar's
    lower edge, the last bar's upper one) and every third edge between them, none closer than
    three bars to the end (two labels side by side ran into each other), so that even one bar
    says what it spans."""
    edges = ["0", *(precise_duration(e) for e in DURATION_EDGES)]  # edges[i]: bucket i's lower
    ticks = [(0, edges[lo])]
    ticks += [(i - lo, edges[i]) for i in range(lo + 1, hi) if (i - lo) % 3 == 0 and hi - i >= 3]
    if hi < len(edges):
        ticks.append((hi - lo, edges[hi]))
    return ticks


def _percentile_note(c: RunCharts) -> str:
    """p50, p95, p99: exact, or (a sampled run: its histogram alone) the bucket each lies in."""
    if c.exact:
        return ", ".join(
            f"p{p} {precise_duration(c.percentiles[p])}" for p in PERCENTILES if p in c.percentiles
        )
    spans: dict[tuple, list[str]] = {}
    for p in PERCENTILES:
        if p in c.bounds:
            spans.setdefault(c.bounds[p], []).append(f"p{p}")
    parts = []
    for (lo, hi), names in spans.items():
        who = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        if hi is None:
            where = f"over {precise_duration(lo)}"
        elif not lo:
            where = f"under {precise_duration(hi)}"
        else:
            where = f"between {precise_duration(lo)} and {precise_duration(hi)}"
        parts.append(f"{who} {where}")
    return "; ".join(parts) + " (from the sampled histogram's buckets)" if parts else ""


def _attempts(c: RunCharts) -> dict[str, Any]:
    shown = range(1, max([*c.attempts, 1]) + 1)
    names = [
        f"{a}{'+' if a == ATTEMPTS_SHOWN else ''} attempt{'s' if a > 1 else ''}" for a in shown
    ]
    series = [svg.Series("items", "attempts", [c.attempts.get(a, 0) for a in shown])]
    ticks = [(i + 0.5, f"{a}{'+' if a == ATTEMPTS_SHOWN else ''}") for i, a in enumerate(shown)]
    more = sum(n for a, n in c.attempts.items() if a > 1)
    return {
        "name": "attempts",
        "title": "Attempts per item",
        "svg": svg.bars(series, "Attempts per item", ticks, "", names),
        "legend": "",
        "note": f"{more:,} items needed more than one attempt"
        if c.attempts
        else "No item has started yet.",
    }


def _waits(c: RunCharts, idle: Sequence[Idle] = ()) -> dict[str, Any]:
    series = [svg.Series(WAIT_NAMES[w], f"wait-{w}", c.waits[w]) for w in WAITS]
    sampled = any(v is not None for v in c.waits["running"])
    return {
        "name": "waits",
        "title": "What unfinished items waited on",
        "svg": svg.bars(
            series,
            "What unfinished items waited on",
            time_ticks(c.axis, "start"),
            "",
            _slot_names(c.axis),
            marks=idle,
        ),
        "legend": svg.legend(series),
        "note": "Mean items per bar, from the supervisor's samples."
        if sampled
        else "No sample yet: the workers' supervisors sample a running run every few seconds.",
    }


def _children(run: BatchRun, c: RunCharts) -> dict[str, Any]:
    origin = run.started_at or run.created_at
    total = c.axis.step.total_seconds() * c.axis.count
    rows = []
    for child in c.children:
        start = child["started_at"] or child["created_at"]
        end = child["finished_at"] or c.axis.start + c.axis.step * c.axis.count
        took = human_duration(end - start)
        rows.append(
            svg.Span(
                f"#{child['pk']} {child['definition']} {child['status']}, {took}",
                f"child-{child['status']}",
                (start - origin).total_seconds(),
                (end - origin).total_seconds(),
                reverse("admin:fanout_batchrun_change", args=[child["pk"]]),
            )
        )
    more = " (the first 60 started)" if c.more_children else ""
    return {
        "name": "children",
        "title": "Child runs",
        "svg": svg.spans(
            rows, "Child runs' durations", total, time_ticks(c.axis, "start"), c.axis.count
        ),
        "legend": "",
        "note": f"{len(rows)} child runs{more}, from when each started to when it ended",
    }


def pool_panels(pool: CapacityPool, now: datetime) -> list[dict[str, Any]]:
    """The pool page's last hour: in flight against its limit, admissions per second."""
    c: PoolCharts = pool_charts(pool.name, now)
    ticks = [(0, "1 hour ago"), (c.axis.count // 2, "30 min"), (c.axis.count, "now")]
    names = [f"{human_duration(now - t)} ago" for t in c.axis.times()]
    in_flight = [svg.Series("in flight", "running", c.in_flight)]
    admitted = [svg.Series("admitted", "finished", _per_second(c.admitted, c.seconds))]
    return [
        {
            "name": "pool-in-flight",
            "title": "In flight, last hour",
            "svg": svg.bars(in_flight, "Items in flight", ticks, "", names, pool.max_concurrency),
            "legend": "",
            "note": (
                "The supervisor's last sample in each minute, now's in the last"
                if c.sampled
                else "At the end of each minute"
            )
            + f"; the line is max_concurrency ({pool.max_concurrency}).",
        },
        {
            "name": "pool-admitted",
            "title": "Admissions per second, last hour",
            "svg": svg.bars(
                admitted,
                "Admissions per second",
                ticks,
                "/s",
                names,
                _rate_limit(pool),
                _burst_ceiling(pool, c.seconds),
                limit_name="rate",
            ),
            "legend": "",
            "note": f"{sum(c.admitted):,} admitted in the hour; rate {pool.describe_rate()}"
            + _burst_note(pool, c.seconds),
        },
    ]


def _rate_limit(pool: CapacityPool) -> float | None:
    if pool.rate_count is None:
        return None
    return pool.rate_count / pool.rate_period


def _burst_ceiling(pool: CapacityPool, seconds: float) -> tuple[float, str] | None:
    """The most a bar of ``seconds`` can admit per second: the rate, and a full bucket (its
    burst) spent at once. A bar between the rate's line and this one is the burst, not a
    broken limit."""
    rate, burst = _rate_limit(pool), pool.capacity
    if rate is None or not burst:
        return None
    bar = human_duration(seconds)
    return rate + burst / seconds, f"most a {bar} bar can admit, with a full burst of {burst}"


def _burst_note(pool: CapacityPool, seconds: float) -> str:
    ceiling = _burst_ceiling(pool, seconds)
    if ceiling is None:
        return ""
    return (
        f". The dashed line is the rate; the dotted one what a bar can admit with a full "
        f"burst ({pool.capacity} at once): {svg.number(ceiling[0])}/s."
    )
