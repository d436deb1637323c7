"""Reading the Execution ledger: in-flight counts over time, rebuilt from start and end times."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tests.testapp.models import Execution


@dataclass(frozen=True)
class Span:
    run_id: int
    key: str
    pool: str
    worker: str
    attempt: int
    started: float
    ended: float


def spans(**filters: object) -> list[Span]:
    """Finished handler calls matching ``filters``; every one must have ended."""
    rows = list(Execution.objects.filter(**filters).order_by("started"))
    unfinished = [r.key for r in rows if r.ended is None]
    assert not unfinished, f"handler calls that never ended: {unfinished}"
    return [Span(r.run_id, r.key, r.pool, r.worker, r.attempt, r.started, r.ended) for r in rows]


def max_in_flight(calls: Sequence[Span]) -> int:
    """The most calls running at one instant; a call ending at t is out before one starting at t."""
    events = sorted([(s.started, 1) for s in calls] + [(s.ended, -1) for s in calls])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def processes(calls: Iterable[Span]) -> set[str]:
    """The worker processes (pids) that ran the calls."""
    return {s.worker.split(":")[0] for s in calls}
