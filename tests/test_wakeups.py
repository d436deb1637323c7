"""An idle worker thread is woken by capacity freed in its process, even when the wake-up
came while it was looking at runs instead of waiting for one."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from fanout import worker
from fanout.claim import claim
from fanout.definition import get_definition
from fanout.lease import Keepers
from fanout.models import BatchRun, CapacityPool, ItemClaim, ItemStatus, RunStatus
from tests.conftest import prepare
from tests.procs import wait_until
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

POOL = "wakeup-pool"


class FreesWhileLooking(worker.Roam):
    """A roaming thread that, after its first round of looking and before it waits, lets
    ``free`` run: the pool's one slot is given back while the thread is not waiting."""

    free: Any = None

    def _home_open(self) -> bool:
        free, self.free = self.free, None
        if free is not None:
            free()
        return super()._home_open()


@override_settings(FANOUT_IDLE_MAX_SECONDS=300)
def test_a_slot_freed_while_an_idle_thread_looks_at_runs_is_claimed_by_it_before_it_sleeps(
    tmp_path: Path,
) -> None:
    CapacityPool.objects.create(name=POOL, max_concurrency=1)
    block = tmp_path / "go"
    run = prepare("pools_named", {"n": 2, "pool": POOL, "block_file": str(block)})
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, executor="rq")
    definition = get_definition("pools_named")
    keepers = Keepers()
    stop = threading.Event()

    # A holds the pool's one slot: its handler waits for the file.
    holder = worker.Drain(
        run.pk,
        definition,
        keepers.for_lease(definition.lease_seconds),
        run.params,
        owner="holder",
        idle_exit=None,
    )
    held = threading.Thread(target=holder, name="holder", daemon=True)
    held.start()
    items = ItemClaim.objects.filter(run=run)
    wait_until(lambda: items.filter(owner="holder", status=ItemStatus.RUNNING).exists(), 60, "A")

    def free() -> None:
        # B was just refused (the pool is full) and has not started waiting: A records its
        # item and gives the slot back now, waking idle threads that are not waiting yet.
        holder.stop.set()
        block.touch()
        held.join(60)
        assert items.filter(owner="holder", status=ItemStatus.SUCCEEDED).count() == 1

    roam = FreesWhileLooking(
        definition.queue,
        keepers,
        owner="idle",
        stop=stop,
        deadline=time.monotonic() + 600,
        idle_exit=300,
    )
    roam.free = free
    idle = threading.Thread(target=roam, name="idle-roam", daemon=True)
    idle.start()
    try:
        # Its refusal gated the run for FANOUT_IDLE_MAX_SECONDS (300 s) and nothing else
        # frees a slot: only the wake-up it missed while looking brings it back.
        wait_until(
            lambda: (
                Execution.objects.filter(run_id=run.pk, worker__endswith=":idle-roam")
                .exclude(ended=None)
                .exists()
            ),
            60,
            "the idle thread to run the freed slot's item",
        )
    finally:
        stop.set()
        worker.wake_all()
        idle.join(10)
        keepers.stop()
    assert items.filter(status=ItemStatus.SUCCEEDED).count() == 2
    assert CapacityPool.objects.get(name=POOL).in_flight == 0


def waiting_in(thread: threading.Thread) -> bool:
    """Whether the thread is blocked in a threading wait (a condition, an event)."""
    frame = sys._current_frames().get(thread.ident or 0)
    return frame is not None and frame.f_code.co_filename == threading.__file__


@override_settings(FANOUT_IDLE_MAX_SECONDS=300)
def test_a_thread_that_finds_another_claiming_the_run_takes_the_next_turn_without_looking_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[int] = []

    def open_runs(*args: Any) -> Any:
        looks.append(1)
        return real_open_runs(*args)

    real_open_runs = worker.open_runs
    monkeypatch.setattr(worker, "open_runs", open_runs)
    CapacityPool.objects.create(name=POOL, max_concurrency=2)
    block = tmp_path / "go"
    run = prepare("pools_named", {"n": 3, "pool": POOL, "block_file": str(block)})
    BatchRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, executor="rq")
    definition = get_definition("pools_named")
    keepers = Keepers()
    stop = threading.Event()
    items = ItemClaim.objects.filter(run=run)

    # Another thread of this process holds the run's turn: its claim is under way.
    assert worker._gate_wait(run.pk, wait=True) is False
    roam = worker.Roam(
        definition.queue,
        keepers,
        owner="idle",
        stop=stop,
        deadline=time.monotonic() + 600,
        idle_exit=300,
    )
    idle = threading.Thread(target=roam, name="idle-roam", daemon=True)
    idle.start()
    try:
        wait_until(lambda: looks and waiting_in(idle), 60, "the thread to wait")
        # The claim under way takes its slot, and answers as a worker's claim does.
        taken = claim(run.pk, "holder", 1, definition.lease_seconds, 3, None)
        worker._gate_set(run.pk, taken)
        assert [i.key for i in taken.items] == ["k00000"]
        wait_until(
            lambda: items.filter(owner="idle", status=ItemStatus.RUNNING).exists(),
            60,
            "the waiting thread to claim the next slot",
        )
        assert len(looks) == 1  # the run was looked at once, before the claim under way
    finally:
        block.touch()
        stop.set()
        worker.wake_all()
        idle.join(30)
        keepers.stop()
