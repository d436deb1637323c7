"""Helpers of the RQ executor tests: reading runs, the ledger and Redis, waiting on them."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from redis import Redis

from fanout.models import BatchRun, ItemClaim, ItemStatus, RunStatus
from tests.procs import wait_until
from tests.testapp.fanouts_rq import rq_key
from tests.testapp.models import Execution


def keys(n: int) -> list[str]:
    return [rq_key(i) for i in range(n)]


def executions(run_id: int) -> Counter[str]:
    """How many times the handler was called for each key of the run."""
    return Counter(Execution.objects.filter(run_id=run_id).values_list("key", flat=True))


def calls(run_id: int, key: str) -> list[Execution]:
    """The handler calls for one key, in the order they started."""
    return list(Execution.objects.filter(run_id=run_id, key=key).order_by("started", "pk"))


def item(run_id: int, key: str) -> ItemClaim:
    return ItemClaim.objects.get(run_id=run_id, key=key)


def workers_that_ran(run_id: int) -> set[int]:
    pids = Execution.objects.filter(run_id=run_id).values_list("worker", flat=True)
    return {int(pid) for pid in pids}


def pending(run_id: int) -> int:
    return ItemClaim.objects.filter(run_id=run_id, status=ItemStatus.PENDING).count()


def started_call(run_id: int, key: str, timeout: float = 30) -> Execution:
    """Wait until the handler has started on ``key``; return that call."""
    return wait_until(
        lambda: Execution.objects.filter(run_id=run_id, key=key).order_by("started").first(),
        timeout,
        f"the handler to start on {key}",
    )


def finished_run(run_id: int, timeout: float = 60, every: float = 0.1) -> BatchRun:
    """Wait until the run has joined; return it."""

    def done() -> BatchRun | None:
        run = BatchRun.objects.get(pk=run_id)
        return run if run.is_terminal else None

    try:
        return wait_until(done, timeout, f"run {run_id} to finish", every=every)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe_runs()}") from None


def describe_runs() -> str:
    """Every run's state and its items' statuses: what a test that timed out shows."""
    lines = []
    for run in BatchRun.objects.order_by("pk"):
        items = Counter(ItemClaim.objects.filter(run=run).values_list("status", flat=True))
        lines.append(
            f"run {run.pk} {run.definition} {run.status} in_flight={run.in_flight} "
            f"items={dict(items)} stalled={run.stalled!r} error={run.error[:200]!r}"
        )
    return "\n".join(lines)


def assert_succeeded_once_each(run_id: int, n: int) -> BatchRun:
    """The run succeeded, joined once, and every one of its n items ran exactly once."""
    run = BatchRun.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.join_runs == 1
    assert run.join_result == {"items": n, "succeeded": n}
    assert executions(run_id) == Counter({k: 1 for k in keys(n)})
    assert not Execution.objects.filter(run_id=run_id, ended__isnull=True).exists()
    assert set(
        ItemClaim.objects.filter(run_id=run_id).values_list("status", "attempt", "crashes")
    ) == {(ItemStatus.SUCCEEDED, 1, 0)}
    return run


def report(stdout: str) -> dict[str, Any]:
    """The JSON report `run_fanout --json` printed (its last line)."""
    return json.loads(stdout.strip().splitlines()[-1])


def drain_jobs(redis: Redis, run_id: int) -> set[str]:
    """Ids of every drain job of the run that Redis holds (queued, running or finished)."""
    prefix = f"rq:job:fanout-drain-{run_id}-"
    return {k.decode()[len("rq:job:") :] for k in redis.scan_iter(match=f"{prefix}*")}


def slot_keys(redis: Redis, run_id: int) -> set[str]:
    return {k.decode() for k in redis.scan_iter(match=f"fanout:drain:{run_id}:*")}


def queued(redis: Redis, queue: str = "fanout") -> list[str]:
    return [j.decode() for j in redis.lrange(f"rq:queue:{queue}", 0, -1)]
