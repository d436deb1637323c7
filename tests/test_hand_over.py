"""The one-statement hand-over keeps the claim path's rules: the crash budget, and the lock
order (the run's row, then the pool's) that keeps two transactions from waiting in a cycle."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from fanout.claim import claim
from fanout.clock import db_now_plus
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.lease import LeaseKeeper
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus
from fanout.transitions import SUCCEEDED, ExecutionOutcome, HandOver, hand_over, release_expired
from fanout.worker import Batch, Drain
from tests.procs import wait_until
from tests.testapp.fanouts_slots import SLOTS_POOL

pytestmark = pytest.mark.django_db(transaction=True)

LEASE, CRASH_BUDGET = 30, 1


def prepared(name: str, **params: Any) -> BatchRun:
    return prepare_run(get_definition(name), params, f"{name}-{uuid.uuid4().hex[:8]}")


def with_hand_over() -> None:
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the one-statement hand-over is PostgreSQL's and MariaDB/MySQL's")


def succeeded(item: Any) -> ExecutionOutcome:
    return ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"ok": item.key})


def test_a_hand_over_leaves_an_item_past_its_crash_budget_to_fail_as_a_claim_fails_it() -> None:
    with_hand_over()
    run = prepared("slots_run", n=2)
    taken = claim(run.pk, "worker", 2, LEASE, CRASH_BUDGET, None)
    assert taken.token is not None and len(taken.items) == 2
    kept, crashing = taken.items
    # The second item's owners died as often as the budget allows; then its lease ran out and
    # a reaper gave its slot back: it is pending again, one crash past the budget.
    ItemClaim.objects.filter(pk=crashing.pk).update(crashes=CRASH_BUDGET)
    ItemClaim.objects.filter(pk=crashing.pk).update(lease_expires_at=db_now_plus(-60))
    assert release_expired(ItemClaim.objects.filter(pk=crashing.pk)) == 1

    handed = hand_over(run.pk, taken.token, succeeded(kept), "worker", uuid.uuid4(), LEASE)

    assert handed.written
    assert handed.next is None, "the hand-over ran an item past its crash budget"
    # The claim path fails it, as it fails every item whose owners kept dying.
    later = claim(run.pk, "worker", 1, LEASE, CRASH_BUDGET, None)
    assert later.crashed_out == 1 and later.items == []
    lost = ItemClaim.objects.get(pk=crashing.pk)
    assert (lost.status, lost.error_class) == (ItemStatus.FAILED, "WorkerLost")
    run.refresh_from_db()
    assert run.in_flight == 0


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's PL/pgSQL function")
def test_a_hand_over_that_gives_its_slot_up_locks_the_runs_row_before_the_pools() -> None:
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=4)
    run = prepared("slots_pool", n=1)
    taken = claim(run.pk, "worker", 1, LEASE, CRASH_BUDGET, SLOTS_POOL)
    token = taken.token
    assert token is not None
    # Nothing is left to hand the slot to: the hand-over gives it up, writing both rows.
    pool_locked, release_pool = threading.Event(), threading.Event()
    handed: list[HandOver] = []
    worker_pid: list[int] = []

    def hold_the_pools_row() -> None:
        try:
            with transaction.atomic():
                list(CapacityPool.objects.filter(name=SLOTS_POOL).select_for_update())
                pool_locked.set()
                release_pool.wait(60)
        finally:
            connections["default"].close()

    def hand_over_the_last_item() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '60s'")  # a wait fails the test, never hangs it
                cursor.execute("SELECT pg_backend_pid()")
                worker_pid.append(cursor.fetchone()[0])
            item = taken.items[0]
            handed.append(hand_over(run.pk, token, succeeded(item), "worker", uuid.uuid4(), LEASE))
        finally:
            connections["default"].close()

    holder = threading.Thread(target=hold_the_pools_row)
    holder.start()
    worker = threading.Thread(target=hand_over_the_last_item)
    try:
        assert pool_locked.wait(30)
        worker.start()

        def waiting_for_a_lock() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                    [worker_pid[0] if worker_pid else 0],
                )
                row = cursor.fetchone()
            return row is not None and row[0] == "Lock"

        wait_until(waiting_for_a_lock, 30, "the hand-over to wait for the pool's row")
        # While it waits for the pool's row, the run's row is already its own.
        with pytest.raises(OperationalError), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT 1 FROM fanout_batchrun WHERE id = %s FOR UPDATE NOWAIT", [run.pk]
                )
    finally:
        release_pool.set()
        holder.join()
        worker.join(90)

    assert handed and handed[0].written and handed[0].next is None
    run.refresh_from_db()
    assert run.in_flight == 0
    assert CapacityPool.objects.get(name=SLOTS_POOL).in_flight == 0


def test_a_hand_over_just_after_a_claim_that_looked_for_expired_leases_does_not_look_again() -> (
    None
):
    with_hand_over()
    run = prepared("slots_run", n=3)
    definition = get_definition("slots_run")
    drain = Drain(run.pk, definition, LeaseKeeper(LEASE), run.params, roam=True)
    # The drain's claim is the run's first in this process: it looks for expired leases.
    taken = drain._claim(None)
    assert taken is not None and len(taken.items) == 1
    batch = Batch(taken.token, taken.items, taken.failure_policy)
    batch.outcomes.append(succeeded(taken.items[0]))

    with CaptureQueriesContext(connection) as queries:
        assert drain._can_hand_over(batch)
    # Every item's hand-over would otherwise cost a second round trip in a run's first moments.
    assert [q["sql"] for q in queries.captured_queries] == []
