"""Nested runs: an item hands its work to a child run and takes the child's outcome."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

import pytest

from fanout.actions import cancel_run, retry_failed
from fanout.definition import get_definition
from fanout.dispatch import resume
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests.procs import other_sessions, wait_until
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def start_tree(wait: bool = True, **params: Any) -> BatchRun:
    return get_definition("nest_orgs").start(params, run_key=uuid.uuid4().hex, wait=wait)


def tree(root: BatchRun) -> list[BatchRun]:
    """The root and every run below it."""
    found, frontier = [root], [root.pk]
    while frontier:
        children = list(BatchRun.objects.filter(parent_item__run_id__in=frontier))
        found += children
        frontier = [c.pk for c in children]
    return found


def wait_tree(root: BatchRun, timeout: float = 60) -> list[BatchRun]:
    """Wait until every run of the tree has ended (the inline children run on their own)."""

    def ended() -> list[BatchRun] | None:
        runs = tree(BatchRun.objects.get(pk=root.pk))
        return runs if all(r.is_terminal for r in runs) else None

    try:
        runs = wait_until(ended, timeout, "the whole tree to end")
    except AssertionError as exc:
        from tests.rq.support import describe_runs

        raise AssertionError(f"{exc}\n{describe_runs()}") from None
    # A child run's inline threads look once more at their run as they leave (a reopened run
    # keeps them): a test that changes the runs next must not race them.
    names = tuple(f"fanout-{r.pk}-" for r in runs)
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith(names)],
        timeout,
        "the tree's inline threads to leave",
    )
    return runs


def leaf_calls(runs: list[BatchRun]) -> Counter[tuple[int, str]]:
    leaves = [r.pk for r in runs if r.definition == "nest_files"]
    return Counter(Execution.objects.filter(run_id__in=leaves).values_list("run_id", "key"))


def test_three_levels_run_every_item_once_and_parents_take_their_childrens_results() -> None:
    root = start_tree(orgs=3, repos=3, files=3)
    runs = wait_tree(root)
    root.refresh_from_db()

    assert root.status == RunStatus.SUCCEEDED, root.error
    assert root.join_result == {"items": 3, "succeeded": 3}
    assert Counter(r.definition for r in runs) == {"nest_orgs": 1, "nest_repos": 3, "nest_files": 9}
    assert all(r.status == RunStatus.SUCCEEDED for r in runs)
    calls = leaf_calls(runs)
    assert len(calls) == 27 and set(calls.values()) == {1}
    org = ItemClaim.objects.get(run=root, key="o0")
    assert org.status == ItemStatus.SUCCEEDED
    assert org.result == {"items": 3, "succeeded": 3}
    # Each child run is linked to the item it decided, and its key derives from it.
    child = BatchRun.objects.get(parent_item=org)
    assert child.run_key == f"spawn:{root.pk}:o0"
    assert all(r.in_flight == 0 for r in BatchRun.objects.filter(pk__in=[r.pk for r in runs]))


def test_a_parents_max_parallel_bounds_how_many_children_run_at_once() -> None:
    root = start_tree(orgs=1, repos=6, files=2, sleep=0.1)
    runs = wait_tree(root)

    repos = next(r for r in runs if r.definition == "nest_repos")
    children = [r for r in runs if r.parent_item_id and r.definition == "nest_files"]
    assert len(children) == 6
    spans = sorted(
        (ts, step) for c in children for ts, step in ((c.started_at, 1), (c.finished_at, -1))
    )
    peak = now = 0
    for _, step in spans:
        now += step
        peak = max(peak, now)
    assert peak == repos.max_parallel == 2


def test_a_failed_grandchild_fails_up_the_tree_and_retry_failed_reaches_only_it() -> None:
    root = start_tree(orgs=2, repos=2, files=3, broken=[[1, 0, 2]])
    runs = wait_tree(root)
    root.refresh_from_db()

    assert root.status == RunStatus.FAILED
    failed_org = ItemClaim.objects.get(run=root, key="o1")
    assert failed_org.status == ItemStatus.FAILED
    assert failed_org.error_class == "ChildRunFailed"
    assert "child run" in failed_org.error and "nest_repos" in failed_org.error
    assert ItemClaim.objects.get(run=root, key="o0").status == ItemStatus.SUCCEEDED

    reopened = retry_failed(root)
    assert reopened == 1
    run, handle = resume(root.pk)
    assert handle is not None
    handle.join(60)
    runs = wait_tree(root)
    root.refresh_from_db()

    assert root.status == RunStatus.SUCCEEDED, root.error
    calls = leaf_calls(runs)
    # Only the broken file ran again; its 11 siblings (and every succeeded parent) did not.
    assert sorted(calls.values()) == [1] * 11 + [2]
    repo_calls = Counter(
        Execution.objects.filter(
            run_id__in=[r.pk for r in runs if r.definition == "nest_repos"]
        ).values_list("run_id", "key")
    )
    assert set(repo_calls.values()) == {1}


def test_cancelling_the_parent_cancels_every_unfinished_descendant() -> None:
    root = start_tree(wait=False, orgs=2, repos=2, files=20, sleep=0.05)
    wait_until(
        lambda: Execution.objects.filter(key__startswith="f").exists(), 30, "a leaf to start"
    )

    cancel_run(root, "stopped by the test")
    runs = wait_tree(root)

    assert BatchRun.objects.get(pk=root.pk).status == RunStatus.CANCELLED
    odd = [(r.pk, r.definition, r.status, r.error[-300:]) for r in runs]
    odd = [r for r in odd if r[2] not in (RunStatus.CANCELLED, RunStatus.SUCCEEDED)]
    assert not odd, f"{odd} (every run: {[(r.pk, r.parent_item_id, r.status) for r in runs]})"
    cancelled = [r for r in runs if r.status == RunStatus.CANCELLED]
    assert len(cancelled) >= 3
    leaves = [r for r in runs if r.definition == "nest_files"]
    assert sum(r.items.filter(status=ItemStatus.CANCELLED).count() for r in leaves) > 0
    wait_until(lambda: other_sessions() == 0, 30, "the tree's worker threads to end")
