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
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.pools import ItemState, PoolState, RunState, hands_over, next_in_slot
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
