"""A compensation is an item's second phase: the item path claims, leases, times out, admits
(rate, backoff, fair share), records and reclaims it, and Throttled and PermanentError mean for
it what they mean for an item. What differs is data: its budget, its order, its function and
its idempotency key."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from fanout import compensate
from fanout.actions import release
from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.rq.conftest import _descendants, processes, redis, redis_url  # noqa: F401
from tests.rq.support import describe_runs
from tests.testapp.fanouts_phase import RATE_POOL, SHARED_POOL
from tests.testapp.models import Execution, Observation

pytestmark = pytest.mark.django_db(transaction=True)

RATE, BURST = 20, 5


def run_inline(name: str, workers: int = 4, **params: Any) -> BatchRun:
    return get_definition(name).start(params, run_key=uuid.uuid4().hex, workers=workers)


def undo_calls(run: BatchRun, key: str | None = None) -> list[Execution]:
    rows = Execution.objects.filter(run_id=run.pk, key__startswith="undo:")
    if key is not None:
        rows = rows.filter(key=f"undo:{key}")
    return list(rows.order_by("started", "pk"))


def most_in_a_window(starts: list[float], seconds: float) -> int:
    """The most of ``starts`` within any window of ``seconds`` (each window opens at a start)."""
    starts = sorted(starts)
    return max(
        (sum(1 for t in starts[i:] if t < s + seconds) for i, s in enumerate(starts)), default=0
    )


def ended(run_id: int, timeout: float) -> BatchRun:
    try:
        return wait_until(
            lambda: (
                BatchRun.objects.filter(pk=run_id)
                .exclude(status=RunStatus.COMPENSATING)
                .exclude(status=RunStatus.RUNNING)
                .exclude(status=RunStatus.JOINING)
                .exclude(status=RunStatus.PENDING)
                .first()
            ),
            timeout,
            f"run {run_id} to end",
            every=0.1,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe_runs()}") from None


def test_compensations_through_a_rate_limited_pool_start_no_faster_than_its_bucket_allows(
    processes: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Charges go through at once; then the pool is 20/s (burst 5), and three fail-fast runs
    # fail together: their refunds, 8 at once per run, share the pool's one bucket.
    CapacityPool.objects.create(
        name=RATE_POOL, max_concurrency=50, rate_count=1000, rate_period=1.0, burst=1000
    )
    processes.workers(2)
    go = tmp_path / "fail"
    params = {"n": 40, "failing": ["p00039"], "fail_file": str(go), "undo_sleep": 0.02}
    rate = get_definition("phase_rate")
    runs = [rate.start(params, uuid.uuid4().hex, executor="rq", wait=False) for _ in range(3)]
    charged = ItemClaim.objects.filter(run__in=runs, status=ItemStatus.SUCCEEDED)
    try:
        wait_until(lambda: charged.count() == 3 * 39, 60, "every charge but the failing ones")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe_runs()}") from None
    CapacityPool.objects.filter(name=RATE_POOL).update(
        rate_count=RATE, burst=BURST, tokens=BURST, tokens_at=db_now()
    )
    go.touch()

    ends = [ended(run.pk, 120) for run in runs]

    assert {run.status for run in ends} == {RunStatus.COMPENSATED}, describe_runs()
    starts = []
    for run in ends:
        undone = undo_calls(run)
        assert len(undone) == 39 and len({u.key for u in undone}) == 39
        starts += [u.started for u in undone]
    # Admissions in any window of T seconds never exceed burst + rate × T; a start is taken a
    # moment after its admission, so the window is widened by that moment's worth.
    for seconds in (0.5, 1.0, 2.0, 3.0):
        allowed = BURST + RATE * (seconds + 0.1)
        seen = most_in_a_window(starts, seconds)
        assert seen <= allowed, f"{seen} refunds in {seconds}s, the bucket allows {allowed:g}"
    pool = CapacityPool.objects.get(name=RATE_POOL)
    assert pool.tokens is not None and pool.tokens >= 0
    assert [BatchRun.objects.get(pk=run.pk).compensating for run in runs] == [0, 0, 0]


def test_a_compensation_waits_for_a_token_of_its_pools_bucket() -> None:
    # One call an hour, and the bucket spent: nothing of the pool may start for an hour.
    CapacityPool.objects.create(name=RATE_POOL, max_concurrency=10, rate_count=1, rate_period=3600)
    definition = get_definition("phase_rate")
    run = prepare_run(definition, {"n": 1}, uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(status=ItemStatus.SUCCEEDED, result={"charged": 1})
    CapacityPool.objects.filter(name=RATE_POOL).update(tokens=0.0, tokens_at=db_now())
    assert compensate.begin(run.pk, "failed on purpose")

    taken = compensate.claim(run.pk, definition, "host:1:worker")

    assert taken.items == []
    assert taken.reason.startswith(f"{RATE_POOL}: rate limited until"), taken.reason
    assert taken.retry_in is not None and taken.retry_in > 50 * 60
    pool = CapacityPool.objects.get(name=RATE_POOL)
    assert (pool.in_flight, pool.tokens) == (0, 0.0)


def compensating(name: str, n: int) -> tuple[BatchRun, Any]:
    """A run of ``n`` items that all succeeded, turned to compensating; and its definition."""
    definition = get_definition(name)
    run = prepare_run(definition, {"n": n}, uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(status=ItemStatus.SUCCEEDED, result={"charged": 1})
    assert compensate.begin(run.pk, "failed on purpose")
    return run, definition


def test_a_compensation_refused_by_its_budget_is_not_claimed_again_at_once() -> None:
    # Reverse order: one at a time. While it runs, another thread is refused; a retry_in of 0
    # (the due compensations' past retry time) made its drain claim again at once, a hot loop
    # of run- and pool-row locks until the first was recorded.
    run, definition = compensating("phase_reverse", 3)
    first = compensate.claim(run.pk, definition, "host:1:w1")
    assert len(first.items) == 1

    second = compensate.claim(run.pk, definition, "host:1:w2")

    assert second.items == []
    assert "compensation budget" in second.reason, second.reason
    assert second.retry_in is None or second.retry_in > 0, second.retry_in


def test_a_compensation_refused_by_a_paused_pool_is_not_claimed_again_at_once() -> None:
    CapacityPool.objects.create(name=SHARED_POOL, max_concurrency=2, paused=True)
    run, definition = compensating("phase_shared", 2)

    taken = compensate.claim(run.pk, definition, "host:1:w1")

    assert taken.items == []
    assert "paused" in taken.reason, taken.reason
    assert taken.retry_in is None or taken.retry_in > 0, taken.retry_in


def test_a_stopping_worker_gives_its_compensation_back_as_it_gives_an_item_back() -> None:
    # A stopping worker releases what it holds (actions.release): an item goes back to pending
    # with no crash counted, and so must a compensation go back to due, its slots given up,
    # not stay held until its lease runs out and then be taken over as a crash.
    CapacityPool.objects.create(name=SHARED_POOL, max_concurrency=2)
    run, definition = compensating("phase_shared", 2)
    taken = compensate.claim(run.pk, definition, "host:1:w1")
    ((item, _result),) = taken.items
    assert CapacityPool.objects.get(name=SHARED_POOL).in_flight == 1

    released = release({item.pk: taken.token})

    row = ItemClaim.objects.get(pk=item.pk)
    assert released == 1
    assert (row.status, row.claim_token, row.compensation_attempt) == (
        ItemStatus.COMPENSATING,
        None,
        0,
    )
    assert BatchRun.objects.get(pk=run.pk).compensating == 0
    assert CapacityPool.objects.get(name=SHARED_POOL).in_flight == 0
    # Claimed again as a fresh attempt 1, with no lost worker in its history.
    again = compensate.claim(run.pk, definition, "host:1:w2")
    assert [(i.pk, i.attempt) for i, _ in again.items] == [(item.pk, 1)]
    assert not ItemAttempt.objects.filter(item_id=item.pk).exists()
    assert not compensate.record(run.pk, definition, taken.token, item, (True, "", ""))


def test_a_drifted_compensation_budget_is_reported_when_the_run_ends_not_zeroed_unseen() -> None:
    run, definition = compensating("phase_reverse", 1)
    taken = compensate.claim(run.pk, definition, "host:1:w1")
    ((item, _result),) = taken.items
    assert taken.token is not None
    assert compensate.record(run.pk, definition, taken.token, item, (True, "", ""))
    BatchRun.objects.filter(pk=run.pk).update(compensating=1)  # a path that forgot it

    assert compensate.finish(run.pk) == RunStatus.COMPENSATED

    ended = BatchRun.objects.get(pk=run.pk)
    assert (ended.counter_drift, ended.compensating) == (1, 0)


def test_a_throttled_compensation_waits_with_its_pool_and_uses_no_attempt() -> None:
    CapacityPool.objects.create(name=SHARED_POOL, max_concurrency=2)
    run = run_inline(
        "phase_shared", n=4, failing=["p00003"], undo_throttle={"p00000": 1.0}, undo_sleep=0.05
    )

    assert run.status == RunStatus.COMPENSATED, run.error
    throttled, *rest = undo_calls(run, "p00000")
    assert len(rest) == 1 and rest[0].attempt == 1  # called again, as attempt 1 still
    item = ItemClaim.objects.get(run=run, key="p00000")
    assert (item.status, item.compensation_attempt) == (ItemStatus.COMPENSATED, 1)
    assert not ItemAttempt.objects.filter(item=item).exists()  # waiting is not a failure
    # It waited out the provider's second, and so did the whole pool: a call admitted after
    # the Throttled was recorded (a moment after the handler raised) waited for it too.
    assert rest[0].started >= throttled.ended + 0.9
    # A call claimed before the Throttled was recorded may start a few hundred ms after the
    # handler raised on a loaded machine (it was seen 0.28 s after): those are not asked to wait.
    after = [u.started for u in undo_calls(run) if u.started >= throttled.ended + 0.5]
    assert after and min(after) >= throttled.ended + 0.9, (throttled.ended, after)


def test_a_compensation_that_raises_permanent_error_fails_at_once_and_stays_visible() -> None:
    run = run_inline("phase_reverse", n=3, failing=["p00002"], undo_permanent=["p00001"])

    assert run.status == RunStatus.COMPENSATION_FAILED
    item = ItemClaim.objects.get(run=run, key="p00001")
    assert item.status == ItemStatus.COMPENSATION_FAILED
    assert "was refused" in item.error
    assert len(undo_calls(run, "p00001")) == 1  # not retried: max_attempts=3 is not for it
    noted = ItemAttempt.objects.filter(item=item).values_list("error_class", flat=True)
    assert list(noted) == ["compensation: PermanentError"]
    assert ItemClaim.objects.get(run=run, key="p00000").status == ItemStatus.COMPENSATED


def test_a_compensation_that_outlives_its_timeout_is_taken_over_while_it_still_runs() -> None:
    run = run_inline("phase_reverse", n=2, failing=["p00001"], undo_first={"p00000": 4.0})

    assert run.status == RunStatus.COMPENSATED, run.error
    first, second = undo_calls(run, "p00000")
    # Its lease was not renewed past the definition's timeout (1 s): another thread took it
    # over while the first call still ran, and the first call's late outcome was dropped.
    assert second.started < first.ended
    item = ItemClaim.objects.get(run=run, key="p00000")
    assert (item.status, item.compensation_attempt) == (ItemStatus.COMPENSATED, 1)
    lost = ItemAttempt.objects.filter(item=item, error_class="compensation: WorkerLost")
    assert lost.count() == 1
    assert BatchRun.objects.get(pk=run.pk).compensating == 0


def test_a_compensation_has_an_idempotency_key_of_its_own_stable_across_its_retries() -> None:
    run = run_inline("phase_reverse", n=2, failing=["p00001"], undo_fail={"p00000": 1})

    assert run.status == RunStatus.COMPENSATED, run.error
    seen = Observation.objects.filter(run_id=run.pk, key="p00000")
    charge = set(seen.filter(name="charge_key").values_list("value", flat=True))
    refunds = list(seen.filter(name="refund_key").values_list("value", flat=True))
    assert len(charge) == 1 and len(refunds) == 2  # its refund bounced once, then went through
    assert len(set(refunds)) == 1  # the same key on every attempt of the refund
    assert set(refunds) != charge  # and not the charge's: a provider would take it as a repeat


def test_a_compensating_run_gets_its_fair_share_of_a_pool_another_run_keeps_full() -> None:
    CapacityPool.objects.create(name=SHARED_POOL, max_concurrency=2)
    forward = get_definition("phase_forward").start(
        {"n": 40, "sleep": 0.5}, run_key=uuid.uuid4().hex, workers=4, wait=False
    )
    busy = ItemClaim.objects.filter(run=forward, status=ItemStatus.RUNNING)
    wait_until(lambda: busy.count() == 2, 30, "the forward run to fill the pool")

    run = run_inline("phase_shared", n=3, failing=["p00002"])

    assert run.status == RunStatus.COMPENSATED, run.error
    # It was undone while the other run still had items to run: the pool's slots were shared,
    # not handed from one of the other run's items to the next until it ran out.
    undone = max(u.ended for u in undo_calls(run))
    # (Its next item may start a moment after the last refund ended: wait for it, not race it.)
    later = Execution.objects.filter(run_id=forward.pk, started__gt=undone)
    wait_until(later.exists, 30, f"a forward item to start after the refunds\n{describe_runs()}")
    ended(forward.pk, 60)


def test_a_compensating_run_whose_compensations_worker_is_killed_is_taken_over_and_ends(
    processes: Any,  # noqa: F811
) -> None:
    first = processes.worker()
    run = get_definition("phase_killed").start(
        {"n": 4, "failing": ["p00003"], "undo_first": {"p00002": 60}},
        executor="rq",
        wait=False,
    )
    under_way = Execution.objects.filter(run_id=run.pk, key="undo:p00002", ended=None)
    wait_until(under_way.exists, 60, "a compensation to be under way", every=0.1)

    for pid in _descendants(first.pid):  # its work horse, in a process group of its own
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    first.signal(signal.SIGKILL)
    first.wait(timeout=10)
    processes.worker()

    run = ended(run.pk, 60)
    assert run.status == RunStatus.COMPENSATED, describe_runs()
    assert len(undo_calls(run, "p00002")) == 2
    item = ItemClaim.objects.get(run=run, key="p00002")
    assert (item.status, item.compensation_attempt) == (ItemStatus.COMPENSATED, 1)
    assert ItemAttempt.objects.filter(item=item, error_class="compensation: WorkerLost").exists()
    assert {i.status for i in ItemClaim.objects.filter(run=run)} == {
        ItemStatus.COMPENSATED,
        ItemStatus.FAILED,
    }
    assert BatchRun.objects.get(pk=run.pk).compensating == 0
