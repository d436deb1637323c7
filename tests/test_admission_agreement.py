"""The admission rule has one definition, in Python (fanout.pools), and the SQL fast paths
implement it: the same random states of runs, pools and items, written to real rows, get the
same decision from the rule and from every hand-over routine of the database under test."""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from fanout.clock import db_now
from fanout.models import (
    BatchRun,
    CapacityPool,
    ItemClaim,
    ItemStatus,
    RunStatus,
    SpendAccount,
)
from fanout.pools import ItemState, PoolState, RunState, hands_over, next_in_slot
from fanout.spend import _ACCOUNT_FIELDS, Gate, _Account, _roll
from fanout.transitions import SUCCEEDED, ExecutionOutcome, hand_over, hand_over_spending

pytestmark = pytest.mark.django_db(transaction=True)

SEED = 20261203
EXAMPLES = 200
LEASE = 30.0
# Times in a state lie a minute or more from the clock, so that the few milliseconds between
# reading the clock for the rule and the routine's own reading cannot change a decision.
AGO, AHEAD = -60.0, 60.0


@dataclass
class PoolSpec:
    max_concurrency: int
    in_flight: int
    paused: bool
    backoff: float | None  # seconds from now
    rate_count: int | None
    tokens: float | None
    waiters: dict[str, float]  # "own" / "other": seconds from now


@dataclass
class ItemSpec:
    pool: str  # "a", "b" or ""
    status: str
    crashes: int
    due: float  # next_attempt_at, seconds from now


@dataclass
class State:
    """One random state: the run whose item finished, its pools and items, another run."""

    status: str
    max_parallel: int
    in_flight: int
    pool: str  # the finished item's: "a" or ""
    pools: dict[str, PoolSpec]
    items: list[ItemSpec]
    others: dict[str, int] = field(default_factory=dict)  # the other run's slots per pool


def random_pool(rng: random.Random) -> PoolSpec:
    # Each refusal is likely enough to be seen, and rare enough that many states admit.
    rated = rng.random() < 0.2
    waiters = {}
    for who in ("own", "other"):
        if rng.random() < 0.3:
            waiters[who] = rng.choice((AGO, AHEAD))
    return PoolSpec(
        max_concurrency=rng.randint(0, 5),
        in_flight=rng.randint(1, 4),
        paused=rng.random() < 0.1,
        backoff=rng.choice((None, None, None, AGO, AHEAD)),
        rate_count=rng.randint(1, 10) if rated else None,
        tokens=rng.choice((0.0, 0.5, 1.0, 3.0)) if rated else None,
        waiters=waiters,
    )


def random_state(rng: random.Random) -> State:
    items = [
        ItemSpec(
            pool=rng.choice(("a", "a", "b", "")),
            status=rng.choice(("pending", "pending", "pending", "succeeded", "running")),
            crashes=rng.choice((0, 0, 0, 1)),
            due=rng.choice((AGO, AGO, AHEAD)),
        )
        for _ in range(rng.randint(0, 5))
    ]
    return State(
        status=rng.choice((RunStatus.RUNNING,) * 12 + (RunStatus.CANCELLED, RunStatus.JOINING)),
        max_parallel=rng.randint(1, 5),
        in_flight=rng.randint(1, 4),
        pool=rng.choice(("a", "a", "a", "")),
        pools={"a": random_pool(rng), "b": random_pool(rng)},
        items=items,
        others={name: rng.choice((0, 0, 1, 2)) for name in ("a", "b")},
    )


@dataclass
class Written:
    run: BatchRun
    other: BatchRun
    finished: ItemClaim
    token: uuid.UUID
    names: dict[str, str]  # "a" -> the pool's row name
    items: list[ItemClaim]


