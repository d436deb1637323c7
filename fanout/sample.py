"""Sample what a running run's unfinished items wait on, for the run page's chart, and a
pool's admissions, for the pool page's.

The item rows say why an item waits only now; a RunSample keeps that answer for a moment of
the run's life. The supervisor that tends a running run writes one at most every
FANOUT_SAMPLE_SECONDS (whoever else tends the run at once, the run's row decides who writes),
so a run of any size gets a few rows a minute, and its samples go when its row is pruned.

Each sample also counts the items that ended in its window, (the previous sample's upto,
upto], with upto SAMPLE_SECONDS behind the sample and, for a batched run, before the earliest
start of its items in flight, so that outcomes written late (a batch's, recorded when the batch
ends) are in: summed, the samples draw the run's throughput, durations and attempts without
reading its items.

A pool is sampled the same way (PoolSample), by the supervisor elected to audit it: its running
items, and the items it admitted in a window, for the pool page's last hour.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, Min, Q

from .clock import db_now
from .conf import conf
from .definition import get_definition
from .errors import FanoutError
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus, PoolSample, RunSample, RunStatus
from .spend import run_hold
from .tally import Ended, ended
from .waiting import PoolState, pool_states

# The columns of a sample, in the order the chart stacks them.
WAITS = (
    "running",
    "ready",
    "max_parallel",
    "pool_full",
    "rate_limited",
    "throttled",
    "budget",
    "paused",
    "retry_due",
    "child_runs",
)


def sample_run(run: BatchRun, now: datetime | None = None) -> RunSample | None:
    """Write a sample of a running run unless its last one is younger than SAMPLE_SECONDS."""
    if run.status != RunStatus.RUNNING:
        return None
    now = now or db_now()
    due = now - timedelta(seconds=float(conf.SAMPLE_SECONDS))
    if not _due(_last(run), due):
        return None
    sample = measure(run, now)
    with transaction.atomic():
        # Two samplers of one run (the election's and run_fanout's watcher) must not both
        # count the same window, nor one count items a retry puts back meanwhile: the one
        # that takes the run's row counts and writes, if nobody did since.
        if not _lock_run(run):
            return None
        previous = _last(run)
        if not _due(previous, due):
            return None
        since = previous[1] if previous else None
        tally(sample, run, since, _window_end(run, since, due))
        sample.save()
    return sample


def _last(run: BatchRun) -> tuple[datetime, datetime | None] | None:
    last = RunSample.objects.filter(run_id=run.pk).order_by("-at", "-pk")
    return last.values_list("at", "upto").first()


def _due(previous: tuple[datetime, datetime | None] | None, due: datetime) -> bool:
    return previous is None or previous[0] <= due


def _lock_run(run: BatchRun) -> bool:
    """Take the run's row for this transaction unless a claim holds it (then sample later)."""
    runs = BatchRun.objects.filter(pk=run.pk)
    if connection.features.has_select_for_update:
        no_key = connection.features.has_select_for_no_key_update
        runs = runs.select_for_update(skip_locked=True, no_key=no_key)
    else:
        runs.update(status=F("status"))  # SQLite: the database's write lock, as claims take it
    return bool(list(runs.values_list("pk", flat=True)))


def _window_end(run: BatchRun, since: datetime | None, upto: datetime) -> datetime:
    """Where a window may end, never before the previous one's end. A batch's outcomes are
    written when the whole batch ends, each with the time its own handler returned: for a
    batched run the window stops before the earliest start of its items in flight, whose
    outcomes may yet be written with an earlier time. One item at a time is written as it
    ends, within SAMPLE_SECONDS."""
    if _batched(run):
        running = ItemClaim.objects.filter(run_id=run.pk, status=ItemStatus.RUNNING)
        started = running.aggregate(first=Min("started_at"))["first"]
        if started is not None:
            upto = min(upto, started - timedelta(microseconds=1))
    return upto if since is None else max(upto, since)


def _batched(run: BatchRun) -> bool:
    try:
        return get_definition(run.definition).batch_size > 1
    except FanoutError:
        return True  # not known here: its batches may be any size


def tally(sample: RunSample, run: BatchRun, since: datetime | None, upto: datetime) -> None:
    """Count the run's items that ended in (since, upto] into ``sample``: one query over the
    (run, finished_at) index, so a sample costs the same at any size of run."""
    items = ItemClaim.objects.filter(run_id=run.pk, finished_at__lte=upto)
    if since is not None:
        items = items.filter(finished_at__gt=since)
    counts = Ended.empty().add(ended(items))
    sample.upto, sample.reopened = upto, run.reopened
    sample.finished, sample.failed = counts.finished[0], counts.failed[0]
    sample.durations = counts.durations
    sample.attempts = {str(a): n for a, n in sorted(counts.attempts.items())}


