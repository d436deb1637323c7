"""Read the execution ledger of a scenario's runs and turn it into figures and violations.

Every handler call wrote an ``Execution`` row (started, ended) and, unless it simply returned,
an ``Observation`` saying how it ended. With the deaths the harness caused or saw, each
re-execution of an item is explained (a retry, a throttle, its worker died, it timed out) or is
a violation: two live owners at once, or a run after the item's outcome was recorded.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .procs import Death

# An execution whose worker died within this long after its handler returned may not have
# recorded its outcome: running the item again is then a recovery, not a duplicate.
RECORD_WINDOW = 5.0
RETRYABLE = ("raised", "throttled")
# Ledger keys of calls that are not an item's handler: joins ("join:") and compensations
# ("undo:<key>"). Item analysis leaves them out; ``calls`` reads them.
SIDE_CALLS = ("join:", "undo:")
_EXEC_IN_ERROR = re.compile(r"\(exec (\d+)\)")


@dataclass
class Exec:
    id: int
    run_id: int
    key: str
    attempt: int
    pool: str
    pid: int
    started: float
    ended: float | None
    ending: str | None = None  # "raised", "throttled", "permanent", "exit"; None: returned
    claimed: float | None = None  # ItemClaim.claimed_at when the handler started
    exit_at: float | None = None

    @property
    def returned(self) -> bool:
        return self.ended is not None and self.ending in (None, "returned")


@dataclass
class RunInfo:
    id: int
    definition: str
    status: str
    max_parallel: int
    timeout: float | None
    max_attempts: int
    lease_seconds: float
    join_runs: int
    has_join: bool
    join_result: Any


@dataclass
class Figures:
    items: int = 0
    executions: int = 0
    once: int = 0
    never: int = 0
    retried: int = 0  # items run again only because they raised or were throttled
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # key -> reasons
    violations: list[str] = field(default_factory=list)
    lost: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    inflight_run: int = 0
    limit_run: int = 0
    inflight_pool: dict[str, int] = field(default_factory=dict)
    admissions: dict[str, int] = field(default_factory=dict)  # pool -> max in one period
    reclaims: list[float] = field(default_factory=list)  # seconds from death to reclaim
    join_runs: dict[int, int] = field(default_factory=dict)

    def duplicate_keys(self, at_most: int = 4) -> str:
        keys = sorted(self.duplicates)
        more = f",+{len(keys) - at_most}" if len(keys) > at_most else ""
        return ",".join(keys[:at_most]) + more

    def as_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "executions": self.executions,
            "executed_once": self.once,
            "never_executed": self.never,
            "retried": self.retried,
            "executed_more_than_once": len(self.duplicates),
            "duplicates": self.duplicates,
            "violations": self.violations,
            "lost": self.lost,
            "statuses": self.statuses,
            "max_in_flight_run": self.inflight_run,
            "max_parallel": self.limit_run,
            "max_in_flight_pool": self.inflight_pool,
            "max_admissions_per_period": self.admissions,
            "reclaim_seconds": [round(r, 3) for r in self.reclaims],
            "join_runs": self.join_runs,
        }


def load(run_ids: list[int]) -> tuple[list[Exec], dict[int, RunInfo], list[dict[str, Any]]]:
    """The ledger rows, the runs and the items of ``run_ids``."""
    from fanout.definition import get_definition
    from fanout.models import BatchRun, ItemClaim
    from tests.testapp.models import Execution, Observation

    endings: dict[int, dict[str, Any]] = {}
    for value in Observation.objects.filter(run_id__in=run_ids, name="chaos").values_list(
        "value", flat=True
    ):
        endings.setdefault(value["exec"], {}).update(value)
    execs = []
    rows = Execution.objects.filter(run_id__in=run_ids)
    for prefix in SIDE_CALLS:
        rows = rows.exclude(key__startswith=prefix)
    for row in rows.order_by("started", "pk"):
        seen = endings.get(row.pk, {})
        execs.append(
            Exec(
                id=row.pk,
                run_id=row.run_id,
                key=row.key,
                attempt=row.attempt,
                pool=row.pool,
                pid=int(row.worker.rsplit(":", 1)[-1]),
                started=row.started,
                ended=row.ended,
                ending=seen.get("ending"),
                claimed=seen.get("claimed"),
                exit_at=seen.get("at") if seen.get("ending") == "exit" else None,
            )
        )
    runs = {}
    for run in BatchRun.objects.filter(pk__in=run_ids):
        d = get_definition(run.definition)
        runs[run.pk] = RunInfo(
            run.pk,
            run.definition,
            run.status,
            run.max_parallel,
            d.timeout,
            d.max_attempts,
            d.lease_seconds,
            run.join_runs,
            d.join is not None,
            run.join_result,
        )
    items = list(
        ItemClaim.objects.filter(run_id__in=run_ids).values(
            "run_id",
            "key",
            "status",
            "result",
            "error",
            "error_class",
            "claimed_at",
            "attempt",
            "crashes",
        )
    )
    return execs, runs, items


def analyse(
    run_ids: list[int],
    deaths: dict[int, Death],
    pools: dict[str, dict[str, Any]] | None = None,
    now: float | None = None,
) -> Figures:
    """Figures for the runs: duplicates explained or not, lost items, in flight, admissions."""
    import time

    execs, runs, items = load(run_ids)
    now = now or time.time()
    deaths = dict(deaths)
    for e in execs:
        if e.exit_at is not None:
            deaths[e.pid] = Death(e.pid, e.exit_at, "os._exit")
    fig = Figures(items=len(items), executions=len(execs))
    fig.limit_run = max((r.max_parallel for r in runs.values()), default=0)
    fig.join_runs = {r.id: r.join_runs for r in runs.values() if r.has_join}
    for it in items:
        fig.statuses[it["status"]] = fig.statuses.get(it["status"], 0) + 1
    fig.lost = sum(1 for it in items if it["status"] in ("pending", "running", "waiting"))

    by_item: dict[tuple[int, str], list[Exec]] = defaultdict(list)
    for e in execs:
        by_item[(e.run_id, e.key)].append(e)
    claimed_at = {
        (it["run_id"], it["key"]): it["claimed_at"].timestamp() if it["claimed_at"] else None
        for it in items
    }
    for it in items:
        calls = by_item.get((it["run_id"], it["key"]), [])
        if not calls:
            fig.never += 1
            if it["status"] == "succeeded":
                fig.violations.append(f"{it['key']}: succeeded without running")
            continue
        if len(calls) == 1:
            fig.once += 1
        run = runs[it["run_id"]]
        reasons = _explain(it, calls, run, deaths, claimed_at, fig)
        # Each run after a death went through a crash reclaim, which the item counts: more
        # such runs than crashes means one of them ran an item that had its outcome.
        died = sum(1 for r in reasons if "died" in r)
        if died > it["crashes"]:
            fig.violations.append(
                f"{it['key']}: ran {died} times after deaths but counts {it['crashes']} crashes"
            )
        if any(r != "retry" for r in reasons):
            # Runs of a tree share keys: name the run too, or duplicates would merge.
            label = it["key"] if len(runs) == 1 else f"{it['key']}@{it['run_id']}"
            fig.duplicates[label] = sorted(set(reasons) - {"retry"})
        elif reasons:
            fig.retried += 1
        _check_recorded(it, calls, run, deaths, fig)

    def end_of(e: Exec) -> float:
        run = runs[e.run_id]
        if run.timeout and (e.ended or now) - e.started > run.timeout:
            return e.started + run.timeout  # the lease was given up at the timeout
        if e.ended is not None:
            return e.ended
        death = deaths.get(e.pid)
        return death.at if death else now

    for run_id in run_ids:
        spans = [(e.started, end_of(e)) for e in execs if e.run_id == run_id]
        fig.inflight_run = max(fig.inflight_run, max_overlap(spans))
    for name, limits in (pools or {}).items():
        # Admissions are claim times (the handler read its item's claimed_at), else starts.
        mine = [e for e in execs if e.pool == name]
        fig.inflight_pool[name] = max_overlap([(e.started, end_of(e)) for e in mine])
        times = sorted(e.claimed if e.claimed is not None else e.started for e in mine)
        fig.admissions[name] = _max_in_window(times, limits["period"])
    return fig


def _explain(
    item: dict[str, Any],
    calls: list[Exec],
    run: RunInfo,
    deaths: dict[int, Death],
    claimed_at: dict[tuple[int, str], float | None],
    fig: Figures,
) -> list[str]:
    """Why each execution after the first happened; violations go to ``fig``."""
    key = item["key"]
    reasons = []
    for i in range(1, len(calls)):
        prev, e = calls[i - 1], calls[i]
        death = deaths.get(prev.pid)
        timed_out = bool(run.timeout) and e.started >= prev.started + (run.timeout or 0)
        # When the item was claimed again: its claimed_at if this is its last claim.
        last = i == len(calls) - 1 and claimed_at.get((e.run_id, key))
        reclaimed = last if last and last <= e.started else e.started
        if prev.ended is None:
            if timed_out and (death is None or death.at > e.started):
                reasons.append("timed out")
            elif death is None:
                fig.violations.append(f"{key}: ran again while its owner {prev.pid} lived")
                reasons.append("violation")
            elif reclaimed < death.at - 0.05:
                fig.violations.append(
                    f"{key}: reclaimed {death.at - reclaimed:.2f}s before its owner died"
                )
                reasons.append("violation")
            else:
                reasons.append("worker died")
                fig.reclaims.append(reclaimed - death.at)
                if e.attempt != prev.attempt:
                    fig.violations.append(f"{key}: a crash used an attempt")
            continue
        if e.started < prev.ended:
            if timed_out:
                reasons.append("timed out")
            else:
                fig.violations.append(f"{key}: two executions at once (exec {prev.id}, {e.id})")
                reasons.append("violation")
            continue
        if prev.ending == "throttled":
            reasons.append("retry")
            if e.attempt != prev.attempt:
                fig.violations.append(f"{key}: Throttled used an attempt")
        elif prev.ending == "raised" and prev.attempt < run.max_attempts:
            reasons.append("retry")
            if e.attempt != prev.attempt + 1:
                fig.violations.append(f"{key}: attempt {e.attempt} after attempt {prev.attempt}")
        elif death is not None and prev.ended - 0.05 <= death.at <= prev.ended + RECORD_WINDOW:
            reasons.append("worker died before recording")
            fig.reclaims.append(reclaimed - death.at)
        elif timed_out and prev.ended - prev.started > (run.timeout or 0):
            reasons.append("timed out")
        else:
            fig.violations.append(f"{key}: executed again after an outcome (exec {prev.id})")
            reasons.append("violation")
    return reasons


def _check_recorded(
    item: dict[str, Any], calls: list[Exec], run: RunInfo, deaths: dict[int, Death], fig: Figures
) -> None:
    """The recorded outcome is the current owner's, and nothing ran after it was recorded."""
    if item["status"] in ("pending", "running", "waiting"):
        return  # no outcome yet: an error on the row is from an earlier attempt
    exec_id = None
    if isinstance(item["result"], dict):
        exec_id = item["result"].get("exec")
    elif item["error"]:
        found = _EXEC_IN_ERROR.search(item["error"])
        exec_id = int(found.group(1)) if found else None
    if exec_id is None:
        return
    key = item["key"]
    recorded = next((e for e in calls if e.id == exec_id), None)
    if recorded is None or recorded.ended is None:
        fig.violations.append(f"{key}: its recorded outcome is from no finished execution")
        return
    later = [e.id for e in calls if e.started > recorded.ended]
    if later:
        fig.violations.append(f"{key}: ran again ({later}) after its outcome was recorded")
    for e in calls:
        if e.started <= recorded.started or e.ended is None or e.ending in RETRYABLE:
            continue
        if run.timeout and e.ended - e.started > run.timeout:
            continue  # it lost its lease at the timeout: its outcome is rightly dropped
        death = deaths.get(e.pid)
        if death is not None and death.at <= e.ended + RECORD_WINDOW:
            continue  # it died before it could record
        fig.violations.append(
            f"{key}: exec {recorded.id}'s outcome was recorded over its successor {e.id}'s"
        )


