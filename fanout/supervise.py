"""Supervise: workers take up runs that nobody is carrying, so no run needs a parent.

Every FanoutWorker, and every process running the inline executor, runs a supervisor thread.
Every FANOUT_SUPERVISE_SECONDS it takes a few open runs, each for one period by a conditional
UPDATE (the fleet's election: each run is looked at by one process at a time), and for each:

- a running RQ run with work left gets its empty drain slots filled again (a deploy killed its
  workers, Redis lost its jobs); slots whose job failed or vanished are freed first, and why a
  job failed is recorded on the run, for the admin and ``run_fanout`` to show;
- a run whose items are all finished is joined, and a join whose worker died (its lease ran
  out) or that raised (its retry is due) is taken over;
- a pending run whose writer died mid-work-list (its lease ran out) is written to the end and
  dispatched; one that the database refuses in a way no retry mends says why on the run, and
  is written again with the re-dispatch's backoff;
- a compensating run's forward items whose workers died are released, so that it can end;
- a running run gets a sample of what its items wait on (fanout.sample), at a bounded rate.

After tending, it audits the in_flight counters of the runs it took and of a few pools (each
pool by one supervisor per period) against their rows, and corrects any drift (fanout.audit).

It needs no cron and no parent, and Redis may lose everything: the rows say what to do.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from django.db import close_old_connections, connection, transaction
from django.db.models import Q
from redis.exceptions import RedisError

from . import launch
from .audit import audit
from .backends import backend
from .clock import DbNow, db_now_plus
from .compensate import finish, release_lost
from .conf import conf, host_name
from .definition import FanOut, get_definition, unknown_here
from .errors import FanoutError
from .join import maybe_join, resolve_waiting
from .materialize import WritingInterrupted, materialize
from .models import BatchRun, ItemClaim, RunStatus
from .prune import prune_by_retention
from .queues import enqueue_drains, get_queue, reap_slots
from .sample import sample_run
from .stall import STALL_BACKOFF, STALL_BACKOFF_MAX, clear_stall, note_stall

logger = logging.getLogger("fanout")

RUNS_PER_SWEEP = 20


def take_runs(limit: int = RUNS_PER_SWEEP) -> list[int]:
    """Take up to ``limit`` open runs that no other supervisor has taken this period."""
    period = float(conf.SUPERVISE_SECONDS)
    with transaction.atomic():
        # SQLite: a writer from the start, so that its update below never upgrades a read lock
        # (which fails at once, "database is locked", on Django's default options).
        backend().take_write_lock(BatchRun.objects.all())
        # A pending run is taken once nobody writes its work list (its writer died or let go).
        unwritten = Q(status=RunStatus.PENDING) & (
            Q(materialize_token__isnull=True) | Q(materialize_lease_expires_at__lte=DbNow())
        )
        due = (
            BatchRun.objects.filter(
                Q(status__in=(RunStatus.RUNNING, RunStatus.JOINING, RunStatus.COMPENSATING))
                | unwritten
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
    run = BatchRun.objects.filter(pk=run_id).first()
    if run is None or run.is_terminal:
        return "nothing: the run is over"
    if run.status == RunStatus.PENDING:
        return _tend_writing(run)
    resolve_waiting(run_id)  # children that ended while nobody decided their parent item
    if run.status == RunStatus.COMPENSATING:
        return _tend_compensation(run)
    sample_run(run)  # what its items wait on now, for the run page's chart
    unfinished = ItemClaim.objects.filter(run_id=run_id).unfinished().exists()
    if not unfinished:
        return "joined" if maybe_join(run_id) else "join held by another worker"
    if run.status != RunStatus.RUNNING or run.executor != "rq":
        return "nothing: carried by its parent"
    if not ItemClaim.objects.filter(run_id=run_id).claimable().exists():
        return "nothing: every unfinished item is held by a live worker"
    return redispatch(run)


def _tend_writing(run: BatchRun) -> str:
    """Finish writing the work list of a run whose writer died, then dispatch it.

    The work list is deterministic and the items' keys unique, so a second writer adds what
    the first did not commit, and nothing twice.
    """
    try:
        definition = get_definition(run.definition)
    except FanoutError:
        note_stall(run.pk, unknown_here(run.definition, host_name()))
        return "stalled: unknown definition here"
    stalled = bool(run.stalled)
    if stalled:
        held = _writing_hold(run, definition)
        if held:
            return f"stalled: writing held back {held:.1f} s more"
    run, why_not = _write(run, definition)
    if why_not:
        return why_not
    if run.status == RunStatus.PENDING:
        return "nothing: another writer holds it"
    if stalled and run.stalled:
        clear_stall(run.pk)  # written: a drain's stall is noted afresh if one comes
        run.stalled = ""
    return _dispatch_written(run, definition)


def _write(run: BatchRun, definition: FanOut) -> tuple[BatchRun, str]:
    """Write the rest of the run's work list; return the run, and why not if it was not."""
    try:
        return materialize(run, definition, wait=False), ""
    except WritingInterrupted as exc:
        if exc.transient:
            logger.warning("run %s: could not finish writing its items: %s", run.pk, exc)
            return run, f"not written: {exc}"
        # The database refuses it the same way however often it is asked: say so on the run,
        # and write it again only after the stall's backoff.
        note_stall(run.pk, f"{exc} (on host {host_name()})")
        return run, f"stalled: {exc}"
    except FanoutError as exc:
        logger.warning("run %s: could not finish writing its items: %s", run.pk, exc)
        return run, f"not written: {exc}"