def write(state: State, tag: str) -> Written:
    """The state as rows, its times counted from the database's clock."""
    now = db_now()

    def at(seconds: float) -> datetime:
        return now + timedelta(seconds=seconds)

    def new_run(status: str, max_parallel: int, in_flight: int, name: str) -> BatchRun:
        return BatchRun.objects.create(
            definition="agreement",
            run_key=f"agreement-{tag}-{name}",
            status=status,
            max_parallel=max_parallel,
            in_flight=in_flight,
            failure_policy="collect",
            join_mode="none",
        )

    run = new_run(state.status, state.max_parallel, state.in_flight, "run")
    other = new_run(RunStatus.RUNNING, 10, sum(state.others.values()), "other")
    names = {short: f"agreement-{tag}-{short}" for short in state.pools}
    whose = {"own": str(run.pk), "other": str(other.pk)}
    for short, spec in state.pools.items():
        CapacityPool.objects.create(
            name=names[short],
            max_concurrency=spec.max_concurrency,
            in_flight=spec.in_flight,
            paused=spec.paused,
            backoff_until=at(spec.backoff) if spec.backoff is not None else None,
            rate_count=spec.rate_count,
            rate_period=1.0,
            tokens=spec.tokens,
            tokens_at=now if spec.tokens is not None else None,
            waiters={whose[w]: at(s).timestamp() for w, s in spec.waiters.items()},
        )
    token = uuid.uuid4()
    pool_of = {**names, "": ""}
    finished = ItemClaim.objects.create(
        run=run,
        key="finished",
        index=0,
        pool=pool_of[state.pool],
        status=ItemStatus.RUNNING,
        owner="agreement",
        claim_token=token,
        lease_expires_at=at(LEASE),
        started_at=at(-1),
        next_attempt_at=at(AGO),
    )
    items = []
    for index, spec in enumerate(state.items, start=1):
        running = spec.status == "running"
        items.append(
            ItemClaim.objects.create(
                run=run,
                key=f"item-{index}",
                index=index,
                pool=pool_of[spec.pool],
                status=spec.status,
                crashes=spec.crashes,
                next_attempt_at=at(spec.due),
                owner="someone" if running else "",
                claim_token=uuid.uuid4() if running else None,
                lease_expires_at=at(LEASE) if running else None,
            )
        )
    held = [short for short, n in state.others.items() for _ in range(n)]
    for index, short in enumerate(held):
        ItemClaim.objects.create(
            run=other,
            key=f"held-{index}",
            index=index,
            pool=names[short],
            status=ItemStatus.RUNNING,
            owner="someone",
            claim_token=uuid.uuid4(),
            lease_expires_at=at(LEASE),
        )
    return Written(run, other, finished, token, names, items)


def holders(written: Written, name: str) -> dict[int, int]:
    """Slots each run holds in the pool, from the rows."""
    held: dict[int, int] = {}
    for run_id in ItemClaim.objects.filter(pool=name, status=ItemStatus.RUNNING).values_list(
        "run_id", flat=True
    ):
        held[run_id] = held.get(run_id, 0) + 1
    return held


@dataclass
class Decision:
    handed: int | None  # the item that took the slot over, or None: the slot was given up
    run_in_flight: int
    pools: dict[str, tuple[int, float | None]]  # in_flight, tokens per pool
    reason: str = ""


def rule(written: Written, now: datetime) -> Decision:
    """What the Python rule decides, from plain values read off the rows."""
    run = BatchRun.objects.get(pk=written.run.pk)
    name = written.finished.pool
    row = CapacityPool.objects.filter(name=name).first() if name else None
    pool = PoolState.of(row, holders(written, name)) if row is not None else None
    room = hands_over(
        RunState(run.status, run.max_parallel, run.in_flight), name, pool, run.pk, now
    )
    items = [
        ItemState(i.pk, i.index, i.pool, i.status, i.crashes, i.next_attempt_at)
        for i in ItemClaim.objects.filter(run=run)
    ]
    nxt = next_in_slot(items, name, now) if room.count > 0 else None
    gives_up = 0 if nxt is not None else 1
    pools = {}
    for row in CapacityPool.objects.filter(name__in=written.names.values()):
        freed = gives_up if row.name == name else 0
        pools[row.name] = (row.in_flight - freed, row.tokens)
    return Decision(
        nxt.pk if nxt else None, run.in_flight - gives_up, pools, room.reason or "admitted"
    )


