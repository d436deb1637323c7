"""An item's failed attempts survive retries; signals announce what committed."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from fanout.actions import retry_failed
from fanout.claim import claim
from fanout.models import BatchRun, CapacityPool, ItemAttempt, ItemClaim, ItemStatus
from fanout.signals import item_finished, pool_throttled, run_finished, run_started
from tests.conftest import prepare, start
from tests.testapp.fanouts_pools import THROTTLE_POOL

pytestmark = pytest.mark.django_db(transaction=True)


def history(run: BatchRun, key: str) -> list[tuple[int, str]]:
    return list(
        ItemAttempt.objects.filter(item__run=run, item__key=key).values_list(
            "attempt", "error_class"
        )
    )


def test_an_item_that_failed_twice_then_succeeded_keeps_both_failed_attempts() -> None:
    run = start("t_collect", {"n": 3, "flaky": {"k00001": 2}})

    item = ItemClaim.objects.get(run=run, key="k00001")
    assert (item.status, item.attempt) == (ItemStatus.SUCCEEDED, 3)
    assert history(run, "k00001") == [(1, "RuntimeError"), (2, "RuntimeError")]
    first = ItemAttempt.objects.filter(item=item).first()
    assert first is not None and "flaked on attempt 1" in first.error
    assert first.owner and first.started_at and first.finished_at >= first.started_at
    assert history(run, "k00000") == []  # success writes no history


def test_a_retry_failed_does_not_erase_an_items_history() -> None:
    run = start("t_collect", {"n": 2, "permanent_once": ["k00000"]})
    assert history(run, "k00000") == [(1, "PermanentError")]

    retry_failed(run)
    run = start("t_collect", {"n": 2, "permanent_once": ["k00000"]})

    assert ItemClaim.objects.get(run=run, key="k00000").status == ItemStatus.SUCCEEDED
    assert history(run, "k00000") == [(1, "PermanentError")]


def test_an_attempt_cut_off_by_a_dead_worker_is_in_the_history() -> None:
    run = prepare("t_ledger", {"n": 1})
    claim(run.pk, "doomed-host:1:t", 1, 30, 3, None)
    ItemClaim.objects.filter(run=run).update(lease_expires_at=timezone.now() - timedelta(1))

    claim(run.pk, "survivor", 1, 30, 3, None)

    (lost,) = ItemAttempt.objects.filter(item__run=run)
    assert (lost.attempt, lost.owner, lost.error_class) == (1, "doomed-host:1:t", "WorkerLost")


@pytest.fixture
def heard() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    got: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name, signal in (
        ("run_started", run_started),
        ("item_finished", item_finished),
        ("run_finished", run_finished),
        ("pool_throttled", pool_throttled),
    ):

        def receive(sender: Any, name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            got.append((name, kwargs))

        receivers[name] = receive
        signal.connect(receive, weak=False)
    yield got
    for name, signal in (
        ("run_started", run_started),
        ("item_finished", item_finished),
        ("run_finished", run_finished),
        ("pool_throttled", pool_throttled),
    ):
        signal.disconnect(receivers[name])


def test_signals_announce_a_run_its_finished_items_and_its_end(heard: list) -> None:
    run = start("t_collect", {"n": 4, "permanent": ["k00002"]}, workers=2)

    names = [name for name, _ in heard]
    assert names[0] == "run_started" and names[-1] == "run_finished"
    assert names.count("run_started") == names.count("run_finished") == 1
    finished = {kw["key"]: kw["status"] for name, kw in heard if name == "item_finished"}
    assert finished == {
        "k00000": "succeeded",
        "k00001": "succeeded",
        "k00002": "failed",
        "k00003": "succeeded",
    }
    assert heard[-1][1]["run"].pk == run.pk and heard[-1][1]["run"].status == "failed"


def test_a_throttled_item_announces_its_pool(heard: list) -> None:
    CapacityPool.objects.create(name=THROTTLE_POOL, max_concurrency=4)
    start("pools_throttle", {"n": 2, "throttle": {"k00000": 0.05}}, workers=2)

    throttled = [kw for name, kw in heard if name == "pool_throttled"]
    assert throttled == [{"pool": THROTTLE_POOL, "retry_after": 0.05}]
