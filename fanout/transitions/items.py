"""Every status change of an item, in one place, each keeping the in_flight counters exact.

A run's and a pool's ``in_flight`` count their items that are ``running`` (live or expired
lease). An item enters ``running`` only by ``claim`` (a fresh slot: the caller holds the run's
and the pools' row locks and decided there was room) and leaves it only through ``settle``
(``succeed``, ``fail``, ``retry``, ``throttle``, ``wait_on_child``), ``release``, ``fail_lost``
or ``hand_over``; ``reclaim`` moves an expired item to a new owner and keeps its slot.
Nothing outside this package writes an item's status (tests/test_shape.py checks it).

Lock order, so that no two transactions wait on each other in a cycle: a claim locks the run,
then its pools in name order, then items with SKIP LOCKED (it never waits for an item); a
writer that finishes items locks them first, then the run, then the pools in name order.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from django.db import connection, transaction
from django.db.models import F, QuerySet

from .. import spend
from ..backends import HandOverRow, backend
from ..clock import DbNow, db_now_plus
from ..models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus

# What an execution ended in; RETRY, THROTTLED and RELEASED put the item back to pending.
SUCCEEDED, FAILED, RETRY, THROTTLED, RELEASED = (
    "succeeded",
    "failed",
    "retry",
    "throttled",
    "released",
)
# The handler handed its item to a child run: it waits, keeping its run slot (see nest.py).
SPAWNED = "spawned"
CHILD_FAILED = "ChildRunFailed"  # error_class of an item whose child run failed or was cancelled
FAILED_FAST = "FailedFast"  # error_class of items cancelled because a fail_fast run failed
# error_class of items cancelled because the run's failures crossed max_failures or its rate
FAILURE_THRESHOLD = "FailureThreshold"


@dataclass
class ExecutionOutcome:
    pk: int
    key: str
    kind: str
    pool: str = ""
    result: Any = None
    error: str = ""
    error_class: str = ""
    # Seconds from the database's now until a retry is due (RETRY, THROTTLED, RELEASED).
    retry_after: float = 0.0
    # How long the handler ran, by this host's monotonic clock, and so when it finished by
    # the database's: the item's started_at plus that.
    elapsed: float = 0.0
    finished_at: datetime | None = None
    # Spend (fanout.spend): what the call reported it cost (None: nothing), and whether its
    # definition counts cost at all (then its outcome settles the item's reservation).
    cost: dict[str, float] | None = None
    accounted: bool = False
    # The call said what it cost in a way nobody can read (cost_from=): it costs its estimate.
    cost_unread: bool = False

    @property
    def terminal(self) -> bool:
        return self.kind in (SUCCEEDED, FAILED)


@dataclass(frozen=True)
class ClaimedItem:
    pk: int
    key: str
    index: int
    payload: Any
    pool: str
    attempt: int
    started_at: datetime | None = None  # by the database's clock


# --- the counters -----------------------------------------------------------------------


@dataclass
class Freed:
    """What a batch recorded first in a claim (``slots_freed``) leaves to the claim: the run
    slots its successes give up, and the spend they settle on the run's budget."""

    run_id: int
    slots: Counter[int] = field(default_factory=Counter)
    then: list[Callable[[], Any]] = field(default_factory=list)

    def settle(self) -> None:
        """Settle the spend left here: call with the run's row locked (the run's budget comes
        after it in the lock order)."""
        while self.then:
            self.then.pop(0)()


# Set by a claim that records its worker's last batch first (``slots_freed``): the run slots
# that batch's successes give up, which the claim then moves with its own lock of the run.
_freeing: ContextVar[Freed | None] = ContextVar("_freeing", default=None)


@contextlib.contextmanager
def slots_freed(run_id: int) -> Iterator[Freed]:
    """Within the block, successes of ``run_id`` that free no pool slot leave the run's
    counter alone and count here instead: the caller must move the run's ``in_flight`` by
    as many, in the same transaction (claim.lock_run does, in the statement that locks it),
    and then settle their spend (``Freed.settle``). One statement less under the run's lock,
    which every claimer of the run waits for."""
    freed = Freed(run_id)
    reset = _freeing.set(freed)
    try:
        yield freed
    finally:
        _freeing.reset(reset)