def outcome(written: Written) -> Decision:
    """What the rows say after the routine ran."""
    run = BatchRun.objects.get(pk=written.run.pk)
    running = ItemClaim.objects.filter(run=run, owner="agreement-next")
    handed = list(running.values_list("pk", flat=True))
    assert len(handed) <= 1
    pools = {
        p.name: (p.in_flight, p.tokens)
        for p in CapacityPool.objects.filter(name__in=written.names.values())
    }
    return Decision(handed[0] if handed else None, run.in_flight, pools)


def routines() -> list[Any]:
    if connection.vendor in ("postgresql", "mysql"):
        return [hand_over, hand_over_spending]
    pytest.skip("no SQL fast path on this database: the claim decides in Python alone")


def check(state: State, tag: str, routine: Any, seen: Counter[str] | None = None) -> str | None:
    """Run one state through the rule and the routine; describe any disagreement."""
    written = write(state, tag)
    now = db_now()
    expected = rule(written, now)
    new_token = uuid.uuid4()
    done = routine(
        written.run.pk,
        written.token,
        ExecutionOutcome(
            written.finished.pk, "finished", SUCCEEDED, written.finished.pool, {"ok": True}
        ),
        "agreement-next",
        new_token,
        LEASE,
    )
    got = outcome(written)
    if seen is not None:
        # The kind of decision: admitted, or the first word of why not (run, pool, rate...).
        seen[expected.reason.split(" ")[0] if expected.handed is None else "handed"] += 1
    finished = ItemClaim.objects.get(pk=written.finished.pk)
    problems = []
    if not done.written or finished.status != ItemStatus.SUCCEEDED:
        problems.append("the finished item's outcome was not written")
    if (done.next.pk if done.next else None) != got.handed:
        problems.append(f"the routine answered {done.next} but the rows say {got.handed}")
    if got.handed is not None:
        taken = ItemClaim.objects.get(pk=got.handed)
        if (taken.status, taken.claim_token) != (ItemStatus.RUNNING, new_token):
            problems.append(f"the next item is {taken.status} under {taken.claim_token}")
    for what in ("handed", "run_in_flight", "pools"):
        if getattr(expected, what) != getattr(got, what):
            problems.append(f"{what}: rule {getattr(expected, what)}, routine {getattr(got, what)}")
    if not problems:
        return None
    return (
        f"{routine.__name__} on {connection.vendor} disagrees with the rule "
        f"({expected.reason}): {'; '.join(problems)}\n  state: {json.dumps(asdict(state))}"
    )


def test_every_hand_over_routine_decides_as_the_python_rule_on_random_states() -> None:
    rng = random.Random(SEED)
    states = [random_state(rng) for _ in range(EXAMPLES)]
    found, seen = [], Counter[str]()
    for number, state in enumerate(states):
        for routine in routines():
            problem = check(state, f"{number}-{routine.__name__}", routine, seen)
            if problem:
                found.append(f"example {number}: {problem}")
    assert not found, f"{len(found)} disagreements:\n" + "\n".join(found[:10])
    # The states reach every decision: a slot handed on, and each reason to give it up.
    for decision in ("handed", "admitted", "run", "pool", "rate", "other", "throttled"):
        assert seen[decision] >= 3, f"too few states decided {decision!r}: {seen}"


def test_a_hand_over_passes_its_slot_on_when_another_runs_wait_for_the_pool_has_run_out() -> None:
    # Another run registered as waiting a minute ago; nothing else holds the slot back.
    pool = PoolSpec(3, 3, False, None, None, None, {"other": AGO})
    state = State(
        status=RunStatus.RUNNING,
        max_parallel=5,
        in_flight=1,
        pool="a",
        pools={"a": pool},
        items=[ItemSpec("a", "pending", 0, AGO)],
    )
    for routine in routines():
        assert check(state, f"ran-out-{routine.__name__}", routine) is None
        taken = ItemClaim.objects.get(
            key="item-1", run__run_key=f"agreement-ran-out-{routine.__name__}-run"
        )
        assert taken.status == ItemStatus.RUNNING, f"{routine.__name__} gave the slot up"


