"""The runs console of the terminal (manage.py fanout_runs): what runs now, and one run close up.

Everything is read from the rows with the admin's and run_fanout's own progress (report.py), so
the three never disagree. Rendering fits a width on a terminal and wraps a reason rather than
cutting it; elsewhere every line is whole.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q

from .clock import db_now
from .models import TERMINAL_RUN_STATUSES, BatchRun, ItemClaim, ItemStatus
from .nest import descendants
from .report import Progress, progress_of
from .text import human_duration, human_rate, last_line, without_class

FAILURES_SHOWN = 5


@dataclass
class RunLine:
    """One run as the console shows it."""

    id: int
    definition: str
    run_key: str
    status: str
    done: int
    total: int
    percent: float
    rate: float | None
    eta_seconds: float | None
    # Why its items are not running, the binding reason first; then the held items' reasons
    # (Progress.held_back, under its --json key "waiting").
    why: str
    waiting: dict[str, int]
    stalled: bool
    parent_run: int | None = None
    depth: int = 0
    # The pool whose rate sets the ETA (its pending items come no faster), or "".
    paced_by: str = ""


@dataclass
class RunDetail:
    run: RunLine
    tree: list[RunLine] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)


def _line(p: Progress, depth: int = 0) -> RunLine:
    run, rate = p.run, p.rate()
    open_ = run.status not in TERMINAL_RUN_STATUSES
    eta, paced_by = p.eta(rate)
    parent = run.parent_item.run_id if run.parent_item_id and run.parent_item else None
    return RunLine(
        id=run.pk,
        definition=run.definition,
        run_key=run.run_key,
        status=run.status,
        done=p.done,
        total=p.total or run.total_items,
        percent=round(p.percent_done, 1),
        rate=rate if open_ else (rate or None),
        eta_seconds=eta,
        why=p.why,
        waiting=dict(p.held_back),
        stalled=p.stalled,
        parent_run=parent,
        depth=depth,
        paced_by=paced_by,
    )


def runs_now(since: timedelta, limit: int, now: datetime | None = None) -> list[RunLine]:
    """Open runs, then runs finished within ``since``, newest first; ``limit`` in all."""
    now = now or db_now()
    runs = list(
        BatchRun.objects.filter(
            ~Q(status__in=TERMINAL_RUN_STATUSES) | Q(finished_at__gte=now - since)
        )
        .select_related("parent_item")
        .order_by("-created_at", "-pk")[:limit]
    )
    runs.sort(key=lambda r: (r.status in TERMINAL_RUN_STATUSES, -r.pk))
    progress, _ = progress_of(runs, now)
    return [_line(progress[r.pk]) for r in runs]


def run_detail(run_id: int, now: datetime | None = None) -> RunDetail | None:
    """One run close up: its tree, the pools it uses and its latest failures."""
    now = now or db_now()
    run = BatchRun.objects.select_related("parent_item").filter(pk=run_id).first()
    if run is None:
        return None
    below = BatchRun.objects.select_related("parent_item").filter(pk__in=descendants(run_id))
    runs = [run, *below]
    progress, states = progress_of(runs, now)
    depth = {run.pk: 0}
    tree: list[RunLine] = []
    for child in sorted(below, key=lambda r: r.pk):
        parent = child.parent_item.run_id if child.parent_item else run.pk
        depth[child.pk] = depth.get(parent, 0) + 1
        tree.append(_line(progress[child.pk], depth[child.pk]))
    pools = [
        {
            "name": name,
            "in_flight": state.in_flight,
            "limit": state.pool.max_concurrency if state.pool else None,
            "reason": state.reason,
            "items": progress[run.pk].pool_items.get(name, 0),
        }
        for name, state in sorted(states.items())
        if name in progress[run.pk].pool_items
    ]
    return RunDetail(_line(progress[run.pk]), tree, pools, _failures(run_id))


def _failures(run_id: int) -> list[dict[str, Any]]:
    latest = (
        ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.FAILED)
        .order_by("-finished_at", "-pk")
        .values("key", "attempt", "error_class", "error", "finished_at")[:FAILURES_SHOWN]
    )
    return [{**f, "error": last_line(f["error"]), "finished_at": f["finished_at"]} for f in latest]


def as_json(value: Any) -> Any:
    """Dataclasses and datetimes as JSON-ready values."""
    if isinstance(value, RunLine | RunDetail):
        return as_json(asdict(value))
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


# --- text -------------------------------------------------------------------------------------

_HEAD = f"{'RUN':>6} {'STATUS':<12} {'DONE':>15} {'RATE':>8} {'ETA':>7}  DEFINITION"


def _progress(line: RunLine) -> str:
    return f"{line.done:,}/{line.total:,} {line.percent:3.0f}%"


def _reasons(line: RunLine) -> list[str]:
    """What holds the run up, the binding reason first, each whole."""
    out = [line.why] if line.why else []
    out += [f"{n:,} waiting: {reason}" for reason, n in line.waiting.items()]
    if line.paced_by:
        out.append(f"ETA paced by pool {line.paced_by}: its rate admits the pending items")
    return out


def render_lines(lines: list[RunLine], width: int | None) -> list[str]:
    """A header and one line per run, each reason on its own indented line(s) below."""
    out = [_HEAD]
    for line in lines:
        eta = human_duration(line.eta_seconds) if line.eta_seconds is not None else ""
        head = (
            f"{line.id:>6} {line.status:<12} {_progress(line):>15} "
            f"{human_rate(line.rate):>8} {eta:>7}  {'  ' * line.depth}{line.definition}"
        )
        out.append(head if width is None else head[:width])
        for reason in _reasons(line):
            out += _wrapped(f"└ {reason}", width, indent=8)
    return out


def render_detail(detail: RunDetail, width: int | None) -> list[str]:
    run = detail.run
    out = [f"run {run.id} {run.definition} ({run.status})", f"key: {run.run_key}"]
    out += render_lines([run, *detail.tree], width)
    if detail.pools:
        out.append("pools:")
        for pool in detail.pools:
            limit = pool["limit"] if pool["limit"] is not None else "-"
            text = f"  {pool['name']}: {pool['in_flight']}/{limit} in flight"
            out += _wrapped(text + (f", {pool['reason']}" if pool["reason"] else ""), width, 4)
    if detail.failures:
        out.append("latest failures:")
        for f in detail.failures:
            error = without_class(f["error"], f["error_class"])
            text = f"  {f['key']} (attempt {f['attempt']}): {f['error_class']}: {error}"
            out += _wrapped(text, width, 4)
    return out


def _wrapped(text: str, width: int | None, indent: int) -> list[str]:
    if width is None:
        return [" " * indent + text]
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent + 2),
        break_long_words=True,
    )
