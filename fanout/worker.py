"""The drain loop every executor runs: claim, run outside the transaction, record, repeat."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connection
from django.db.models import Exists, F, OuterRef, Q, QuerySet

from . import compensate, spend
from .call import execute
from .claim import EXPIRED_CHECK_SECONDS, ClaimResult, _expired_checked, claim
from .conf import conf, host_name
from .definition import FanOut, get_definition, registered
from .errors import FanoutError, is_transient, ride_out
from .group_commit import shared_hand_over
from .join import maybe_join, settle_up
from .lease import Keepers, LeaseKeeper
from .models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from .record import Recorded, record
from .signals import item_finished, pool_throttled, send
from .stall import note_stall
from .telemetry import claim_took, item_spans, items_finished
from .transitions import (
    RELEASED,
    SPAWNED,
    SUCCEEDED,
    THROTTLED,
    ClaimedItem,
    ExecutionOutcome,
    can_hand_over,
    hand_over_spending,
)

logger = logging.getLogger("fanout")
T = TypeVar("T")

# One condition per process: a worker that frees capacity wakes the idle ones at once.
_lock = threading.RLock()
_wake = threading.Condition(_lock)
# Told when an idle worker of this process that held a run's turn has its claim's answer: the
# threads of the process that wait for that run take their turns then, without looking again.
_answered = threading.Condition(_lock)
# Wake-ups so far (under _wake): a thread that was looking at runs or claiming when one came
# was not waiting on the condition, and must not sleep through the capacity it announced.
_wakes = [0]


def wake_all() -> None:
    with _wake:
        _wakes[0] += 1
        _wake.notify_all()


def wake(count: int) -> None:
    """Wake up to ``count`` idle workers of this process (none for 0)."""
    if count > 0:
        with _wake:
            _gate.clear()
            _wakes[0] += 1
            _wake.notify(count)


def wakes() -> int:
    """The wake-ups so far: read before looking for work, handed to ``nap`` after."""
    with _wake:
        return _wakes[0]


def nap(seen: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for a wake-up, unless one came since ``wakes()`` said
    ``seen`` (capacity was freed while this thread looked elsewhere: it looks again at once).
    True when woken or already due to look again."""
    with _wake:
        if _wakes[0] != seen:
            return True
        return _wake.wait(timeout)


# Per run: time.monotonic() before which idle workers of this process do not try to claim,
# because one of them is trying now or was just refused for capacity (pool full, rate limit).
# Every claimer of a run queues on the run's row lock, so N idle threads retrying at once
# (all woken at the same retry time) make a convoy that delays the worker that has outcomes
# to record; one idle thread per process tries at a time instead, and passes the turn on.
_gate: dict[int, float] = {}
# Runs whose turn an idle worker of this process holds now: its answer comes within moments.
_trying: set[int] = set()


def _gate_wait(run_id: int, wait: bool = True) -> bool:
    """Wait while another idle worker of this process holds the run's turn; True if it was
    held. A worker that serves other runs too (``wait`` False) waits only for the answer of a
    claim under way, which comes within moments; a refusal sends it elsewhere."""
    with _wake:
        until = _gate.get(run_id, 0.0)
        now = time.monotonic()
        while not wait and until > now and run_id in _trying:
            _answered.wait(min(until - now, conf.IDLE_MAX_SECONDS))
            until, now = _gate.get(run_id, 0.0), time.monotonic()
        if until > now:
            if wait:
                _wake.wait(min(until - now, conf.IDLE_MAX_SECONDS))
            return True
        _gate[run_id] = now + conf.IDLE_MAX_SECONDS  # our turn: others wait for our answer
        _trying.add(run_id)
        return False


def gated(run_id: int) -> bool:
    """Whether an idle worker of this process holds the run's turn, or it was just refused."""
    with _wake:
        return _gate.get(run_id, 0.0) > time.monotonic()


def gates_open_in(run_ids: list[int]) -> float:
    """Seconds until the first of these runs may be tried again by an idle worker of this
    process: a refused run's gate lasts until its capacity may be back (a wake-up opens it
    sooner), and a run whose turn another thread holds is served as soon as it is answered."""
    now = time.monotonic()
    with _wake:
        if any(pk in _trying for pk in run_ids):
            return GATED_PAUSE
        return max(0.0, min(_gate.get(pk, 0.0) for pk in run_ids) - now) if run_ids else 0.0


