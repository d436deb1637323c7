"""A model of item and run transitions: Hypothesis drives fanout's own functions in random orders.

Simulated workers claim (``claim.claim``), run handlers (``call.execute``) that succeed, raise,
refuse for good, are throttled or spawn a child run, and record through the three paths a drain
takes (``hand_over``, a claim that records first, ``record`` alone). They die (their leases forced
into the past), stop gracefully (``actions.release``), compensate (``compensate.claim/record``).
Operators cancel (with or without compensation), retry failed items, pause, resume, lower and
raise pool limits; writers die mid-work-list; supervisors sweep; time passes by whole tokens of
the rated pool. Two or three runs share two pools, one of them rate-limited with a small burst.

After every step the invariants of DESIGN.md are checked on the rows: every run's and pool's
counters equal the rows holding their slots (12), no limit is newly exceeded (2), no bucket is
negative and the rated pool admits no more than the model's own bucket allows (3), a recorded
success never goes back (5), every open run has something that moves it (13). At the end of
every example nobody watches any more: live workers finish, then only supervisor sweeps and
fresh workers' drains run, and every run must end (13, 9).

HYPOTHESIS_PROFILE picks the settings: ``ci`` (the default: deterministic, a few minutes),
``search`` (the same examples unshrunk: how many it takes to find a reverted fix) or ``long``
(random, far more examples, for local runs).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fanout import compensate, supervise
from fanout.actions import cancel_run, check_retryable, release, retry_failed
from fanout.call import execute
from fanout.claim import _expired_checked, claim
from fanout.clock import db_now, db_now_plus
from fanout.definition import FanOut, Item, get_definition
from fanout.errors import FanoutError, PermanentError, Throttled
from fanout.join import maybe_join, settle_up
from fanout.lease import LeaseKeeper
from fanout.materialize import create_run, materialize
from fanout.models import (
    TERMINAL_RUN_STATUSES,
    BatchRun,
    CapacityPool,
    ItemClaim,
    ItemStatus,
    RunStatus,
)
from fanout.pools import refill
from fanout.record import record
from fanout.transitions import SPAWNED, ClaimedItem, can_hand_over, hand_over
from fanout.worker import Drain, _expired_asked, _gate
from tests.rq.conftest import redis, redis_url  # noqa: F401 - child runs are dispatched to RQ

pytestmark = pytest.mark.django_db(transaction=True)

# --- the definitions the model runs -----------------------------------------------------

POOLS = ("model-a", "model-b")
RATED = "model-b"  # the pool with a token bucket
PERIOD = 3600.0  # its rate's period: tokens come back only when the model lets time pass
LEASE = 300.0  # leases never run out by themselves here: a death forces them into the past

SUCCEED, RAISE, PERMANENT, THROTTLE, SPAWN = "succeed", "raise", "permanent", "throttle", "spawn"
# What the next execution of an item does, by (run id, key); absent: it succeeds.
ACTIONS: dict[tuple[int, str], str] = {}
# Compensations that raise on their next call, by (run id, key).
FAILING_UNDO: set[tuple[int, str]] = set()
# Runs (by their "tag" param) whose first writer dies after writing this many elements.
DYING_WRITERS: dict[str, int] = {}


class WriterDied(BaseException):
    """A writer killed mid-work-list: like a SIGKILL, no ``except Exception`` tidies up after it."""


def elements(params: dict[str, Any]) -> Any:
    die_after = DYING_WRITERS.pop(params["tag"], None)
    for i in range(params["n"]):
        if i == die_after:
            raise WriterDied
        yield i


def pool_of(item: Item) -> str:
    """Items spread over the shared pools as the run's ``pools`` param says ("abba...")."""
    return f"model-{item.params['pools'][item.index]}"


def handle(item: Item) -> Any:
    action = ACTIONS.pop((item.run_id, item.key), SUCCEED)
    if action == RAISE:
        raise RuntimeError("the provider failed")
    if action == PERMANENT:
        raise PermanentError("the provider refused for good")
    if action == THROTTLE:
        raise Throttled(0)
    if action == SPAWN:
        return item.spawn("model_child", {"n": 2, "pools": "ab", "tag": f"{item.run_id}"})
    return {"i": item.index}