def _adjust(runs: Counter[int], pools: Counter[str], sign: int) -> None:
    """Move runs' and pools' counters by ``sign`` × the counts: runs first, then pools, each
    in order (the lock order every transaction keeps).

    No clamp at zero: a counter that would go negative has drifted from its rows, and the
    column's check makes that an error instead of a zero that hides it.
    """
    for run_id in sorted(r for r, count in runs.items() if count):
        BatchRun.objects.filter(pk=run_id).update(in_flight=F("in_flight") + sign * runs[run_id])
    for name in sorted(n for n, count in pools.items() if n and count):
        CapacityPool.objects.filter(name=name).update(in_flight=F("in_flight") + sign * pools[name])


def _counts(run_id: int, rows: Sequence[dict]) -> tuple[Counter[int], Counter[str]]:
    return Counter({run_id: len(rows)}), Counter(r["pool"] for r in rows)


def recount(run_id: int) -> int:
    """Set the run's counter from its rows (under the run's lock); return the new value."""
    with transaction.atomic():
        list(BatchRun.objects.filter(pk=run_id).select_for_update().values_list("pk"))
        count = ItemClaim.objects.filter(run_id=run_id).holding_run_slots().count()
        BatchRun.objects.filter(pk=run_id).update(in_flight=count)
    return count


# --- into running -------------------------------------------------------------------------


def _running(owner: str, token: uuid.UUID, lease_seconds: float, now: datetime) -> dict[str, Any]:
    return dict(
        status=ItemStatus.RUNNING,
        owner=owner[:200],
        claim_token=token,
        lease_expires_at=db_now_plus(lease_seconds),
        claimed_at=now,
        started_at=now,
        finished_at=None,
    )


def claim(
    run_id: int,
    rows: Sequence[dict],
    owner: str,
    token: uuid.UUID,
    lease_seconds: float,
    now: datetime,
) -> int:
    """Pending items take new slots. The caller holds the run's and the pools' locks."""
    if not rows:
        return 0
    pks = [r["pk"] for r in rows]
    runs, pools = _counts(run_id, rows)
    n = backend().start_held(run_id, pks, owner[:200], token, lease_seconds, now)
    if n is None:
        n = ItemClaim.objects.filter(pk__in=pks).update(
            **_running(owner, token, lease_seconds, now)
        )
    else:
        runs = Counter()  # counted by the same statement
    _adjust(runs, pools, +1)
    return n


start = claim  # the name it had


LOST = (
    "the worker running this attempt stopped renewing its lease: it died, was stopped, "
    "or the handler outlived its timeout"
)


def _note_lost(rows: Sequence[dict]) -> None:
    """Each attempt cut off by a lost worker joins its item's history."""
    ItemAttempt.objects.bulk_create(
        ItemAttempt(
            item_id=r["pk"],
            attempt=r["attempt"],
            owner=r["owner"],
            started_at=r["started_at"],
            finished_at=r.get("lease_expires_at"),
            error_class="WorkerLost",
            error=LOST,
        )
        for r in rows
    )


def reclaim(
    rows: Sequence[dict], owner: str, token: uuid.UUID, lease_seconds: float, now: datetime
) -> int:
    """Expired items go to a new owner; their slots stay taken. Their old owner died: a crash."""
    if not rows:
        return 0
    _note_lost(rows)
    return ItemClaim.objects.filter(pk__in=[r["pk"] for r in rows]).update(
        crashes=F("crashes") + 1, **_running(owner, token, lease_seconds, now)
    )


# --- out of running -----------------------------------------------------------------------


def fail_lost(run_id: int, rows: Sequence[dict], crash_budget: int) -> int:
    """Items whose owners kept dying fail; the expired ones give their slots up.

    A pending one holds no slot: a reaper (``release_expired``) gave it back already.
    """
    if not rows:
        return 0
    holding = [r for r in rows if r["status"] == ItemStatus.RUNNING]
    _note_lost(holding)
    n = ItemClaim.objects.filter(pk__in=[r["pk"] for r in rows]).update(
        status=ItemStatus.FAILED,
        claim_token=None,
        lease_expires_at=None,
        crashes=crash_budget + 1,
        finished_at=DbNow(),
        error_class="WorkerLost",
        error=f"the worker running this item died {crash_budget + 1} times "
        f"(crash budget {crash_budget})",
    )
    _adjust(*_counts(run_id, holding), -1)
    return n