def _gate_set(run_id: int, result: ClaimResult) -> None:
    with _wake:
        _trying.discard(run_id)
        _answered.notify_all()
        if result.items or not result.run_open:
            # Capacity (or the end) was found: the next idle worker may look at once.
            _gate.pop(run_id, None)
            _wakes[0] += 1
            _wake.notify(1)
            return
        wait = conf.IDLE_MAX_SECONDS
        if result.retry_in is not None:
            wait = min(wait, result.retry_in)
        _gate[run_id] = time.monotonic() + wait


class Joiner:
    """Joins the runs that this process's roaming threads finished, each on a thread of its own.

    A run's join reads every outcome and calls the definition's join: a thread that waited for
    it would idle while other runs of its queue have admissible items, and a join that waited
    for another run's (a slow join of its own) would end its run late. The join stays elected
    by one conditional UPDATE (fanout.join), so it does not matter which thread runs it; a join
    lost with its process is taken up by a supervisor, as any join whose worker died.
    """

    def __init__(self) -> None:
        self._joining: set[int] = set()  # runs whose join thread has not ended
        # Runs asked for again while their join thread ran: it may have looked before the
        # last item ended, so it looks once more before it ends.
        self._again: set[int] = set()
        self._changed = threading.Condition()

    def add(self, run_id: int, definition: FanOut) -> None:
        """Join the run soon, if every item has finished by then."""
        with self._changed:
            if run_id in self._joining:
                self._again.add(run_id)
                return
            self._joining.add(run_id)
        name = f"fanout-join-{run_id}"
        threading.Thread(
            target=self._serve, args=(run_id, definition), name=name, daemon=True
        ).start()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the joins asked for so far; True once done."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._joining:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _serve(self, run_id: int, definition: FanOut) -> None:
        try:
            while True:
                self._join(run_id, definition)
                with self._changed:
                    if run_id not in self._again:
                        break
                    self._again.discard(run_id)
        finally:
            connection.close()
            with self._changed:
                self._again.discard(run_id)
                self._joining.discard(run_id)
                self._changed.notify_all()

    def _join(self, run_id: int, definition: FanOut) -> None:
        pause = 0.1
        while True:
            try:
                maybe_join(run_id, definition)
                return
            except DatabaseError as exc:
                connection.close()
                if not is_transient(exc):
                    # As a drain that met it would: left to a supervisor, said in the log.
                    logger.exception("run %s: join failed", run_id)
                    return
                logger.warning("run %s: database unavailable (%s); joining again", run_id, exc)
                time.sleep(pause)  # a pause before reconnecting, not a wait for another thread
                pause = min(pause * 2, 2.0)
            except Exception:  # maybe_join records the join's own errors; this is a bug
                logger.exception("run %s: join failed", run_id)
                return


# The one joiner of this process.
joiner = Joiner()


# Per run: when a hand-over of this process last asked for expired leases (time.monotonic()).
_expired_asked: dict[int, float] = {}


def announce(run_id: int, definition: str, outcomes: list[ExecutionOutcome]) -> None:
    """Send the signals for outcomes that were just committed, and count them."""
    items_finished(definition, outcomes)
    if item_finished.has_listeners(ItemClaim):
        for o in outcomes:
            if o.terminal:
                status = "succeeded" if o.kind == SUCCEEDED else "failed"
                send(
                    item_finished,
                    ItemClaim,
                    run_id=run_id,
                    key=o.key,
                    status=status,
                    result=o.result,
                    error=o.error,
                )
    for o in outcomes:
        if o.kind == THROTTLED and o.pool:
            send(pool_throttled, CapacityPool, pool=o.pool, retry_after=o.retry_after)


def owner_name(suffix: str = "") -> str:
    name = f"{host_name()}:{os.getpid()}:{threading.current_thread().name}"
    return f"{name}:{suffix}" if suffix else name


@dataclass
class Batch:
    """Items a worker holds under one claim token, and what became of those it ran."""

    token: uuid.UUID
    items: list[ClaimedItem]
    failure_policy: str
    outcomes: list[ExecutionOutcome] = field(default_factory=list)
    # A budget refused its items as they were handed over: they are recorded released, unrun.
    refused: bool = False


