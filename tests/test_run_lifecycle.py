"""A run from start to join: failure policies, retries, outcomes that never erase each other."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from fanout.actions import retry_failed
from fanout.definition import get_definition
from fanout.dispatch import dispatch, resume
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.report import final_report
from tests.conftest import executions, items, keys, start
from tests.testapp.models import Execution, Observation

pytestmark = pytest.mark.django_db(transaction=True)


def attempts(run_id: int, key: str) -> list[int]:
    """The attempt numbers the handler saw for ``key``, in order."""
    return list(
        Execution.objects.filter(run_id=run_id, key=key)
        .order_by("pk")
        .values_list("attempt", flat=True)
    )


def joins() -> list[dict[str, Any]]:
    return list(Observation.objects.filter(name="join").values_list("value", flat=True))


def statuses(run_id: int) -> dict[str, str]:
    return {k: i.status for k, i in items(run_id).items()}


def square(i: int) -> dict[str, int]:
    return {"i": i, "square": i * i}


def test_a_run_that_succeeds_joins_once_over_every_outcome_and_stores_the_result() -> None:
    run = start("t_collect", {"n": 6}, workers=3)

    assert run.status == RunStatus.SUCCEEDED
    assert run.join_runs == 1
    assert run.join_result == {"count": 6, "succeeded": 6, "sum": 15}
    assert run.finished_at is not None
    # The join saw every item, each already terminal.
    assert joins() == [{"count": 6, "statuses": ["succeeded"]}]
    assert executions(run.pk) == dict.fromkeys(keys(6), 1)
    assert {k: i.result for k, i in items(run.pk).items()} == {
        f"k{i:05d}": square(i) for i in range(6)
    }


def test_collect_runs_every_item_and_fails_the_run_if_any_failed() -> None:
    run = start("t_collect", {"n": 6, "permanent": ["k00002"]}, workers=3)

    assert run.status == RunStatus.FAILED
    assert executions(run.pk) == dict.fromkeys(keys(6), 1)
    assert statuses(run.pk) == {
        **dict.fromkeys(keys(6), ItemStatus.SUCCEEDED),
        "k00002": ItemStatus.FAILED,
    }
    assert run.join_runs == 1
    assert run.join_result == {"count": 6, "succeeded": 5, "sum": 13}
    report = final_report(run)
    assert report["failed"] == [
        {"key": "k00002", "error": "fanout.errors.PermanentError: k00002 is broken for good"}
    ]
    assert report["counts"]["succeeded"] == 5
    assert report["counts"]["failed"] == 1


def test_fail_fast_cancels_unclaimed_items_and_lets_running_ones_finish() -> None:
    # k00000 is running when k00001 fails: it waits for that failure, then succeeds.
    params = {"n": 20, "permanent": ["k00001"], "await_failed": {"k00000": "k00001"}}

    run = start("t_fail_fast", params, workers=2)  # max_parallel=2

    assert run.status == RunStatus.FAILED
    rows = items(run.pk)
    assert rows["k00000"].status == ItemStatus.SUCCEEDED
    assert rows["k00000"].result == square(0)
    assert rows["k00001"].status == ItemStatus.FAILED
    assert {k: r.status for k, r in rows.items() if k not in ("k00000", "k00001")} == (
        dict.fromkeys(keys(20)[2:], ItemStatus.CANCELLED)
    )
    assert "k00001" in rows["k00002"].error
    assert executions(run.pk) == {"k00000": 1, "k00001": 1}
    assert run.join_runs == 1
    assert joins() == [{"count": 20, "statuses": ["cancelled", "failed", "succeeded"]}]


def test_fail_fast_does_not_retry_an_item_after_the_run_has_failed() -> None:
    # k00000 is running when k00001 fails; then it raises an error that would be retried.
    params = {
        "n": 3,
        "permanent": ["k00001"],
        "await_failed": {"k00000": "k00001"},
        "flaky": {"k00000": 2},
    }

    run = start("t_fail_fast", params, workers=2)

    assert run.status == RunStatus.FAILED
    assert attempts(run.pk, "k00000") == [1]
    assert items(run.pk)["k00000"].status in (ItemStatus.FAILED, ItemStatus.CANCELLED)
    assert items(run.pk)["k00002"].status == ItemStatus.CANCELLED


def test_tolerate_succeeds_and_lists_the_failures_in_the_report() -> None:
    run = start("t_tolerate", {"n": 5, "permanent": ["k00001", "k00003"]}, workers=2)

    assert run.status == RunStatus.SUCCEEDED
    assert executions(run.pk) == dict.fromkeys(keys(5), 1)
    report = final_report(run)
    assert report["status"] == "succeeded"
    assert [f["key"] for f in report["failed"]] == ["k00001", "k00003"]
    assert all("broken for good" in f["error"] for f in report["failed"])
    assert report["counts"]["succeeded"] == 3


@pytest.mark.parametrize(
    ("name", "permanent", "expected"),
    [
        ("t_any", ["k00000", "k00001", "k00002"], RunStatus.SUCCEEDED),
        ("t_any", ["k00000", "k00001", "k00002", "k00003"], RunStatus.FAILED),
        ("t_collect", ["k00000"], RunStatus.FAILED),
    ],
    ids=["any-with-one-success", "any-with-none", "all-with-one-failure"],
)
def test_the_join_mode_decides_whether_a_run_with_failures_succeeded(
    name: str, permanent: list[str], expected: str
) -> None:
    run = start(name, {"n": 4, "permanent": permanent}, workers=2)

    assert run.status == expected
    assert run.join_runs == 1


def test_a_permanent_error_fails_the_item_at_once() -> None:
    run = start("t_collect", {"n": 1, "permanent": ["k00000"]}, workers=1)

    row = items(run.pk)["k00000"]
    assert (row.status, row.attempt, row.error_class) == (ItemStatus.FAILED, 1, "PermanentError")
    assert "k00000 is broken for good" in row.error
    assert attempts(run.pk, "k00000") == [1]


def test_other_exceptions_are_retried_until_max_attempts() -> None:
    assert get_definition("t_collect").max_attempts == 3
    # k00000 always fails; k00001 fails twice and then succeeds.
    run = start("t_collect", {"n": 2, "flaky": {"k00000": 9, "k00001": 2}}, workers=2)

    rows = items(run.pk)
    assert attempts(run.pk, "k00000") == [1, 2, 3]
    assert (rows["k00000"].status, rows["k00000"].attempt) == (ItemStatus.FAILED, 3)
    assert rows["k00000"].error_class == "RuntimeError"
    assert "flaked on attempt 3" in rows["k00000"].error
    assert attempts(run.pk, "k00001") == [1, 2, 3]
    assert (rows["k00001"].status, rows["k00001"].result) == (ItemStatus.SUCCEEDED, square(1))
    assert rows["k00001"].error == ""
    assert run.status == RunStatus.FAILED


def test_a_handler_result_that_is_not_json_fails_the_item_without_retrying() -> None:
    run = start("t_collect", {"n": 2, "nonjson": ["k00001"]}, workers=1)

    row = items(run.pk)["k00001"]
    assert (row.status, row.error_class, row.result) == (ItemStatus.FAILED, "ResultNotJSON", None)
    assert "not JSON" in row.error
    assert attempts(run.pk, "k00001") == [1]
    assert items(run.pk)["k00000"].status == ItemStatus.SUCCEEDED


def test_a_failed_item_never_erases_a_siblings_outcome() -> None:
    # Batches of 5 items are recorded together: failures and successes in one write.
    assert get_definition("t_batched").batch_size == 5
    params = {"n": 10, "permanent": ["k00003"], "nonjson": ["k00007"], "flaky": {"k00005": 1}}

    run = start("t_batched", params, workers=2)

    rows = items(run.pk)
    failed = {"k00003": "PermanentError", "k00007": "ResultNotJSON"}
    for key, row in rows.items():
        if key in failed:
            assert (row.status, row.error_class, row.result) == (
                ItemStatus.FAILED,
                failed[key],
                None,
            )
        else:
            assert (row.status, row.result, row.error) == (
                ItemStatus.SUCCEEDED,
                square(row.index),
                "",
            ), key
    assert attempts(run.pk, "k00005") == [1, 2]
    assert run.join_result == {"count": 10, "succeeded": 8, "sum": 45 - 3 - 7}
    assert final_report(run)["counts"] == {
        "pending": 0,
        "running": 0,
        "succeeded": 8,
        "failed": 2,
        "cancelled": 0,
    }


@override_settings(FANOUT_JOIN_RETRY_BACKOFF=0.05)
def test_a_join_that_raises_is_retried_then_fails_the_run_and_stores_the_error() -> None:
    run = start("t_join_raises", {"n": 3}, workers=2)

    assert run.status == RunStatus.FAILED
    assert run.join_runs == 3  # FANOUT_JOIN_ATTEMPTS
    assert run.join_result is None
    assert "the join raised ValueError: the join broke on purpose" in run.error
    assert statuses(run.pk) == dict.fromkeys(keys(3), ItemStatus.SUCCEEDED)


def test_retry_failed_reruns_only_failed_items_and_joins_again() -> None:
    # k00002 fails on its first execution only.
    run = start("t_collect", {"n": 5, "permanent_once": ["k00002"]}, workers=2)
    assert run.status == RunStatus.FAILED
    assert run.join_result == {"count": 5, "succeeded": 4, "sum": 8}

    count = retry_failed(run)

    assert count == 1
    assert run.status == RunStatus.RUNNING
    assert run.finished_at is None
    row = items(run.pk)["k00002"]
    assert (row.status, row.attempt) == (ItemStatus.PENDING, 1)
    handle = dispatch(run, get_definition("t_collect"), "inline", workers=2)
    assert handle is not None
    handle.join(timeout=30)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert run.join_runs == 2
    assert run.join_result == {"count": 5, "succeeded": 5, "sum": 10}
    assert run.error == ""
    assert executions(run.pk) == {**dict.fromkeys(keys(5), 1), "k00002": 2}


def test_retry_failed_on_a_run_without_failures_changes_nothing() -> None:
    run = start("t_collect", {"n": 3}, workers=1)

    assert retry_failed(run) == 0

    assert run.status == RunStatus.SUCCEEDED
    assert ItemClaim.objects.filter(run=run, status=ItemStatus.SUCCEEDED).count() == 3


def test_resuming_a_finished_run_runs_nothing_again() -> None:
    run = start("t_collect", {"n": 3}, workers=1)

    again, handle = resume(run.pk)

    assert handle is None
    assert again.status == RunStatus.SUCCEEDED
    assert executions(run.pk) == dict.fromkeys(keys(3), 1)
    assert BatchRun.objects.get(pk=run.pk).join_runs == 1


def test_a_run_without_a_join_is_decided_by_its_outcomes() -> None:
    ok = start("t_no_join", {"n": 2}, workers=1)
    bad = start("t_no_join", {"n": 2, "permanent": ["k00000"]}, workers=1)

    assert (ok.status, ok.join_result) == (RunStatus.SUCCEEDED, None)
    assert (bad.status, bad.join_result) == (RunStatus.FAILED, None)
