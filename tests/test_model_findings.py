"""What the model of transitions (test_model.py) found, each kept as a plain test.

Each test replays one shrunk failure of the model with the same real functions, step by step,
and names the invariant it broke. They fail until the fixes of issue 20 land.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from fanout.actions import cancel_run
from fanout.call import execute
from fanout.claim import claim
from fanout.clock import db_now_plus
from fanout.definition import get_definition
from fanout.materialize import create_run, materialize
from fanout.models import (
    TERMINAL_RUN_STATUSES,
    BatchRun,
    CapacityPool,
    ItemClaim,
    ItemStatus,
    RunStatus,
)
from fanout.record import record
from tests.rq.conftest import redis, redis_url  # noqa: F401 - runs here are RQ runs
from tests.test_model import (
    DYING_WRITERS,
    LEASE,
    Rows,
    WriterDied,
    describe,
    drain,
    force_expired,
    forget_process_state,
    sweep,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def small_chunks(settings: Any) -> None:
    settings.FANOUT_MATERIALIZE_CHUNK = 2  # a dying writer leaves part of its list written
    settings.FANOUT_IDLE_MAX_SECONDS = 0.02


def start(name: str, pools: str, most: int) -> BatchRun:
    """A run of the model's definition ``name``, one item per letter of ``pools``."""
    tag = uuid.uuid4().hex[:8]
    params = {"n": len(pools), "pools": pools, "tag": tag}
    run, _ = create_run(get_definition(name), params, f"finding-{tag}", most, executor="rq")
    return materialize(run, get_definition(name))


def take(run: BatchRun, limit: int = 1) -> Any:
    """A worker of its own process claims up to ``limit`` items of the run."""
    forget_process_state()
    definition = get_definition(run.definition)
    return claim(
        run.pk, f"finding:{uuid.uuid4().hex[:6]}", limit, LEASE, definition.crash_budget, None
    )


def succeed(run: BatchRun, taken: Any) -> None:
    """The worker's handlers return and it records their outcomes."""
    definition = get_definition(run.definition)
    outcomes = [execute(definition, run.pk, run.params, item) for item in taken.items]
    record(run.pk, taken.token, outcomes, taken.failure_policy, definition)


def nobody_watching(run: BatchRun, seconds: float = 20.0) -> BatchRun:
    """Only supervisors and fresh workers' drains from now on; the run as they leave it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.is_terminal:
            break
        sweep()
        for pk in BatchRun.objects.exclude(status__in=TERMINAL_RUN_STATUSES).values_list(
            "pk", flat=True
        ):
            drain(pk)
    run.refresh_from_db()
    return run


def assert_counters_are_the_rows() -> None:
    rows = Rows()
    for pool in rows.pools:
        assert pool["in_flight"] == rows.pool_slots[pool["name"]], describe()
    for r in rows.runs:
        assert r["in_flight"] == rows.run_slots[r["pk"]], describe()


def test_a_lost_item_that_a_reaper_gave_back_does_not_give_its_slot_back_twice() -> None:
    """Finding 1: fail_lost lowers the counters for a pending item that holds no slot."""
    CapacityPool.objects.create(name="model-a", max_concurrency=1)
    CapacityPool.objects.create(name="model-b", max_concurrency=1)
    dying = start("model_plain", "a", 1)  # crash_budget=0: its first lost worker fails it
    other = start("model_plain", "a", 1)
    third = start("model_plain", "a", 1)

    force_expired(take(dying).token)  # its worker dies holding the pool's one slot
    # The other run's claimer finds the pool full of a dead lease: it gives the slot back (a
    # crash counted) and takes it.
    assert len(take(other).items) == 1
    # The dying run's next claim fails its item for the crash budget: a pending item, no slot.
    assert take(dying).crashed_out == 1
    assert ItemClaim.objects.get(run=dying).status == ItemStatus.FAILED

    assert_counters_are_the_rows()
    assert take(third).items == [], "a pool at max_concurrency=1 admitted a second item"


def test_a_reclaim_and_a_fresh_item_in_one_claim_never_overspend_the_rate() -> None:
    """Finding 2: a reclaimed item takes a token, yet the fresh one is admitted on it too."""
    CapacityPool.objects.create(name="model-a", max_concurrency=3)
    CapacityPool.objects.create(name="model-b", max_concurrency=3, rate_count=2, rate_period=3600.0)
    run = start("model_saga", "bbb", 3)  # crash_budget=1: a lost item is reclaimed once

    force_expired(take(run).token)  # one token spent, one left; its worker dies
    taken = take(run, limit=3)

    pool = CapacityPool.objects.get(name="model-b")
    assert pool.tokens >= 0, f"the bucket was saved at {pool.tokens} tokens"
    assert len(taken.items) == 1, "two calls admitted on one token"


def test_a_run_cancelled_to_compensate_while_a_dead_workers_item_runs_still_ends() -> None:
    """Finding 3: compensation waits for a running item whose lease nobody releases."""
    CapacityPool.objects.create(name="model-a", max_concurrency=2)
    CapacityPool.objects.create(name="model-b", max_concurrency=2)
    run = start("model_saga", "aa", 2)
    done = take(run)
    force_expired(take(run).token)  # the second item's worker dies
    succeed(run, done)

    cancel_run(run, compensate=True)
    assert run.status == RunStatus.COMPENSATING

    run = nobody_watching(run)
    assert run.status == RunStatus.COMPENSATED, describe()


def test_a_run_whose_writer_died_mid_work_list_is_finished_with_nobody_watching() -> None:
    """Finding 4: nothing takes up a pending run whose writer's lease ran out."""
    CapacityPool.objects.create(name="model-a", max_concurrency=2)
    CapacityPool.objects.create(name="model-b", max_concurrency=2)
    definition = get_definition("model_plain")
    tag = uuid.uuid4().hex[:8]
    DYING_WRITERS[tag] = 2  # it writes one chunk of two items, then dies
    params = {"n": 3, "pools": "aba", "tag": tag}
    run, _ = create_run(definition, params, f"finding-{tag}", 2, executor="rq")
    with pytest.raises(WriterDied):
        materialize(run, definition)
    # Its lease runs out: the writer is gone for good.
    BatchRun.objects.filter(pk=run.pk).update(materialize_lease_expires_at=db_now_plus(-1))
    assert ItemClaim.objects.filter(run=run).count() == 2

    run = nobody_watching(run)
    assert run.status == RunStatus.SUCCEEDED, describe()
    items = ItemClaim.objects.filter(run=run)
    assert sorted(items.values_list("key", flat=True)) == ["i0", "i1", "i2"]
    assert set(items.values_list("status", flat=True)) == {ItemStatus.SUCCEEDED}
