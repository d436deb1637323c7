"""Time is the database's: workers whose clocks disagree by minutes share a run correctly."""

from __future__ import annotations

import glob
import json
import os
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fanout.clock import db_now
from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from fanout.waiting import RETRY_NOT_DUE
from tests import procs
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

SKEWS = {"+90s": 90.0, "-90s": -90.0, "": 0.0}

# A host whose clock is wrong has a wrong wall clock and a right monotonic one. libfaketime
# shifts the monotonic clock too unless told not to, and then every timed wait of a thread
# lasts the shift longer; told not to, it breaks time.sleep's absolute-deadline sleep
# (EINVAL). So the skewed children keep a true monotonic clock and sleep on an Event, which
# waits on that clock.
SLEEP_SHIM = """
import threading
import time


def _sleep(seconds):
    if seconds > 0:
        threading.Event().wait(seconds)


time.sleep = _sleep
"""


def skewed(env: dict[str, str], skew: str, shim: Path) -> dict[str, str]:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        pytest.fail("libfaketime is missing: `make test` installs Debian's faketime package")
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    path = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return {
        **env,
        "LD_PRELOAD": found[0],
        "FAKETIME": skew,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }


def test_workers_whose_clocks_are_90_seconds_apart_run_every_item_once_and_all_take_part(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    run = prepare_run(get_definition("slots_skew"), {"n": 120, "sleep": 0.05}, uuid.uuid4().hex)
    command = ["run_fanout", "--resume", str(run.pk), "--workers", "2", "--json"]
    go = tmp_path / "go"
    started = {}
    for n, skew in enumerate(SKEWS):
        env = procs.child_env(database_url)
        if skew:
            env = skewed(env, skew, tmp_path / "shim")
        proc = procs.spawn_manage(command, env, tmp_path / f"ready-{n}", go)
        children.append(proc)
        started[skew] = proc
    procs.release_together(list(started.values()), [tmp_path / f"ready-{n}" for n in range(3)], go)
    begun = time.time()

    for proc in started.values():
        code, out, err = procs.finish(proc, timeout=120)
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["status"] == RunStatus.SUCCEEDED

    run = BatchRun.objects.get(pk=run.pk)
    assert run.status == RunStatus.SUCCEEDED
    calls = Counter(Execution.objects.filter(run_id=run.pk).values_list("key", flat=True))
    assert len(calls) == 120
    twice = sorted(k for k, n in calls.items() if n > 1)
    assert twice == [], f"{len(twice)} items ran more than once"
    by_worker = Counter(Execution.objects.filter(run_id=run.pk).values_list("worker", flat=True))
    for skew, proc in started.items():
        assert by_worker[str(proc.pid)] > 0, f"the worker with clock {skew or '+0s'} ran nothing"
        # The skew was real: the ledger holds each worker's own idea of the time.
        first = Execution.objects.filter(run_id=run.pk, worker=str(proc.pid)).first()
        assert first is not None and abs(first.started - begun - SKEWS[skew]) < 30


def test_a_failed_spawn_on_a_host_behind_the_database_ends_after_it_started(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    # An item's end is placed on the database's clock (its start plus the handler's monotonic
    # time), never on the host's: a host 90 s behind must not end an item before it began.
    run = prepare_run(get_definition("t_spawn_refused"), {"n": 3}, uuid.uuid4().hex)
    env = skewed(procs.child_env(database_url), "-90s", tmp_path / "shim")
    code, out, err = procs.finish(
        procs.spawn_manage(["run_fanout", "--resume", str(run.pk), "--json"], env), timeout=120
    )

    assert json.loads(out.strip().splitlines()[-1])["status"] == RunStatus.FAILED, err
    items = list(ItemClaim.objects.filter(run_id=run.pk))
    assert {(i.status, i.error_class) for i in items} == {(ItemStatus.FAILED, "SpawnFailed")}
    for item in items:
        assert item.started_at is not None and item.finished_at is not None
        assert item.finished_at >= item.started_at, (item.key, item.finished_at - item.started_at)


def test_the_console_on_a_host_ahead_of_the_database_sees_a_retry_not_yet_due(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    # Whether a retry is due is the database's to say, in the console's list as in the claim:
    # a host 90 s ahead must not call a retry due in 60 s ready to run.
    run = prepare_run(get_definition("t_ledger"), {"n": 1}, uuid.uuid4().hex)
    ItemClaim.objects.filter(run=run).update(
        attempt=1, next_attempt_at=db_now() + timedelta(seconds=60)
    )
    env = skewed(procs.child_env(database_url), "+90s", tmp_path / "shim")
    proc = procs.spawn_manage(["fanout_runs", "--json"], env)
    children.append(proc)
    code, out, err = procs.finish(proc, timeout=60)

    assert code == 0, err
    listed = {r["id"]: r for r in json.loads(out)}
    assert listed[run.pk]["waiting"] == {RETRY_NOT_DUE: 1}
