"""Slots: counters that decide the limits, hand-overs that touch no shared row, per-item leases."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import InlineExecutor, prepare_run
from fanout.lease import LeaseKeeper
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.transitions import SUCCEEDED, ExecutionOutcome, hand_over, recount
from fanout.worker import Drain
from tests import procs
from tests.pools.workers import kill_group
from tests.procs import wait_until
from tests.testapp.fanouts_slots import SLOTS_POOL
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def prepared(name: str, **params: Any) -> BatchRun:
    return prepare_run(get_definition(name), params, f"{name}-{uuid.uuid4().hex[:8]}")


def counts(run: BatchRun) -> tuple[int, int]:
    """The run's counter, and what its rows say it should be."""
    run.refresh_from_db()
    return run.in_flight, ItemClaim.objects.filter(run=run, status=ItemStatus.RUNNING).count()


def most_at_once(run_id: int, after: float = 0.0) -> int:
    """The most handler calls of the run that overlapped in time (from the ledger)."""
    rows = Execution.objects.filter(run_id=run_id, started__gte=after)
    edges = []
    for started, ended in rows.values_list("started", "ended"):
        edges += [(started, 1), (ended if ended is not None else float("inf"), -1)]
    peak = now = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        now += step
        peak = max(peak, now)
    return peak


def with_hand_over() -> None:
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the one-statement hand-over is PostgreSQL's and MariaDB/MySQL's")


def test_a_worker_in_its_steady_state_touches_neither_the_runs_row_nor_the_pools() -> None:
    with_hand_over()
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=4)
    run = prepared("slots_pool", n=30)
    definition = get_definition("slots_pool")
    drain = Drain(run.pk, definition, LeaseKeeper(definition.lease_seconds), run.params)

    sql: list[str] = []

    def note(execute: Any, statement: str, *args: Any) -> Any:
        sql.append(statement)
        return execute(statement, *args)

    with connection.execute_wrapper(note):
        assert drain() in ("run finished", "run succeeded")

    qn = connection.ops.quote_name
    # The run's counter moves in a statement of its own, or in the claim's (PostgreSQL).
    run_writes = [
        q
        for q in sql
        if q.startswith(f"UPDATE {qn('fanout_batchrun')} SET {qn('in_flight')}")
        or "UPDATE fanout_batchrun SET in_flight" in q
    ]
    pool_writes = [
        q for q in sql if q.startswith(f"UPDATE {qn('fanout_capacitypool')} SET {qn('in_flight')}")
    ]
    hand_overs = [q for q in sql if "fanout_hand_over" in q]
    # One slot taken at the start, 29 hand-overs, the slot given up by the last one.
    assert len(hand_overs) == 30
    assert run_writes == [run_writes[0]], "the counters moved in the steady state"
    assert len(pool_writes) == 1
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.SUCCEEDED).count() == 30
    assert counts(run) == (0, 0)
    assert CapacityPool.objects.get(name=SLOTS_POOL).in_flight == 0


def test_a_hand_over_does_not_wait_for_a_transaction_that_holds_the_runs_row() -> None:
    with_hand_over()
    run = prepared("slots_run", n=3)
    first = claim(run.pk, "a", 1, 30, 3, None)
    assert first.token is not None
    locked, done = threading.Event(), threading.Event()

    def hold_the_run_row() -> None:
        with connections["default"].cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT 1 FROM fanout_batchrun WHERE id = %s FOR UPDATE", [run.pk])
            locked.set()
            done.wait(30)
            cursor.execute("ROLLBACK")
        connections["default"].close()

    holder = threading.Thread(target=hold_the_run_row)
    holder.start()
    try:
        assert locked.wait(10)
        with connection.cursor() as cursor:
            # A wait fails the test, never hangs it.
            if connection.vendor == "mysql":
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 3")
            else:
                cursor.execute("SET lock_timeout = '3s'")
        item = first.items[0]
        outcome = ExecutionOutcome(item.pk, item.key, SUCCEEDED, result={"ok": 1})
        handed = hand_over(run.pk, first.token, outcome, "a", uuid.uuid4(), 30)
    finally:
        done.set()
        holder.join()
    assert handed.written
    assert handed.next is not None and handed.next.key == "s00001"


def test_a_renewal_extends_only_leases_that_are_still_live() -> None:
    run = prepared("slots_run", n=2)
    result = claim(run.pk, "a", 2, 30, 3, None)
    assert result.token is not None
    keeper = LeaseKeeper(30)
    keeper.hold(result.token, [i.pk for i in result.items])
    gone = timezone.now() - timedelta(seconds=1)
    ItemClaim.objects.filter(key="s00000", run=run).update(lease_expires_at=gone)

    renewed = keeper.renew_now()

    assert renewed == 1
    assert ItemClaim.objects.get(key="s00000", run=run).lease_expires_at == gone
    assert ItemClaim.objects.get(key="s00001", run=run).lease_expires_at > timezone.now()


