"""host_max_parallel: at most N of a definition's items run at once on any one host."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fanout.definition import get_definition
from fanout.dispatch import prepare_run
from fanout.models import RunStatus
from tests import procs
from tests.pools.ledger import max_in_flight
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def run_on_two_hosts(
    run_id: int, database_url: str, tmp_path: Path, children: list[Any], exit_code: int = 0
) -> dict[str, str]:
    """Two processes on each of two hosts (named by FANOUT_HOST_NAME), six threads each,
    resume the run from the same instant; return each process's host by pid."""
    command = ["run_fanout", "--resume", str(run_id), "--workers", "6", "--json"]
    go = tmp_path / "go"
    hosts = {}
    started = []
    for n, host in enumerate(["host-a", "host-a", "host-b", "host-b"]):
        env = procs.child_env(database_url, FANOUT_HOST_NAME=host)
        proc = procs.spawn_manage(command, env, tmp_path / f"ready-{n}", go)
        children.append(proc)
        started.append(proc)
        hosts[str(proc.pid)] = host
    procs.release_together(started, [tmp_path / f"ready-{n}" for n in range(4)], go)
    for proc in started:
        code, out, err = procs.finish(proc, timeout=120)
        assert code == exit_code, err
    return hosts


def test_two_hosts_each_run_at_most_host_max_parallel_items_at_once(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    run = prepare_run(get_definition("slots_per_host"), {"n": 60, "sleep": 0.05}, uuid.uuid4().hex)
    hosts = run_on_two_hosts(run.pk, database_url, tmp_path, children)

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    by_host: dict[str, list[Execution]] = defaultdict(list)
    for row in Execution.objects.filter(run_id=run.pk):
        by_host[hosts[row.worker]].append(row)
    assert sum(len(rows) for rows in by_host.values()) == 60
    assert {host: max_in_flight(rows) for host, rows in by_host.items()} == {
        "host-a": 2,
        "host-b": 2,
    }


def test_compensations_keep_to_host_max_parallel_on_each_host_counted_apart_from_items(
    database_url: str, tmp_path: Path, children: list[Any]
) -> None:
    # 15 charges succeed and one fails: the run compensates the 15, in parallel with a budget
    # of 8, but at most one at a time on each host.
    params = {"n": 16, "sleep": 0.05, "failing": ["s00015"], "refund_sleep": 0.2}
    run = prepare_run(get_definition("comp_per_host"), params, uuid.uuid4().hex)
    # run_fanout exits 4: the run failed, and was compensated.
    hosts = run_on_two_hosts(run.pk, database_url, tmp_path, children, exit_code=4)

    run.refresh_from_db()
    assert run.status == RunStatus.COMPENSATED, run.error
    rows = Execution.objects.filter(run_id=run.pk)
    undo: dict[str, list[Execution]] = defaultdict(list)
    forward: dict[str, list[Execution]] = defaultdict(list)
    for row in rows:
        (undo if row.key.startswith("undo:") else forward)[hosts[row.worker]].append(row)
    assert sum(len(r) for r in undo.values()) == 15
    assert {host: max_in_flight(r) for host, r in undo.items()} == {"host-a": 1, "host-b": 1}
    assert {host: max_in_flight(r) for host, r in forward.items()} == {"host-a": 1, "host-b": 1}