def write_first(run_id: int | None = None) -> None:
    """SQLite: take the database's write lock before reading, so it is never a read upgraded.

    Elsewhere rows are locked one by one and this does nothing.
    """
    runs = BatchRun.objects.all() if run_id is None else BatchRun.objects.filter(pk=run_id)
    backend().take_write_lock(runs)


def _lock_held(items: QuerySet[ItemClaim]) -> list[tuple[int, int, str]]:
    """Lock running items and say which they are: (pk, run, pool)."""
    return list(items.running().select_for_update().values_list("pk", "run_id", "pool"))


def _leave(rows: list[tuple[int, int, str]], keep_run_slot: Iterable[int] = ()) -> None:
    """Give up the rows' slots; those in ``keep_run_slot`` keep their run's (they wait)."""
    keep = set(keep_run_slot)
    runs = Counter(run_id for pk, run_id, _ in rows if pk not in keep)
    _adjust(runs, Counter(pool for _, _, pool in rows), -1)


def release(items: QuerySet[ItemClaim], after: float = 0.0) -> int:
    """Running items go back to pending, and held compensations to due, with no attempt
    used and no crash counted; their slots (run, compensation budget, pool) are given up.

    A call that may have started keeps its reservation as spent."""
    with transaction.atomic():
        write_first()
        rows = _lock_held(items)
        undoing = list(
            items.filter(status=ItemStatus.COMPENSATING, claim_token__isnull=False)
            .select_for_update()
            .values_list("pk", "run_id", "pool")
        )
        if not rows and not undoing:
            return 0
        free = dict(claim_token=None, lease_expires_at=None, next_attempt_at=db_now_plus(after))
        n = 0
        pks = [r[0] for r in rows]
        if rows:
            n += ItemClaim.objects.filter(pk__in=pks).update(status=ItemStatus.PENDING, **free)
        if undoing:
            # A fresh claim began an attempt: a compensation given back did not use it.
            n += ItemClaim.objects.filter(pk__in=[r[0] for r in undoing]).update(
                compensation_attempt=F("compensation_attempt") - 1, **free
            )
        # Runs first, then pools, each in order: the lock order every transaction keeps.
        in_flight = Counter(run_id for _, run_id, _ in rows)
        budget = Counter(run_id for _, run_id, _ in undoing)
        for run_id in sorted(set(in_flight) | set(budget)):
            BatchRun.objects.filter(pk=run_id).update(
                in_flight=F("in_flight") - in_flight[run_id],
                compensating=F("compensating") - budget[run_id],
            )
        _adjust(Counter(), Counter(pool for _, _, pool in (*rows, *undoing)), -1)
        if pks:
            spend.charge_lost(pks)  # a call that may be running keeps its reservation
    return n


def release_expired(items: QuerySet[ItemClaim], limit: int = 100) -> int:
    """Expired items (their owners died) go back to pending with a crash counted, and give
    their slots up: a full pool that another run's dead worker holds admits again."""
    with transaction.atomic():
        write_first()
        found = list(
            items.expired()
            .select_for_update(skip_locked=True)
            .values("pk", "run_id", "pool", "attempt", "owner", "started_at", "lease_expires_at")[
                :limit
            ]
        )
        if not found:
            return 0
        _note_lost(found)
        rows = [(r["pk"], r["run_id"], r["pool"]) for r in found]
        n = ItemClaim.objects.filter(pk__in=[r[0] for r in rows]).update(
            status=ItemStatus.PENDING,
            claim_token=None,
            lease_expires_at=None,
            crashes=F("crashes") + 1,
            next_attempt_at=DbNow(),
        )
        _leave(rows)
        spend.charge_lost([r[0] for r in rows])
    return n