def _dispatch_written(run: BatchRun, definition: FanOut) -> str:
    if run.executor == "rq":
        return f"written; {redispatch(run)}"
    if run.parent_item_id is not None:
        # An inline child run: its parent item waits for it, and its writer is gone.
        launch.dispatch(run, definition, "inline")
        return "written; dispatched here"
    return "written: carried by its parent"


def _tend_compensation(run: BatchRun) -> str:
    release_lost(run.pk)  # forward items whose workers died hold it up otherwise
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
    try:
        definition = get_definition(run.definition)
    except FanoutError:
        note_stall(run.pk, unknown_here(run.definition, host_name()))
        return "stalled: unknown definition here"
    try:
        failures = reap_slots(run, definition)
        if failures:
            note_stall(run.pk, failures[-1])
        held = _stall_hold(get_queue(definition).connection, run.pk, bool(failures or run.stalled))
        if held:
            return f"stalled: re-dispatch held back {held:.1f} s more"
        enqueued = enqueue_drains(run, definition)
    except (FanoutError, RedisError) as exc:
        # Redis is down or restarting: the rows keep the run; the next round tries again.
        logger.warning("run %s: could not re-dispatch: %s", run.pk, exc)
        return f"not re-dispatched: {exc}"
    return f"re-dispatched {enqueued} drain jobs"


def _stall_hold(conn: Any, run_id: int, stalled: bool) -> float:
    """Seconds a stalled run's re-dispatch is still held back; 0.0 to go ahead now.

    Each re-dispatch of a stalled run holds the next one back twice as long as the last, up to
    STALL_BACKOFF_MAX: a worker that cannot run it is not fed a job every round. Redis keeps
    the count; losing it only starts the backoff over.
    """
    count_key, hold_key = f"fanout:stall:{run_id}:count", f"fanout:stall:{run_id}:hold"
    if not stalled:
        conn.delete(count_key, hold_key)
        return 0.0
    left = conn.pttl(hold_key)
    if left > 0:
        return left / 1000
    n = conn.incr(count_key)
    conn.expire(count_key, 86400)
    delay = min(STALL_BACKOFF_MAX, STALL_BACKOFF * 2 ** (n - 1))
    if not conn.set(hold_key, n, nx=True, px=int(delay * 1000)):
        return max(conn.pttl(hold_key), 1) / 1000  # another supervisor went ahead just now
    return 0.0


def _writing_hold(run: BatchRun, definition: Any) -> float:
    """Seconds a stalled run's writing is still held back (the re-dispatch's backoff, with its
    count in Redis); 0.0 to write it now.

    Without Redis for the definition's queue (an inline executor's host), the run's next
    supervision is put off by the longest backoff instead, by the database's clock."""
    try:
        return _stall_hold(get_queue(definition).connection, run.pk, True)
    except (FanoutError, RedisError):
        BatchRun.objects.filter(pk=run.pk).update(tended_until=db_now_plus(STALL_BACKOFF_MAX))
        return 0.0


def sweep() -> list[tuple[int, str]]:
    """One round: take runs and tend each; a failure on one run does not stop the others."""
    done = []
    taken = take_runs()
    for run_id in taken:
        try:
            done.append((run_id, tend(run_id)))
        except Exception:
            logger.exception("run %s: supervision failed", run_id)
    audit(taken)  # the counters of what it took up, and of the pools it is elected to
    return done


def prune_round() -> None:
    """Delete a bounded batch of runs past FANOUT_RETENTION (nothing when it is not set)."""
    pruned = prune_by_retention()
    if pruned.roots:
        logger.info(
            "pruned %d finished runs (%d items) past FANOUT_RETENTION", pruned.runs, pruned.items
        )


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
                    prune_round()
                except Exception:  # the database or Redis is down: the next round tries again
                    logger.exception("supervision round failed")
                finally:
                    connection.close()  # an idle worker holds no connection between rounds
        finally:
            connection.close()