# --------------------------------------------------------------------------------- budgets
#
# A hand-over that counts cost settles the finished item (its reservation becomes what it
# cost) and reserves the next item's estimate; a budget that the next item would pass (or that
# is reached already) refuses it. The rule is the claim's (fanout.spend.Gate.admit, after a
# pool's ended period rolls over); every routine must decide as it does and leave the same
# spent and reserved on every account.

UNITS = ("usd", "tokens")
AMOUNTS = (0.0, 0.5, 1.0, 1.5, 2.0)


@dataclass
class AccountSpec:
    budget: float
    spent: float
    reserved: float  # besides the finished item's estimate, which it holds too
    ended: bool = False  # a pool's rolling period that has ended


@dataclass
class SpendState:
    pool: str  # the finished item's: "a" or ""
    run_budget: dict[str, AccountSpec]  # unit -> account ({}: the run has no budget)
    pool_budget: dict[str, AccountSpec]
    estimate: dict[str, float] | None  # the finished item's
    cost: dict[str, float] | None  # what its call reported (None: nothing, so its estimate)
    next_estimate: dict[str, float] | None  # the pending item's, when there is one
    pending: bool = True


def random_costs(rng: random.Random) -> dict[str, float] | None:
    if rng.random() < 0.15:
        return None
    return {u: rng.choice(AMOUNTS) for u in UNITS if rng.random() < 0.6}


def random_accounts(rng: random.Random, periods: bool) -> dict[str, AccountSpec]:
    return {
        unit: AccountSpec(
            budget=rng.choice((0.0, 1.0, 2.0, 3.0, 4.0)),
            spent=rng.choice(AMOUNTS),
            reserved=rng.choice((0.0, 0.0, 0.5, 1.0)),
            ended=periods and rng.random() < 0.3,
        )
        for unit in UNITS
        if rng.random() < 0.6
    }


def random_spend_state(rng: random.Random) -> SpendState:
    pool = rng.choice(("a", "a", ""))
    return SpendState(
        pool=pool,
        run_budget=random_accounts(rng, periods=False) if rng.random() < 0.7 else {},
        pool_budget=random_accounts(rng, periods=True) if pool and rng.random() < 0.7 else {},
        estimate=random_costs(rng),
        cost=random_costs(rng) if rng.random() < 0.6 else None,
        next_estimate=random_costs(rng),
        pending=rng.random() < 0.9,
    )


def write_spend(state: SpendState, tag: str) -> tuple[Written, dict[str, list[int]]]:
    """The state as rows: a run and pool that both admit, and their budgets' accounts."""
    pools = {"a": PoolSpec(10, 1, False, None, None, None, {})}
    items = [ItemSpec(state.pool, "pending", 0, AGO)] if state.pending else []
    written = write(State(RunStatus.RUNNING, 10, 1, state.pool, pools, items), tag)
    ItemClaim.objects.filter(pk=written.finished.pk).update(estimate=state.estimate)
    for item in written.items:
        ItemClaim.objects.filter(pk=item.pk).update(estimate=state.next_estimate)
    now = db_now()
    accounts: dict[str, list[int]] = {"run": [], "pool": []}
    held = state.estimate or {}
    for owner, specs in (("run", state.run_budget), ("pool", state.pool_budget)):
        for unit, spec in specs.items():
            started = now - timedelta(seconds=90 if spec.ended else 30)
            account = SpendAccount.objects.create(
                run=written.run if owner == "run" else None,
                pool=written.names["a"] if owner == "pool" else None,
                unit=unit,
                budget=spec.budget,
                spent=spec.spent,
                reserved=spec.reserved + held.get(unit, 0.0),
                period=60.0 if owner == "pool" else None,
                period_started_at=started if owner == "pool" else None,
            )
            accounts[owner].append(account.pk)
    return written, accounts


def _accounts(pks: list[int]) -> list[_Account]:
    rows = SpendAccount.objects.filter(pk__in=pks).order_by("unit")
    return [_Account(*values) for values in rows.values_list(*_ACCOUNT_FIELDS)]


