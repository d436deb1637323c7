"""Groups: different members at once, each with its own options, joined by name."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fanout import FanOut, FanoutError, Group, Step
from fanout.definition import get_definition, registered
from fanout.models import BatchRun, ItemAttempt, ItemClaim, ItemStatus, RunStatus
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def run_group(name: str, **params: Any) -> BatchRun:
    return get_definition(name).start(params, run_key=uuid.uuid4().hex)


def spans(run: BatchRun) -> dict[str, tuple[float, float]]:
    rows = Execution.objects.filter(run_id=run.pk).order_by("started")
    return {r.key: (r.started, r.ended) for r in rows}


def test_a_groups_members_run_at_once_and_its_join_is_keyed_by_member_name() -> None:
    run = run_group("group_onboard", customer=7, sleep=0.3, n=2)

    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_result == {
        "email": {"sent_to": 7},
        "crm": {"crm": "synced"},
        "repos": {"items": 2, "succeeded": 2},
    }
    # Each member's item got the group's params as its payload, and they overlapped in time.
    email, crm = spans(run)["email"], spans(run)["crm"]
    assert email[0] < crm[1] and crm[0] < email[1]
    child = BatchRun.objects.get(parent_item__run=run, parent_item__key="repos")
    assert child.definition == "nest_files" and child.params["customer"] == 7


def test_a_step_keeps_its_own_attempts() -> None:
    # The group's default is 3 attempts; the email step has 5 and needs 4.
    run = run_group("group_onboard", customer=1, email_flaky=3, n=1)

    assert run.status == RunStatus.SUCCEEDED, run.error
    email = ItemClaim.objects.get(run=run, key="email")
    assert email.attempt == 4
    assert ItemAttempt.objects.filter(item=email).count() == 3


def test_each_failure_policy_holds_for_a_group() -> None:
    collect = run_group("group_onboard", crm_broken=True, n=1)
    fail_fast = run_group("group_fail_fast", crm_broken=True, n=1)
    tolerate = run_group("group_tolerate", crm_broken=True, n=1)

    assert collect.status == RunStatus.FAILED
    assert fail_fast.status == RunStatus.FAILED
    assert tolerate.status == RunStatus.SUCCEEDED
    assert tolerate.join_result["crm"] is None
    for run in (collect, fail_fast, tolerate):
        crm = ItemClaim.objects.get(run=run, key="crm")
        assert (crm.status, crm.error_class) == (ItemStatus.FAILED, "PermanentError")


def test_a_group_is_refused_clearly_when_a_member_is_not_runnable() -> None:
    with pytest.raises(FanoutError, match="member 'x' must be a Step, a FanOut or a callable"):
        Group("group_bad", steps={"x": 42})
    with pytest.raises(FanoutError, match="steps must be a non-empty mapping"):
        Group("group_empty", steps={})
    with pytest.raises(FanoutError, match="Step max_attempts"):
        Step(print, max_attempts=0)


def test_a_groups_steps_are_compensated_when_it_fails() -> None:
    # "ship" fails after the others succeeded: each of them is undone once, latest first.
    run = run_group("group_compensating", failing=["ship"], slow={"ship": 0.3}, sleep=0)

    assert run.status == RunStatus.COMPENSATED, run.error
    statuses = dict(ItemClaim.objects.filter(run=run).values_list("key", "status"))
    assert statuses == {
        "reserve": ItemStatus.COMPENSATED,
        "pay": ItemStatus.COMPENSATED,
        "ship": ItemStatus.FAILED,
    }
    undone = Execution.objects.filter(run_id=run.pk, key__startswith="undo:").order_by("started")
    finished = ItemClaim.objects.filter(run=run, key__in=["reserve", "pay"]).order_by(
        "-finished_at"
    )
    assert [u.key for u in undone] == [f"undo:{i.key}" for i in finished]


def test_a_step_compensation_must_be_callable_and_only_on_steps() -> None:
    with pytest.raises(FanoutError, match="Step compensate must be callable"):
        Step(print, compensate=42)
    with pytest.raises(FanoutError, match="give compensate= on its Steps, not on the group"):
        Group("group_both", steps={"a": Step(print, compensate=print)}, compensate=print)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("timeout", "5", "timeout must be a number > 0, got '5'"),
        ("timeout", float("nan"), "timeout must be a number > 0, got nan"),
        ("max_attempts", 2.5, "max_attempts must be an integer >= 1, got 2.5"),
        ("compensate", 42, "compensate must be callable, got 42"),
        ("requires", "", "requires must be a name (1 to 200 characters), got ''"),
    ],
)
def test_a_step_refuses_a_bad_option_as_a_fanout_does_with_the_same_words(
    option: str, value: Any, message: str
) -> None:
    with pytest.raises(FanoutError) as as_step:
        Step(print, **{option: value})
    with pytest.raises(FanoutError) as as_fanout:
        FanOut("group_bad_option", over=list, do=print, **{option: value})

    assert str(as_step.value) == f"Step {message}"
    assert str(as_fanout.value) == f"fan-out 'group_bad_option': {message}"
    assert "group_bad_option" not in registered()