def test_counters_return_to_zero_after_a_pool_limited_run_on_many_threads() -> None:
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=3)
    run = prepared("slots_pool", n=40, sleep=0.05)
    executor = InlineExecutor(run, get_definition("slots_pool"), workers=6).start()
    executor.join(60)

    assert not executor.alive
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert counts(run) == (0, 0)
    assert recount(run.pk) == 0
    assert CapacityPool.objects.get(name=SLOTS_POOL).in_flight == 0
    assert most_at_once(run.pk) == 3


def test_a_batch_whose_last_item_outlives_its_timeout_keeps_its_earlier_outcomes() -> None:
    run = prepared("slots_batch", n=4, slow={"s00003": 4})
    executor = InlineExecutor(run, get_definition("slots_batch"), workers=2).start()
    executor.join(60)

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    calls = {
        key: Execution.objects.filter(run_id=run.pk, key=key).count()
        for key in ("s00000", "s00001", "s00002", "s00003")
    }
    # Only the slow item lost its lease and ran again; its batch-mates' outcomes were kept.
    assert calls == {"s00000": 1, "s00001": 1, "s00002": 1, "s00003": 2}
    assert counts(run) == (0, 0)


def test_limits_hold_exactly_across_four_processes_with_threads_and_follow_a_shrink(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    CapacityPool.objects.create(name=SLOTS_POOL, max_concurrency=5)
    run = prepared("slots_pool", n=240, sleep=0.05)
    workers = procs.child_env(database_url)
    command = ["run_fanout", "--resume", str(run.pk), "--workers", "4", "--json"]
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(4)]
    started = [procs.spawn_manage(command, workers, r, go) for r in ready]
    children.extend(started)
    procs.release_together(started, ready, go)

    # Mid-run an operator shrinks the pool, as the admin's form does.
    wait_until(lambda: Execution.objects.filter(run_id=run.pk).count() >= 60, 60, "60 items")
    CapacityPool.objects.filter(name=SLOTS_POOL).update(max_concurrency=2)
    shrunk_at = time.time()
    # Items already running when it shrank finish within 0.05 s; the limit holds after that.
    wait_until(lambda: all(p.poll() is not None for p in started), 120, "the workers to finish")

    for proc in started:
        code, out, err = procs.finish(proc)
        assert code == 0, err
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert Execution.objects.filter(run_id=run.pk).count() == 240
    assert most_at_once(run.pk) == 5
    assert most_at_once(run.pk, after=shrunk_at + 1.0) <= 2
    pids = set(Execution.objects.filter(run_id=run.pk).values_list("worker", flat=True))
    # Slots stay with the threads that hold them (a finished item hands its slot over), so
    # which processes run the items is first come, first served; reaching 5 at once takes two.
    assert len(pids) >= 2, "the processes did not share the run"
    assert counts(run) == (0, 0)
    assert CapacityPool.objects.get(name=SLOTS_POOL).in_flight == 0


def test_a_worker_stopped_past_its_leases_neither_exceeds_the_limit_nor_records(
    database_url: str, children: list[Any]
) -> None:
    run = prepared("slots_run", n=6, slow={"s00000": 6, "s00001": 6})
    env = procs.child_env(database_url)
    first = procs.spawn_manage(["run_fanout", "--resume", str(run.pk), "--workers", "2"], env)
    children.append(first)
    wait_until(
        lambda: Execution.objects.filter(run_id=run.pk, key__in=["s00000", "s00001"]).count() == 2,
        30,
        "the two slow items to start",
    )
    os.killpg(first.pid, signal.SIGSTOP)
    stalled_pid = str(first.pid)
    # Its leases (3 s) run out while it is stopped; a second worker reclaims them.
    wait_until(
        lambda: (
            not ItemClaim.objects.filter(run=run)
            .in_flight()
            .filter(owner__contains=f":{stalled_pid}:")
            .exists()
        ),
        30,
        "the stopped worker's leases to run out",
    )
    second = procs.spawn_manage(
        ["run_fanout", "--resume", str(run.pk), "--workers", "6", "--json"], env
    )
    children.append(second)
    wait_until(
        lambda: Execution.objects.filter(run_id=run.pk, key="s00000").count() == 2,
        30,
        "the slow item to be reclaimed",
    )
    os.killpg(first.pid, signal.SIGCONT)

    # While both run, live leases never exceed max_parallel (6), nor does the counter.
    def settled() -> bool:
        live = ItemClaim.objects.filter(run=run).in_flight().count()
        run.refresh_from_db()
        assert live <= 6 and run.in_flight <= 6, (live, run.in_flight)
        return run.status == RunStatus.SUCCEEDED

    wait_until(settled, 60, "the run to finish")
    code, out, err = procs.finish(second)
    assert code == 0, err
    kill_group(first)
    # The stalled worker's late outcomes were refused: the reclaiming worker recorded them.
    for key in ("s00000", "s00001"):
        row = ItemClaim.objects.get(run=run, key=key)
        assert row.status == ItemStatus.SUCCEEDED
        assert row.result["pid"] == second.pid
    assert counts(run) == (0, 0)