@dataclass
class Drain:
    """One worker's drain of one run; ``stop`` asks it to finish its items and return."""

    run_id: int
    definition: FanOut
    keeper: LeaseKeeper
    params: dict[str, Any]
    owner: str = field(default_factory=owner_name)
    stop: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() after which it claims no more
    # Return after this long with nothing claimable and nothing due soon (an RQ drain: its
    # worker is then free for other runs' jobs; the supervisor brings one back when work
    # appears). None: wait until the run is finished (the inline executor's threads).
    idle_exit: float | None = None
    # Leave as soon as the run has nothing for this thread, to serve another run (a Roam's
    # drain): another idle worker's turn, a joining run and an idle wait all mean "look
    # elsewhere" instead of waiting here.
    roam: bool = False
    executed: int = 0
    # The batch in hand: its finished outcomes are recorded before a stopping job releases it.
    batch: Batch | None = None
    # Seconds until the run's next retry or lease comes due, as the last claim said.
    retry_in: float | None = None
    # Whether its items' costs are counted against budgets (fanout.spend); else the paths
    # are exactly those of a run that counts nothing.
    spend: bool = False

    def __call__(self) -> str:
        """Drain until the run is finished, stopped or the deadline passes; say which."""
        try:
            return self.serve()
        finally:
            connection.close()

    def _count(self, n: int) -> None:
        self.executed += n

    def serve(self) -> str:
        """Drain as ``__call__`` does, keeping this thread's connection for what it does next.

        A database error that no retry mends stops it, said on the run; others go up."""
        try:
            return self._loop()
        except DatabaseError as exc:
            if is_transient(exc):
                raise
            return self._give_up(exc)

    def _give_up(self, exc: DatabaseError) -> str:
        """Stop on a database error that no retry mends, and say why on the run."""
        reason = (
            f"a database error that retrying will not mend ({type(exc).__name__}: {exc}); "
            "workers stop draining the run until it is fixed"
        )
        connection.close()  # a fresh session to write the note with
        try:
            note_stall(self.run_id, reason)
        except DatabaseError:
            logger.exception("run %s: could not note why its drain stopped", self.run_id)
        return f"stopped: {reason}"

    def _loop(self) -> str:
        # Items run but not yet recorded: they are recorded by the next claim or hand-over.
        batch: Batch | None = None
        self.spend = self.definition.accounted or spend.run_has_budget(self.run_id)
        self._idle_since: float | None = None
        self._seen = wakes()
        self._spans = item_spans(self.run_id, self.definition.name)
        while True:
            ended = self._ended()
            if ended:
                if batch is not None:
                    self._settle(batch)
                    self._join_if_done()
                return ended
            # With DEBUG on, Django keeps every query's SQL; a long drain must not pile it up.
            connection.queries_log.clear()
            if batch is not None and self._can_hand_over(batch):
                batch = self._hand_over(batch)
                if batch is not None:
                    self._execute(batch)
                elif self.roam:
                    # Nothing to take in our slot: the run has no admissible item for us now.
                    return "handed over: nothing next"
                continue
            if batch is None and _gate_wait(self.run_id, wait=not self.roam):
                if self.roam:
                    return "busy: another worker's turn"
                continue
            self._seen = wakes()  # a wake-up from here on is not slept through by _idle
            result = self._claim(batch)
            if result is None:
                continue  # the database went away and came back: the batch is re-recorded
            batch = self._started(result)
            if batch is None:
                left = self._nothing_claimed(result)
                if left:
                    return left

    def _ended(self) -> str:
        """Why the drain stops now ("stopped", "time budget spent"), or ""."""
        if self.stop.is_set():
            return "stopped"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "time budget spent"
        return ""

    def _started(self, result: ClaimResult) -> Batch | None:
        """Run what the claim took, under a lease; its outcomes wait for the next claim."""
        if not result.items:
            return None
        self._idle_since = None
        assert result.token is not None
        batch = Batch(result.token, result.items, result.failure_policy)
        self.keeper.hold(batch.token, [i.pk for i in batch.items])
        self._execute(batch)
        return batch

    def _nothing_claimed(self, result: ClaimResult) -> str:
        """The claim took nothing: why the drain leaves (the run compensates, joins, ended, or
        had nothing for too long), or "" once it has waited for the next claim."""
        if result.crashed_out:
            self._db(lambda: maybe_join(self.run_id, self.definition))
        if result.run_status == RunStatus.COMPENSATING and self.definition.compensate:
            return compensate.drain(
                self.definition,
                self.run_id,
                self.owner,
                self.stop,
                self.deadline,
                ran=self._count,
                leave_when_idle=self.roam,
                keeper=self.keeper,
            )
        if result.run_status == RunStatus.JOINING:
            if self.roam:
                return "run joining"
            self._idle(result)  # it may yet compensate, with every worker's help
            return ""
        if not result.run_open:
            return f"run {result.run_status}"
        unfinished = self._db(
            lambda: ItemClaim.objects.filter(run_id=self.run_id).unfinished().exists()
        )
        if unfinished is False:
            self._join()
            # The next claim sees how it ended (or that it compensates); a roaming thread,
            # whose join runs beside it, serves other runs meanwhile.
            return "run finished" if self.roam else ""
        if self._idle_too_long(result):
            return "idle: nothing claimable"
        self._idle(result)
        return ""

    def _join_if_done(self) -> None:
        """A stopping drain that recorded its run's last items joins the run itself: no thread
        comes back to a run with nothing left to claim, and a work horse's joiner would not
        outlive its job (the join was left to a supervisor, over a minute later)."""
        unfinished = self._db(
            lambda: ItemClaim.objects.filter(run_id=self.run_id).unfinished().exists()
        )
        if unfinished is False:
            self._db(lambda: maybe_join(self.run_id, self.definition))

    def _join(self) -> None:
        """Join the run if every item has finished: a roaming thread leaves that to the
        process's joiner and serves the next run at once; a run's own thread joins it."""
        if self.roam:
            joiner.add(self.run_id, self.definition)
        else:
            self._db(lambda: maybe_join(self.run_id, self.definition))

    def _execute(self, batch: Batch) -> None:
        self.batch = batch
        for item in batch.items:
            if self.stop.is_set() or batch.refused:
                # A release gives the item back at once and costs no attempt.
                batch.outcomes.append(
                    ExecutionOutcome(
                        item.pk, item.key, RELEASED, pool=item.pool, accounted=self.spend
                    )
                )
                continue
            self.keeper.started(item.pk, self.definition.timeout_for(item.key))
            if self._spans is None:
                outcome = execute(self.definition, self.run_id, self.params, item)
            else:
                run = partial(execute, self.definition, self.run_id, self.params, item)
                outcome = self._spans.execute(item, run)
            batch.outcomes.append(outcome)
            self.keeper.finished(item.pk)
            self.executed += 1
        # A handler that broke this thread's connection shows up in the next query, which
        # _db() answers by reconnecting.

    def _can_hand_over(self, batch: Batch) -> bool:
        if len(batch.outcomes) != 1 or not can_hand_over(batch.outcomes[0]):
            return False
        # A dead owner's items hold slots that hand-overs would never give them: take the
        # claim path, which reclaims them first.
        return not self._expired_waiting()

    def _expired_waiting(self) -> bool:
        """Whether the run has expired leases to reclaim; asked at most twice a second per
        process and run, by a hand-over or a claim (which reclaims what it finds)."""
        now = time.monotonic()
        with _wake:
            # A claim that found expired leases left its time at 0: it looks again at once.
            asked = max(
                _expired_asked.get(self.run_id, 0.0), _expired_checked.get(self.run_id, 0.0)
            )
            if now - asked < EXPIRED_CHECK_SECONDS:
                return False
            _expired_asked[self.run_id] = now
        found = bool(
            self._db(lambda: ItemClaim.objects.filter(run_id=self.run_id).expired().exists())
        )
        if found:
            _expired_checked[self.run_id] = 0.0  # the claim looks for them at once
            _expired_asked[self.run_id] = 0.0  # and so does the next hand-over
        return found

    def _hand_over(self, batch: Batch) -> Batch | None:
        """Record the one outcome and take the next item in its slot: one statement."""
        outcome = batch.outcomes[0]
        token = uuid.uuid4()
        began = time.perf_counter()
        # A call that said what it cost (report_cost, cost_from=) moves spend even in a run
        # that reserves nothing: the plain hand-over would drop its cost.
        spending = self.spend or outcome.accounted
        done = self._db(
            partial(
                hand_over_spending if spending else shared_hand_over,
                self.run_id,
                batch.token,
                outcome,
                self.owner,
                token,
                self.definition.lease_seconds,
            )
        )
        if done is None:
            return batch  # the database went away: record it again
        claim_took(self.definition.name, "hand_over", time.perf_counter() - began)
        self.keeper.drop([outcome.pk])
        self.batch = None
        if done.written:
            announce(self.run_id, self.definition.name, [outcome])
        if not done.written:
            logger.warning(
                "run %s: outcome of %s dropped: this worker had lost its claim",
                self.run_id,
                outcome.key,
            )
        if done.next is not None:
            self.keeper.hold(token, [done.next.pk])
            return Batch(token, [done.next], batch.failure_policy, refused=done.refused)
        if done.written:
            wake(1)  # a slot was given up: an idle worker of this process may take it
            if outcome.terminal:
                self._join()
        return None

    def _claim(self, batch: Batch | None) -> ClaimResult | None:
        """Take new slots, recording the last batch's outcomes in the same transaction."""
        definition = self.definition
        began = time.perf_counter()
        result = self._db(
            partial(
                claim,
                self.run_id,
                self.owner,
                definition.batch_size,
                definition.lease_seconds,
                definition.crash_budget,
                definition.static_pool,
                before=partial(self._record, batch) if batch is not None else None,
                host_limit=(
                    (definition.name, definition.host_max_parallel)
                    if definition.host_max_parallel
                    else None
                ),
                spend=self.spend,
            )
        )
        if result is None:
            return None
        self.retry_in = result.retry_in
        claim_took(definition.name, "claim", time.perf_counter() - began)
        if batch is None:
            _gate_set(self.run_id, result)
        else:
            recorded = self._recorded(batch, result.before, result.items)
            if recorded.terminal and not result.items:
                self._join()
        return result

    def _settle(self, batch: Batch) -> None:
        """Record the batch without claiming more (the drain is stopping)."""
        recorded = self._db(
            partial(self._record, batch), give_up_after=self.definition.lease_seconds * 2
        )
        recorded = self._recorded(batch, recorded)
        if recorded.terminal:
            self._db(lambda: maybe_join(self.run_id, self.definition))

    def record_finished(self) -> int:
        """Record the outcomes of the batch in hand whose handlers returned; return how many
        were written.

        Called by a stopping job's main thread when its grace period is over and this thread
        is still inside a handler: what finished is recorded, so that only what never finished
        is released (and runs again elsewhere). The fence makes a later record by this thread
        drop what was written here.
        """
        batch = self.batch
        if batch is None:
            return 0
        done = [o for o in list(batch.outcomes) if o.kind != RELEASED]
        if not done:
            return 0
        recorded = record(self.run_id, batch.token, done, batch.failure_policy, self.definition)
        self.keeper.drop([o.pk for o in done])
        if recorded.written:
            announce(self.run_id, self.definition.name, done)
        return recorded.written

    def _record(self, batch: Batch) -> Recorded:
        return record(
            self.run_id, batch.token, batch.outcomes, batch.failure_policy, self.definition
        )

    def _recorded(
        self, batch: Batch, recorded: Recorded | None, reclaimed: list[Any] | None = None
    ) -> Recorded:
        """Stop renewing the batch's leases and say what became of its outcomes."""
        outcomes = batch.outcomes
        self.keeper.drop([i.pk for i in batch.items])
        self.batch = None
        if recorded is None:
            logger.error(
                "run %s: could not record %d outcomes; their leases will expire",
                self.run_id,
                len(outcomes),
            )
            return Recorded(0, len(outcomes), 0, 0)
        if recorded.dropped:
            logger.warning(
                "run %s: %d outcomes dropped: this worker had lost their claims",
                self.run_id,
                recorded.dropped,
            )
        # Capacity was freed: idle workers of this process may claim now. When the outcomes rode
        # in a claim that took as many slots of the same pools again, nothing was freed, and
        # waking every idle worker would only queue them on the run's lock for nothing.
        freed = Counter(o.pool for o in outcomes)
        if reclaimed is not None:
            freed.subtract(Counter(item.pool for item in reclaimed))
        wake(sum(n for n in freed.values() if n > 0))
        if not recorded.dropped:
            announce(self.run_id, self.definition.name, outcomes)
        for o in outcomes:
            if o.kind == SPAWNED:
                # The child may have ended before its parent item was waiting: decide it now.
                child = o.result["child_run"]
                self._db(lambda child=child: settle_up(child))
        return recorded

    def _idle_too_long(self, result: ClaimResult) -> bool:
        if self.idle_exit is None:
            return False
        now = time.monotonic()
        if result.retry_in is not None and result.retry_in <= self.idle_exit:
            self._idle_since = None  # a retry or a lease comes due soon: stay for it
            return False
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since >= self.idle_exit

    def _idle(self, result: ClaimResult) -> None:
        timeout = conf.IDLE_MAX_SECONDS
        if result.retry_in is not None:
            timeout = min(timeout, result.retry_in)
        nap(self._seen, max(timeout, 0.005))

    def _db(self, op: Callable[[], T], give_up_after: float | None = None) -> T | None:
        """Run ``op``; ride out a database that is restarting instead of losing the worker.

        An error that will never go away (see errors.is_transient) is raised: the drain stops.
        """
        return ride_out(op, self.stop, f"run {self.run_id}", give_up_after)