def settle(run_id: int, token: uuid.UUID, outcomes: Sequence[ExecutionOutcome]) -> list[int]:
    """Write outcomes of items still held under ``token``; return the pks written.

    The rows are locked first and only those still held are written, so a writer that lost
    its lease changes nothing (its outcomes are dropped) and the counters move by exactly
    the slots given up.
    """
    if not outcomes:
        return []
    with transaction.atomic(savepoint=False):
        write_first(run_id)
        rows = _succeed_held(token, outcomes)
        written = rows is not None
        if rows is None:
            by_pk = {o.pk: o for o in outcomes}
            rows = _lock_held(ItemClaim.objects.filter(pk__in=list(by_pk), claim_token=token))
        held = {pk for pk, _, _ in rows}
        mine = [o for o in outcomes if o.pk in held]
        if not mine:
            return []
        freeing = _freeing.get()
        if not written:
            _note_failed([o for o in mine if o.kind in (FAILED, RETRY)])
            _write_outcomes(mine)
        accounted = any(o.accounted for o in mine)
        if written and freeing is not None and _only_run_slots(rows, freeing.run_id):
            freeing.slots[freeing.run_id] += len(rows)
            if accounted:
                # Settling locks the run's budget, which comes after the run's row in the lock
                # order: the claim settles it once it holds the row.
                freeing.then.append(partial(spend.settle, rows, mine))
            return [o.pk for o in mine]
        spawned = {o.pk for o in mine if o.kind == SPAWNED}
        if spawned and accounted:
            # They keep their run slots, so giving up their pools' would lock a pool and not
            # the run, whose budget their spend then settles on: the run's row comes first in
            # the lock order, as a claimer of the run holds it.
            _lock_runs({run for pk, run, _ in rows if pk in spawned})
        _leave(rows, keep_run_slot=spawned)
        spend.settle(rows, mine)
    return [o.pk for o in mine]


def _lock_runs(run_ids: Iterable[int]) -> None:
    """Lock the runs' rows for this transaction, in the order every transaction keeps."""
    runs = BatchRun.objects.filter(pk__in=sorted(run_ids)).order_by("pk")
    if connection.features.has_select_for_update:
        no_key = connection.features.has_select_for_no_key_update
        runs = runs.select_for_update(no_key=no_key)
    list(runs.values_list("pk", flat=True))


def _only_run_slots(rows: Sequence[tuple[int, int, str]], run_id: int) -> bool:
    return all(run == run_id and not pool for _, run, pool in rows)


def _succeed_held(
    token: uuid.UUID, outcomes: Sequence[ExecutionOutcome]
) -> list[tuple[int, int, str]] | None:
    """A batch of successes, locked, fenced and written in one statement where the backend
    has it (the steady state of a batched drain); None: lock first, then write by kind."""
    if any(o.kind != SUCCEEDED for o in outcomes):
        return None
    return backend().succeed_held(
        token,
        [
            (o.pk, o.finished_at, json.dumps(o.result) if o.result is not None else None)
            for o in outcomes
        ],
    )


def _note_failed(outcomes: Sequence[ExecutionOutcome]) -> None:
    """Failed attempts join their items' history (read before the attempt number moves on)."""
    if not outcomes:
        return
    current = {
        pk: (attempt, owner, started)
        for pk, attempt, owner, started in ItemClaim.objects.filter(
            pk__in=[o.pk for o in outcomes]
        ).values_list("pk", "attempt", "owner", "started_at")
    }
    ItemAttempt.objects.bulk_create(
        ItemAttempt(
            item_id=o.pk,
            attempt=current[o.pk][0],
            owner=current[o.pk][1],
            started_at=current[o.pk][2],
            finished_at=o.finished_at,
            error_class=o.error_class,
            error=o.error,
        )
        for o in outcomes
    )