def undo(item: Item, result: Any) -> None:
    if (item.run_id, item.key) in FAILING_UNDO:
        FAILING_UNDO.discard((item.run_id, item.key))
        raise RuntimeError("the undo failed")


common: dict[str, Any] = dict(
    over=elements,
    key=lambda i: f"i{i}",
    payload=lambda i: {"i": i},
    pool=pool_of,
    do=handle,
    lease_seconds=LEASE,
    retry_backoff=0.001,
    max_attempts=2,
)
FanOut(
    "model_saga",
    failure_policy="collect",
    crash_budget=1,
    compensate=undo,
    compensate_order="parallel",
    compensate_max_parallel=2,
    **common,
)
FanOut("model_plain", failure_policy="tolerate", crash_budget=0, **common)
FanOut("model_child", failure_policy="fail_fast", crash_budget=1, **common)
PARENTS = ("model_saga", "model_plain")

# --- the simulated fleet ------------------------------------------------------------------


@dataclass
class Worker:
    """A simulated worker's batch: what it claimed, under which token."""

    owner: str
    run_id: int
    token: uuid.UUID
    items: list[ClaimedItem]
    failure_policy: str


@dataclass
class Bucket:
    """The rated pool's token bucket as the model keeps it, from what it saw admitted.

    DESIGN.md 3 bounds admissions in any window of T seconds by burst + rate x T: tokens start
    at the burst, each admission takes one, time gives ``rate`` back per period up to the burst.
    """

    burst: int
    rate: int
    tokens: float

    def refill(self, seconds: float) -> None:
        self.tokens = min(float(self.burst), self.tokens + seconds * self.rate / PERIOD)


# The wall clock also refills the rows' bucket, by rate x (seconds an example takes) / PERIOD:
# far less than this. One admission too many is a whole token.
BUCKET_SLACK = 0.25


def sweep() -> None:
    """A supervisor's round, its period over: every open run is due for it."""
    BatchRun.objects.update(tended_until=None)
    supervise.sweep()


def force_expired(token: uuid.UUID) -> None:
    """A worker died: its leases run out now, by the database's clock."""
    ItemClaim.objects.filter(claim_token=token).update(lease_expires_at=db_now_plus(-1))


def forget_process_state() -> None:
    """Each claim comes from a process of its own: no cached "looked for expired leases"."""
    _expired_checked.clear()
    _expired_asked.clear()
    _gate.clear()


OPEN = ("pending", "running", "waiting")
SUCCESS_STAYS = (
    ItemStatus.SUCCEEDED,
    ItemStatus.COMPENSATING,
    ItemStatus.COMPENSATED,
    ItemStatus.COMPENSATION_FAILED,
)


def describe() -> str:
    """Every run, pool and item, for a failure's message."""
    lines = []
    for run in BatchRun.objects.order_by("pk"):
        lines.append(
            f"run {run.pk} {run.definition} {run.status} in_flight={run.in_flight} "
            f"max_parallel={run.max_parallel} compensating={run.compensating} "
            f"parent_item={run.parent_item_id} writer_lease={run.materialize_lease_expires_at}"
        )
        for i in ItemClaim.objects.filter(run=run).order_by("index"):
            lines.append(
                f"  {i.pk} {i.key} {i.pool} {i.status} attempt={i.attempt} crashes={i.crashes} "
                f"token={'yes' if i.claim_token else 'no'} lease={i.lease_expires_at}"
            )
    for pool in CapacityPool.objects.order_by("name"):
        lines.append(
            f"pool {pool.name} in_flight={pool.in_flight} max={pool.max_concurrency} "
            f"tokens={pool.tokens} paused={pool.paused}"
        )
    return "\n".join(lines)


