"""The drain loop every executor runs: claim, run outside the transaction, record, repeat."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connection

from .claim import EXPIRED_CHECK_SECONDS, ClaimResult, _expired_checked, claim
from .conf import conf, host_name
from .definition import FanOut
from .errors import is_transient
from .join import maybe_join
from .lease import LeaseKeeper
from .models import CapacityPool, ItemClaim, RunStatus
from .nest import settle_up
from .record import Recorded, record
from .run import execute
from .signals import item_finished, pool_throttled, send
from .supervise import note_stall
from .telemetry import claim_took, item_spans, items_finished
from .transitions import (
    RELEASED,
    SPAWNED,
    SUCCEEDED,
    THROTTLED,
    ClaimedItem,
    ExecutionOutcome,
    can_hand_over,
    hand_over,
)

logger = logging.getLogger("fanout")
T = TypeVar("T")

# One condition per process: a worker that frees capacity wakes the idle ones at once.
_wake = threading.Condition()


def wake_all() -> None:
    with _wake:
        _wake.notify_all()


def wake(count: int) -> None:
    """Wake up to ``count`` idle workers of this process (none for 0)."""
    if count > 0:
        with _wake:
            _gate.clear()
            _wake.notify(count)


# Per run: time.monotonic() before which idle workers of this process do not try to claim,
# because one of them is trying now or was just refused for capacity (pool full, rate limit).
# Every claimer of a run queues on the run's row lock, so N idle threads retrying at once
# (all woken at the same retry time) make a convoy that delays the worker that has outcomes
# to record; one idle thread per process tries at a time instead, and passes the turn on.
_gate: dict[int, float] = {}


def _gate_wait(run_id: int) -> bool:
    """Wait while another idle worker of this process holds the run's turn; True if we waited."""
    with _wake:
        until = _gate.get(run_id, 0.0)
        now = time.monotonic()
        if until > now:
            _wake.wait(min(until - now, conf.IDLE_MAX_SECONDS))
            return True
        _gate[run_id] = now + conf.IDLE_MAX_SECONDS  # our turn: others wait for our answer
        return False


def _gate_set(run_id: int, result: ClaimResult) -> None:
    with _wake:
        if result.items or not result.run_open:
            # Capacity (or the end) was found: the next idle worker may look at once.
            _gate.pop(run_id, None)
            _wake.notify(1)
            return
        wait = conf.IDLE_MAX_SECONDS
        if result.retry_in is not None:
            wait = min(wait, result.retry_in)
        _gate[run_id] = time.monotonic() + wait


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
    executed: int = 0

    def __call__(self) -> str:
        """Drain until the run is finished, stopped or the deadline passes; say which."""
        try:
            return self._loop()
        except DatabaseError as exc:
            if is_transient(exc):
                raise
            return self._give_up(exc)
        finally:
            connection.close()

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
        self._idle_since: float | None = None
        self._spans = item_spans(self.run_id, self.definition.name)
        while True:
            if self.stop.is_set() or (
                self.deadline is not None and time.monotonic() >= self.deadline
            ):
                if batch is not None:
                    self._settle(batch)
                return "stopped" if self.stop.is_set() else "time budget spent"
            # With DEBUG on, Django keeps every query's SQL; a long drain must not pile it up.
            connection.queries_log.clear()
            if batch is not None and self._can_hand_over(batch):
                batch = self._hand_over(batch)
                if batch is not None:
                    self._execute(batch)
                continue
            if batch is None and _gate_wait(self.run_id):
                continue
            result = self._claim(batch)
            if result is None:
                continue  # the database went away and came back: the batch is re-recorded
            batch = None
            if result.items:
                self._idle_since = None
                assert result.token is not None
                batch = Batch(result.token, result.items, result.failure_policy)
                self.keeper.hold(batch.token, [i.pk for i in batch.items])
                self._execute(batch)
                continue
            if result.crashed_out:
                self._db(lambda: maybe_join(self.run_id, self.definition))
            if result.run_status == RunStatus.COMPENSATING and self.definition.compensate:
                from . import compensate

                return compensate.drain(
                    self.definition, self.run_id, self.owner, self.stop, self.deadline
                )
            if result.run_status == RunStatus.JOINING:
                self._idle(result)  # it may yet compensate, with every worker's help
                continue
            if not result.run_open:
                return f"run {result.run_status}"
            unfinished = self._db(
                lambda: ItemClaim.objects.filter(run_id=self.run_id).unfinished().exists()
            )
            if unfinished is False:
                self._db(lambda: maybe_join(self.run_id, self.definition))
                continue  # the next claim sees how it ended (or that it compensates)
            if self._idle_too_long(result):
                return "idle: nothing claimable"
            self._idle(result)

    def _execute(self, batch: Batch) -> None:
        for item in batch.items:
            if self.stop.is_set():
                # A release gives the item back at once and costs no attempt.
                batch.outcomes.append(ExecutionOutcome(item.pk, item.key, RELEASED, pool=item.pool))
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
        process and run."""
        now = time.monotonic()
        with _wake:
            if now - _expired_asked.get(self.run_id, 0.0) < EXPIRED_CHECK_SECONDS:
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
        done = self._db(
            partial(
                hand_over,
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
            return Batch(token, [done.next], batch.failure_policy)
        if done.written:
            wake(1)  # a slot was given up: an idle worker of this process may take it
            if outcome.terminal:
                self._db(lambda: maybe_join(self.run_id, self.definition))
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
            )
        )
        if result is None:
            return None
        claim_took(definition.name, "claim", time.perf_counter() - began)
        if batch is None:
            _gate_set(self.run_id, result)
        else:
            recorded = self._recorded(batch, result.before, result.items)
            if recorded.terminal and not result.items:
                self._db(lambda: maybe_join(self.run_id, definition))
        return result

    def _settle(self, batch: Batch) -> None:
        """Record the batch without claiming more (the drain is stopping)."""
        recorded = self._db(
            partial(self._record, batch), give_up_after=self.definition.lease_seconds * 2
        )
        recorded = self._recorded(batch, recorded)
        if recorded.terminal:
            self._db(lambda: maybe_join(self.run_id, self.definition))

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
        with _wake:
            _wake.wait(max(timeout, 0.005))

    def _db(self, op: Callable[[], T], give_up_after: float | None = None) -> T | None:
        """Run ``op``; ride out a database that is restarting instead of losing the worker.

        An error that will never go away (see errors.is_transient) is raised: the drain stops.
        """
        started = time.monotonic()
        pause = 0.1
        while True:
            try:
                return op()
            except (OperationalError, InterfaceError) as exc:
                if not is_transient(exc):
                    raise
                logger.warning("run %s: database unavailable (%s); retrying", self.run_id, exc)
                connection.close()
                if give_up_after is not None and time.monotonic() - started > give_up_after:
                    return None
                if self.stop.wait(pause):
                    return None
                pause = min(pause * 2, 2.0)
