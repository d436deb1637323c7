"""A prune can rest between its batches, so that a live run beside it keeps its pace."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from fanout import prune as prune_module
from fanout.models import BatchRun, ItemClaim
from tests.procs import child_env, finish, spawn_manage, wait_until
from tests.test_prune import finished_run

pytestmark = pytest.mark.django_db(transaction=True)


def watch_prune(proc: subprocess.Popen[str], run_id: int) -> list[int]:
    """The run's item counts as another connection sees them while the prune runs."""
    seen: list[int] = []
    while proc.poll() is None:
        n = ItemClaim.objects.filter(run_id=run_id).count()
        if not seen or seen[-1] != n:
            seen.append(n)
        time.sleep(0.02)  # a poll's interval: the prune's pace is what is measured
    return seen


def test_a_prune_with_a_pause_rests_between_its_batches(
    database_url: str, children: list[subprocess.Popen[str]]
) -> None:
    run = finished_run("t_ledger", 40, n=60)
    pause = 0.5
    args = ["fanout_prune", "--older-than", "30d", "--batch", "10", "--pause", str(pause)]
    started = time.monotonic()
    proc = spawn_manage([*args, "--json"], child_env(database_url))
    children.append(proc)

    seen = watch_prune(proc, run.pk)
    took = time.monotonic() - started
    code, out, err = finish(proc)

    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["items"] == 60
    # Six batches of ten, each committed on its own, with a rest after each but the last:
    # another connection sees the run between them, a batch at a time.
    assert set(seen) <= {60, 50, 40, 30, 20, 10, 0}
    assert len([n for n in seen if 0 < n < 60]) >= 3, seen
    assert took >= 5 * pause
    assert not ItemClaim.objects.filter(run_id=run.pk).exists()


@pytest.mark.parametrize("pause", ["inf", "nan", "-1"])
def test_a_pause_that_is_not_a_finite_number_of_seconds_is_refused_before_anything_goes(
    pause: str,
) -> None:
    run = finished_run("t_ledger", 40, n=3)
    with pytest.raises(CommandError, match="--pause"):
        call_command("fanout_prune", "--older-than", "30d", "--batch", "1", "--pause", pause)
    assert ItemClaim.objects.filter(run_id=run.pk).count() == 3


def test_a_resting_prune_keeps_its_tree_from_a_second_pruner_until_it_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hold is taken once for HOLD_SECONDS; rests add up past it on a large tree (300 s is
    # 300 full batches at the default pause, 600,000 items), after which a second pruner (the
    # supervisors' retention, another fanout_prune) took the same tree.
    monkeypatch.setattr(prune_module, "HOLD_SECONDS", 1.0)
    run = finished_run("t_ledger", 40, n=8)
    assert prune_module.take(run.pk)
    pruning = threading.Thread(
        target=lambda: (prune_module.prune_tree(run.pk, batch=1, pause=0.4), connection.close())
    )
    pruning.start()
    try:
        # Well past the hold, the prune still resting between its batches.
        wait_until(lambda: ItemClaim.objects.filter(run_id=run.pk).count() <= 3, 30, "five batches")
        assert ItemClaim.objects.filter(run_id=run.pk).exists()
        assert not prune_module.take(run.pk), "a second pruner took a tree being pruned"
    finally:
        pruning.join(30)
    assert not BatchRun.objects.filter(pk=run.pk).exists()