class Transitions(RuleBasedStateMachine):
    """Two or three runs over two shared pools, their workers, operators and supervisors."""

    def __init__(self) -> None:
        super().__init__()
        forget_process_state()
        ACTIONS.clear()
        FAILING_UNDO.clear()
        DYING_WRITERS.clear()
        # Rows of an earlier example: the test database is shared by every example.
        BatchRun.objects.filter(parent_item__isnull=False).delete()
        BatchRun.objects.all().delete()
        CapacityPool.objects.all().delete()
        self.workers: list[Worker] = []
        self.runs: list[int] = []
        self.parents = 0
        self.seen_succeeded: set[int] = set()
        self.held_before: dict[tuple[str, Any], int] = {}
        self.started = 0
        self.bucket = Bucket(1, 1, 1.0)
        Transitions.examples += 1

    examples = 0  # examples begun in this process: a failure says after how many

    # --- set-up -------------------------------------------------------------------------

    @initialize(
        limit_a=st.integers(1, 3),
        limit_b=st.integers(1, 3),
        rate_b=st.integers(1, 3),
        burst_b=st.integers(1, 3),
        first=st.tuples(st.sampled_from(PARENTS), st.text("ab", min_size=1, max_size=8)),
        second=st.tuples(st.sampled_from(PARENTS), st.text("ab", min_size=1, max_size=8)),
        parallel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    )
    def pools_and_runs(
        self,
        limit_a: int,
        limit_b: int,
        rate_b: int,
        burst_b: int,
        first: tuple[str, str],
        second: tuple[str, str],
        parallel: tuple[int, int],
    ) -> None:
        CapacityPool.objects.create(name="model-a", max_concurrency=limit_a)
        # A rate of a few per hour and a small burst: its tokens come back only when the model
        # lets time pass, so a claim of several items often finds fewer tokens than items.
        CapacityPool.objects.create(
            name=RATED,
            max_concurrency=limit_b,
            rate_count=rate_b,
            rate_period=PERIOD,
            burst=burst_b,
        )
        self.bucket = Bucket(burst_b, rate_b, float(burst_b))
        for (name, pools), most in zip((first, second), parallel, strict=True):
            self._start(name, pools, most)

    def _start(self, name: str, pools: str, most: int, dies_after: int | None = None) -> int:
        definition = get_definition(name)
        self.started += 1
        tag = f"r{self.started}"
        params = {"n": len(pools), "pools": pools, "tag": tag}
        run, _ = create_run(definition, params, f"model-{tag}", most, executor="rq")
        self.runs.append(run.pk)
        self.parents += 1
        if dies_after is not None:
            DYING_WRITERS[tag] = dies_after
            try:
                materialize(run, definition)
            except WriterDied:
                # Its lease runs out now: the writer is gone for good.
                BatchRun.objects.filter(pk=run.pk).update(
                    materialize_lease_expires_at=db_now_plus(-1)
                )
            return run.pk
        materialize(run, definition)
        return run.pk

    @precondition(lambda self: self.parents < 3)
    @rule(
        name=st.sampled_from(PARENTS),
        pools=st.text("ab", min_size=2, max_size=8),
        written=st.integers(1, 7),
        most=st.integers(1, 3),
    )
    def a_writer_dies_mid_work_list(self, name: str, pools: str, written: int, most: int) -> None:
        self._start(name, pools, most, dies_after=min(written, len(pools) - 1))

    # --- workers ------------------------------------------------------------------------

    def _run(self, pick: int) -> BatchRun:
        return BatchRun.objects.get(pk=self.runs[pick % len(self.runs)])

    def _definition(self, run_id: int) -> FanOut:
        return get_definition(BatchRun.objects.get(pk=run_id).definition)

    @rule(pick=st.integers(0, 8), limit=st.integers(1, 3), dies=st.booleans())
    def a_worker_claims(self, pick: int, limit: int, dies: bool) -> None:
        """A worker of its own process claims; it may die before running what it took."""
        run = self._run(pick)
        owner, result = self._take(run.pk, limit)
        if dies and result.token is not None:
            force_expired(result.token)
            return
        self._claimed(run.pk, owner, result)

    @precondition(lambda self: self.workers)
    @rule(pick=st.integers(0, 8), later=st.integers(0, 2), limit=st.integers(2, 3))
    def a_worker_dies_and_a_successor_claims_a_batch(
        self, pick: int, later: int, limit: int
    ) -> None:
        """A worker dies; once its leases ran out (``later`` tokens of time), another worker of
        the run claims several items in one call: the dead one's items and fresh ones together."""
        worker = self.workers.pop(pick % len(self.workers))
        force_expired(worker.token)
        if later:
            self._time_passes(later)
        owner, result = self._take(worker.run_id, limit)
        self._claimed(worker.run_id, owner, result)

    def _take(self, run_id: int, limit: int) -> tuple[str, Any]:
        """A worker of its own process claims up to ``limit`` items of the run."""
        definition = self._definition(run_id)
        forget_process_state()
        owner = f"model:w{uuid.uuid4().hex[:6]}"
        result = claim(
            run_id,
            owner,
            limit,
            definition.lease_seconds,
            definition.crash_budget,
            definition.static_pool,
        )
        self._admitted(result.items)
        return owner, result

    def _admitted(self, items: list[ClaimedItem]) -> None:
        """Admissions the model saw: each into the rated pool takes a token of its bucket."""
        self.bucket.tokens -= sum(1 for item in items if item.pool == RATED)

    def _claimed(self, run_id: int, owner: str, result: Any) -> None:
        """What a drain does with a claim's answer (worker.Drain._loop)."""
        if result.items:
            self.workers.append(
                Worker(owner, run_id, result.token, result.items, result.failure_policy)
            )
            return
        if result.crashed_out:
            maybe_join(run_id)
        elif result.run_open and not ItemClaim.objects.filter(run_id=run_id).unfinished().exists():
            maybe_join(run_id)

    @precondition(lambda self: self.workers)
    @rule(
        pick=st.integers(0, 8),
        actions=st.lists(
            st.sampled_from((SUCCEED, RAISE, PERMANENT, THROTTLE, SPAWN)), min_size=3, max_size=3
        ),
        path=st.sampled_from(("hand_over", "claim", "record")),
        limit=st.integers(1, 3),
    )
    def a_worker_finishes_its_items(
        self, pick: int, actions: list[str], path: str, limit: int
    ) -> None:
        worker = self.workers.pop(pick % len(self.workers))
        run = BatchRun.objects.get(pk=worker.run_id)
        definition = get_definition(run.definition)
        for item, action in zip(worker.items, actions, strict=False):
            if action == SPAWN and run.parent_item_id is not None:
                action = SUCCEED  # one level of children is enough
            ACTIONS[(run.pk, item.key)] = action
        outcomes = [execute(definition, run.pk, run.params, item) for item in worker.items]
        if path == "hand_over" and len(outcomes) == 1 and can_hand_over(outcomes[0]):
            new_token = uuid.uuid4()
            done = hand_over(run.pk, worker.token, outcomes[0], worker.owner, new_token, LEASE)
            if done.next is not None:
                self._admitted([done.next])
                self.workers.append(
                    Worker(worker.owner, run.pk, new_token, [done.next], worker.failure_policy)
                )
            elif done.written:
                maybe_join(run.pk)
            return
        recording = partial(
            record, run.pk, worker.token, outcomes, worker.failure_policy, definition
        )
        if path == "claim":
            forget_process_state()
            result = claim(
                run.pk,
                worker.owner,
                limit,
                definition.lease_seconds,
                definition.crash_budget,
                definition.static_pool,
                before=recording,
            )
            self._admitted(result.items)
            recorded = result.before
        else:
            result, recorded = None, recording()
        for o in outcomes:
            if o.kind == SPAWNED:
                child = o.result["child_run"]
                if child not in self.runs:
                    self.runs.append(child)
                settle_up(child)
        if result is not None and result.items:
            self._claimed(run.pk, worker.owner, result)
        elif recorded.terminal:
            maybe_join(run.pk)

    @precondition(lambda self: self.workers)
    @rule(pick=st.integers(0, 8))
    def a_worker_dies(self, pick: int) -> None:
        worker = self.workers.pop(pick % len(self.workers))
        force_expired(worker.token)

    @precondition(lambda self: self.workers)
    @rule(pick=st.integers(0, 8))
    def a_worker_stops_gracefully(self, pick: int) -> None:
        worker = self.workers.pop(pick % len(self.workers))
        release({item.pk: worker.token for item in worker.items})

    @rule(pick=st.integers(0, 8), fails=st.booleans(), dies=st.booleans())
    def a_worker_compensates(self, pick: int, fails: bool, dies: bool) -> None:
        run = self._run(pick)
        if run.status != RunStatus.COMPENSATING:
            return
        definition = get_definition(run.definition)
        owner = f"model:c{uuid.uuid4().hex[:6]}"
        taken = compensate.claim(run.pk, definition, owner)
        if taken.token is None:
            compensate.finish(run.pk)
            return
        self._admitted([item for item, _ in taken.items])
        if dies:
            force_expired(taken.token)
            return
        for item, result in taken.items:
            if fails:
                FAILING_UNDO.add((run.pk, item.key))
            outcome = compensate.execute(definition, run, item, result)
            compensate.record(run.pk, definition, taken.token, item, outcome)
        compensate.finish(run.pk)

    # --- operators, supervisors, time -----------------------------------------------------

    @rule(pick=st.integers(0, 8), action=st.sampled_from(("cancel", "compensate", "retry")))
    def an_operator_acts_on_a_run(self, pick: int, action: str) -> None:
        """Cancel it, cancel it to compensate, or retry its failed items (if it may be)."""
        run = self._run(pick)
        try:
            if action == "retry":
                check_retryable(run)
                retry_failed(run)
            else:
                undo_it = action == "compensate"
                cancel_run(run, compensate=undo_it and run.definition == "model_saga")
        except FanoutError:
            pass  # refused (it ended, or may not be reopened): nothing changed

    @rule(
        pool=st.sampled_from(POOLS),
        action=st.sampled_from(("limit", "pause", "resume")),
        limit=st.integers(1, 3),
    )
    def an_operator_changes_a_pool(self, pool: str, action: str, limit: int) -> None:
        """Lower or raise its limit, pause it or resume it, as the admin does."""
        pools = CapacityPool.objects.filter(name=pool)
        if action == "limit":
            pools.update(max_concurrency=limit)
        else:
            pools.update(paused=action == "pause")

    @rule(tokens=st.integers(1, 3))
    def time_passes(self, tokens: int) -> None:
        """Long enough for the rated pool to earn ``tokens``; a supervisor sweeps every open run."""
        self._time_passes(tokens)
        sweep()

    def _time_passes(self, tokens: int) -> None:
        """The test's clock moves on: the buckets' last refill is that much further back."""
        seconds = tokens * PERIOD / self.bucket.rate
        CapacityPool.objects.filter(tokens_at__isnull=False).update(
            tokens_at=F("tokens_at") - timedelta(seconds=seconds)
        )
        self.bucket.refill(seconds)

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def the_invariants_hold(self) -> None:
        """Read every row once (three queries), then check each invariant on them."""
        rows = Rows()
        try:
            self.counters_are_the_rows(rows)
            self.no_limit_is_exceeded(rows)
            self.no_bucket_is_negative(rows)
            self.admissions_stay_within_the_bucket(rows)
            self.a_recorded_success_never_goes_back(rows)
            self.every_open_run_has_something_that_moves_it(rows)
        except AssertionError as exc:
            seen = f"(example {Transitions.examples} in this process)"
            raise AssertionError(f"{exc} {seen}\n{describe()}") from None

    def counters_are_the_rows(self, rows: Rows) -> None:
        """DESIGN.md 12: each run's and pool's counters equal the rows that hold their slots."""
        for run in rows.runs:
            held = rows.run_slots[run["pk"]]
            assert run["in_flight"] == held, (
                f"run {run['pk']}: in_flight {run['in_flight']}, its rows hold {held}"
            )
            comps = rows.run_compensations[run["pk"]]
            assert run["compensating"] == comps, (
                f"run {run['pk']}: compensating {run['compensating']}, its rows hold {comps}"
            )
        for pool in rows.pools:
            held = rows.pool_slots[pool["name"]]
            assert pool["in_flight"] == held, (
                f"pool {pool['name']}: in_flight {pool['in_flight']}, its rows hold {held}"
            )

    def no_limit_is_exceeded(self, rows: Rows) -> None:
        """DESIGN.md 2: no step adds a slot to a run at max_parallel or a pool at its limit."""
        held = {("run", pk): n for pk, n in rows.run_slots.items()}
        held.update({("pool", name): n for name, n in rows.pool_slots.items()})
        limits = {("run", r["pk"]): r["max_parallel"] for r in rows.runs}
        limits.update({("pool", p["name"]): p["max_concurrency"] for p in rows.pools})
        for what, n in held.items():
            # A lowered limit may leave more running than it allows: they finish; none is added.
            grew = n > self.held_before.get(what, 0)
            assert not (grew and n > limits[what]), (
                f"{what[0]} {what[1]}: {n} hold slots, its limit is {limits[what]}"
            )
        self.held_before = held

    def no_bucket_is_negative(self, rows: Rows) -> None:
        """DESIGN.md 3: a pool's rate tokens are never spent below zero."""
        for pool in rows.pools:
            tokens = pool["tokens"]
            assert tokens is None or tokens >= -1e-9, f"pool {pool['name']}: {tokens} rate tokens"

    def admissions_stay_within_the_bucket(self, rows: Rows) -> None:
        """DESIGN.md 3, counted by the model: the rated pool admitted no more than burst + rate
        x T allows, and its row holds the tokens the model's own bucket holds."""
        assert self.bucket.tokens >= -BUCKET_SLACK, (
            f"pool {RATED}: {-self.bucket.tokens:.2f} admissions beyond burst + rate x T"
        )
        pool = CapacityPool(**next(p for p in rows.pools if p["name"] == RATED))
        refill(pool, db_now())
        assert pool.tokens is not None and abs(pool.tokens - self.bucket.tokens) <= BUCKET_SLACK, (
            f"pool {RATED}: its row holds {pool.tokens:.2f} tokens, the model's bucket "
            f"{self.bucket.tokens:.2f}"
        )

    def a_recorded_success_never_goes_back(self, rows: Rows) -> None:
        """DESIGN.md 5: a succeeded item stays succeeded (or is compensated), never runs again."""
        back = {
            i["pk"]: i["status"]
            for i in rows.items
            if i["pk"] in self.seen_succeeded and i["status"] not in SUCCESS_STAYS
        }
        assert not back, f"succeeded items went back: {back}"
        self.seen_succeeded |= {i["pk"] for i in rows.items if i["status"] == "succeeded"}

    def every_open_run_has_something_that_moves_it(self, rows: Rows) -> None:
        """DESIGN.md 13, as far as the rows show it; the end of each example proves the rest."""
        for run in rows.runs:
            if run["status"] not in TERMINAL_RUN_STATUSES:
                assert rows.moves(run), f"run {run['pk']} ({run['status']}) has nothing to move it"

    # --- nobody watching ----------------------------------------------------------------

    def teardown(self) -> None:
        """Live workers finish; then only supervisors and fresh drains run: every run ends."""
        if not self.runs:
            return
        ACTIONS.clear()
        for worker in self.workers:
            definition = self._definition(worker.run_id)
            run = BatchRun.objects.get(pk=worker.run_id)
            outcomes = [execute(definition, run.pk, run.params, i) for i in worker.items]
            record(run.pk, worker.token, outcomes, worker.failure_policy, definition)
            maybe_join(run.pk)
        self.workers = []
        FAILING_UNDO.clear()
        # Operators leave the pools admitting: only what nobody watches is under test now.
        CapacityPool.objects.update(paused=False, rate_count=None, tokens=None, tokens_at=None)
        for _ in range(ROUNDS):
            open_runs = list(
                BatchRun.objects.exclude(status__in=TERMINAL_RUN_STATUSES)
                .order_by("-pk")
                .values_list("pk", flat=True)
            )
            if not open_runs:
                return
            before = snapshot()
            sweep()
            for run_id in open_runs:
                drain(run_id)
            if snapshot() == before:
                break  # a round of supervisors and drains moved nothing: nor will the next
        stuck = BatchRun.objects.exclude(status__in=TERMINAL_RUN_STATUSES)
        assert not stuck.exists(), (
            f"runs still open with nobody watching: {list(stuck.values_list('pk', 'status'))} "
            f"(example {Transitions.examples} in this process)\n"
            f"{describe()}"
        )