def measure(run: BatchRun, now: datetime) -> RunSample:
    """What the run's unfinished items are doing at ``now``, in two queries (and the pools',
    and the run's budget's when it has due items that no pool holds)."""
    by_pool = _unfinished_by_pool(run, now)
    states = pool_states(list(by_pool), now)
    sample = RunSample(run_id=run.pk, at=now)
    # What holds the run's slots: a claimable item beyond them waits for max_parallel.
    held = sum(r["running"] + r["children"] for r in by_pool.values())
    at_limit = held >= run.max_parallel
    spent: bool | None = None  # the run's own budget holds its due items: read when needed
    for name, r in by_pool.items():
        sample.running += r["running"]
        sample.retry_due += r["later"]
        sample.child_runs += r["children"]
        field = _waits_on(states.get(name), at_limit)
        if field == "ready" and r["due"]:
            # The claim asks the run's budget after its max_parallel, before it admits one.
            spent = bool(run_hold(run.pk, now)) if spent is None else spent
            field = "budget" if spent else field
        setattr(sample, field, getattr(sample, field) + r["due"])
    return sample


def _unfinished_by_pool(run: BatchRun, now: datetime) -> dict[str, dict[str, Any]]:
    due = Q(status=ItemStatus.PENDING, next_attempt_at__lte=now) | Q(
        status=ItemStatus.RUNNING, lease_expires_at__lte=now
    )
    rows = (
        ItemClaim.objects.filter(run_id=run.pk)
        .unfinished()
        .values("pool")
        .annotate(
            running=Count("pk", filter=Q(status=ItemStatus.RUNNING, lease_expires_at__gt=now)),
            due=Count("pk", filter=due),
            later=Count("pk", filter=Q(status=ItemStatus.PENDING, next_attempt_at__gt=now)),
            children=Count("pk", filter=Q(status=ItemStatus.WAITING)),
        )
        .order_by()
    )
    return {r["pool"]: dict(r) for r in rows}


def _waits_on(state: PoolState | None, at_limit: bool) -> str:
    """The sample's column for a pool's due items."""
    reason = state.reason if state is not None else ""
    if not reason:
        return "max_parallel" if at_limit else "ready"
    if reason in ("pool missing", "pool paused"):
        return "paused"
    if reason.startswith("pool full"):
        return "pool_full"
    if reason.startswith("throttled"):
        return "throttled"
    if reason.startswith("budget"):  # fanout.cost.describe: the pool's budget is spent
        return "budget"
    return "rate_limited"


# ----------------------------------------------------------------------------------- pools

# A pool's samples older than this are deleted as new ones are written: the page draws an hour.
POOL_SAMPLES_KEPT = timedelta(hours=2)
# The longest window a pool sample counts: a pool nobody sampled for longer starts afresh.
POOL_WINDOW_MAX = timedelta(hours=1)


def sample_pool(pool: CapacityPool, now: datetime | None = None) -> PoolSample | None:
    """Write a sample of the pool unless its last one is younger than SAMPLE_SECONDS: its
    running items now, and the items it admitted since the last sample's window, up to
    SAMPLE_SECONDS ago (a claim's time is its transaction's: one that commits a moment after
    it began is in). The supervisor elected to audit the pool calls it; two at once count a
    window once (the second's row is refused)."""
    now = now or db_now()
    seconds = timedelta(seconds=float(conf.SAMPLE_SECONDS))
    last = PoolSample.objects.filter(pool=pool).order_by("-at", "-pk")
    previous = last.values_list("at", "upto").first()
    if previous is not None and previous[0] > now - seconds:
        return None
    upto = now - seconds
    since = upto - seconds if previous is None else max(previous[1], upto - POOL_WINDOW_MAX)
    if since >= upto:
        return None
    sample = PoolSample(
        pool=pool,
        at=now,
        in_flight=ItemClaim.objects.filter(pool=pool.name).running().count(),
        since=since,
        upto=upto,
        admitted=admitted(pool.name, since, upto),
    )
    try:
        with transaction.atomic():
            sample.save()
    except IntegrityError:
        return None  # another supervisor counted this window
    PoolSample.objects.filter(pool=pool, at__lt=now - POOL_SAMPLES_KEPT).delete()
    return sample


def admitted(pool: str, since: datetime, upto: datetime) -> int:
    """The pool's items claimed in (since, upto]: one count over the (pool, claimed_at) index."""
    items = ItemClaim.objects.filter(pool=pool, claimed_at__gt=since, claimed_at__lte=upto)
    return items.count()
