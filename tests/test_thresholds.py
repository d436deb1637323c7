"""Failure thresholds: a run fails once more than N (or a share) of its items failed."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fanout import FanOut
from fanout.actions import retry_failed
from fanout.definition import get_definition
from fanout.dispatch import InlineExecutor, prepare_run
from fanout.errors import FanoutError
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = 4


def run_to_end(name: str, **params: Any) -> BatchRun:
    run = prepare_run(get_definition(name), params, uuid.uuid4().hex)
    executor = InlineExecutor(run, get_definition(name), workers=WORKERS).start()
    executor.join(60)
    assert not executor.alive
    run.refresh_from_db()
    return run


def statuses(run: BatchRun) -> dict[str, int]:
    return {
        s: ItemClaim.objects.filter(run=run, status=s).count()
        for s in (ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED)
    }


def test_a_run_fails_once_more_than_max_failures_items_failed_and_cancels_the_rest() -> None:
    # Every other item of 200 fails: the threshold (5) is crossed early.
    run = run_to_end("slots_max_failures", n=200, sleep=0.01, failing=list(range(0, 200, 2)))

    assert run.status == RunStatus.FAILED
    assert run.error.startswith("the run failed: ")
    assert "more than max_failures=5" in run.error
    counts = statuses(run)
    # Failures stop at the threshold plus what was already running on the 4 workers.
    assert 6 <= counts[ItemStatus.FAILED] <= 5 + 1 + WORKERS
    assert counts[ItemStatus.CANCELLED] > 100
    cancelled = ItemClaim.objects.filter(run=run, status=ItemStatus.CANCELLED).first()
    assert cancelled is not None and cancelled.error_class == "FailureThreshold"
    # Cancelled items never ran.
    ran = set(Execution.objects.filter(run_id=run.pk).values_list("key", flat=True))
    assert not ran & set(
        ItemClaim.objects.filter(run=run, status=ItemStatus.CANCELLED).values_list("key", flat=True)
    )


def test_a_tolerant_run_under_its_failure_rate_succeeds() -> None:
    run = run_to_end("slots_failure_rate", n=50, failing=[3, 17, 31])  # 6%

    assert run.status == RunStatus.SUCCEEDED
    assert statuses(run)[ItemStatus.FAILED] == 3


def test_a_tolerant_run_over_its_failure_rate_fails_and_says_so() -> None:
    run = run_to_end("slots_failure_rate", n=100, sleep=0.01, failing=list(range(0, 100, 3)))

    assert run.status == RunStatus.FAILED
    assert "more than max_failure_rate=0.1" in run.error
    counts = statuses(run)
    assert 11 <= counts[ItemStatus.FAILED] <= 10 + 1 + WORKERS
    assert counts[ItemStatus.CANCELLED] > 0


def test_retry_failed_reopens_the_items_a_threshold_cancelled() -> None:
    run = run_to_end("slots_max_failures", n=40, sleep=0.01, failing=list(range(0, 40, 2)))
    assert run.status == RunStatus.FAILED
    before = statuses(run)

    reopened = retry_failed(run)

    assert reopened == before[ItemStatus.FAILED] + before[ItemStatus.CANCELLED]
    assert statuses(run)[ItemStatus.SUCCEEDED] == before[ItemStatus.SUCCEEDED]
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.PENDING).count() == reopened


@pytest.mark.parametrize(
    "options",
    [{"max_failures": -1}, {"max_failure_rate": 1.5}, {"max_failure_rate": "5%"}],
)
def test_a_bad_threshold_is_refused_with_a_clear_message(options: dict[str, Any]) -> None:
    with pytest.raises(FanoutError, match="max_failure"):
        FanOut("t_bad_threshold", over=list, do=print, **options)