ROUNDS = 6  # rounds of supervisors and drains; each run ends in one or two of them
DRAIN_SECONDS = 1.0


def drain(run_id: int) -> str:
    """A fresh worker's drain of the run (worker.Drain), until it ends or idles."""
    forget_process_state()
    run = BatchRun.objects.get(pk=run_id)
    return Drain(
        run_id,
        get_definition(run.definition),
        LeaseKeeper(LEASE),
        run.params,
        owner=f"model:d{uuid.uuid4().hex[:6]}",
        deadline=time.monotonic() + DRAIN_SECONDS,
        idle_exit=0.1,
    )()


def snapshot() -> tuple[list[tuple], list[tuple]]:
    """Everything a round of recovery could change."""
    runs = BatchRun.objects.order_by("pk").values_list("pk", "status", "in_flight", "compensating")
    items = ItemClaim.objects.order_by("pk").values_list(
        "pk", "status", "claim_token", "attempt", "crashes", "compensation_attempt"
    )
    return list(runs), list(items)


class Rows:
    """Every run, pool and item, read once after a step, and the slots they hold."""

    def __init__(self) -> None:
        self.runs = list(
            BatchRun.objects.values(
                "pk",
                "status",
                "in_flight",
                "compensating",
                "max_parallel",
                "materialize_token",
                "join_token",
                "parent_item_id",
            )
        )
        self.pools = list(
            CapacityPool.objects.values(
                "name",
                "in_flight",
                "max_concurrency",
                "tokens",
                "tokens_at",
                "rate_count",
                "rate_period",
                "burst",
            )
        )
        self.items = list(ItemClaim.objects.values("pk", "run_id", "pool", "status", "claim_token"))
        self.run_slots: Counter[int] = Counter()
        self.run_compensations: Counter[int] = Counter()
        self.pool_slots: Counter[str] = Counter()
        for i in self.items:
            leased = i["claim_token"] is not None
            # What ItemClaim.holding_run_slots() and .running() select, and the compensations
            # that compensate.claim admitted into their pool and the run's own budget.
            if i["status"] in (ItemStatus.RUNNING, ItemStatus.WAITING):
                self.run_slots[i["run_id"]] += 1
            if i["status"] == ItemStatus.RUNNING or (i["status"] == "compensating" and leased):
                if i["pool"]:
                    self.pool_slots[i["pool"]] += 1
            if i["status"] == ItemStatus.COMPENSATING and leased:
                self.run_compensations[i["run_id"]] += 1

    def moves(self, run: dict[str, Any]) -> bool:
        """Whether something will move this open run, in the terms of the code's predicates.

        A pending run has a writer (live, or dead: then a worker must finish its work list). A
        joining run has its join taken. A running or compensating run has nothing unfinished
        (a join, or the end of its compensation, is due), or an unfinished item that is pending
        or running: ``claimable()`` (due, or its lease ran out), ``in_flight()`` (a live lease)
        or a retry not due yet cover every such item. An item waiting has its child run.
        """
        if run["status"] == RunStatus.PENDING:
            return run["materialize_token"] is not None
        if run["status"] == RunStatus.JOINING:
            return run["join_token"] is not None
        unfinished = [i for i in self.items if i["run_id"] == run["pk"] and i["status"] in OPEN]
        if any(i["status"] != ItemStatus.WAITING for i in unfinished):
            return True
        parents = {r["parent_item_id"] for r in self.runs}
        return all(i["pk"] in parents for i in unfinished)