def calls(run_ids: list[int], prefix: str = "") -> list[Exec]:
    """Ledger rows by start time: the items' handler calls, or (``prefix`` "join:", "undo:")
    the joins or compensations, keyed by what follows the prefix."""
    from tests.testapp.models import Execution

    rows = Execution.objects.filter(run_id__in=run_ids)
    if prefix:
        rows = rows.filter(key__startswith=prefix)
    else:
        for side in SIDE_CALLS:
            rows = rows.exclude(key__startswith=side)
    return [
        Exec(
            id=row.pk,
            run_id=row.run_id,
            key=row.key.removeprefix(prefix),
            attempt=row.attempt,
            pool=row.pool,
            pid=int(row.worker.rsplit(":", 1)[-1]),
            started=row.started,
            ended=row.ended,
        )
        for row in rows.order_by("started", "pk")
    ]


def cut_off(call: Exec, deaths: dict[int, Death]) -> bool:
    """Whether a kill cut the call off: its worker died mid-call, or after it returned but
    before it could record its outcome (within ``RECORD_WINDOW``)."""
    death = deaths.get(call.pid)
    if death is None or death.at < call.started - 0.05:
        return False
    return call.ended is None or call.ended - 0.05 <= death.at <= call.ended + RECORD_WINDOW


def span_end(call: Exec, deaths: dict[int, Death], now: float) -> float:
    """When a call stopped: its end, else its worker's death, else now (it still runs)."""
    if call.ended is not None:
        return call.ended
    death = deaths.get(call.pid)
    return death.at if death else now


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    best = cur = 0
    for _, delta in events:  # an end sorts before a start at the same instant
        cur += delta
        best = max(best, cur)
    return best


def _max_in_window(times: list[float], period: float) -> int:
    """The most admissions in any half-open window of ``period`` seconds."""
    best = 0
    for i, t in enumerate(times):
        best = max(best, bisect_left(times, t + period) - i)
    return best


def describe_reclaims(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{max(values):.1f}s max/{statistics.median(values):.1f}s med"
