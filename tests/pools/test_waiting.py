"""Waiting for capacity is not failing: it uses no attempt and shows its reason."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from typing import Any

import pytest
from django.utils import timezone

import fanout.worker
from fanout.models import CapacityPool, ItemClaim, ItemStatus, RunStatus
from fanout.report import held_back
from tests.procs import wait_until
from tests.testapp.fanouts_pools import HOLD_POOL, THROTTLE_POOL
from tests.testapp.models import Execution

from .workers import Workers, finished

pytestmark = pytest.mark.django_db(transaction=True)


def test_throttled_backs_the_whole_pool_off_and_charges_no_attempt(inline: Any) -> None:
    CapacityPool.objects.create(name=THROTTLE_POOL, max_concurrency=1)
    # One slot, taken first by k00000 (items are admitted in index order), which is throttled.
    handle = inline("pools_throttle", {"n": 5, "throttle": {"k00000": 2.0}}, "throttled", 3)
    run_id = handle.run.pk

    pool = wait_until(
        lambda: CapacityPool.objects.filter(
            name=THROTTLE_POOL, backoff_until__isnull=False
        ).first(),
        10,
        "the pool to back off",
    )
    now = timezone.now()
    assert now < pool.backoff_until, "the backoff ended before it could be looked at"
    # The other items wait on the pool, visibly; the throttled one waits for its own retry.
    assert held_back(run_id, now) == {f"{THROTTLE_POOL}: throttled": 4, "retry not yet due": 1}
    throttled = ItemClaim.objects.get(run_id=run_id, key="k00000")
    assert (throttled.status, throttled.attempt) == (ItemStatus.PENDING, 1)

    run = finished(handle)

    assert run.status == RunStatus.SUCCEEDED
    calls = list(Execution.objects.filter(run_id=run_id).order_by("started"))
    assert Counter(c.key for c in calls) == {
        "k00000": 2,
        "k00001": 1,
        "k00002": 1,
        "k00003": 1,
        "k00004": 1,
    }
    # Nothing of the pool started before the backoff ended, and no attempt was charged.
    assert all(c.started >= pool.backoff_until.timestamp() for c in calls[1:])
    assert [c.attempt for c in calls] == [1] * 6
    assert set(ItemClaim.objects.filter(run_id=run_id).values_list("attempt", flat=True)) == {1}


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count, per reason, the claims this process's workers were refused."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()
    real = fanout.worker.claim

    def counting(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not result.items:
            with lock:
                seen[result.reason] += 1
        return result

    monkeypatch.setattr(fanout.worker, "claim", counting)
    return seen


@pytest.mark.parametrize(
    ("held", "reason", "resumed"),
    [
        ({"paused": True}, "pool paused", {"paused": False}),
        ({"max_concurrency": 0}, "pool full (0/0)", {"max_concurrency": 2}),
    ],
    ids=["paused", "max_concurrency_0"],
)
def test_a_held_pool_keeps_every_item_waiting_visibly_and_drains_once_resumed(
    inline: Any, refusals: Counter[str], held: dict[str, Any], reason: str, resumed: dict[str, Any]
) -> None:
    CapacityPool.objects.create(name=HOLD_POOL, **{"max_concurrency": 2, **held})
    handle = inline("pools_hold", {"n": 5}, "held", 3)
    run_id = handle.run.pk

    # Every worker has asked for items, more than once, and was told why not.
    wait_until(lambda: refusals[f"{HOLD_POOL}: {reason}"] >= 9, 10, "workers to be refused")
    assert set(refusals) == {f"{HOLD_POOL}: {reason}"}
    assert held_back(run_id) == {f"{HOLD_POOL}: {reason}": 5}
    assert (
        list(ItemClaim.objects.filter(run_id=run_id).values_list("status", "attempt"))
        == [(ItemStatus.PENDING, 1)] * 5
    )
    assert not Execution.objects.filter(run_id=run_id).exists()

    # An operator resumes the pool while the workers wait: they drain it.
    CapacityPool.objects.filter(name=HOLD_POOL).update(**resumed)
    run = finished(handle)

    assert run.status == RunStatus.SUCCEEDED
    assert Counter(Execution.objects.filter(run_id=run_id).values_list("key", "attempt")) == {
        (f"k{i:05d}", 1): 1 for i in range(5)
    }


def test_run_fanout_progress_shows_why_items_wait(workers: Workers) -> None:
    CapacityPool.objects.create(name=HOLD_POOL, max_concurrency=2, paused=True)
    (proc,) = workers([["run_fanout", "pools_hold", "--run-key", "shown", "--param", "n=4"]])
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in iter(proc.stdout.readline, "")],
        daemon=True,
    )
    reader.start()

    def progress_line() -> str:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if "waiting:" in line:
                return line
        raise AssertionError("run_fanout printed no progress line saying why items wait")

    assert "waiting: 4 pools-hold: pool paused" in progress_line()
    CapacityPool.objects.filter(name=HOLD_POOL).update(paused=False)
    reader.join(30)
    assert not reader.is_alive(), "run_fanout did not finish"
    code = proc.wait(10)
    rest = [lines.get() for _ in range(lines.qsize())]
    assert code == 0, proc.stderr.read()
    assert any("SUCCEEDED" in line for line in rest), rest
