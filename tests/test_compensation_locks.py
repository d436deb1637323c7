"""A compensation's claim keeps the lock order: the run's row, then pool rows in name order."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction  # noqa: F401 (skipif)
from django.utils import timezone

from fanout import compensate
from fanout.audit import measure_pool, measure_run
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.test_retry_race import session_id, waits_for_a_lock

pytestmark = [
    pytest.mark.skipif("connection.vendor != 'postgresql'", reason="row locks to deadlock on"),
    pytest.mark.django_db(transaction=True),
]

POOL_A, POOL_B = "comp-locks-a", "comp-locks-b"


def compensating_run_with_a_lost_item() -> BatchRun:
    """A compensating run: one compensation due in pool A, one forward item in pool B whose
    worker died (running, its lease expired, holding its run's and pool B's slots)."""
    for name in (POOL_A, POOL_B):
        CapacityPool.objects.create(name=name, max_concurrency=5)
    definition = get_definition("comp_parallel")
    run = prepare_run(definition, {"n": 2}, uuid.uuid4().hex)
    done, lost = ItemClaim.objects.filter(run=run).order_by("index")
    ItemClaim.objects.filter(pk=done.pk).update(
        status=ItemStatus.SUCCEEDED, pool=POOL_A, result={"charged": done.key}
    )
    past = timezone.now() - timedelta(seconds=60)
    ItemClaim.objects.filter(pk=lost.pk).update(
        status=ItemStatus.RUNNING,
        pool=POOL_B,
        owner="host:1:dead",
        claim_token=uuid.uuid4(),
        attempt=1,
        claimed_at=past,
        started_at=past,
        lease_expires_at=past,
    )
    BatchRun.objects.filter(pk=run.pk).update(in_flight=1)
    CapacityPool.objects.filter(name=POOL_B).update(in_flight=1)
    assert compensate.begin(run.pk, "the run failed")
    return run


def test_a_compensation_claim_releasing_a_lost_item_does_not_deadlock_with_another_run() -> None:
    run = compensating_run_with_a_lost_item()
    definition = get_definition("comp_parallel")
    holds_a, go = threading.Event(), threading.Event()
    sessions: list[int] = []
    errors: list[BaseException] = []
    taken: list[compensate.Taken] = []

    def other_run() -> None:
        # Another run's settle or claim over pools A and B: it locks them in name order.
        try:
            with transaction.atomic():
                list(CapacityPool.objects.filter(name=POOL_A).select_for_update())
                holds_a.set()
                go.wait(30)
                list(CapacityPool.objects.filter(name=POOL_B).select_for_update())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    def compensation_claim() -> None:
        try:
            sessions.append(session_id())
            taken.append(compensate.claim(run.pk, definition, "host:2:alive"))
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    other = threading.Thread(target=other_run)
    claimer = threading.Thread(target=compensation_claim)
    other.start()
    try:
        assert holds_a.wait(30)
        claimer.start()
        # The compensation claim waits for pool A, which the other transaction holds; what it
        # locked before that must not include pool B, which the other one takes next.
        wait_until(lambda: sessions, 30, "the compensation claim to start")
        wait_until(lambda: waits_for_a_lock(sessions[0]), 30, "the claim to wait for pool A")
    finally:
        go.set()
        other.join(60)
        if claimer.ident is not None:
            claimer.join(60)

    assert errors == [], errors
    assert len(taken) == 1 and [i.pool for i, _ in taken[0].items] == [POOL_A], taken
    items = {i.pool: i for i in ItemClaim.objects.filter(run=run)}
    assert items[POOL_B].status == ItemStatus.CANCELLED
    assert items[POOL_A].status == ItemStatus.COMPENSATING
    assert BatchRun.objects.get(pk=run.pk).status == RunStatus.COMPENSATING
    with transaction.atomic():
        # The counters are the rows: B's dead slot given back, A's taken by the compensation.
        assert measure_run(run.pk) == (0, 0)
        assert measure_pool(POOL_A) == (1, 1)
        assert measure_pool(POOL_B) == (0, 0)