# The longest a Roam stays on one run while other runs of its queue are open: items are the
# unit of scheduling, so a long run shares the threads with the runs started after it.
SERVE_SECONDS = 5.0
# Open runs of a queue a Roam looks at in one round: a random sample when there are more, so
# that runs held up for long (a paused pool, a far retry) never hide the runs after them.
CANDIDATES = 500
GATED_PAUSE = 0.05  # seconds a Roam waits before looking again at runs others were trying
# When this process's threads last began or ended serving each run (time.monotonic()): the
# least recently served run is served first, so every open run of a queue gets threads in turn.
_served: dict[int, float] = {}
SERVING = (RunStatus.RUNNING, RunStatus.COMPENSATING)
# Each run's params, read once per process: a run's params never change.
_params: dict[int, dict[str, Any]] = {}


def serve_first(run_id: int) -> None:
    """Put a run that has just been dispatched ahead of those already served."""
    _served.setdefault(run_id, 0.0)


def open_runs(names: list[str], executor: str) -> QuerySet[BatchRun, dict[str, Any]]:
    """The open runs of these definitions, carried by ``executor``, that a Roam may serve:
    compensating ones, and running ones with an item to claim and a slot to claim it in (a
    free one, or a dead owner's expired lease). A run whose items are all held is left to
    the threads that hold them, instead of being locked by claims that cannot succeed."""
    items = ItemClaim.objects.filter(run=OuterRef("pk"))
    waiting = items.filter(status=ItemStatus.PENDING)
    expired = items.expired()
    room = Q(in_flight__lt=F("max_parallel")) | Exists(expired)
    workable = Q(status=RunStatus.COMPENSATING) | (
        Q(status=RunStatus.RUNNING) & (Exists(waiting) | Exists(expired)) & room
    )
    runs = BatchRun.objects.filter(executor=executor, definition__in=names).filter(workable)
    fields = ("pk", "definition", "status")
    return runs.order_by("?").values(*fields)[:CANDIDATES]