def spend_rule(
    state: SpendState, written: Written, accounts: dict[str, list[int]], now: datetime
) -> tuple[bool, dict[int, tuple[float, float]]]:
    """What the rule decides: whether the next item is refused, and each account's (spent,
    reserved) after the hand-over."""
    actual = dict(state.cost) if state.cost is not None else dict(state.estimate or {})
    gate = Gate(written.run.pk, now)
    gate.run = _accounts(accounts["run"])
    name = written.finished.pool
    if name:
        gate.pools[name] = _accounts(accounts["pool"])
        for account in gate.pools[name]:
            _roll(account, now)
    for account in [*gate.run, *gate.pools.get(name, ())]:
        account.spent += actual.get(account.unit, 0.0)
        account.reserved -= (state.estimate or {}).get(account.unit, 0.0)
    refused = state.pending and bool(gate.admit(state.next_estimate, name, reclaim=False))
    after = {a.pk: (a.spent, a.reserved) for a in [*gate.run, *gate.pools.get(name, ())]}
    if refused:
        # Refused by the routine's rule only after it reserved: the worker releases the item.
        for account in [*gate.run, *gate.pools.get(name, ())]:
            n = (state.next_estimate or {}).get(account.unit, 0.0)
            after[account.pk] = (account.spent, account.reserved + n)
    return refused, after


def python_hand_over_spending(*args: Any) -> Any:
    """The hand-over and then its spend in Python, as databases without the routine do it."""
    from django.db import transaction

    from fanout import spend

    run_id, outcome = args[0], args[2]
    with transaction.atomic():
        done = hand_over(*args)
        next_pk = done.next.pk if done.next is not None else None
        if not spend.after_hand_over(outcome, run_id, next_pk, spend.run_has_budget(run_id)):
            done.refused = True
    return done


def check_spend(state: SpendState, tag: str, routine: Any, decided: Counter[str]) -> str | None:
    written, accounts = write_spend(state, tag)
    now = db_now()
    refused, expected = spend_rule(state, written, accounts, now)
    decided["refused" if refused else "admitted" if state.pending else "none next"] += 1
    result = ExecutionOutcome(
        written.finished.pk, "finished", SUCCEEDED, written.finished.pool, {"ok": True}
    )
    result.cost, result.accounted = state.cost, True
    done = routine(written.run.pk, written.token, result, "agreement-next", uuid.uuid4(), LEASE)
    problems = []
    if not done.written:
        problems.append("the finished item's outcome was not written")
    if (done.next is not None) != state.pending:
        problems.append(f"next item {done.next}, pending {state.pending}")
    if done.next is not None and done.refused != refused:
        problems.append(f"refused: rule {refused}, routine {done.refused}")
    got = {
        pk: (spent, reserved)
        for pk, spent, reserved in SpendAccount.objects.filter(pk__in=list(expected)).values_list(
            "pk", "spent", "reserved"
        )
    }
    for pk, (spent, reserved) in expected.items():
        if abs(got[pk][0] - spent) > 1e-9 or abs(got[pk][1] - reserved) > 1e-9:
            problems.append(f"account {pk}: rule {(spent, reserved)}, routine {got[pk]}")
    if not problems:
        return None
    return (
        f"{getattr(routine, '__name__', routine)} on {connection.vendor} disagrees with the "
        f"rule: {'; '.join(problems)}\n  state: {json.dumps(asdict(state))}"
    )


def test_every_hand_over_routine_admits_against_budgets_as_the_python_rule() -> None:
    routines()  # skips where there is no SQL routine to compare
    rng = random.Random(SEED + 1)
    states = [random_spend_state(rng) for _ in range(EXAMPLES)]
    found = []
    decided = Counter[str]()
    for number, state in enumerate(states):
        for routine in (hand_over_spending, python_hand_over_spending):
            problem = check_spend(state, f"spend-{number}-{routine.__name__}", routine, decided)
            if problem:
                found.append(f"example {number}: {problem}")
    assert not found, f"{len(found)} disagreements:\n" + "\n".join(found[:10])
    # The states reach both decisions, each often.
    assert decided["refused"] >= 20 and decided["admitted"] >= 20, decided
