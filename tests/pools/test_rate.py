"""A pool's rate limit is a token bucket decided under the pool row's lock, on a clock that
is read after the lock is taken and never moves backwards."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from fanout.claim import claim
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.pools import refill
from fanout.report import held_back
from tests.procs import finish, wait_until
from tests.testapp.fanouts_pools import BUSY_POOL, RATE_POOL
from tests.testapp.models import Execution

from .workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)

RATE, BURST = 20, 20


def most_in_any_window(times: list[float], width: float) -> int:
    """The most admissions in any half-open window [t, t + width)."""
    times = sorted(times)
    most, first = 0, 0
    for last, t in enumerate(times):
        while times[first] <= t - width:
            first += 1
        most = max(most, last - first + 1)
    return most


def test_a_rate_of_20_per_second_never_admits_more_than_rate_plus_burst_in_any_second(
    workers: Workers,
) -> None:
    CapacityPool.objects.create(name=RATE_POOL, max_concurrency=50, rate_count=RATE)
    n = 120
    command = ["run_fanout", "pools_rate", "--run-key", "rate", "--workers", "4"]
    command += ["--param", f"n={n}"]
    procs = workers([command, command])

    for proc in procs:
        code, out, err = finish(proc, timeout=120)
        assert code == 0, f"worker process exited {code}:\n{out}\n{err}"

    run = BatchRun.objects.get(run_key="rate")
    assert run.status == RunStatus.SUCCEEDED
    items = list(ItemClaim.objects.filter(run=run))
    # claimed_at is the admission time the bucket was charged at; a reclaim would overwrite it.
    assert [i.crashes for i in items] == [0] * n
    assert Execution.objects.filter(run_id=run.pk).count() == n
    admitted = sorted(i.claimed_at.timestamp() for i in items)

    most = most_in_any_window(admitted, 1.0)
    print(f"most admissions in one second: {most} (limit {RATE + BURST})")
    assert most <= RATE + BURST
    # The bucket's own bound, for every stretch of time: burst + rate x its length.
    for i, start in enumerate(admitted):
        for j in range(i, n):
            assert j - i + 1 <= BURST + RATE * (admitted[j] - start) + 1e-6
    # After the initial burst the long-run average is the rate: not above it, and not far below.
    average = (n - BURST) / (admitted[-1] - admitted[0])
    print(f"average admissions per second after the burst: {average:.1f}")
    assert RATE * 0.7 <= average <= RATE * 1.02


def test_items_the_bucket_holds_back_are_shown_rate_limited_while_the_run_goes(
    workers: Workers,
) -> None:
    """A bucket of 4 that gains a token an hour: the run's first claim takes the 4, and every
    other item then waits for the rate, however slowly this machine runs its items."""
    CapacityPool.objects.create(
        name=RATE_POOL, max_concurrency=50, rate_count=1, rate_period=3600, burst=4
    )
    n = 12
    command = ["run_fanout", "pools_rate", "--run-key", "slow-rate", "--workers", "2"]
    procs = workers([[*command, "--param", f"n={n}"]])

    def four_done() -> bool:
        assert all(proc.poll() is None for proc in procs), "the run's worker exited"
        items = ItemClaim.objects.filter(run__run_key="slow-rate")
        return items.filter(status=ItemStatus.SUCCEEDED).count() == 4

    wait_until(four_done, 60, "the bucket's 4 items to finish")
    run = BatchRun.objects.get(run_key="slow-rate")
    items = ItemClaim.objects.filter(run=run)
    assert items.exclude(claimed_at=None).count() == 4
    held = held_back(run.pk)
    assert [n for reason, n in held.items() if f"{RATE_POOL}: rate limited" in reason] == [8], held
    assert run.status == RunStatus.RUNNING


def test_the_bucket_clock_never_moves_backwards() -> None:
    pool = CapacityPool(name="clock", max_concurrency=5, rate_count=RATE)
    t1 = timezone.now()
    refill(pool, t1)
    assert (pool.tokens, pool.tokens_at) == (BURST, t1)
    pool.tokens = 5.0

    refill(pool, t1 - timedelta(seconds=3))  # a claimer whose clock was read earlier
    assert (pool.tokens, pool.tokens_at) == (5.0, t1)

    refill(pool, t1 + timedelta(milliseconds=500))
    assert pool.tokens == pytest.approx(15.0)
    assert pool.tokens_at == t1 + timedelta(milliseconds=500)

    refill(pool, t1 + timedelta(seconds=60))
    assert pool.tokens == BURST


@pytest.fixture
def locker() -> Iterator[Callable[[Any], tuple[threading.Event, list[datetime]]]]:
    """Hold a row's FOR UPDATE lock in another connection until told to let go."""
    threads: list[tuple[threading.Thread, threading.Event]] = []

    def hold(queryset: Any) -> tuple[threading.Event, list[datetime]]:
        locked, release = threading.Event(), threading.Event()
        released_at: list[datetime] = []

        def main() -> None:
            try:
                with transaction.atomic():
                    assert len(queryset.select_for_update()) == 1
                    locked.set()
                    release.wait(30)
                    released_at.append(timezone.now())
            finally:
                connection.close()

        thread = threading.Thread(target=main)
        thread.start()
        threads.append((thread, release))
        assert locked.wait(10), "the row could not be locked"
        return release, released_at

    yield hold
    for thread, release in threads:
        release.set()
        thread.join(10)


def claim_in_thread(run_id: int, pool: str) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []

    def main() -> None:
        try:
            results.append(claim(run_id, "waiter", 1, 30, 3, pool))
        finally:
            connection.close()

    thread = threading.Thread(target=main)
    thread.start()
    return thread, results


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0] > 0


def decided_after_release(
    locker: Callable[[Any], tuple[threading.Event, list[datetime]]], locked_rows: Any, run: BatchRun
) -> None:
    release, released_at = locker(locked_rows)
    thread, results = claim_in_thread(run.pk, BUSY_POOL)
    try:
        wait_until(waiting_on_a_lock, 10, "the claimer to wait for the lock")
    finally:
        release.set()
        thread.join(10)
    (result,) = results
    (item,) = result.items
    claimed = ItemClaim.objects.get(pk=item.pk)
    # Time spent waiting for the lock must not age the decision, nor shorten the lease.
    assert claimed.claimed_at >= released_at[0]
    assert claimed.lease_expires_at >= released_at[0] + timedelta(seconds=30)


def test_a_claim_reads_the_clock_after_it_has_waited_for_the_run_lock(locker: Any) -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    run = prepare_run(get_definition("pools_busy"), {"n": 2}, "clock-run")

    decided_after_release(locker, BatchRun.objects.filter(pk=run.pk), run)


def test_a_claim_reads_the_clock_after_it_has_waited_for_the_pool_lock(locker: Any) -> None:
    CapacityPool.objects.create(name=BUSY_POOL, max_concurrency=3)
    run = prepare_run(get_definition("pools_busy"), {"n": 2}, "clock-pool")

    decided_after_release(locker, CapacityPool.objects.filter(name=BUSY_POOL), run)