def _write_outcomes(outcomes: Sequence[ExecutionOutcome]) -> None:
    """One UPDATE per kind of outcome; per-row values in one statement where they vary."""
    by_kind: dict[str, list[ExecutionOutcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    for kind, group in by_kind.items():
        _OUTCOMES[kind](group)
        rows = [
            ItemClaim(
                pk=o.pk,
                result=o.result if kind == SUCCEEDED else None,
                error="" if kind == SUCCEEDED else o.error,
                error_class="" if kind == SUCCEEDED else o.error_class,
                finished_at=o.finished_at,
            )
            for o in group
        ]
        fields = ["error", "error_class", "finished_at"]
        if kind == SPAWNED:
            fields = ["error", "error_class"]
        _write_values(rows, ["result", *fields] if kind == SUCCEEDED else fields)


# Each kind of outcome, a named transition of held items (settle() locks them and moves the
# counters: these write only the rows).


def succeed(outcomes: Sequence[ExecutionOutcome]) -> int:
    """The handler returned: the item is done."""
    return _end(outcomes, ItemStatus.SUCCEEDED)


def fail(outcomes: Sequence[ExecutionOutcome]) -> int:
    """A permanent error, or attempts used up: the item failed for good."""
    return _end(outcomes, ItemStatus.FAILED)


def _end(outcomes: Sequence[ExecutionOutcome], status: str) -> int:
    items = ItemClaim.objects.filter(pk__in=[o.pk for o in outcomes])
    return items.update(status=status, claim_token=None, lease_expires_at=None)


def retry(outcomes: Sequence[ExecutionOutcome]) -> int:
    """A handler exception used an attempt: the item is pending again after its backoff."""
    # The attempt number moves on only here: a handler exception used it up.
    ItemClaim.objects.filter(pk__in=[o.pk for o in outcomes]).update(attempt=F("attempt") + 1)
    return _back_to_pending(outcomes)


def throttle(outcomes: Sequence[ExecutionOutcome]) -> int:
    """The provider said to wait (Throttled): pending again, no attempt used."""
    return _back_to_pending(outcomes)


def _back_to_pending(outcomes: Sequence[ExecutionOutcome]) -> int:
    released = dict(status=ItemStatus.PENDING, claim_token=None, lease_expires_at=None)
    n = 0
    for after, same in _grouped(outcomes, lambda o: round(o.retry_after, 3)).items():
        n += ItemClaim.objects.filter(pk__in=[o.pk for o in same]).update(
            next_attempt_at=db_now_plus(after), **released
        )
    return n


def wait_on_child(outcomes: Sequence[ExecutionOutcome]) -> int:
    """The handler handed its item to a child run: it waits, keeping its run slot."""
    items = ItemClaim.objects.filter(pk__in=[o.pk for o in outcomes])
    return items.update(status=ItemStatus.WAITING, claim_token=None, lease_expires_at=None)


_OUTCOMES = {
    SUCCEEDED: succeed,
    FAILED: fail,
    RETRY: retry,
    THROTTLED: throttle,
    RELEASED: _back_to_pending,
    SPAWNED: wait_on_child,
}


def _grouped(outcomes: Sequence[ExecutionOutcome], by: Any) -> dict[Any, list[ExecutionOutcome]]:
    groups: dict[Any, list[ExecutionOutcome]] = {}
    for o in outcomes:
        groups.setdefault(by(o), []).append(o)
    return groups


def _write_values(rows: list[ItemClaim], fields: list[str]) -> None:
    """Per-row values for locked rows, in as few statements as the database allows."""
    first = rows[0]
    varying = [f for f in fields if any(getattr(r, f) != getattr(first, f) for r in rows[1:])]
    items = ItemClaim.objects.filter(pk__in=[r.pk for r in rows])
    if not varying:
        items.update(**{f: getattr(first, f) for f in fields})
    else:
        # One UPDATE ... FROM (VALUES ...) on PostgreSQL; Django's CASE WHEN elsewhere.
        constants = {f: getattr(first, f) for f in fields if f not in varying}
        backend().update_rows(ItemClaim, rows, varying, constants)


# --- pending items that nobody holds ------------------------------------------------------


def cancel_pending(items: QuerySet[ItemClaim], reason: str, error_class: str = "Cancelled") -> int:
    """Pending items are cancelled; they hold no slot."""
    return items.filter(status=ItemStatus.PENDING).update(
        status=ItemStatus.CANCELLED, finished_at=DbNow(), error=reason, error_class=error_class
    )


cancel = cancel_pending


def rewait(run_id: int, pks: Sequence[int]) -> int:
    """Failed items whose child run was reopened wait on it again, taking back a run slot.

    The caller holds the run's lock."""
    if not pks:
        return 0
    n = ItemClaim.objects.filter(pk__in=pks, status=ItemStatus.FAILED).update(
        status=ItemStatus.WAITING, finished_at=None, error="", error_class=""
    )
    _adjust(Counter({run_id: n}), Counter(), +1)
    return n


def reopen(items: QuerySet[ItemClaim]) -> int:
    """Failed items (and those a failed-fast run cancelled unrun) go back to pending, afresh."""
    from django.db.models import Q

    return items.filter(
        Q(status=ItemStatus.FAILED)
        | Q(status=ItemStatus.CANCELLED, error_class__in=(FAILED_FAST, FAILURE_THRESHOLD))
    ).update(
        status=ItemStatus.PENDING,
        attempt=1,
        crashes=0,
        next_attempt_at=DbNow(),
        claim_token=None,
        lease_expires_at=None,
        finished_at=None,
        owner="",
        error="",
        error_class="",
    )


# --- the hot path: one finished item hands its slot to the next -------------------------


@dataclass
class HandOver:
    written: bool  # False: this worker had lost the item; its outcome was dropped
    next: ClaimedItem | None  # the item that took over the slot, under the new token
    # A budget refused the next item: record it released, unrun (fanout.spend).
    refused: bool = False


def can_hand_over(outcome: ExecutionOutcome) -> bool:
    """Outcomes the one-statement path takes: successes. A failure goes through settle(),
    which also keeps the attempt's history."""
    return backend().hands_over and outcome.kind == SUCCEEDED


def hand_over(
    run_id: int,
    token: uuid.UUID,
    outcome: ExecutionOutcome,
    owner: str,
    new_token: uuid.UUID,
    lease_seconds: float,
) -> HandOver:
    """Record one outcome and give its slot to the run's next pending item of the same pool.

    One statement, one round trip, one commit: the steady state of a worker. It touches
    neither the run's nor the pool's row unless it gives the slot up, so claimers of one run
    never wait for each other. It takes no item whose worker died (``crashes`` > 0): those are
    claim()'s, which knows the run's crash budget.
    """
    assert outcome.kind == SUCCEEDED, "only successes are handed over (see can_hand_over)"
    row = backend().hand_over(
        _hand_over_args(run_id, token, outcome, owner, new_token, lease_seconds)
    )
    return HandOver(row.done, _next_item(row))


@dataclass
class Handing:
    """One thread's finished item in a group of hand-overs (``hand_over_group``)."""

    token: uuid.UUID
    outcome: ExecutionOutcome
    owner: str
    new_token: uuid.UUID


def hand_over_group(run_id: int, group: Sequence[Handing], lease_seconds: float) -> list[HandOver]:
    """``hand_over`` for several items of one run, in one statement and one commit; one answer
    per item, in ``group``'s order.

    Each outcome is fenced by its own token and each item's next one is picked for its owner,
    exactly as one by one. The statement locks every item first (in id order), and then the
    slots given up lock the run's row and the pools' in name order (the hand-overs go by pool,
    then id): items, run, pools, the order every transaction keeps.
    """
    assert all(h.outcome.kind == SUCCEEDED for h in group), "only successes are handed over"
    order = sorted(range(len(group)), key=lambda n: (group[n].outcome.pool, group[n].outcome.pk))
    ordered = [group[n] for n in order]
    rows = backend().hand_over_group(
        [
            [h.outcome.pk for h in ordered],
            [h.token for h in ordered],
            [
                json.dumps(h.outcome.result) if h.outcome.result is not None else None
                for h in ordered
            ],
            [h.outcome.elapsed for h in ordered],
            run_id,
            [h.outcome.pool for h in ordered],
            [h.owner[:200] for h in ordered],
            [h.new_token for h in ordered],
            lease_seconds,
        ]
    )
    answers: list[HandOver | None] = [None] * len(group)
    for n, row in zip(order, rows, strict=True):
        answers[n] = HandOver(row.done, _next_item(row))
    return [a for a in answers if a is not None]


def _hand_over_args(
    run_id: int,
    token: uuid.UUID,
    outcome: ExecutionOutcome,
    owner: str,
    new_token: uuid.UUID,
    lease_seconds: float,
) -> list[Any]:
    """The hand-over routines' arguments, in their order (the spend one adds its own after)."""
    return [
        outcome.pk,
        token,
        json.dumps(outcome.result) if outcome.result is not None else None,
        outcome.elapsed,
        run_id,
        outcome.pool,
        owner[:200],
        new_token,
        lease_seconds,
    ]


def _next_item(row: HandOverRow) -> ClaimedItem | None:
    if row.pk is None:
        return None
    payload = _loads(row.payload)
    return ClaimedItem(row.pk, row.key, row.index, payload, row.pool, row.attempt, row.started_at)


def hand_over_spending(
    run_id: int,
    token: uuid.UUID,
    outcome: ExecutionOutcome,
    owner: str,
    new_token: uuid.UUID,
    lease_seconds: float,
) -> HandOver:
    """The hand-over, and the spend it moves, in one transaction: the finished item's
    reservation becomes its cost, and the next item reserves its estimate or, if a budget
    refuses it, is to be recorded released without being run (``refused``)."""
    run_budget = spend.run_has_budget(run_id)
    # One round trip where the backend has it (PostgreSQL); else the hand-over, then the spend
    # it moves (spend.after_hand_over), in one transaction.
    answer = backend().hand_over_spending(
        [
            *_hand_over_args(run_id, token, outcome, owner, new_token, lease_seconds),
            json.dumps(outcome.cost) if outcome.cost is not None else None,
            run_budget,
        ]
    )
    if answer is not None:
        row, refused = answer
        return HandOver(row.done, _next_item(row), refused)
    with transaction.atomic():
        done = hand_over(run_id, token, outcome, owner, new_token, lease_seconds)
        if not done.written:
            return done
        next_pk = done.next.pk if done.next is not None else None
        if not spend.after_hand_over(outcome, run_id, next_pk, run_budget):
            done.refused = True
    return done


def _loads(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


# --- items waiting on a child run -----------------------------------------------------------


def child_ended(pk: int, run_id: int, succeeded: bool, result: Any, error: str) -> bool:
    """The item's child run ended: it succeeds with the child's join result, or fails naming
    the child, and gives its run slot back (it held no pool slot while it waited). Only an
    item still waiting is decided, under its row's lock, so whoever comes second does nothing.
    """
    with transaction.atomic():
        waiting = ItemClaim.objects.filter(pk=pk, status=ItemStatus.WAITING)
        if not list(waiting.select_for_update().values_list("pk", flat=True)):
            return False
        if succeeded:
            decided = dict(status=ItemStatus.SUCCEEDED, result=result, error="", error_class="")
        else:
            decided = dict(status=ItemStatus.FAILED, error=error, error_class=CHILD_FAILED)
        ItemClaim.objects.filter(pk=pk).update(finished_at=DbNow(), **decided)
        _adjust(Counter({run_id: 1}), Counter(), -1)
    return True


# --- an item's second phase: its compensation ---------------------------------------------


def compensate(run_id: int) -> int:
    """The run compensates: its items that succeeded (so far) are to be undone."""
    return ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.SUCCEEDED).update(
        status=ItemStatus.COMPENSATING,
        compensation_attempt=0,
        claim_token=None,
        lease_expires_at=None,
        next_attempt_at=DbNow(),
    )


def reopen_compensations(run_id: int) -> int:
    """Compensations that used up their attempts are due again, afresh. The caller holds
    the run's lock."""
    return ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.COMPENSATION_FAILED).update(
        status=ItemStatus.COMPENSATING,
        compensation_attempt=0,
        next_attempt_at=DbNow(),
        error="",
    )


# error_class of a compensation's attempt cut off by a lost worker (in the item's history)
COMPENSATION_LOST = "compensation: WorkerLost"


def _note_compensation_lost(rows: Sequence[dict]) -> None:
    ItemAttempt.objects.bulk_create(
        ItemAttempt(
            item_id=r["pk"],
            attempt=r["compensation_attempt"],
            owner=r["owner"],
            error_class=COMPENSATION_LOST,
            error="its worker died or stopped renewing the lease mid-compensation",
            finished_at=DbNow(),
        )
        for r in rows
    )


def _compensation_slots(run_id: int, rows: Sequence[Mapping[str, Any]], sign: int) -> None:
    """Move the run's compensation budget and the pools' counters: run first, then pools."""
    if not rows:
        return
    BatchRun.objects.filter(pk=run_id).update(compensating=F("compensating") + sign * len(rows))
    _adjust(Counter(), Counter(r["pool"] for r in rows), sign)


def claim_compensations(
    run_id: int, rows: Sequence[dict], owner: str, token: uuid.UUID, lease_seconds: float
) -> int:
    """Due compensations take a slot of the run's compensation budget and of their pool, and
    begin an attempt. The caller holds the run's and the pools' locks."""
    if not rows:
        return 0
    n = ItemClaim.objects.filter(pk__in=[r["pk"] for r in rows]).update(
        compensation_attempt=F("compensation_attempt") + 1,
        **_held(owner, token, lease_seconds),
    )
    _compensation_slots(run_id, rows, +1)
    return n


def _held(owner: str, token: uuid.UUID, lease_seconds: float) -> dict[str, Any]:
    return dict(claim_token=token, owner=owner[:200], lease_expires_at=db_now_plus(lease_seconds))


def retake_compensations(
    rows: Sequence[dict], owner: str, token: uuid.UUID, lease_seconds: float
) -> int:
    """Compensations whose worker died go to a new owner: they keep their slots and their
    attempt (a crash is not the compensation's fault), and the crash joins their history."""
    if not rows:
        return 0
    _note_compensation_lost(rows)
    return ItemClaim.objects.filter(pk__in=[r["pk"] for r in rows]).update(
        **_held(owner, token, lease_seconds)
    )


def compensation_lost(run_id: int, rows: Sequence[dict], crash_budget: int) -> int:
    """Compensations whose workers kept dying (more than ``crash_budget`` in one attempt)
    fail for good and give their slots back."""
    if not rows:
        return 0
    _note_compensation_lost(rows)
    n = ItemClaim.objects.filter(pk__in=[r["pk"] for r in rows]).update(
        status=ItemStatus.COMPENSATION_FAILED,
        claim_token=None,
        lease_expires_at=None,
        error=f"WorkerLost: {crash_budget + 1} workers died running its compensation "
        f"(crash_budget={crash_budget})",
    )
    _compensation_slots(run_id, rows, -1)
    return n


def compensated(run_id: int, token: uuid.UUID, outcomes: Sequence[ExecutionOutcome]) -> list[int]:
    """Write the outcomes of compensations still held under ``token``; return the pks written.

    Succeeded: the item is compensated. A permanent error, or attempts used up: its
    compensation failed (it stays visible; an operator can retry it). A retry waits out its
    backoff; Throttled (or a release) waits with no attempt used. Each gives its slots back.
    """
    with transaction.atomic(savepoint=False):
        pks = [o.pk for o in outcomes]
        held = list(
            ItemClaim.objects.filter(pk__in=pks, claim_token=token, status=ItemStatus.COMPENSATING)
            .select_for_update()
            .values("pk", "pool", "owner", "compensation_attempt")
        )
        by_pk = {r["pk"]: r for r in held}
        mine = [o for o in outcomes if o.pk in by_pk]
        for o in mine:
            _compensation_outcome(o, by_pk[o.pk])
        _compensation_slots(run_id, held, -1)
    return [o.pk for o in mine]


def _compensation_outcome(o: ExecutionOutcome, row: Mapping[str, Any]) -> None:
    item = ItemClaim.objects.filter(pk=o.pk)
    free = dict(claim_token=None, lease_expires_at=None)
    if o.kind in (FAILED, RETRY):
        ItemAttempt.objects.create(
            item_id=o.pk,
            attempt=row["compensation_attempt"],
            owner=row["owner"],
            finished_at=DbNow(),
            error_class=f"compensation: {o.error_class}",
            error=o.error,
        )
    if o.kind == SUCCEEDED:
        item.update(status=ItemStatus.COMPENSATED, **free)
    elif o.kind == FAILED:
        item.update(status=ItemStatus.COMPENSATION_FAILED, error=o.error, **free)
    elif o.kind == RETRY:
        item.update(next_attempt_at=db_now_plus(o.retry_after), **free)
    else:  # THROTTLED, RELEASED: waiting is not a failure, and uses no attempt
        item.update(
            compensation_attempt=F("compensation_attempt") - 1,
            next_attempt_at=db_now_plus(o.retry_after),
            **free,
        )
