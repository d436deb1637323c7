"""Group commit: the worker threads of one process that finish items of one run while a
hand-over is in flight share the next one, one statement and one commit.

Leader and followers, no timer: a thread that finds no hand-over of its run in flight sends
its own at once (alone, it never waits for company); threads that come while one is in flight
queue, and when it commits, one of them sends the queue's hand-overs together. Every thread
waits for its own answer, so none starts its next item before its last outcome is committed,
and a process that dies with a statement in flight loses all of its outcomes or none (they
run again once their leases run out).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter

from django.db import DatabaseError

from .backends import backend
from .conf import conf
from .errors import is_transient
from .transitions import ExecutionOutcome, Handing, HandOver, hand_over, hand_over_group

logger = logging.getLogger("fanout.group_commit")

# What this process's hand-overs did: "statements" sent, "outcomes" they carried, "shared" of
# those outcomes that went with another thread's, "joined" threads that queued behind one in
# flight. Read by tests and profiles.
counts: Counter[str] = Counter()


class _Ask:
    """One thread's hand-over, and its answer once the statement that carried it ends."""

    def __init__(self, handing: Handing) -> None:
        self.handing = handing
        self.answer: HandOver | None = None
        self.error: BaseException | None = None
        self.taken = False  # a statement in flight carries it
        self.done = False
        self.alone = False  # the group failed for good: hand over alone, to find whose it was


class _Run:
    """One run's hand-overs of this process: the queue, and how many are in flight."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.queue: list[_Ask] = []
        self.busy = 0

    def hand_over(self, run_id: int, ask: _Ask, lease_seconds: float) -> None:
        # Hand-over statements of one run that one process keeps in flight at once. With one,
        # the threads split into two groups that take turns (those answered together come back
        # together while the others' statement is in flight), so each thread waits for the
        # other group's statement before its own: bench/lone.py drained 0.56x as fast as one
        # by one with 8 threads, 0.73x with two statements in flight (README, "Scale").
        lanes = max(1, int(conf.GROUP_COMMIT_LANES))
        with self.changed:
            self.queue.append(ask)
            if self.busy >= lanes:
                counts["joined"] += 1
                logger.debug("run %s: a hand-over joins the next one in flight", run_id)
            # Until a statement has carried it, or it may send the queue's (its own among them).
            while not ask.done and (ask.taken or self.busy >= lanes):
                self.changed.wait()
            if ask.done:
                return
            group, self.queue = self.queue, []
            for taken in group:
                taken.taken = True
            self.busy += 1
        try:
            answers = _send(run_id, group, lease_seconds)
        except Exception as exc:  # each thread of the group raises it, or retries alone
            self._ended(group, None, exc)
        except BaseException as exc:
            self._ended(group, None, exc)
            raise
        else:
            self._ended(group, answers, None)

    def _ended(
        self, group: list[_Ask], answers: list[HandOver] | None, error: BaseException | None
    ) -> None:
        with self.changed:
            counts["statements"] += 1
            if answers is not None:
                counts["outcomes"] += len(group)
                if len(group) > 1:
                    counts["shared"] += len(group)
            # A group whose statement failed for good, or was cut off (the leader's thread was
            # interrupted), leaves each of its threads to hand over alone: the fence drops
            # whatever that statement did commit.
            alone = (
                error is not None
                and len(group) > 1
                and (
                    not isinstance(error, Exception)
                    or (isinstance(error, DatabaseError) and not is_transient(error))
                )
            )
            for n, ask in enumerate(group):
                ask.answer = answers[n] if answers is not None else None
                ask.error = error
                ask.alone = alone
                ask.done = True
            self.busy -= 1
            self.changed.notify_all()


def _send(run_id: int, group: list[_Ask], lease_seconds: float) -> list[HandOver]:
    """One statement: a lone thread's the plain hand-over's, so its latency stays what it was."""
    if len(group) == 1:
        h = group[0].handing
        return [hand_over(run_id, h.token, h.outcome, h.owner, h.new_token, lease_seconds)]
    return hand_over_group(run_id, [a.handing for a in group], lease_seconds)


_runs: dict[int, _Run] = {}
_runs_lock = threading.Lock()


def _of(run_id: int) -> _Run:
    with _runs_lock:
        run = _runs.get(run_id)
        if run is None:
            if len(_runs) > 1000:  # forget runs no thread is handing over in
                for key in [k for k, r in _runs.items() if not r.busy and not r.queue]:
                    del _runs[key]
            run = _runs[run_id] = _Run()
        return run


def enabled() -> bool:
    """Whether hand-overs are grouped here: the setting, on a database that can."""
    return bool(conf.GROUP_COMMIT) and backend().hands_over_groups


def shared_hand_over(
    run_id: int,
    token: uuid.UUID,
    outcome: ExecutionOutcome,
    owner: str,
    new_token: uuid.UUID,
    lease_seconds: float,
) -> HandOver:
    """``transitions.hand_over``, sent with the hand-overs of this process's other threads that
    finish items of the run meanwhile (one statement, one commit)."""
    if not enabled():
        return hand_over(run_id, token, outcome, owner, new_token, lease_seconds)
    ask = _Ask(Handing(token, outcome, owner, new_token))
    _of(run_id).hand_over(run_id, ask, lease_seconds)
    if ask.alone:
        # Something in the group fails for good: each goes alone, so only its own item fails.
        return hand_over(run_id, token, outcome, owner, new_token, lease_seconds)
    if ask.error is not None:
        raise ask.error
    assert ask.answer is not None
    return ask.answer
