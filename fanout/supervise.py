"""Supervise: workers take up runs that nobody is carrying, so no run needs a parent.

Every FanoutWorker, and every process running the inline executor, runs a supervisor thread.
Every FANOUT_SUPERVISE_SECONDS it takes a few open runs, each for one period by a conditional
UPDATE (the fleet's election: each run is looked at by one process at a time), and for each:

- a running RQ run with work left gets its empty drain slots filled again (a deploy killed its
  workers, Redis lost its jobs); slots whose job failed or vanished are freed first, and why a
  job failed is recorded on the run, for the admin and ``run_fanout`` to show;
- a run whose items are all finished is joined, and a join whose worker died (its lease ran
  out) or that raised (its retry is due) is taken over.

It needs no cron and no parent, and Redis may lose everything: the rows say what to do.
"""

from __future__ import annotations

import logging
import random
import threading

from django.db import close_old_connections, connection, transaction
from django.db.models import Q
from redis.exceptions import RedisError

from .clock import DbNow, db_now_plus
from .conf import conf, host_name
from .models import BatchRun, ItemClaim, RunStatus

logger = logging.getLogger("fanout")

RUNS_PER_SWEEP = 20


def take_runs(limit: int = RUNS_PER_SWEEP) -> list[int]:
    """Take up to ``limit`` open runs that no other supervisor has taken this period."""
    period = float(conf.SUPERVISE_SECONDS)
    with transaction.atomic():
        due = (
            BatchRun.objects.filter(
                status__in=(RunStatus.RUNNING, RunStatus.JOINING, RunStatus.COMPENSATING)
            )
            .filter(Q(tended_until__isnull=True) | Q(tended_until__lte=DbNow()))
            .order_by("tended_until", "pk")
            .select_for_update(skip_locked=True)
            .values_list("pk", flat=True)[:limit]
        )
        ids = list(due)
        if ids:
            BatchRun.objects.filter(pk__in=ids).update(tended_until=db_now_plus(period * 0.9))
    return ids


def tend(run_id: int) -> str:
    """Look after one run; say what was done (for logs and tests)."""
    from .join import maybe_join

    run = BatchRun.objects.filter(pk=run_id).first()
    if run is None or run.is_terminal:
        return "nothing: the run is over"
    if run.status == RunStatus.COMPENSATING:
        return _tend_compensation(run)
    from .nest import resolve_waiting

    resolve_waiting(run_id)  # children that ended while nobody decided their parent item
    unfinished = ItemClaim.objects.filter(run_id=run_id).unfinished().exists()
    if not unfinished:
        return "joined" if maybe_join(run_id) else "join held by another worker"
    if run.status != RunStatus.RUNNING or run.executor != "rq":
        return "nothing: carried by its parent"
    if not ItemClaim.objects.filter(run_id=run_id).claimable().exists():
        return "nothing: every unfinished item is held by a live worker"
    return redispatch(run)


def _tend_compensation(run: BatchRun) -> str:
    from .compensate import finish

    if finish(run.pk):
        return "compensation finished"
    if run.executor != "rq":
        return "nothing: carried by its parent"
    due = ItemClaim.objects.filter(run_id=run.pk, status="compensating").filter(
        Q(claim_token__isnull=True) | Q(lease_expires_at__lte=DbNow())
    )
    return redispatch(run) if due.exists() else "nothing: compensations under way"


def redispatch(run: BatchRun) -> str:
    """Free the run's dead drain slots, record why they died, and fill the empty ones."""
    from .definition import get_definition
    from .errors import FanoutError
    from .rq import enqueue_drains, reap_slots

    try:
        definition = get_definition(run.definition)
    except FanoutError as exc:
        note_stall(run.pk, f"{exc} (on host {host_name()})")
        return "stalled: unknown definition here"
    try:
        failures = reap_slots(run, definition)
        if failures:
            note_stall(run.pk, failures[-1])
        enqueued = enqueue_drains(run, definition)
    except (FanoutError, RedisError) as exc:
        # Redis is down or restarting: the rows keep the run; the next round tries again.
        logger.warning("run %s: could not re-dispatch: %s", run.pk, exc)
        return f"not re-dispatched: {exc}"
    return f"re-dispatched {enqueued} drain jobs"


def note_stall(run_id: int, reason: str) -> None:
    """Say on the run why no worker could run it; cleared once one does."""
    logger.error("run %s: %s", run_id, reason)
    BatchRun.objects.filter(pk=run_id).exclude(stalled=reason[:4000]).update(stalled=reason[:4000])


def clear_stall(run_id: int) -> None:
    BatchRun.objects.filter(pk=run_id).exclude(stalled="").update(stalled="")


def sweep() -> list[tuple[int, str]]:
    """One round: take runs and tend each; a failure on one run does not stop the others."""
    done = []
    for run_id in take_runs():
        try:
            done.append((run_id, tend(run_id)))
        except Exception:
            logger.exception("run %s: supervision failed", run_id)
    return done


class Supervisor:
    """A daemon thread that sweeps every FANOUT_SUPERVISE_SECONDS (with jitter) until stopped."""

    def __init__(self, name: str = "fanout-supervisor") -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        try:
            while not self._stop.wait(float(conf.SUPERVISE_SECONDS) * random.uniform(0.5, 1.0)):
                try:
                    close_old_connections()
                    sweep()
                except Exception:  # the database or Redis is down: the next round tries again
                    logger.exception("supervision round failed")
                finally:
                    connection.close()  # an idle worker holds no connection between rounds
        finally:
            connection.close()