def profile() -> hypothesis_settings:
    """HYPOTHESIS_PROFILE's settings; ``ci`` on MariaDB/MySQL is the shorter ``ci-mysql``."""
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if name == "ci" and connection.vendor == "mysql":
        name = "ci-mysql"
    return hypothesis_settings.get_profile(name)


_slow = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# CI: deterministic data, though the paths taken depend on timing (drains' deadlines), so how
# soon a bug is found varies between passes. With one fix reverted at a time, the first 300
# examples found each of findings 1-4 of issue 20 (docs/guarantees.md says after how many);
# MariaDB runs the same rules on fewer examples, to prove its SQL paths (the hand-over
# procedure, its locks) rather than to search.
hypothesis_settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=_slow,
    print_blob=True,
)
hypothesis_settings.register_profile(
    "ci-mysql", hypothesis_settings.get_profile("ci"), max_examples=60
)
# The ci examples, not shrunk: a failure's message says after how many examples it was found
# (HYPOTHESIS_PROFILE=search, one finding's fix reverted: the table in docs/guarantees.md).
hypothesis_settings.register_profile(
    "search", hypothesis_settings.get_profile("ci"), phases=(Phase.explicit, Phase.generate)
)
# Local: random and far longer (HYPOTHESIS_PROFILE=long).
hypothesis_settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=_slow,
    print_blob=True,
)


def test_every_transition_keeps_the_counters_limits_buckets_and_runs_moving(
    settings: Any,
) -> None:
    settings.FANOUT_MATERIALIZE_CHUNK = 2  # a dying writer leaves part of its list written
    settings.FANOUT_IDLE_MAX_SECONDS = 0.02
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the model runs on PostgreSQL and MariaDB/MySQL")
    run_state_machine_as_test(Transitions, settings=profile())