def serving_order(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs no idle worker of this process was just refused by, least recently served first,
    then those whose turn another thread holds (a thread that reaches one waits for that
    claim's answer and takes the next turn, instead of looking at every run again). A run at
    max_parallel is tried too: its slots may be held by dead owners' expired leases, which
    only a claim reclaims; a refusal gates it for a moment."""
    if len(_served) > CANDIDATES * 4:  # forget runs that are no longer open
        for pk in set(_served) - {r["pk"] for r in runs}:
            _served.pop(pk, None)
    with _wake:
        held = {r["pk"] for r in runs if r["pk"] in _trying}
    ready = [r for r in runs if r["pk"] in held or not gated(r["pk"])]
    return sorted(
        ready, key=lambda r: (r["pk"] in held, _served.get(r["pk"], 0.0), random.random())
    )


@dataclass
class Roam:
    """One worker thread that serves every open run of a queue, one run at a time.

    It takes the run this process served least recently that has room, drains it until the
    run has nothing for this thread (or SERVE_SECONDS pass while other runs wait), and moves
    on; so a process's threads never idle while any run of their queue has an admissible item,
    and a run's max_parallel, pools and host limit are decided by the same claim as ever.
    """

    queue: str
    keepers: Keepers
    owner: str
    stop: threading.Event
    deadline: float  # time.monotonic() after which it claims no more
    # Stay while this run is open, even with nothing to do (a worker nobody supervises: no
    # supervisor would bring a drain back). None: leave after ``idle_exit`` with nothing.
    home: int | None = None
    idle_exit: float = 2.0
    executor: str = "rq"
    # The drain of the run being served, for a stopping job to record its finished items.
    current: Drain | None = None

    def __post_init__(self) -> None:
        self.names = [n for n, d in registered().items() if d.queue == self.queue]

    def __call__(self) -> str:
        """Serve the queue until stopped, out of time, or idle; say which."""
        try:
            return self._loop()
        finally:
            connection.close()

    def _loop(self) -> str:
        idle_since = time.monotonic()
        while True:
            if self.stop.is_set():
                return "stopped"
            if time.monotonic() >= self.deadline:
                return "time budget spent"
            seen = wakes()
            runs = self._look(lambda: list(open_runs(self.names, self.executor))) or []
            ready = serving_order(runs)
            served, due_soon = self._round(ready)
            now = time.monotonic()
            if served or due_soon or self._home_open():
                idle_since = now
                if served:
                    continue
            elif now - idle_since >= self.idle_exit:
                return "idle: nothing claimable"
            pause = conf.IDLE_MAX_SECONDS
            if len(ready) < len(runs):
                # Runs with work were skipped because a thread of ours was just refused by them:
                # look again when the first of them may admit, or a slot is freed, not before
                # (each look is a query and a claim that the threads holding slots wait on).
                gated_runs = [r["pk"] for r in runs if r not in ready]
                pause = min(pause, max(gates_open_in(gated_runs), 0.005))
            nap(seen, pause)

    def _round(self, runs: list[dict[str, Any]]) -> tuple[bool, bool]:
        """Serve the first of ``runs`` that has work for us; say whether one had, and whether
        a retry or an expiring lease comes due soon on any that had none."""
        due_soon = False
        for run in runs:
            if self.stop.is_set() or time.monotonic() >= self.deadline:
                break
            drain = self._serve(run, alone=len(runs) == 1)
            if drain is None:
                continue
            if drain.executed:
                return True, due_soon
            due_soon |= drain.retry_in is not None and drain.retry_in <= self.idle_exit
        return False, due_soon

    def _params(self, run_id: int) -> dict[str, Any] | None:
        """The run's params, read once per process (a few runs' worth kept); None if the
        database is away."""
        params = _params.get(run_id)
        if params is None:
            rows = BatchRun.objects.filter(pk=run_id).values_list("params", flat=True)
            params = self._look(rows.first)
            if params is None:
                return None
            if len(_params) > CANDIDATES * 4:
                _params.clear()
            _params[run_id] = params
        return params

    def _serve(self, run: dict[str, Any], alone: bool) -> Drain | None:
        try:
            definition = get_definition(run["definition"])
        except FanoutError:
            return None  # gone from this process's registry: not ours to run
        params = self._params(run["pk"])
        if params is None:
            return None
        until = self.deadline if alone else min(self.deadline, time.monotonic() + SERVE_SECONDS)
        drain = Drain(
            run["pk"],
            definition,
            self.keepers.for_lease(definition.lease_seconds),
            params,
            owner=self.owner,
            stop=self.stop,
            deadline=until,
            idle_exit=0.0,
            roam=True,
        )
        _served[run["pk"]] = time.monotonic()
        self.current = drain
        try:
            drain.serve()
        except DatabaseError as exc:
            # A deadlock or a lost session on one run (its compensations are not retried as
            # its items' claims are) costs this thread nothing but its session: it moves on
            # and comes back to the run in its turn. An error that no retry mends was noted on
            # the run by the drain already.
            if not is_transient(exc):
                raise
            logger.warning("run %s: database error (%s); serving on", run["pk"], exc)
            connection.close()
            self.stop.wait(0.5)
        finally:
            self.current = None
            _served[run["pk"]] = time.monotonic()
        return drain

    def _home_open(self) -> bool:
        if self.home is None:
            return False
        statuses = (*SERVING, RunStatus.JOINING)
        return bool(self._look(BatchRun.objects.filter(pk=self.home, status__in=statuses).exists))

    def _look(self, op: Callable[[], T]) -> T | None:
        """Run a read; None while the database is away (the next round looks again)."""
        try:
            return op()
        except (OperationalError, InterfaceError) as exc:
            logger.warning("queue %s: database unavailable (%s); retrying", self.queue, exc)
            connection.close()
            self.stop.wait(0.5)
            return None
